#!/usr/bin/env bash
# Compares submits sent as messages to the node's actor (`ferry bench --via
# actor`) with direct `Node::submit` calls (`--via node`), which take the same
# routing path: what the actor's mailbox hop costs. Over TCP on this host and
# over soft-RoCE in one VM boot (tests/rxe/run.sh), in ROUNDS interleaved
# rounds (the order of the two alternates), compared as medians:
#
#   8-byte write, one op per submit      p50 latency      actor / node (goal <= 1.10)
#   4 KiB writes, one op per submit      message rate     actor / node (goal >= 0.90)
#   4 KiB writes, 64 ops per submit      message rate     actor / node
#   16 workers, 1 MiB writes             aggregate GB/s   actor / node (goal ~1.00)
#
# and, as the floor under any actor hop, the p50 round trip of an empty
# message to a do-nothing actor on the same runtime (`--via echo`).
#
#   scripts/bench-actor-vs-node.sh [ROUNDS [SECONDS_PER_ROW]]   (default 3 2)
#
# Set FERRY_BENCH_SKIP_RDMA=1 to run the TCP half only.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh

# One line per case: the arguments both sides run with.
cases=(
    "--size 4K --block 8 --batch 1 --op write --iters 4000"
    "--size 4M --block 4K --batch 1 --op write --duration $seconds"
    "--size 64M --block 4K --batch 64 --op write --duration $seconds"
    "--size 64M --block 1M --workers 16 --op write --duration $seconds"
)

# Prints the shell commands of all rounds for one transport.
commands() {
    local ferry=$1 transport=$2 round case first second
    for round in $(seq "$rounds"); do
        if ((round % 2)); then first=node second=actor; else first=actor second=node; fi
        for case in "${cases[@]}"; do
            for via in $first $second; do
                echo "$ferry bench --loopback --transport $transport --json --warmup 20 --via $via $case"
            done
        done
        echo "$ferry bench --loopback --transport $transport --json --warmup 20 --via echo ${cases[0]}"
    done
}

echo "TCP on this host: $rounds rounds" >&2
commands "$target_dir/release/ferry" tcp | while read -r line; do
    $line >>"$out/tcp.jsonl"
done

if [ "${FERRY_BENCH_SKIP_RDMA:-0}" != 1 ]; then
    echo "ibverbs on soft-RoCE, one VM boot: $rounds rounds" >&2
    guest=$(commands ferry ibverbs | paste -sd '&' | sed 's/&/ \&\& /g')
    tests/rxe/run.sh --bin "$target_dir/release/ferry" -- "$guest" | tee "$out/console.log" >&2
    grep -a '^{' "$out/console.log" >"$out/ibverbs.jsonl"
fi

python3 - "$out" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
def case(r):
    return (r["block"], r["batch"], r["workers"])
names = {
    (8, 1, 1): ("8 B write, 1 op/submit", "p50 us", lambda r: r["lat_p50_us"], "lower"),
    (4096, 1, 1): ("4 KiB write, 1 op/submit", "Kmsg/s", lambda r: r["mops"] * 1e3, "higher"),
    (4096, 64, 1): ("4 KiB write, 64 ops/submit", "Kmsg/s", lambda r: r["mops"] * 1e3, "higher"),
}
for transport in ("tcp", "ibverbs"):
    path = os.path.join(out, f"{transport}.jsonl")
    if not os.path.exists(path):
        continue
    rows = [json.loads(l) for l in open(path) if l.strip()]
    echo = [r["lat_p50_us"] for r in rows if r["via"] == "echo"]
    rows = [r for r in rows if r["via"] != "echo"]
    print(f"\n{transport}: actor / node, medians of {len(rows) // 8} rounds")
    print("| case | unit | via node | via actor | actor / node | runs (node; actor) |")
    print("|---|---|---|---|---|---|")
    for key in sorted({case(r) for r in rows}, key=lambda k: (k[2], k[0], k[1])):
        name, unit, value, _ = names.get(
            key, (f"{key[2]} workers, {key[0] >> 20} MiB write", "MiB/s", lambda r: r["gbps"] * 1e9 / 2**20, "higher"))
        by = {via: [value(r) for r in rows if case(r) == key and r["via"] == via] for via in ("node", "actor")}
        if not by["node"] or not by["actor"]:
            continue
        node, actor = statistics.median(by["node"]), statistics.median(by["actor"])
        runs = " ".join(f"{x:.1f}" for x in by["node"]) + "; " + " ".join(f"{x:.1f}" for x in by["actor"])
        print(f"| {name} | {unit} | {node:.2f} | {actor:.2f} | {actor / node:.2f} | {runs} |")
    if echo:
        runs = " ".join(f"{x:.1f}" for x in echo)
        print(f"\nempty message to a do-nothing actor (--via echo): p50 {statistics.median(echo):.2f} us ({runs})")
PY
