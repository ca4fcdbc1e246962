#!/usr/bin/env bash
# Weight fan-out through relays behind a slow publisher link (issue 58's
# scaling target: update time for 8 subscribers at most 2x the time for 1).
# Runs examples/relay_bench.rs in a network namespace of its own, whose
# loopback limits only the traffic sent from the publisher's port (tc: an
# htb class of RATE, and a u32 filter on that source port), so that
# the publisher's link is the bottleneck and the subscribers' links are
# not; measures that link first with iperf3 -R (the server sending from
# the same port) as the physical reference. Each run sweeps the counts
# without relays (every subscriber pulls from the publisher) and with
# them (a binary tree: subscriber i pulls from (i - 1) / 2).
#
#   sudo scripts/bench-relays.sh [-r RATE] [-m MIB] [-s COUNTS] [-v VERSIONS] [-n RUNS]
#
#   -r  the publisher link's rate, as tc takes it                  [2gbit]
#   -m  MiB per version                                            [256]
#   -s  subscriber counts                                          [1,2,4,8]
#   -v  versions per count (the first, which faults buffers in,
#       is left out of the median)                                 [3]
#   -n  runs                                                       [3]
#
# Needs root (unshare, tc); nothing outside the namespace it makes is touched.
set -euo pipefail

RATE=2gbit
MIB=256
COUNTS=1,2,4,8
VERSIONS=3
RUNS=3
PORT=5399
while getopts "r:m:s:v:n:h" opt; do
    case "$opt" in
        r) RATE=$OPTARG ;;
        m) MIB=$OPTARG ;;
        s) COUNTS=$OPTARG ;;
        v) VERSIONS=$OPTARG ;;
        n) RUNS=$OPTARG ;;
        *) sed -n '2,22p' "$0"; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps iperf3 iproute2 >&2
echo "building examples/relay_bench.rs (release)" >&2
cargo build --release --locked --example relay_bench >&2
source scripts/target-dir.sh
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

export RATE MIB COUNTS VERSIONS RUNS PORT WORK
export BENCH=$target_dir/release/examples/relay_bench
exec unshare --net bash -s <<'INNER'
set -euo pipefail
source scripts/iperf3.sh
ip link set lo up
# htb: traffic the filter picks goes through class 1:10 at RATE; the rest
# matches no class and goes out directly, unshaped (its default, 99, does
# not exist). (prio and tbf alone would do, but not every kernel here has
# sch_prio.)
tc qdisc add dev lo root handle 1: htb default 99
tc class add dev lo parent 1: classid 1:10 htb rate "$RATE" ceil "$RATE" burst 4mb cburst 4mb quantum 65536
tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport "$PORT" 0xffff flowid 1:10
echo "the publisher's link: htb $RATE on traffic from port $PORT; iperf3 -R over it, 5 s:" >&2
LINK=$(iperf3_sum 1 1 5 "$PORT" "$WORK" -R)
OTHER=$(iperf3_sum 1 1 5 $((PORT + 1)) "$WORK" -R)
printf 'relay_bench: link: %.3f GB/s from the publisher'"'"'s port, %.3f GB/s from any other\n' "$LINK" "$OTHER"
echo "relay_bench: one version over the link alone: $(python3 -c "print(f'{$MIB * 2**20 / ($LINK * 1e9) * 1e3:.0f}')") ms"
for run in $(seq "$RUNS"); do
    echo "relay_bench: run $run" >&2
    "$BENCH" --port "$PORT" --mib "$MIB" --versions "$VERSIONS" --subscribers "$COUNTS" | grep -v round
    "$BENCH" --port "$PORT" --mib "$MIB" --versions "$VERSIONS" --subscribers "$COUNTS" --relays | grep -v round
done
INNER
