#!/usr/bin/env bash
# TCP bandwidth on loopback, ferry against NIXL 1.5.1 (UCX tcp) and Mooncake
# TE 0.3.13 (tcp), measured by bench/peers/ (the project's benchmarks of
# them), on `ferry bench`'s bandwidth workload: one request of 4K x1024,
# 64K x1024, 1M x64 or 16M x4 in flight at a time against a 256 MiB region,
# writes and reads. ROUNDS interleaved rounds; per round:
#
#   ferry bench --op OP --block B --batch N                       (one-shot submit)
#   ferry bench --op OP --block B --prepared --strided --descs N  (transfer request)
#     both against one long-lived `ferry serve` (same-host path off)
#   bench/peers/nixl_bench.py and mooncake_bench.py --workload bw, both
#   ops, every block
#
# Prints each cell's median GB/s, every round's figures, and ferry's ratio
# to the better peer's median. Makes the peers' venvs first when they are
# missing (bench/peers/setup.sh). Run it on an idle machine.
#
#   scripts/bench-tcp-bw-vs-peers.sh [ROUNDS [SECONDS]]   (default 5 2)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
seconds=${2:-2}
source scripts/peers-here.sh
peers_setup nixl mooncake
shapes=("4K 1024" "64K 1024" "1M 64" "16M 4")
serve_tcp

# "system op block gbps" from the JSON rows on stdin (bw rows only).
pick() {
    python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if r.get("workload", "bw") == "bw":
        print(sys.argv[1], r.get("op", sys.argv[2]), r["block"], r["gbps"])
' "$@"
}

for round in $(seq "$rounds"); do
    echo "round $round" >&2
    for op in write read; do
        for shape in "${shapes[@]}"; do
            set -- $shape
            $ferry bench --handle "$dir/h" --transport tcp --op $op --block "$1" \
                --batch "$2" --duration "$seconds" --json | pick submit $op >>"$dir/rows"
            $ferry bench --handle "$dir/h" --transport tcp --op $op --block "$1" \
                --prepared --strided --descs "$2" --duration "$seconds" --json |
                pick prepared $op >>"$dir/rows"
        done
    done
    "$NIXL_PY" "$NIXL_BENCH" --transport tcp --workload bw --op both \
        --duration "$seconds" --no-prog-thread 2>/dev/null | pick nixl "" >>"$dir/rows"
    "$MOONCAKE_PY" "$MOONCAKE_BENCH" --transport tcp --workload bw --op both \
        --duration "$seconds" 2>/dev/null | pick mooncake "" >>"$dir/rows"
done

python3 - "$dir/rows" <<'PY'
import statistics, sys
cells = {}
for line in open(sys.argv[1]):
    system, op, block, gbps = line.split()
    cells.setdefault((op, int(block)), {}).setdefault(system, []).append(float(gbps))
systems = ("submit", "prepared", "nixl", "mooncake")
print("| op | block | ferry submit | ferry prepared | NIXL | Mooncake | submit / best peer | prepared / best peer |")
print("|---|---|---|---|---|---|---|---|")
med = lambda xs: statistics.median(xs) if xs else float("nan")
for (op, block), by in sorted(cells.items(), key=lambda kv: (kv[0][0] != "write", kv[0][1])):
    m = {s: med(by.get(s, [])) for s in systems}
    best = max(m["nixl"], m["mooncake"])
    size = f"{block >> 20} MiB" if block >= 1 << 20 else f"{block >> 10} KiB"
    print(f"| {op} | {size} | " + " | ".join(f"{m[s]:.2f}" for s in systems)
          + f" | {m['submit'] / best:.2f} | {m['prepared'] / best:.2f} |")
print()
print("every round, GB/s:")
for (op, block), by in sorted(cells.items()):
    print(f"  {op} {block}: " + "; ".join(f"{s} " + " ".join(f"{x:.2f}" for x in by.get(s, [])) for s in systems))
PY
