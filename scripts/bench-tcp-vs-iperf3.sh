#!/usr/bin/env bash
# Compares ferry's TCP fallback over loopback with the physical reference,
# scripts/tcp-mover.c: as many sender/receiver process pairs as ferry opens
# TCP connections, sweeping the same region size in 1 MiB send() and
# recv() calls (ferry's TCP chunk size): ferry's work with no protocol, the
# bound to hold it to. iperf3 with the same number of connections is shown
# beside it as context, not as the bound: it sends one cache-hot buffer
# again and again, which moves more than a sweep of a region larger than
# the caches can. Also reports ferry's memory use above its registered
# regions.
#
#   scripts/bench-tcp-vs-iperf3.sh [-n STREAMS] [-b BLOCKS] [-t SECONDS] [-s SIZE] [-p PORT]
#
#   -n  TCP connections: ferry --streams N, tcp-mover's N pairs, iperf3 -P N [4]
#   -b  ferry op sizes, comma separated                          [1M,4M,16M]
#   -t  seconds per measurement (each reference's run, each ferry row) [5]
#   -s  ferry's region size on each side (tcp-mover sweeps as much) [256M]
#   -p  loopback port for iperf3 -s                              [5299]
#
# The mover sends one way; its figure stands for "write" and "read" alike.
# iperf3's "write" is the client sending to the server, "read" iperf3 -R
# (the server sends). Everything runs on 127.0.0.1 only.
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
        *) sed -n '2,22p' "$0"; exit 2 ;;
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

# The physical reference: STREAMS process pairs, 1 MiB calls, SIZE bytes.
cc -O2 -o "$WORK/tcp-mover" scripts/tcp-mover.c
echo "tcp-mover: $STREAMS process pairs sweeping $SIZE in 1 MiB send/recv calls, ${SECONDS_PER_RUN} s" >&2
MOVER=$("$WORK/tcp-mover" bw "$STREAMS" $((1 << 20)) "$(numfmt --from=iec "$SIZE")" "$SECONDS_PER_RUN")

echo "iperf3 (context): -P $STREAMS in one process, and $STREAMS processes of -P 1; ${SECONDS_PER_RUN} s each" >&2
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
    "$(iperf3 --version | head -1)" "$MOVER" <<'EOF'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
one = {"write": float(sys.argv[2]), "read": float(sys.argv[3])}
many = {"write": float(sys.argv[4]), "read": float(sys.argv[5])}
mover = float(sys.argv[7])
mib = lambda b: b / 2**20

def size(b):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"

print(f"{'op':<6} {'block':>8} {'streams':>7} {'ferry GB/s':>10} {'tcp-mover':>9} {'ratio':>6} "
      f"{'iperf3 -P N':>11} {'N x iperf3':>10} {'initiator RSS over regions MiB':>31}")
for r in rows:
    over = f"{mib(r['peak_rss'] - r['registered']):.1f}"
    print(f"{r['op']:<6} {size(r['block']):>8} {r['streams']:>7} {r['gbps']:>10.2f} {mover:>9.2f} "
          f"{r['gbps'] / mover:>6.2f} {one[r['op']]:>11.2f} {many[r['op']]:>10.2f} {over:>31}")
print(f"(ratio = ferry / tcp-mover, the physical reference; iperf3 is context, 'read' beside iperf3 -R; "
      f"{sys.argv[6]}; all ferry rows verified)")
EOF
