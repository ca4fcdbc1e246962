#!/usr/bin/env bash
# ferry through NIXL's API: the FERRY plugin against NIXL's own UCX backend,
# on bench/peers/nixl_bench.py's workloads (`--backend NAME` runs them on
# any NIXL backend), over TCP loopback and same-host memory, in one
# sitting, ROUNDS interleaved rounds, medians. Beside them, each round, the
# physical references the targets are set against:
#   tcp  scripts/tcp-mover.c: four sender/receiver process pairs sweeping
#        256 MiB in 1 MiB send/recv calls (ferry's four connections and
#        its 1 MiB TCP chunks: its work, with no protocol), and
#   shm  a two-thread memcpy (numpy) of each cell's request size, and
#        one thread's process_vm_writev of the cell's blocks
#        (scripts/memcpy-bench.c pvm): the kernel copy ferry makes for
#        memory it did not allocate, as NIXL's is;
# and, with FERRY_PY=1, ferry's own Python API (python/bench.py, prepared
# requests) on the same cells and the same kind of memory: the process's
# own, registered (NIXL's benchmark registers page-aligned anonymous memory,
# which ferry reaches across processes with process_vm_writev, where memory
# ferry allocated is mapped and copied with memcpy).
#
# Cells: bw (4K x1024, 64K x1024, 1M x64, 16M x4; write and read, one
# request in flight) and lat (one 8-byte write per request, p50). Then, per
# backend and transport, what a post of 16,384 64 B blocks costs per block
# (scripts/bench-nixl-post.py: CPU inside postXfer, and the whole
# request). Makes NIXL's venv first when it is missing
# (bench/peers/setup.sh); installs the release plugin into it. Run it on an
# idle machine.
#
#   scripts/bench-nixl-backend.sh [ROUNDS [SECONDS]]   (default 3 2)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-2}
source bench/peers/venvs.sh
bench/peers/setup.sh nixl >&2
source scripts/install-deps.sh
ferry_install_deps >&2
cargo build --release --locked -q -p ferry-cli -p ferry-nixl
source scripts/target-dir.sh
if [ "${FERRY_PY:-0}" = 1 ]; then
    ferry_venv="$target_dir/python-venv"
    ferry_make_venv "$ferry_venv"
    "$ferry_venv/bin/python" -m pip install -q --disable-pip-version-check maturin==1.16.0 numpy==2.4.6
    CARGO_TARGET_DIR="$target_dir" VIRTUAL_ENV="$ferry_venv" PATH="$ferry_venv/bin:$PATH" \
        maturin develop --release --manifest-path python/Cargo.toml --locked -q
fi
"$target_dir/release/ferry" nixl install --python "$NIXL_PY" \
    --plugin "$target_dir/release/libplugin_FERRY.so" >&2
out=$(mktemp -d)
trap 'rm -rf "$out"; kill $(jobs -p) 2>/dev/null || true' EXIT
echo "rows in $out/rows" >&2

# "system transport workload op block value" per JSON row on stdin: GB/s
# for bw, p50 µs for lat. Rows must be verified, except ferry's Python
# bench's (it does not compare bytes; the suite's Python tests do).
pick() {
    python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if not r.get("verified", True) and sys.argv[1] != "ferry-py":
        sys.exit(f"unverified row: {line}")
    w = r.get("workload", "bw")
    value = r["gbps"] if w == "bw" else r["lat_p50_us"]
    print(sys.argv[1], sys.argv[2], w, r.get("op"), r["block"], value)
' "$@"
}


cc -O2 -o "$out/memcpy-bench" scripts/memcpy-bench.c
cc -O2 -o "$out/tcp-mover" scripts/tcp-mover.c

# One thread's process_vm_writev of each cell's blocks, GB/s.
pvm_ref() {
    local block
    for block in 4096 65536 1048576 16777216; do
        local gbps
        gbps=$("$out/memcpy-bench" $block "$seconds" $((256 << 20)) pvm)
        echo "pvm shm bw write $block $gbps"
        echo "pvm shm bw read $block $gbps"
    done
}

# A two-thread memcpy of each cell's request between two 256 MiB buffers.
memcpy_ref() {
    "$NIXL_PY" - "$seconds" <<'PY'
import sys, threading, time
import numpy as np
seconds = float(sys.argv[1])
src = np.ones(256 << 20, np.uint8); dst = np.zeros(256 << 20, np.uint8)
for block, n in ((4096, 1024), (65536, 1024), (1 << 20, 64), (16 << 20, 4)):
    size = block * n
    slots = (256 << 20) // size
    def copy(part, k):
        a, b = k * size + part * size // 2, k * size + (part + 1) * size // 2
        np.copyto(dst[a:b], src[a:b])
    moved, k, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        threads = [threading.Thread(target=copy, args=(p, k)) for p in (0, 1)]
        [t.start() for t in threads]; [t.join() for t in threads]
        moved += size; k = (k + 1) % slots
    gbps = moved / (time.perf_counter() - start) / 1e9
    for op in ("write", "read"):
        print("memcpy shm bw", op, block, gbps)
PY
}

for round in $(seq "$rounds"); do
    echo "round $round" >&2
    for transport in tcp shm; do
        for backend in UCX FERRY; do
            for workload in bw lat; do
                "$NIXL_PY" bench/peers/nixl_bench.py --backend $backend --transport $transport \
                    --workload $workload --op both --duration "$seconds" --no-prog-thread \
                    2>"$out/err" | pick "$backend" "$transport" >>"$out/rows" ||
                    { cat "$out/err" >&2; exit 1; }
            done
        done
        if [ "${FERRY_PY:-0}" = 1 ]; then
            [ $transport = tcp ] && ferry_transport=tcp || ferry_transport=memory
            for workload in bw lat; do
                "$ferry_venv/bin/python" python/bench.py --transport $ferry_transport \
                    --workload $workload --mode prepared --memory registered \
                    --duration "$seconds" 2>"$out/err" |
                    pick ferry-py "$transport" >>"$out/rows" || { cat "$out/err" >&2; exit 1; }
            done
        fi
    done
    for transport in memory tcp; do
        for backend in UCX FERRY; do
            "$NIXL_PY" scripts/bench-nixl-post.py --backend $backend --transport $transport \
                --descs 16384 --iters 50 2>"$out/err" >>"$out/post" || { cat "$out/err" >&2; exit 1; }
        done
    done
    echo "mover tcp bw write 0 $("$out/tcp-mover" bw 4 $((1 << 20)) $((256 << 20)) "$seconds")" >>"$out/rows"
    memcpy_ref >>"$out/rows"
    pvm_ref >>"$out/rows"
done

python3 - "$out/rows" "$out/post" <<'PY'
import json, statistics, sys
cells = {}
for line in open(sys.argv[1]):
    system, transport, workload, op, block, value = line.split()
    cells.setdefault((transport, workload, op, int(block)), {}).setdefault(system, []).append(float(value))
# tcp-mover moves bytes one way: its figure stands for writes and reads.
mover = statistics.median(cells.get(("tcp", "bw", "write", 0), {}).get("mover", [float("nan")]))
med = lambda xs: statistics.median(xs) if xs else float("nan")
size = lambda b: f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" if b >= 1024 else f"{b} B"
py = any("ferry-py" in by for by in cells.values())
print("| transport | cell | UCX | FERRY | FERRY / UCX | physical | FERRY / physical | process_vm | FERRY / process_vm |"
      + (" ferry Python | FERRY / ferry Python |" if py else ""))
print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if py else ""))
for (transport, workload, op, block), by in sorted(cells.items()):
    if "FERRY" not in by:
        continue
    u, f, p = med(by.get("UCX", [])), med(by["FERRY"]), med(by.get("ferry-py", []))
    if workload == "bw":
        phys = mover if transport == "tcp" else med(cells.get(("shm", "bw", op, block), {}).get("memcpy", []))
        line = f"| {transport} | {op} {size(block)} GB/s | {u:.2f} | {f:.2f} | {f / u:.2f} | {phys:.2f} | {f / phys:.2f} |"
        pvm = med(by.get("pvm", []))
        line += f" {pvm:.2f} | {f / pvm:.2f} |" if transport == "shm" else " | |"
        line += f" {p:.2f} | {f / p:.2f} |" if py else ""
    else:
        line = f"| {transport} | {op} 8 B p50 µs | {u:.1f} | {f:.1f} | {f / u:.2f} (lower is better) | | | | |"
        line += f" {p:.1f} | {f / p:.2f} (lower is better) |" if py else ""
    print(line)
print()
posts = {}
for line in open(sys.argv[2]):
    if not line.startswith("{"):
        continue  # UCX's own warnings, on stdout
    r = json.loads(line)
    if not r["verified"]:
        sys.exit(f"unverified row: {line}")
    by = posts.setdefault(r["transport"], {}).setdefault(r["backend"], {"post": [], "request": []})
    by["post"].append(r["post_cpu_ns_per_desc"])
    by["request"].append(r["request_ns_per_desc"])
print("| transport | 16,384 x 64 B, ns per block | UCX | FERRY | FERRY / UCX |")
print("|---|---|---|---|---|")
for transport, by in sorted(posts.items()):
    for what, label in (("post", "CPU in postXfer"), ("request", "whole request")):
        u, f = med(by.get("UCX", {}).get(what, [])), med(by.get("FERRY", {}).get(what, []))
        print(f"| {transport} | {label} | {u:.0f} | {f:.0f} | {f / u:.3f} |")
print()
print("every round:")
for key, by in sorted(cells.items()):
    print(" ", *key, "; ".join(f"{s} " + " ".join(f"{x:.3g}" for x in xs) for s, xs in by.items()))
PY
