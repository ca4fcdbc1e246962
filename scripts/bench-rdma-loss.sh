#!/usr/bin/env bash
# ferry against perftest across a lossy wire: two soft-RoCE VMs
# (tests/rxe/run.sh --two), `ferry serve` in VM a, and in VM b, for each
# loss rate (netem, each way), op and block size, perftest's ib_*_bw and
# `ferry bench --transport ibverbs` in turn, RUNS times, in the same boot.
# Prints PERF lines (perftest, MiB/s) and FERRY lines (ferry, MiB/s, from
# bench's gbps, which is 1e9 bytes per second); the
# ratio of the two under the same loss is the figure to read.
#
# usage: scripts/bench-rdma-loss.sh [LOSSES (default "0 2")] [RUNS (default 2)]
set -euo pipefail
cd "$(dirname "$0")/.."
LOSSES=${1:-0 2}
RUNS=${2:-2}
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
cmd=$(cat <<EOF2
on-peer 'setsid ferry serve --listen 10.88.0.1:7100 --size 8M --publish r < /dev/null > /tmp/serve.log 2>&1 &'
sleep 5
for loss in $LOSSES; do
  /usr/bin/tc qdisc replace dev wire root netem loss \$loss%
  on-peer /usr/bin/tc qdisc replace dev wire root netem loss \$loss%
  for run in \$(seq $RUNS); do
    for op in write read; do
      for spec in "65536 100" "1048576 8"; do
        set -- \$spec
        echo "LOSS=\$loss run=\$run \$(rxe-pair --perf ib_\${op}_bw -s \$1 -n \$2)"
        mibps=\$(ferry bench --peer 10.88.0.1:7100 --region r --transport ibverbs --op \$op --block \$1 --size 4M --iters 2 --warmup 1 --json |
                 sed -n 's/.*"gbps":\([0-9.e+-]*\).*/\1/p' | awk '{ printf "%.2f", \$1 * 1e9 / 1048576 }')
        echo "LOSS=\$loss run=\$run FERRY op=\$op bytes=\$1 mibps=\$mibps"
      done
    done
  done
done
EOF2
)
tests/rxe/run.sh --two --bin "$target_dir/release/ferry" -- "$cmd" | grep -E '^LOSS='
