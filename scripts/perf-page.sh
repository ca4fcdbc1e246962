#!/usr/bin/env bash
# Generates docs/performance.md, its plots (docs/perf/*.svg) and the README's
# headline table (only the lines between <!-- perf:begin --> and
# <!-- perf:end -->) from one run of the side-by-side benchmarks on this
# machine, ROUNDS interleaved rounds: ferry against NIXL and Mooncake (the
# project's own benchmarks of them, bench/peers/, in venvs that
# bench/peers/setup.sh makes) and the physical references, which do
# ferry's work with nothing else: scripts/tcp-mover.c over loopback TCP (4
# process pairs sweeping 256 MiB in 1 MiB send/recv calls; a ping-pong of 8
# bytes, polling and blocking), a one-thread memcpy, UCX's ucx_perftest,
# and, with --rdma, perftest in the soft-RoCE VM (tests/rxe/); iperf3 and
# sockperf beside them as context. The cells and commands are those of
# bench-tcp-bw-vs-peers.sh, bench-tcp-small-vs-peers.sh,
# bench-prepared-vs-nixl.sh, bench-memory-vs-ucx.sh,
# bench-tcp-vs-iperf3.sh, bench-nixl-backend.sh and
# bench-rdma-vs-perftest.sh:
#
#   TCP bandwidth   ferry submit and prepared requests (one long-lived `ferry
#                   serve`), NIXL (UCX tcp), Mooncake (tcp): 4K x1024, 64K
#                   x1024, 1M x64, 16M x4, writes and reads; tcp-mover bw
#                   with 4 pairs (ferry's 4 connections) in 1 MiB calls
#                   (ferry's TCP chunk: whatever the block size, ferry's
#                   connections move requests of at most 1 MiB, small ops
#                   gathered, large ones cut); context: iperf3 -P 4 and
#                   4 x iperf3 -P 1, both directions
#   latency         one 8-byte write per request: ferry, NIXL, Mooncake over
#                   TCP; tcp-mover's 8-byte ping-pong round trip, polling
#                   (`spin`, as ferry's TCP busy-polls) and blocking; context:
#                   sockperf's ping-pong; ferry memory and NIXL shm on the
#                   same host
#   same host       ferry's memory transport (prepared) against NIXL shm and
#                   memcpy, same shapes; ferry against ucx_perftest put_bw
#                   (posix,cma and tcp) at 1M and 16M
#   through NIXL    bench/peers/nixl_bench.py with --backend FERRY (ferry's
#                   plugin, built with ferry-cli's profile and installed into
#                   the NIXL venv) beside its UCX rows above: TCP and shm
#                   bandwidth and 8-byte write latency, as
#                   bench-nixl-backend.sh
#   --rdma          one VM boot: ferry over ibverbs against ib_write_bw,
#                   ib_read_bw (64 B to 1 MiB), ib_write_lat, ib_read_lat
#
# Every row goes into one JSON-lines file, $target_dir/perf-page/RUN/rows.jsonl
# (each tool's stderr beside it in log/), and scripts/perf_page.py renders
# it; `python3 scripts/perf_page.py render RUN_DIR` re-renders a run.
#
#   scripts/perf-page.sh [--smoke] [--rounds N] [--seconds S] [--rdma] [--out DIR]
#
#   --rounds N   interleaved rounds; tables give median and min-max   [5]
#   --seconds S  seconds per measurement (the VM's bandwidth rows: at
#                least 6, as bench-rdma-vs-perftest.sh)                [2]
#   --rdma       also boot the soft-RoCE VM (ferry against perftest)
#   --out DIR    write DIR/performance.md and DIR/perf/*.svg          [docs]
#                (the README's table is rewritten only for docs; else it
#                goes to DIR/readme-headline.md)
#   --smoke      one short round (0.3 s a cell) of 1 MiB blocks only,
#                written beside its rows ($target_dir/perf-page/RUN-smoke/
#                page/, or --out, never docs), then checks that the page
#                and every plot are well formed; a peer whose venv is
#                missing is skipped with a line saying so (NIXL's is the
#                test suite's, $target_dir/nixl-venv, when there is one).
#                Fails on a failure of ferry's own (its NIXL plugin's
#                included); a peer's or a tool's shows on the page and in
#                a line here.
#
# Takes about 20 minutes with the defaults on a 2-core machine (about 4 a
# round), --rdma about 8 more; --smoke a minute or two (--rdma: 2). Add the
# release build of ferry-cli and ferry-nixl (3-5 minutes the first time;
# --smoke uses the debug build, FERRY_PROFILE=release to override). A full
# run makes the peers' venvs first when they are missing
# (bench/peers/setup.sh, from PyPI: a minute or two the first time);
# installs iperf3, sockperf and ucx-utils when missing. Exits 1 when any
# command failed (the page is written anyway, listing them). Run it on an
# idle machine: other load moves every number.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=5
seconds=2
rdma=0
smoke=0
out=
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) smoke=1 ;;
        --rdma) rdma=1 ;;
        --rounds) rounds=${2:?--rounds N}; shift ;;
        --seconds) seconds=${2:?--seconds S}; shift ;;
        --out) out=${2:?--out DIR}; shift ;;
        -h | --help) usage ;;
        *) echo "perf-page: unknown argument $1" >&2; usage ;;
    esac
    shift
done
invocation="scripts/perf-page.sh"
((smoke)) && invocation+=" --smoke"
[ "$rounds" != 5 ] && invocation+=" --rounds $rounds"
[ "$seconds" != 2 ] && invocation+=" --seconds $seconds"
((rdma)) && invocation+=" --rdma"
[ -n "$out" ] && invocation+=" --out $out"
if ((smoke)); then
    rounds=1
    seconds=0.3
    if [ -n "$out" ] && [ "$(realpath -m "$out")" = "$(realpath -m docs)" ]; then
        echo "perf-page: --smoke does not write over docs/; give another --out" >&2
        exit 2
    fi
fi
started=$(date +%s)

# Tools: the references, installed when missing as the bench scripts do.
source scripts/install-deps.sh
source scripts/iperf3.sh
ferry_install_deps iperf3 sockperf ucx-utils >&2 || true
for tool in iperf3 sockperf ucx_perftest cc; do
    if ! command -v $tool >/dev/null; then
        ((smoke)) || { echo "perf-page: $tool is missing and could not be installed" >&2; exit 1; }
    fi
done

# The `ferry` to measure ($ferry), the peers' benchmarks and venvs
# ($NIXL_BENCH, $NIXL_PY, ...) and serve_tcp, as the peers scripts use them.
# A smoke run checks the script, not the figures: the debug build the test
# suite made already does (a release build costs CI minutes).
((smoke)) && export FERRY_PROFILE=${FERRY_PROFILE:-debug}
echo "perf-page: building ferry-cli (${FERRY_PROFILE:-release})" >&2
source scripts/peers-here.sh
have_nixl=1
have_mooncake=1
skipped=()
# A debug plugin goes into the test suite's own NIXL venv (made by
# scripts/nixl-tests.sh, which installs that plugin there too) when there is
# one, not into the peers' venv: benchmarks run later by hand would measure
# it there as FERRY, an 8-byte write 1.6 times slower than the release one.
if [ "${FERRY_PROFILE:-release}" = debug ] && [ -x "$target_dir/nixl-venv/bin/python" ]; then
    NIXL_PY=$target_dir/nixl-venv/bin/python
fi
peer_here() { # NAME PYTHON: a full run makes a missing venv; a smoke run skips its peer
    [ -x "$2" ] && return 0
    if ((smoke)); then
        echo "perf-page: skipping $1: no venv at $2 (run bench/peers/setup.sh $1 to include it)" >&2
        skipped+=("skipped_$1=$1: no venv at $2 (run bench/peers/setup.sh $1 to include it)")
        return 1
    fi
    echo "perf-page: making $1's venv (bench/peers/setup.sh $1)" >&2
    peers_setup "$1"
}
peer_here nixl "$NIXL_PY" || have_nixl=0
peer_here mooncake "$MOONCAKE_PY" || have_mooncake=0
# ferry as a NIXL backend: the FERRY plugin, built as ferry-cli is, copied
# into the NIXL venv's plugin directory (as bench-nixl-backend.sh does).
if ((have_nixl)); then
    echo "perf-page: building ferry-nixl (${FERRY_PROFILE:-release}) and installing its plugin" >&2
    if [ "${FERRY_PROFILE:-release}" = debug ]; then
        plugin=$ferry_plugin   # built with $ferry (scripts/peers-here.sh)
    else
        cargo build --release --locked -q -p ferry-nixl
        plugin=$target_dir/release/libplugin_FERRY.so
    fi
    "$ferry" nixl install --python "$NIXL_PY" --plugin "$plugin" >&2
fi
for tool in iperf3 sockperf ucx_perftest; do
    command -v $tool >/dev/null && continue
    echo "perf-page: skipping $tool: not installed" >&2
    skipped+=("skipped_$tool=$tool: not installed")
done

measuring=$(date +%s)
run=$target_dir/perf-page/$(date -u +%Y%m%dT%H%M%SZ)$( ((smoke)) && echo -smoke || true)
rows=$run/rows.jsonl
mkdir -p "$run/log"
: >"$rows"
# A smoke run's page goes beside its rows unless --out says otherwise.
((smoke)) && out=${out:-$run/page}
out=${out:-docs}
echo "perf-page: rows in $rows" >&2
version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }
python3 scripts/perf_page.py meta "$run" command="$invocation" rounds="$rounds" seconds="$seconds" \
    smoke="$smoke" rdma="$rdma" version_iperf3="$(version iperf3)" version_sockperf="$(version sockperf)" \
    version_ucx_perftest="$(version ucx-utils)" version_rustc="$(rustc --version 2>/dev/null || true)" \
    "${skipped[@]}"

# The cells: smoke mode measures 1 MiB blocks only.
if ((smoke)); then
    shapes=("1M 64")
    peer_blocks=1M
    mem_blocks=(1048576)
    ucx_blocks=(1048576)
    ucx_bytes=$((256 << 20))
    ucx_tcp_bytes=$((64 << 20))
    rdma_seconds=$seconds
    lat_args=(--lat-iters 200 --warmup 20)
    limit=120
else
    shapes=("4K 1024" "64K 1024" "1M 64" "16M 4")
    peer_blocks=4K,64K,1M,16M
    mem_blocks=(4096 65536 1048576 16777216)
    ucx_blocks=(1048576 16777216)
    ucx_bytes=$((4 << 30))
    ucx_tcp_bytes=$((256 << 20)) # UCX over loopback TCP moves 50-250 MB/s here
    rdma_seconds=$(python3 -c "print(max(6, $seconds))") # bench-rdma-vs-perftest.sh's 6 s a row
    lat_args=()
    limit=600
fi
whole=$(python3 -c "import math; print(max(1, math.ceil($seconds)))") # iperf3 and sockperf: whole seconds
streams=4 # ferry bench's default TCP connections per peer; iperf3 gets as many

serve_tcp
work=$(mktemp -d)
sockperf_pid=
cleanup() {
    kill "$server" 2>/dev/null || true
    [ -n "$sockperf_pid" ] && kill "$sockperf_pid" 2>/dev/null || true
    rm -rf "$dir" "$work"
}
trap cleanup EXIT

# How a command is shown on the page: the paths that change from machine to
# machine replaced by names.
ferry_shown=$ferry
case $ferry in "$PWD"/*) ferry_shown=${ferry#"$PWD"/} ;; esac
show() {
    local arg s=
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then s+=" $arg"; else s+=" '${arg//\'/\'\\\'\'}'"; fi
    done
    s=${s# }
    s=${s//"$ferry"/$ferry_shown}
    s=${s//"$dir"/\$SERVE_DIR}
    s=${s//"$work"/\$WORK}
    s=${s//"$PWD/"/}
    s=${s//"$HOME"/\~}
    echo "$s"
}

# measure KIND SUITE SYSTEM [TAG=VALUE...] [cmd=SHOWN] -- COMMAND...
# Runs COMMAND (at most $limit s), turns what it prints into rows (KIND: see
# perf_page.py ingest) tagged with the suite, system, round and the command,
# and keeps its stderr in $run/log/. A failure is a row too, and a line here.
n=0
failures=0
ferry_failures=0
measure() {
    local kind=$1 suite=$2 system=$3 shown= tags=() log
    shift 3
    while [ "$1" != -- ]; do
        case $1 in cmd=*) shown=${1#cmd=} ;; *) tags+=("$1") ;; esac
        shift
    done
    shift
    [ -n "$shown" ] || shown=$(show "$@")
    n=$((n + 1))
    log=$run/log/$(printf %03d $n)-$suite-$system.err
    local runner=(timeout -k 5 "$limit")
    declare -F "$1" >/dev/null && runner=()
    if "${runner[@]}" "$@" 2>"$log" | python3 scripts/perf_page.py ingest "$kind" "$rows" suite="$suite" \
        system="$system" round="$round" "cmd=$shown" "${tags[@]}"; then
        return 0
    fi
    echo "perf-page: FAILED: $shown (its stderr: $log)" >&2
    python3 scripts/perf_page.py ingest failed "$rows" suite="$suite" system="$system" round="$round" \
        "cmd=$shown" "log=$log" </dev/null
    failures=$((failures + 1))
    # (nixl-ferry: ferry's NIXL plugin, ferry's own code)
    case $system in ferry | nixl-ferry) ferry_failures=$((ferry_failures + 1)) ;; esac
    return 0
}
note() { # SUITE TEXT: a line for the page's list of commands
    python3 scripts/perf_page.py ingest note "$rows" suite="$1" "cmd=$2" </dev/null
}

# The memcpy reference (scripts/memcpy-bench.c): one thread copying between
# two buffers (256 MiB, or the third argument) in blocks of the size measured.
cc -O2 -o "$work/memcpy" scripts/memcpy-bench.c
note memcpy "\$WORK/memcpy BLOCK SECONDS [BUFFER]: scripts/memcpy-bench.c (cc -O2)"

# The TCP references (scripts/tcp-mover.c): ferry's work over loopback TCP
# with no protocol. Bandwidth: $streams sender/receiver process pairs (ferry
# bench's connections) sweeping 256 MiB (ferry serve's region) in 1 MiB
# send() and recv() calls, for every cell: ferry's TCP moves any request in
# pieces of at most its chunk size, 1 MiB (TcpConfig::chunk_size; runs of
# 4 or 64 KiB ops gathered into one, 16 MiB ops cut in 16), so 1 MiB calls
# are the work its connections do whatever the block size. The mover sends
# one way; its figure stands for writes and reads alike. Latency: the
# median round trip of 8 bytes, one process per side, receiving in a
# polling loop (`spin`, as ferry's TCP busy-polls), and blocking in recv().
cc -O2 -o "$work/tcp-mover" scripts/tcp-mover.c
mover_block=$((1 << 20))
mover_size=$((256 << 20))
note tcp-bw "\$WORK/tcp-mover bw PAIRS BLOCK SIZE SECONDS | pingpong LEN SECONDS [spin]: scripts/tcp-mover.c (cc -O2)"
note lat "\$WORK/tcp-mover bw PAIRS BLOCK SIZE SECONDS | pingpong LEN SECONDS [spin]: scripts/tcp-mover.c (cc -O2)"

# iperf3_pairs PROCS STREAMS_PER_PROC [-R]: scripts/iperf3.sh's iperf3_sum
# for this run's seconds.
iperf3_pairs() {
    iperf3_sum "$1" "$2" "$whole" 5299 "$work" ${3:-}
}

# ucx_put TLS SIZE ITERS: ucx_perftest's put bandwidth between two
# processes, as bench-memory-vs-ucx.sh measures it.
ucx_put() {
    local port=$((20000 + RANDOM % 20000)) iters=$3 server rc=0
    UCX_TLS=$1 timeout 120 ucx_perftest -p $port -t ucp_put_bw -s "$2" -n $iters >/dev/null 2>&1 &
    server=$!
    sleep 0.5
    UCX_TLS=$1 timeout 120 ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw -s "$2" -n $iters || rc=$?
    wait $server 2>/dev/null || true
    return $rc
}

sockperf_port=11311
if command -v sockperf >/dev/null; then
    sockperf server --tcp -i 127.0.0.1 -p $sockperf_port >/dev/null 2>&1 &
    sockperf_pid=$!
    note lat "in the background: sockperf server --tcp -i 127.0.0.1 -p $sockperf_port"
fi
note tcp-bw "in the background: FERRY_DISABLE_MEMORY=1 $ferry_shown serve --size 256M --no-ibverbs --handle-file \$SERVE_DIR/h"
note lat "the tcp rows use the same ferry serve as the TCP bandwidth table"
((have_nixl || have_mooncake)) && note tcp-bw "once, before the rounds: bench/peers/setup.sh (the peers' venvs, under ~/.cache/ferry-peers unless \$FERRY_PEERS_VENVS)"
if ((have_nixl)); then
    plugin_shown=$plugin
    case $plugin in "$PWD"/*) plugin_shown=${plugin#"$PWD"/} ;; esac
    note nixl-ferry "once, before the rounds: $(show "$ferry" nixl install --python "$NIXL_PY" --plugin "$plugin_shown")"
fi
round=0

for round in $(seq "$rounds"); do
    echo "perf-page: round $round of $rounds: TCP bandwidth" >&2
    for op in write read; do
        for shape in "${shapes[@]}"; do
            set -- $shape
            measure json tcp-bw ferry variant=submit transport=tcp -- "$ferry" bench --handle "$dir/h" \
                --transport tcp --op $op --block "$1" --batch "$2" --duration "$seconds" --json
            measure json tcp-bw ferry variant=prepared transport=tcp -- "$ferry" bench --handle "$dir/h" \
                --transport tcp --op $op --block "$1" --prepared --strided --descs "$2" --duration "$seconds" --json
        done
    done
    ((have_nixl)) && measure json tcp-bw nixl transport=tcp -- "$NIXL_PY" "$NIXL_BENCH" \
        --transport tcp --workload bw --op both --blocks $peer_blocks --duration "$seconds" --no-prog-thread
    ((have_nixl)) && measure json tcp-bw nixl-ferry transport=tcp -- "$NIXL_PY" "$NIXL_BENCH" \
        --backend FERRY --transport tcp --workload bw --op both --blocks $peer_blocks --duration "$seconds" \
        --no-prog-thread
    ((have_mooncake)) && measure json tcp-bw mooncake transport=tcp -- "$MOONCAKE_PY" \
        "$MOONCAKE_BENCH" --transport tcp --workload bw --op both --blocks $peer_blocks \
        --duration "$seconds"
    measure gbps tcp-bw tcp-mover variant="${streams}x1M" block=$mover_block -- \
        "$work/tcp-mover" bw $streams $mover_block $mover_size "$seconds"
    if command -v iperf3 >/dev/null; then
        for op in write read; do
            reverse=
            [ $op = read ] && reverse=-R
            variants=("1 $streams")
            ((smoke)) || variants+=("$streams 1")
            for variant in "${variants[@]}"; do
                set -- $variant
                shown="iperf3 -s -B 127.0.0.1 -p PORT -1 & iperf3 -c 127.0.0.1 -p PORT -P $2 -t $whole -J"
                shown+=${reverse:+ $reverse}
                [ "$1" = 1 ] || shown="$1 pairs at once of: $shown"
                measure gbps tcp-bw iperf3 variant="$1x$2" op=$op "cmd=$shown" -- iperf3_pairs "$1" "$2" $reverse
            done
        done
    fi

    echo "perf-page: round $round of $rounds: latency" >&2
    measure json lat ferry transport=tcp -- "$ferry" bench --handle "$dir/h" --transport tcp --block 8 \
        --batch 1 --duration "$seconds" --warmup 200 --json
    ((have_nixl)) && measure json lat nixl transport=tcp -- "$NIXL_PY" "$NIXL_BENCH" \
        --transport tcp --workload lat --op write --duration "$seconds" --no-prog-thread "${lat_args[@]}"
    ((have_nixl)) && measure json lat nixl-ferry transport=tcp -- "$NIXL_PY" "$NIXL_BENCH" \
        --backend FERRY --transport tcp --workload lat --op write --duration "$seconds" --no-prog-thread \
        "${lat_args[@]}"
    ((have_mooncake)) && measure json lat mooncake transport=tcp -- "$MOONCAKE_PY" \
        "$MOONCAKE_BENCH" --transport tcp --workload lat --op write --duration "$seconds" \
        "${lat_args[@]}"
    measure p50 lat tcp-mover variant=spin transport=tcp op=write block=8 -- \
        "$work/tcp-mover" pingpong 8 "$seconds" spin
    measure p50 lat tcp-mover variant=blocking transport=tcp op=write block=8 -- \
        "$work/tcp-mover" pingpong 8 "$seconds"
    [ -n "$sockperf_pid" ] && measure sockperf lat sockperf transport=tcp op=write block=14 -- \
        sockperf ping-pong --tcp -i 127.0.0.1 -p $sockperf_port -m 14 -t "$whole" --full-rtt
    measure json lat ferry transport=memory -- "$ferry" bench --loopback --transport memory --size 4K \
        --block 8 --batch 1 --duration "$seconds" --warmup 200 --json
    ((have_nixl)) && measure json lat nixl transport=memory -- "$NIXL_PY" "$NIXL_BENCH" \
        --transport shm --workload lat --op write --duration "$seconds" --no-prog-thread "${lat_args[@]}"
    ((have_nixl)) && measure json lat nixl-ferry transport=memory -- "$NIXL_PY" "$NIXL_BENCH" \
        --backend FERRY --transport shm --workload lat --op write --duration "$seconds" --no-prog-thread \
        "${lat_args[@]}"

    echo "perf-page: round $round of $rounds: same host" >&2
    for op in write read; do
        for shape in "${shapes[@]}"; do
            set -- $shape
            measure json mem-bw ferry variant=prepared transport=memory -- "$ferry" bench --loopback \
                --size 256M --transport memory --op $op --prepared --strided --block "$1" --descs "$2" \
                --duration "$seconds" --json
        done
    done
    ((have_nixl)) && measure json mem-bw nixl transport=shm -- "$NIXL_PY" "$NIXL_BENCH" \
        --transport shm --workload bw --op both --blocks $peer_blocks --duration "$seconds" --no-prog-thread
    ((have_nixl)) && measure json mem-bw nixl-ferry transport=shm -- "$NIXL_PY" "$NIXL_BENCH" \
        --backend FERRY --transport shm --workload bw --op both --blocks $peer_blocks --duration "$seconds" \
        --no-prog-thread
    for block in "${mem_blocks[@]}"; do
        measure gbps memcpy memcpy variant=256M block="$block" op=write -- "$work/memcpy" "$block" "$seconds"
    done
    for block in "${ucx_blocks[@]}"; do
        measure gbps memcpy memcpy variant=one-block block="$block" op=write -- "$work/memcpy" "$block" \
            "$seconds" "$block"
    done
    for block in "${ucx_blocks[@]}"; do
        measure json mem-ucx ferry variant=one-block transport=memory -- "$ferry" bench --loopback \
            --transport memory --size "$block" --block "$block" --duration "$seconds" --json
        measure json mem-ucx ferry variant=256M transport=memory -- "$ferry" bench --loopback \
            --transport memory --size 256M --block "$block" --duration "$seconds" --json
        if command -v ucx_perftest >/dev/null; then
            for tls in posix,cma tcp; do
                [ $tls = tcp ] && iters=$((ucx_tcp_bytes / block)) || iters=$((ucx_bytes / block))
                shown="UCX_TLS=$tls ucx_perftest -p PORT -t ucp_put_bw -s $block -n $iters & "
                shown+="UCX_TLS=$tls ucx_perftest 127.0.0.1 -p PORT -t ucp_put_bw -s $block -n $iters"
                measure ucx mem-ucx ucx variant=$tls block="$block" op=write "cmd=$shown" -- \
                    ucx_put $tls "$block" $iters
            done
        fi
    done
done

if ((rdma)); then
    # One boot of the soft-RoCE VM for every round, so that ferry's and
    # perftest's figures share it (under emulation only ratios mean much).
    echo "perf-page: soft-RoCE VM (tests/rxe/run.sh): $rounds round(s)" >&2
    b="ferry bench --loopback --transport ibverbs --json"
    if ((smoke)); then
        cells=("$b --size 64M --block 64K --op write --duration $rdma_seconds"
            "$b --size 64M --block 64K --op read --duration $rdma_seconds"
            "rxe-pair --perf ib_write_bw -s 65536 -n 200" "rxe-pair --perf ib_read_bw -s 65536 -n 200"
            "rxe-pair --perf ib_write_lat -s 8 -n 500" "$b --size 4K --block 8 --batch 1 --op write --iters 500")
    else
        cells=("$b --size 64M --block 4K,64K,1M --op write --duration $rdma_seconds"
            "$b --size 64M --block 4K,64K,1M --op read --duration $rdma_seconds"
            "$b --size 1M --block 64 --op write --duration $rdma_seconds"
            "rxe-pair --perf ib_write_bw -s 64 -n 20000"
            "rxe-pair --perf ib_write_bw -s 4096 -n 5000" "rxe-pair --perf ib_write_bw -s 65536 -n 1000"
            "rxe-pair --perf ib_write_bw -s 1048576 -n 200" "rxe-pair --perf ib_read_bw -s 4096 -n 5000"
            "rxe-pair --perf ib_read_bw -s 65536 -n 1000" "rxe-pair --perf ib_read_bw -s 1048576 -n 200"
            "rxe-pair --perf ib_write_lat -s 8 -n 5000" "$b --size 4K --block 8 --batch 1 --op write --iters 5000"
            "rxe-pair --perf ib_read_lat -s 8 -n 5000" "$b --size 4K --block 8 --batch 1 --op read --iters 5000")
    fi
    # One line for the guest's sh: m CMD prints a marker naming CMD, then
    # CMD's rows, or a failure marker.
    guest='m() { echo "PERFPAGE-CMD $*"; "$@" || echo "PERFPAGE-FAILED $1 $*"; }; '
    guest+="for round in \$(seq $rounds); do echo PERFPAGE-ROUND \$round; "
    for cell in "${cells[@]}"; do guest+="m $cell; "; done
    guest+="done"
    note rdma "one boot: tests/rxe/run.sh --bin $ferry_shown -- 'for each round: the commands below'"
    rc=0
    FERRY_RXE_TIMEOUT=$((300 + rounds * 300)) tests/rxe/run.sh --bin "$ferry" -- "$guest" \
        >"$run/rxe-console.log" 2>"$run/log/rxe.err" || rc=$?
    python3 scripts/perf_page.py ingest rxe "$rows" suite=rdma transport=ibverbs \
        <"$run/rxe-console.log" || rc=1
    # "measured failed ferry_failed": the VM's rows, and its commands that failed.
    read -r got failed ferry_failed < <(python3 -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rdma = [r for r in rows if r.get("suite") == "rdma" and not r.get("note")]
bad = [r for r in rdma if r.get("failed")]
print(len(rdma) - len(bad), len(bad), sum(r.get("system") == "ferry" for r in bad))' "$rows")
    failures=$((failures + failed))
    ferry_failures=$((ferry_failures + ferry_failed))
    if ((rc != 0)); then
        echo "perf-page: FAILED: the soft-RoCE run (exit $rc; console $run/rxe-console.log, log $run/log/rxe.err)" >&2
        python3 scripts/perf_page.py ingest failed "$rows" suite=rdma system=vm round=0 \
            "cmd=tests/rxe/run.sh (exit $rc)" </dev/null
        failures=$((failures + 1))
        ferry_failures=$((ferry_failures + 1))
    fi
    echo "perf-page: soft-RoCE: $got row(s), $failed command(s) failed in the VM" >&2
fi

python3 scripts/perf_page.py set "$run" finished="$(date +%s)" failures="$failures"
render=(python3 scripts/perf_page.py render "$run" --out "$out")
if [ "$(realpath -m "$out")" = "$(realpath -m docs)" ]; then
    render+=(--readme README.md)
else
    render+=(--headline "$out/readme-headline.md")
fi
render_rc=0
"${render[@]}" || render_rc=$?
echo "perf-page: $out/performance.md, $out/perf/*.svg from $rows;" \
    "$(($(date +%s) - started)) s in all, $(($(date +%s) - measuring)) s measuring" >&2
if ((failures)); then
    echo "perf-page: $failures command(s) failed ($ferry_failures of them ferry's): see the page's Failures" >&2
    # A smoke run fails on ferry's own failures; a peer's or a tool's is shown, not fatal.
    ((smoke && ferry_failures == 0)) || exit 1
fi
exit $render_rc
