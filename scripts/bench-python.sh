#!/usr/bin/env bash
# ferry from Python against ferry from Rust, on the same workloads, two
# processes each, alternating, RUNS rounds, medians (issue 26's targets):
#   bw     1 MiB x64 writes and reads, one-shot submits: Python GB/s over
#          `ferry bench`'s (target >= 0.95);
#   descs  a request of 1,024 x 4 KiB descriptors made per request from a
#          numpy index array, posted and waited: Python's p50 minus
#          `ferry bench --prepared --strided --descs 1024`'s (target <= 20 µs);
#   lat    an 8-byte write: Python's p50 minus `ferry bench`'s (<= 5 µs);
#   idle   an idle Python node's CPU (<= 1% of a core).
# Over same-host memory and TCP. Beside them, with PEERS=1, NIXL's and
# Mooncake's Python packages on the same workloads (bench/peers/; their
# venvs made by bench/peers/setup.sh when missing). Run it on an idle
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-3}
source scripts/install-deps.sh
ferry_install_deps
cargo build --release --locked -q -p ferry-cli
source scripts/target-dir.sh
ferry=$target_dir/release/ferry
venv="$target_dir/python-venv"
ferry_make_venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check maturin==1.16.0 numpy==2.4.6
CARGO_TARGET_DIR="$target_dir" VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    maturin develop --release --manifest-path python/Cargo.toml --locked -q
if [ "${PEERS:-0}" = 1 ]; then
    source bench/peers/venvs.sh
    bench/peers/setup.sh >&2
fi
out=${OUT:-$(mktemp -d)}
echo "rows in $out/rows.jsonl" >&2

tag() { # system transport: tags each JSON row read on stdin
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    r["system"], r["transport"] = sys.argv[1], sys.argv[2]
    print(json.dumps(r))' "$1" "$2"
}

for round in $(seq "$RUNS"); do
    for transport in memory tcp; do
        for op in write read; do
            "$ferry" bench --loopback --size 256M --transport "$transport" --op "$op" \
                --block 1M --batch 64 --duration "$SECONDS_PER_RUN" --warmup 20 --json 2>/dev/null |
                sed 's/^{/{"workload":"bw",/' | tag ferry-rust "$transport" >>"$out/rows.jsonl"
            "$ferry" bench --loopback --size 256M --transport "$transport" --op "$op" --prepared \
                --strided --block 4K --descs 1024 --duration "$SECONDS_PER_RUN" --warmup 20 --json 2>/dev/null |
                sed 's/^{/{"workload":"descs",/' | tag ferry-rust "$transport" >>"$out/rows.jsonl"
        done
        "$ferry" bench --loopback --size 256M --transport "$transport" --op write \
            --block 8 --batch 1 --duration "$SECONDS_PER_RUN" --warmup 1000 --json 2>/dev/null |
            sed 's/^{/{"workload":"lat",/' | tag ferry-rust "$transport" >>"$out/rows.jsonl"
        "$venv/bin/python" python/bench.py --transport "$transport" --workload all \
            --blocks 1M:64 --duration "$SECONDS_PER_RUN" --idle-seconds 10 |
            tag ferry-python "$transport" >>"$out/rows.jsonl"
        if [ "${PEERS:-0}" = 1 ]; then
            theirs=$([ "$transport" = memory ] && echo shm || echo tcp)
            "$NIXL_PY" bench/peers/nixl_bench.py --transport "$theirs" --workload bw --op both \
                --duration "$SECONDS_PER_RUN" --blocks 4K,1M --no-prog-thread 2>/dev/null |
                tag nixl "$transport" >>"$out/rows.jsonl" || echo "NIXL failed" >&2
            "$NIXL_PY" bench/peers/nixl_bench.py --transport "$theirs" --workload lat --op write \
                --duration "$SECONDS_PER_RUN" --no-prog-thread 2>/dev/null |
                tag nixl "$transport" >>"$out/rows.jsonl" || echo "NIXL failed" >&2
            if [ "$transport" = tcp ]; then
                for workload in bw lat; do
                    "$MOONCAKE_PY" bench/peers/mooncake_bench.py --transport tcp --workload "$workload" \
                        --blocks 4K,1M --duration "$SECONDS_PER_RUN" 2>/dev/null |
                        tag mooncake "$transport" >>"$out/rows.jsonl" || echo "Mooncake failed" >&2
                done
            fi
        fi
    done
    echo "round $round done" >&2
done

python3 - "$out/rows.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(system, transport, workload, field, op=None, block=None, batch=None):
    xs = [r[field] for r in rows if r["system"] == system and r["transport"] == transport
          and r.get("workload") == workload and (op is None or r.get("op") == op)
          and (block is None or r.get("block") == block) and (batch is None or r.get("batch") == batch)
          and field in r]
    return statistics.median(xs) if xs else float("nan")
print(f"{'transport':<8} {'workload':<26} {'rust':>10} {'python':>10} {'target':>22}   {'nixl':>10} {'mooncake':>10}")
for t in ("memory", "tcp"):
    for op in ("write", "read"):
        r, p = med("ferry-rust", t, "bw", "gbps", op, 1 << 20, 64), med("ferry-python", t, "bw", "gbps", op, 1 << 20, 64)
        n, m = med("nixl", t, "bw", "gbps", op, 1 << 20), med("mooncake", t, "bw", "gbps", op, 1 << 20)
        print(f"{t:<8} {'1M x64 ' + op + ' GB/s':<26} {r:>10.2f} {p:>10.2f} {'py/rust %.3f (>=0.95)' % (p / r):>22}   {n:>10.2f} {m:>10.2f}")
    for op in ("write", "read"):
        r, p = med("ferry-rust", t, "descs", "lat_p50_us", op), med("ferry-python", t, "descs", "lat_p50_us", op)
        n, m = med("nixl", t, "bw", "lat_p50_us", op, 4096), med("mooncake", t, "bw", "lat_p50_us", op, 4096)
        print(f"{t:<8} {'4K x1024 ' + op + ' p50 µs':<26} {r:>10.1f} {p:>10.1f} {'+%.1f µs (<=20)' % (p - r):>22}   {n:>10.1f} {m:>10.1f}")
        post = med("ferry-python", t, "descs", "post_us", op)
        print(f"{t:<8} {'  of which make+post µs':<26} {'':>10} {post:>10.1f}")
    r, p = med("ferry-rust", t, "lat", "lat_p50_us"), med("ferry-python", t, "lat", "lat_p50_us")
    n, m = med("nixl", t, "lat", "lat_p50_us"), med("mooncake", t, "lat", "lat_p50_us")
    print(f"{t:<8} {'8 B write p50 µs':<26} {r:>10.2f} {p:>10.2f} {'+%.2f µs (<=5)' % (p - r):>22}   {n:>10.2f} {m:>10.2f}")
    idle = med("ferry-python", t, "idle", "core_percent")
    print(f"{t:<8} {'idle node % of a core':<26} {'':>10} {idle:>10.3f} {'(<=1)':>22}")
PY
