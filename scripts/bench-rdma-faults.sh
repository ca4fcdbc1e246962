#!/usr/bin/env bash
# ferry beside perftest under link faults: two soft-RoCE VMs
# (tests/rxe/run.sh --two), `ferry serve` in VM a; in VM b, for each
# scenario, 160 MiB of 1 MiB reads (about 20 s on a clean wire) by ferry
# (`ferry bench --transport ibverbs --verify`, 20 submits of 8 ops) and then
# by perftest (`ib_read_bw -n 160`), each while VM a's end of the wire goes
# through the scenario's fault, all in one boot:
#   clean     no fault
#   flap3     wire down 3 s, from 5 s into the run
#   outage30  wire down 30 s, from 5 s into the run
# The fault runs in VM a by itself (started through its agent, which is on
# the mgmt wire, never faulted), so nothing in VM b waits on it.
# Prints one RESULT line per scenario and tool: the tool's own MiB/s
# (ferry's from bench's gbps, 1e9 bytes per second; perftest's "MB/sec" is
# MiB/s, from its cycle counter, which a stall can skew under emulation),
# the tool's wall-clock seconds (process start to exit: connection setup,
# and ferry's verification, included) and 160 MiB over them, its exit
# status, and ferry's error when it failed.
# Each tool is killed after 150 s (status 124): soft-RoCE retries a lost
# packet forever with perftest's retry count, so perftest waits out any
# outage.
#
# usage: scripts/bench-rdma-faults.sh [SCENARIOS (default "clean flap3 outage30")] [RUNS (default 1)]
set -euo pipefail
cd "$(dirname "$0")/.."
SCENARIOS=${1:-clean flap3 outage30}
RUNS=${2:-1}
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
cmd=$(cat <<'EOF2'
up() { cut -d' ' -f1 /proc/uptime; }
elapsed() { awk -v a="$1" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }'; }
per_wall() { [ "$1" = 0 ] && awk -v w="$2" 'BEGIN { printf "%.2f", 160 / w }' || echo none; }
settle() {  # until the fault started at $1 is over, and 3 s more
  until awk -v a="$1" -v b="$(up)" -v d="$down" 'BEGIN { exit !(b - a >= d + 8) }'; do sleep 1; done
}
serve() {
  on-peer 'pkill -x ferry; sleep 1; setsid ferry serve --listen 10.88.0.1:7100 --size 8M --publish r < /dev/null > /tmp/serve.log 2>&1 &'
  sleep 5
}
fault() {  # in VM a, in the background: down for $1 s from 5 s on
  [ "$1" = 0 ] && return 0
  on-peer "(sleep 5; /usr/bin/ip link set wire down; sleep $1; /usr/bin/ip link set wire up) < /dev/null > /dev/null 2>&1 &"
}
serve
for run in $(seq RUNS); do
  for scenario in SCENARIOS; do
    case $scenario in
      clean) down=0 ;; flap3) down=3 ;; outage30) down=30 ;;
      *) echo "unknown scenario $scenario" >&2; exit 2 ;;
    esac
    # ferry
    start=$(up); fault $down; rc=0
    out=$(timeout 150 ferry bench --peer 10.88.0.1:7100 --region r --transport ibverbs \
            --op read --block 1M --size 8M --warmup 0 --iters 20 --verify --json 2>&1) || rc=$?
    wall=$(elapsed "$start")
    mibps=$(printf '%s\n' "$out" | sed -n 's/.*"gbps":\([0-9.e+-]*\).*/\1/p' |
            awk '{ printf "%.2f", $1 * 1e9 / 1048576 }')
    err=$(printf '%s\n' "$out" | grep -i 'error' | tail -n 1 | tr -s ' ' | cut -c1-200)
    echo "RESULT run=$run scenario=$scenario tool=ferry mibps=${mibps:-none} wall_s=$wall wall_mibps=$(per_wall $rc $wall) rc=$rc error=${err:-none}"
    settle "$start"
    # A failed run may leave the owner's side of a broken QP; a fresh
    # owner per scenario keeps the next one independent of it.
    [ $rc = 0 ] || serve
    # perftest
    start=$(up); fault $down; rc=0
    out=$(RXE_PAIR_TIMEOUT=150 rxe-pair --perf ib_read_bw -s 1048576 -n 160 2>&1) || rc=$?
    wall=$(elapsed "$start")
    mibps=$(printf '%s\n' "$out" | sed -n 's/.*bw_avg_MiBps=\([0-9.]*\).*/\1/p')
    echo "RESULT run=$run scenario=$scenario tool=perftest mibps=${mibps:-none} wall_s=$wall wall_mibps=$(per_wall $rc $wall) rc=$rc"
    settle "$start"
  done
done
EOF2
)
cmd=${cmd//SCENARIOS/$SCENARIOS}
cmd=${cmd//RUNS/$RUNS}
tests/rxe/run.sh --two --bin "$target_dir/release/ferry" -- "$cmd" | grep -E '^RESULT'
