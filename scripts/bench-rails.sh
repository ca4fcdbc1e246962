#!/usr/bin/env bash
# Two rails against one, in the two-VM soft-RoCE harness (tests/rxe/run.sh
# --two --rails 2) with each wire rate-limited (`tc netem rate`), so that the
# wire rather than the emulated CPU is the bottleneck: `ferry serve` in VM a
# (both rails), `ferry bench` in VM b with one rail (FERRY_IBV_RAILS=rxe0)
# and with both, 1 MiB and 16 MiB writes and reads, in ROUNDS interleaved
# rounds; prints each configuration's median and the two-rail / one-rail
# ratio. Control traffic goes over the management wire, which is not limited.
#
#   scripts/bench-rails.sh [RATE [SECONDS_PER_ROW [ROUNDS [ENV]]]]   (default 16mbit 8 2)
#
# ENV (e.g. FERRY_IBV_MAX_WR_BYTES=524288) is set for every `ferry bench`.
#
# At 16 Mbit/s a one-rail row moves its 16 MiB region in about 8 s: a run
# takes about 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-16mbit}
seconds=${2:-8}
rounds=${3:-2}
env=${4:-}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
limit="for w in wire wire1; do /usr/bin/tc qdisc replace dev \$w root netem rate $rate || exit 1; done"
bench="env $env ferry bench --handle /tmp/h.json --size 16M --block 1M,16M --warmup 1 --duration $seconds --json"
tests/rxe/run.sh --two --rails 2 --bin "$target_dir/release/ferry" -- \
    "sh -c '$limit' && on-peer '$limit' && \
     on-peer '(ferry serve --listen 10.99.0.1:7100 --size 16M --handle-file /tmp/h.json > /tmp/serve.log 2>&1 &)' && \
     n=0; until on-peer test -s /tmp/h.json; do n=\$((n + 1)); [ \$n -lt 100 ] || exit 1; sleep 0.3; done; \
     on-peer cat /tmp/h.json | head -n 1 > /tmp/h.json && \
     for round in \$(seq $rounds); do \
         for op in write read; do \
             FERRY_IBV_RAILS=rxe0 $bench --op \$op | sed 's/^{/RAILS1 {/' && \
             $bench --op \$op | sed 's/^{/RAILS2 {/' || exit 1; \
         done; \
     done" | tee "$out/console.log" >&2

grep -a '^RAILS' "$out/console.log" >"$out/rows.txt"
python3 - "$out/rows.txt" "$rate" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    tag, body = line.split(" ", 1)
    r = json.loads(body)
    rows.setdefault((r["op"], r["block"], tag), []).append(r["gbps"] * 1e9 / 2**20)
print(f"each wire limited to {sys.argv[2]}; MiB/s, median of {len(next(iter(rows.values())))} rounds (min-max)")
print("| op | block | one rail | two rails | two / one |")
print("|---|---|---|---|---|")
for op in ("write", "read"):
    for block in sorted({b for (o, b, _) in rows if o == op}):
        one, two = rows[(op, block, "RAILS1")], rows[(op, block, "RAILS2")]
        m1, m2 = statistics.median(one), statistics.median(two)
        print(f"| {op} | {block >> 20} MiB | {m1:.2f} ({min(one):.2f}-{max(one):.2f}) "
              f"| {m2:.2f} ({min(two):.2f}-{max(two):.2f}) | {m2 / m1:.2f} |")
PY
