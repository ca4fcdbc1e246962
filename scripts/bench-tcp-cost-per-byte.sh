#!/usr/bin/env bash
# Where ferry's TCP bandwidth goes, against iperf3's: the host's CPU time per
# byte moved over loopback, split into the kernel's copies between user
# memory and socket buffers (_copy_from_iter, _copy_to_iter) and everything
# else, from a system-wide `perf record` taken while each runs.
#
#   scripts/bench-tcp-cost-per-byte.sh [-r ROUNDS] [-t SECONDS] [-p PORT]
#
#   -r  rounds; each runs every row once, in turn        [3]
#   -t  seconds per row (perf samples the middle of it)   [9]
#   -p  loopback port for the iperf3 servers              [5330]
#
# Rows, each with four TCP connections:
#   iperf3      four single-stream iperf3 processes (scripts/iperf3.sh),
#               each side sending from or receiving into its own 128 KiB
#               buffer: memory that stays in the cache.
#   ferry DRAM  `ferry bench --block 1M` over 256 MiB regions: every byte is
#               read from and written to memory that is not in the cache,
#               as a transfer of model weights or a KV cache is.
#   ferry cache `ferry bench --workers 4 --block 256K` over 4 MiB regions:
#               memory the cache holds, as iperf3's.
# ns/B = CPU seconds (both cores' busy share) per byte moved, so two rows
# compare per byte whatever their GB/s. ferry's rows are writes.
#
# Why this exists: four iperf3 processes outrun ferry at 1 MiB blocks
# (0.7-0.85x), and the profile says the difference is in the copies, which
# cost more per byte from memory the cache does not hold, while ferry's own
# share (system calls, TCP, wake-ups, its user space) is no larger than
# iperf3's. Needs root or perf_event_paranoid <= 0 for a system-wide record.
set -euo pipefail

ROUNDS=3
SECONDS_PER_RUN=9
PORT=5330
while getopts "r:t:p:h" opt; do
    case "$opt" in
        r) ROUNDS=$OPTARG ;;
        t) SECONDS_PER_RUN=$OPTARG ;;
        p) PORT=$OPTARG ;;
        *) sed -n '2,29p' "$0"; exit 2 ;;
    esac
done
((SECONDS_PER_RUN >= 5)) || { echo "-t: at least 5 seconds" >&2; exit 2; }

cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
source scripts/install-deps.sh
source scripts/iperf3.sh
ferry_install_deps iperf3 linux-perf >&2

echo "building ferry (release)" >&2
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
FERRY=$target_dir/release/ferry

# sampled NAME CMD...: runs CMD (which prints GB/s on its last line) while
# perf samples every CPU for its middle SECONDS_PER_RUN - 4 seconds; prints
# one row.
sampled() {
    local name=$1
    shift
    "$@" >"$WORK/out" &
    local pid=$!
    sleep 2
    perf record -a -q -o "$WORK/perf.data" -- sleep $((SECONDS_PER_RUN - 4)) >/dev/null 2>&1
    wait "$pid"
    local gbps
    gbps=$(tail -1 "$WORK/out")
    perf report -i "$WORK/perf.data" --no-children --sort sym --stdio 2>/dev/null |
        awk -v name="$name" -v gbps="$gbps" -v cpus="$CPUS" '
            /\[k\] (_copy_to_iter|_copy_from_iter)$/ { sub("%", "", $1); copy += $1 }
            /\[k\] (pv_native_safe_halt|default_idle|intel_idle|acpi_idle_do_entry|poll_idle)$/ {
                sub("%", "", $1); idle += $1 }
            END {
                busy = 100 - idle
                printf "%-12s %6.2f %8.1f %6.1f %9.3f %9.3f %9.3f\n", name, gbps, copy, idle,
                    cpus * copy / 100 / gbps, cpus * (busy - copy) / 100 / gbps,
                    cpus * busy / 100 / gbps
            }'
}

ferry_gbps() {
    "$FERRY" bench --loopback --transport tcp --streams 4 --json --duration "$SECONDS_PER_RUN" "$@" |
        python3 -c 'import json, sys; print(json.loads(sys.stdin.readline())["gbps"])'
}

CPUS=$(nproc)
echo "ns/B figures assume $CPUS CPUs' time; $ROUNDS rounds of ${SECONDS_PER_RUN} s rows" >&2
printf "%-12s %6s %8s %6s %9s %9s %9s\n" row "GB/s" "copy %" "idle %" "copy ns/B" "rest ns/B" "all ns/B"
for ((round = 1; round <= ROUNDS; round++)); do
    sampled "iperf3" iperf3_sum 4 1 "$SECONDS_PER_RUN" "$PORT" "$WORK"
    sampled "ferry DRAM" ferry_gbps --size 256M --block 1M
    sampled "ferry cache" ferry_gbps --workers 4 --size 4M --block 256K
done
echo "(copy = the kernel's copies between user memory and socket buffers; rest = every other busy sample; $(iperf3 --version | head -1))"
