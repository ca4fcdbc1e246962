#!/usr/bin/env bash
# The first transfer to a peer against the steady state, with and without
# `Node::connect` beforehand (issue 25: "after connect, the first
# transfer's latency is within 2x the steady-state one").
#
# One process's first transfer is a single sample, which on these VMs
# varies by 2x from run to run, so this measures a distribution: RUNS fresh
# `ferry bench` processes against one long-lived `ferry serve`, with and
# without --connect in turn, each making one request of 16 x 64 KiB
# writes, then 10 warm-up and 200 measured ones. Prints every run's
# first_us and steady p50 (µs), then per mode the median of each, their
# ratio, and how many runs had a first transfer within 2x their own p50.
# PREPARED=1 makes each request from prepared lists (--prepared): preparing
# the remote list connects too, and on the same host maps the region and
# fills in its page tables, so both modes then start prepared. Run it on an
# idle machine.
#
#   scripts/bench-first-transfer.sh [RUNS [TRANSPORT]]   (default 12 tcp;
#                                                        TRANSPORT: tcp or memory)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-12}
transport=${2:-tcp}
case "$transport" in
tcp | memory) ;;
*) echo "TRANSPORT is tcp or memory, not $transport" >&2; exit 2 ;;
esac
cargo build --release --locked -q -p ferry-cli
source scripts/target-dir.sh
ferry=$target_dir/release/ferry

dir=$(mktemp -d)
$ferry serve --size 64M --no-ibverbs --handle-file "$dir/h" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -rf "$dir"' EXIT
until [ -s "$dir/h" ]; do sleep 0.1; done

request=(--batch 16)
[ "${PREPARED:-0}" = 1 ] && request=(--prepared --descs 16)
for run in $(seq "$runs"); do
    for mode in connect cold; do
        flag=()
        [ "$mode" = connect ] && flag=(--connect)
        $ferry bench --handle "$dir/h" --transport "$transport" --block 64K "${request[@]}" \
            "${flag[@]}" --warmup 10 --iters 200 --json 2>/dev/null | tail -n 1 |
            python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
print(sys.argv[1], sys.argv[2], r["first_us"], r["lat_p50_us"])
' "$run" "$mode" | tee -a "$dir/rows"
    done
done

prepared=""
[ "${PREPARED:-0}" = 1 ] && prepared=", prepared"
python3 - "$dir/rows" "$transport" "$prepared" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
print(f"\n{sys.argv[2]}, 16 x 64 KiB writes{sys.argv[3]}, {len(rows) // 2} runs per mode")
for mode in ("connect", "cold"):
    first = [float(r[2]) for r in rows if r[1] == mode]
    p50 = [float(r[3]) for r in rows if r[1] == mode]
    within = sum(f <= 2 * p for f, p in zip(first, p50))
    mf, mp = statistics.median(first), statistics.median(p50)
    print(f"{mode:8} median first {mf:7.0f} us  median p50 {mp:6.0f} us  "
          f"ratio {mf / mp:4.2f}  runs within 2x: {within}/{len(first)}")
EOF
