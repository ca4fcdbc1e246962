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
trap 'rm -rf "$WORK"' EXIT
source scripts/install-deps.sh
source scripts/iperf3.sh
ferry_install_deps iperf3 >&2

echo "building ferry (release)" >&2
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
FERRY=$target_dir/release/ferry

# iperf3_gbps PROCS STREAMS_PER_PROC [-R]: see scripts/iperf3.sh (ferry is
# compared with the faster of -P N in one process and N processes of -P 1).
iperf3_gbps() {
    iperf3_sum "$1" "$2" "$SECONDS_PER_RUN" "$PORT" "$WORK" ${3:-}
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
