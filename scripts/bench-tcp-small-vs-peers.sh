#!/usr/bin/env bash
# Small TCP transfers on loopback, ferry against NIXL 1.5.1 (UCX tcp) and
# Mooncake TE 0.3.13, measured by bench/peers/ (the project's benchmarks of
# them), in ROUNDS interleaved rounds:
#
#   per round, against one long-lived `ferry serve`:
#     ferry bench --op write --block 1M --batch 64   (a bandwidth run first, as
#                                                     the 8-byte figure once went
#                                                     bimodal after one)
#     ferry bench --op write --block 8 --batch 1     (p50 / p99, µs)
#   then bench/peers/nixl_bench.py's and mooncake_bench.py's `lat` workload
#   (one 8-byte write per request).
#
# Prints every round's figures and the medians. NIXL's initiator and target
# both spin on a core while they wait (the benchmark polls, as vLLM does);
# ferry's connections poll for TcpConfig::busy_poll (100 µs) and then sleep.
# BUSY_POLL_US=0 runs ferry without polling. Makes the peers' venvs first
# when they are missing (bench/peers/setup.sh). Run it on an idle machine.
#
#   scripts/bench-tcp-small-vs-peers.sh [ROUNDS [SECONDS]]   (default 3 2)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-2}
source scripts/peers-here.sh
peers_setup nixl mooncake
poll=()
[ -n "${BUSY_POLL_US:-}" ] && poll=(--busy-poll-us "$BUSY_POLL_US")
serve_tcp "${poll[@]}"

# "system p50 p99" from JSON rows on stdin, rows of `workload` lat if any.
pick() {
    python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if r.get("workload", "lat") == "lat" and r.get("block") == 8 and r.get("op", "write") == "write":
        print(sys.argv[1], r["lat_p50_us"], r["lat_p99_us"])
' "$1"
}

for round in $(seq "$rounds"); do
    echo "round $round" >&2
    bw=$($ferry bench --handle "$dir/h" --transport tcp --block 1M --batch 64 \
        --duration "$seconds" --json "${poll[@]}" | python3 -c 'import json,sys; print(json.loads(sys.stdin.readlines()[-1])["gbps"])')
    echo "ferry-bw $bw" >>"$dir/rows"
    $ferry bench --handle "$dir/h" --transport tcp --block 8 --batch 1 --duration "$seconds" \
        --warmup 200 --json "${poll[@]}" | pick ferry >>"$dir/rows"
    "$NIXL_PY" "$NIXL_BENCH" --transport tcp --workload lat \
        --op write --duration "$seconds" --no-prog-thread 2>/dev/null | pick nixl >>"$dir/rows"
    "$MOONCAKE_PY" "$MOONCAKE_BENCH" --transport tcp \
        --workload lat --op write --duration "$seconds" 2>/dev/null | pick mooncake >>"$dir/rows"
done

python3 - "$dir/rows" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
print("| system | 8-byte write p50 µs, rounds | p99 µs, rounds | median p50 / p99 |")
print("|---|---|---|---|")
for system in ("ferry", "nixl", "mooncake"):
    got = [(float(r[1]), float(r[2])) for r in rows if r[0] == system]
    if not got:
        continue
    p50s, p99s = [g[0] for g in got], [g[1] for g in got]
    print(f"| {system} | {' '.join(f'{x:.1f}' for x in p50s)} | {' '.join(f'{x:.1f}' for x in p99s)} "
          f"| {statistics.median(p50s):.1f} / {statistics.median(p99s):.1f} |")
bw = [float(r[1]) for r in rows if r[0] == "ferry-bw"]
print(f"ferry 1 MiB x 64 writes before each round, GB/s: {' '.join(f'{x:.2f}' for x in bw)}")
PY
