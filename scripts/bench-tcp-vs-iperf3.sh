#!/usr/bin/env bash
# Compares ferry's TCP fallback with iperf3 over loopback, with the same number
# of TCP connections, and reports ferry's memory use above its registered
# regions.
#
#   scripts/bench-tcp-vs-iperf3.sh [-n STREAMS] [-b BLOCKS] [-t SECONDS] [-s SIZE] [-p PORT]
#
#   -n  TCP connections: iperf3 -P N, ferry --streams N         [4]
#   -b  ferry op sizes, comma separated                          [1M,4M,16M]
#   -t  seconds per measurement (each iperf3 run, each ferry row) [5]
#   -s  ferry region size on each side                           [256M]
#   -p  loopback port for iperf3 -s                              [5299]
#
# "write" is compared with iperf3 sending from client to server, "read" with
# iperf3 -R (the server sends). Everything runs on 127.0.0.1 only.
set -euo pipefail

STREAMS=4
BLOCKS=1M,4M,16M
SECONDS_PER_RUN=5
SIZE=256M
PORT=5299
while getopts "n:b:t:s:p:h" opt; do
    case "$opt" in
        n) STREAMS=$OPTARG ;;
        b) BLOCKS=$OPTARG ;;
        t) SECONDS_PER_RUN=$OPTARG ;;
        s) SIZE=$OPTARG ;;
        p) PORT=$OPTARG ;;
        *) sed -n '2,15p' "$0"; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
    for pid in $SERVER_PID; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

if ! command -v iperf3 >/dev/null; then
    echo "iperf3 not found; installing it" >&2
    SUDO=$([[ $(id -u) -eq 0 ]] || echo sudo)
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y iperf3 >/dev/null ||
        { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y iperf3 >/dev/null; }
fi

echo "building ferry (release)" >&2
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
FERRY=$target_dir/release/ferry

# iperf3 3.12 (Debian 12) runs all -P streams on one thread, while ferry uses
# every core, so a single `iperf3 -P N` understates what loopback TCP can do.
# We therefore measure both `iperf3 -P N` and N single-stream iperf3 pairs in
# parallel (one process each), and compare ferry with the faster of the two.
#
# iperf3_gbps PROCS STREAMS_PER_PROC [-R]: prints the summed GB/s (1e9 B/s).
iperf3_gbps() {
    local procs=$1 per=$2 reverse=${3:-} i pids=()
    for ((i = 0; i < procs; i++)); do
        iperf3 -s -B 127.0.0.1 -p $((PORT + i)) -1 >/dev/null 2>&1 &
        SERVER_PID="$SERVER_PID $!"
    done
    # The servers need a moment to listen; retry only while a port is closed.
    for ((i = 0; i < procs; i++)); do
        for _ in $(seq 50); do
            ss -ltn "sport = :$((PORT + i))" | grep -q LISTEN && break
            sleep 0.1
        done
    done
    for ((i = 0; i < procs; i++)); do
        timeout $((SECONDS_PER_RUN + 30)) iperf3 -c 127.0.0.1 -p $((PORT + i)) -P "$per" \
            -t "$SECONDS_PER_RUN" -J $reverse >"$WORK/iperf3.$i.json" &
        pids+=($!)
    done
    wait "${pids[@]}"
    for pid in $SERVER_PID; do
        timeout 10 tail --pid="$pid" -f /dev/null || kill "$pid" 2>/dev/null || true
    done
    SERVER_PID=
    python3 -c 'import json,sys
print(sum(json.load(open(f))["end"]["sum_received"]["bits_per_second"] for f in sys.argv[1:]) / 8 / 1e9)' \
        "$WORK"/iperf3.*.json
    rm -f "$WORK"/iperf3.*.json
}

echo "iperf3: -P $STREAMS in one process, and $STREAMS processes of -P 1; ${SECONDS_PER_RUN} s each" >&2
IPERF_WRITE=$(iperf3_gbps 1 "$STREAMS")
IPERF_READ=$(iperf3_gbps 1 "$STREAMS" -R)
IPERF_WRITE_N=$(iperf3_gbps "$STREAMS" 1)
IPERF_READ_N=$(iperf3_gbps "$STREAMS" 1 -R)

echo "ferry bench --streams $STREAMS --block $BLOCKS, ${SECONDS_PER_RUN} s per row" >&2
for op in write read; do
    timeout 600 "$FERRY" bench --loopback --transport tcp --json --verify --streams "$STREAMS" \
        --block "$BLOCKS" --op "$op" --size "$SIZE" --duration "$SECONDS_PER_RUN" >>"$WORK/ferry.jsonl"
done

python3 - "$WORK/ferry.jsonl" "$IPERF_WRITE" "$IPERF_READ" "$IPERF_WRITE_N" "$IPERF_READ_N" \
    "$(iperf3 --version | head -1)" <<'EOF'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
one = {"write": float(sys.argv[2]), "read": float(sys.argv[3])}
many = {"write": float(sys.argv[4]), "read": float(sys.argv[5])}
mib = lambda b: b / 2**20

def size(b):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"

print(f"{'op':<6} {'block':>8} {'streams':>7} {'ferry GB/s':>10} {'iperf3 -P N':>11} "
      f"{'N x iperf3':>10} {'ratio':>6} {'initiator RSS over regions MiB':>31}")
for r in rows:
    ref = max(one[r["op"]], many[r["op"]])
    over = f"{mib(r['peak_rss'] - r['registered']):.1f}"
    print(f"{r['op']:<6} {size(r['block']):>8} {r['streams']:>7} {r['gbps']:>10.2f} "
          f"{one[r['op']]:>11.2f} {many[r['op']]:>10.2f} {r['gbps'] / ref:>6.2f} {over:>31}")
print(f"(ratio = ferry / the faster iperf3 figure; 'read' is compared with iperf3 -R; {sys.argv[6]}; "
      f"all ferry rows verified)")
EOF
