#!/usr/bin/env bash
# Transfer requests on prepared lists, ferry against NIXL (PyPI `nixl`, its
# bundled UCX) on bench/peers/nixl_bench.py (the project's benchmark of
# it): the `bw` workload, one request in flight at a time, made per
# request from lists prepared once (`make_prepped_xfer` / `Node::make_xfer`), against a
# 256 MiB region: 4K x1024, 64K x1024, 1M x64, 16M x4 descriptors per
# request. Over TCP loopback (NIXL: UCX_TLS=tcp) and same-host memory
# (NIXL: shm). Alternates the two, RUNS rounds, and prints each median
# (GB/s, request p50 in µs) and ferry/NIXL ratios. Makes NIXL's venv first
# when it is missing (bench/peers/setup.sh). Run it on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-3}
OP=${OP:-write}
source bench/peers/venvs.sh
bench/peers/setup.sh nixl >&2

cargo build --release --locked -q -p ferry-cli
source scripts/target-dir.sh
ferry=$target_dir/release/ferry
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
SHAPES=("4096 1024" "65536 1024" "1048576 64" "16777216 4")

for round in $(seq "$RUNS"); do
    for mode in tcp:tcp memory:shm; do
        ours=${mode%%:*} theirs=${mode##*:}
        "$NIXL_PY" bench/peers/nixl_bench.py --transport "$theirs" --workload bw --op "$OP" \
            --duration "$SECONDS_PER_RUN" --blocks 4K,64K,1M,16M --no-prog-thread 2>/dev/null |
            python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if r.get("workload") == "bw":
        print("nixl", sys.argv[1], r["block"], r["batch"], r["gbps"], r["lat_p50_us"])
' "$ours" >>"$out/rows"
        for shape in "${SHAPES[@]}"; do
            set -- $shape
            "$ferry" bench --loopback --size 256M --transport "$ours" --op "$OP" --prepared \
                --strided --block "$1" --descs "$2" --duration "$SECONDS_PER_RUN" --json 2>/dev/null |
                python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print("ferry", sys.argv[1], r["block"], r["batch"], r["gbps"], r["lat_p50_us"])
' "$ours" >>"$out/rows"
        done
    done
    echo "round $round done" >&2
done

python3 - "$out/rows" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    system, transport, block, batch, gbps, p50 = line.split()
    rows.setdefault((transport, int(block)), {}).setdefault(system, []).append((float(gbps), float(p50)))
print(f"{'transport':<9} {'block':>9} {'ferry GB/s':>11} {'nixl GB/s':>10} {'ratio':>6} {'ferry p50':>10} {'nixl p50':>10}  (medians)")
for (transport, block), by in sorted(rows.items()):
    f = by.get("ferry", []); n = by.get("nixl", [])
    if not f or not n:
        continue
    fg, ng = statistics.median(g for g, _ in f), statistics.median(g for g, _ in n)
    fp, np_ = statistics.median(p for _, p in f), statistics.median(p for _, p in n)
    print(f"{transport:<9} {block:>9} {fg:>11.3f} {ng:>10.3f} {fg / ng:>6.2f} {fp:>10.1f} {np_:>10.1f}")
PY
