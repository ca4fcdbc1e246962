#!/usr/bin/env bash
# Same-host copies, in one run: ferry's memory transport against UCX (the
# engine under NIXL) with shared memory (UCX_TLS=posix,cma) and over TCP
# (UCX_TLS=tcp), a single-thread memcpy, and ferry's own TCP loopback, at
# 1 MiB and 16 MiB; several runs each, medians in GB/s (1e9 B/s) and the
# ratios the memory transport is held to (>= 1.3x UCX posix,cma, >= 0.85x
# memcpy, >= 1.5x ferry TCP), plus the 8-byte write p50.
# Installs Debian's ucx-utils when missing. Run it on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps ucx-utils
RUNS=${RUNS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-3}
SIZES=(1048576 16777216)

cargo build --release --locked -q -p ferry-cli
source scripts/target-dir.sh
ferry=$target_dir/release/ferry
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The memcpy reference (scripts/memcpy-bench.c): one thread copying between
# two buffers (256 MiB, or the third argument) in blocks of the size measured.
cc -O2 -o "$work/memcpy" scripts/memcpy-bench.c

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }'; }
median() { sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

ucx() { # TLS SIZE -> GB/s
    local port=$((20000 + RANDOM % 20000)) iters=$(((4 << 30) / $2))
    UCX_TLS=$1 ucx_perftest -p $port -t ucp_put_bw -s "$2" -n $iters >/dev/null 2>&1 &
    local server=$!
    sleep 0.5
    UCX_TLS=$1 ucx_perftest 127.0.0.1 -p $port -t ucp_put_bw -s "$2" -n $iters 2>/dev/null |
        awk '/Final:/ {printf "%.3f\n", $7 * 1048576 / 1e9}'
    wait $server 2>/dev/null || true
}

ferry_gbps() { # TRANSPORT BLOCK REGION -> GB/s
    "$ferry" bench --loopback --transport "$1" --size "$3" --block "$2" \
        --duration "$SECONDS_PER_RUN" --json 2>/dev/null |
        python3 -c 'import sys, json; print("%.3f" % json.loads(sys.stdin.readline())["gbps"])'
}

# ucx_perftest puts one buffer of the block size again and again (cache
# resident at 1 MiB): "memory-1" does the same (a region of one block);
# "memory" and "tcp" sweep a 256 MiB region, as memcpy does.
printf "%-9s %10s %10s %10s %10s %10s %10s   %s\n" size memory-1 memory posix,cma ucx-tcp memcpy tcp \
    "memory-1/posix,cma memory/memcpy memory/tcp"
for size in "${SIZES[@]}"; do
    declare -A got=()
    for name in memory1 memory posix ucxtcp memcpy tcp; do
        samples=()
        for _ in $(seq "$RUNS"); do
            case $name in
                memory1) samples+=("$(ferry_gbps memory "$size" "$size")") ;;
                memory) samples+=("$(ferry_gbps memory "$size" 256M)") ;;
                tcp) samples+=("$(ferry_gbps tcp "$size" 256M)") ;;
                posix) samples+=("$(ucx posix,cma "$size")") ;;
                ucxtcp) samples+=("$(ucx tcp "$size")") ;;
                memcpy) samples+=("$("$work/memcpy" "$size" "$SECONDS_PER_RUN")") ;;
            esac
        done
        got[$name]=$(printf "%s\n" "${samples[@]}" | median)
    done
    printf "%-9s %10s %10s %10s %10s %10s %10s   %.2f %.2f %.2f\n" "$size" "${got[memory1]}" \
        "${got[memory]}" "${got[posix]}" "${got[ucxtcp]}" "${got[memcpy]}" "${got[tcp]}" \
        "$(ratio "${got[memory1]}" "${got[posix]}")" \
        "$(ratio "${got[memory]}" "${got[memcpy]}")" \
        "$(ratio "${got[memory]}" "${got[tcp]}")"
done
"$ferry" bench --loopback --transport memory --size 4K --block 8 --batch 1 --iters 5000 --json 2>/dev/null |
    python3 -c 'import sys, json; r = json.loads(sys.stdin.readline()); print("8-byte write through the memory transport: p50 %.2f us, p99 %.2f us" % (r["lat_p50_us"], r["lat_p99_us"]))'
