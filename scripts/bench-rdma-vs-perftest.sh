#!/usr/bin/env bash
# Compares ferry's RDMA data path with perftest in the same soft-RoCE VM boot:
# ib_write_bw / ib_read_bw at 4 KiB, 64 KiB and 1 MiB (bandwidth and message
# rate) and ib_write_lat at 8 bytes, against the two-process demo moving a
# 64 MiB region in the same block sizes and one-op 8-byte submits.
# Absolute numbers under emulation mean nothing; the ratios are the result.
#
#   scripts/bench-rdma-vs-perftest.sh [SECONDS_PER_ROW]   (default 6)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-6}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

cargo build --release --locked --example demo >&2
tests/rxe/run.sh --perf --bin target/release/examples/demo -- \
    "demo --json --size 64M --block 4K,64K,1M --op write,read --seconds $seconds && \
     demo --json --size 8 --block 8 --op write,read --iters 3000" | tee "$out/console.log" >&2

grep -a '^PERF ' "$out/console.log" >"$out/perftest.txt"
grep -a '^{' "$out/console.log" >"$out/ferry.jsonl"
python3 - "$out/perftest.txt" "$out/ferry.jsonl" <<'PY'
import json, sys
ref = {}
for line in open(sys.argv[1]):
    kv = dict(x.split("=", 1) for x in line.split()[1:])
    ref[(kv["tool"], int(kv["bytes"]))] = kv
rows = [json.loads(l) for l in open(sys.argv[2])]
print("| op | size | ferry MiB/s | perftest MiB/s | ratio | ferry Kmsg/s | perftest Kmsg/s | ratio |")
print("|---|---|---|---|---|---|---|---|")
lat = []
for r in rows:
    size, op = r["block"], r["op"]
    mibps = r["gbps"] * 1e9 / 2**20
    if size == 8:
        lat.append((op, 1e6 * size / (r["gbps"] * 1e9)))
        continue
    tool = "ib_write_bw" if op == "write" else "ib_read_bw"
    p = ref[(tool, size)]
    ref_bw, ref_rate = float(p["bw_avg_MiBps"]), float(p["msg_rate_Mpps"]) * 1e3
    rate = mibps * 2**20 / size / 1e3
    print(f"| {op} | {size} | {mibps:.2f} | {ref_bw:.2f} | {mibps / ref_bw:.2f} | {rate:.3f} | {ref_rate:.3f} | {rate / ref_rate:.2f} |")
one_way = float(ref[("ib_write_lat", 8)]["t_typical_us"])
for op, us in lat:
    # A ferry submit completes when the write is acknowledged: one round trip.
    # ib_write_lat reports one-way latency (half its ping-pong round trip).
    print(f"8-byte {op} submit: {us:.1f} us; ib_write_lat {one_way} us one-way = {2 * one_way:.1f} us round trip; "
          f"ratio to the round trip {us / (2 * one_way):.2f}")
PY
