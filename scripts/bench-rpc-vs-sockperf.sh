#!/usr/bin/env bash
# ferry's control plane on loopback TCP against sockperf, in one run and
# ROUNDS interleaved rounds (medians):
#
#   64-byte RPC round trip, p50          ferry bench --op rpc    / sockperf ping-pong --full-rtt (goal <= 1.5)
#   64-byte messages, 64 senders, msg/s  ferry bench --op message --workers 64, beside sockperf throughput
#                                        (sockperf streams one way unacknowledged; every ferry message is
#                                        acknowledged once it is in the receiver's inbox)
#   4 KiB write p50 with a 64-byte notification / without (goal <= 1.15)
#
#   scripts/bench-rpc-vs-sockperf.sh [ROUNDS [SECONDS]]   (default 3 3)
#
# Installs sockperf (Debian package) if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-3}
port=11311

if ! command -v sockperf >/dev/null; then
    echo "installing sockperf" >&2
    sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get install -y -q sockperf >&2
fi
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
ferry=$target_dir/release/ferry

sockperf server --tcp -i 127.0.0.1 -p $port >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
sleep 1

field() { python3 -c "import json,sys; r=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(r['$1'])"; }
declare -a sp_rtt ferry_rtt sp_rate ferry_rate plain notified
for round in $(seq "$rounds"); do
    echo "round $round" >&2
    sp_rtt+=("$(sockperf ping-pong --tcp -i 127.0.0.1 -p $port -m 64 -t "$seconds" --full-rtt 2>&1 |
        sed -n 's/.*percentile 50.000 = *\([0-9.]*\).*/\1/p')")
    ferry_rtt+=("$($ferry bench --loopback --op rpc --block 64 --size 1M --duration "$seconds" --json | field lat_p50_us)")
    sp_rate+=("$(sockperf throughput --tcp -i 127.0.0.1 -p $port -m 64 -t "$seconds" 2>&1 |
        sed -n 's/.*Message Rate is \([0-9]*\).*/\1/p')")
    ferry_rate+=("$($ferry bench --loopback --op message --block 64 --size 1M --workers 64 --duration "$seconds" --json | field mops)")
    plain+=("$($ferry bench --loopback --transport tcp --block 4K --size 4M --batch 1 --duration "$seconds" --json | field lat_p50_us)")
    notified+=("$($ferry bench --loopback --transport tcp --block 4K --size 4M --batch 1 --notify 64 --duration "$seconds" --json | field lat_p50_us)")
done

python3 - "${sp_rtt[*]}" "${ferry_rtt[*]}" "${sp_rate[*]}" "${ferry_rate[*]}" "${plain[*]}" "${notified[*]}" <<'PY'
import statistics, sys
sp_rtt, f_rtt, sp_rate, f_rate, plain, notified = ([float(x) for x in a.split()] for a in sys.argv[1:])
med = statistics.median
runs = lambda xs: " ".join(f"{x:.1f}" for x in xs)
print("| measure | ferry | reference | ferry / reference | runs (ferry; reference) |")
print("|---|---|---|---|---|")
print(f"| 64 B RPC round trip p50, us (vs sockperf ping-pong full RTT) | {med(f_rtt):.1f} | {med(sp_rtt):.1f} | {med(f_rtt) / med(sp_rtt):.2f} | {runs(f_rtt)}; {runs(sp_rtt)} |")
f_k = [x * 1e3 for x in f_rate]; sp_k = [x / 1e3 for x in sp_rate]
print(f"| 64 B messages, 64 senders, Kmsg/s (vs sockperf throughput) | {med(f_k):.1f} | {med(sp_k):.1f} | {med(f_k) / med(sp_k):.2f} | {runs(f_k)}; {runs(sp_k)} |")
print(f"| 4 KiB write p50 with a 64 B notification, us (vs without) | {med(notified):.1f} | {med(plain):.1f} | {med(notified) / med(plain):.2f} | {runs(notified)}; {runs(plain)} |")
PY
