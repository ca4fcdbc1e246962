#!/usr/bin/env bash
# One rail cut in the middle of a two-rail run, in the two-VM soft-RoCE
# harness (tests/rxe/run.sh --two --rails 2) with each wire rate-limited
# (`tc netem rate`), so the wire rather than the emulated CPU sets the pace:
# `ferry serve` in VM a, one `ferry bench` of 1 MiB writes over both rails
# in VM b, and `wire1` cut CUT_AT seconds in (both ends: `down` takes the
# links down, `loss` drops every packet with the links up). VM b's rxe
# devices' own packet counters are sampled every 0.1 s; the script prints
# the throughput on each rail in 0.5 s steps around the cut, the total
# before and after it (after / before: one rail's share, not zero), and how
# long rail 0 sent nothing after the cut (the time the survivor took to
# resume: the port event's or the stall timeout's reaction, plus the
# keeper's tick).
#
#   scripts/bench-rails-cut.sh [down|loss [RATE [SECONDS [CUT_AT]]]]   (default down 16mbit 30 12)
#
# About 2 minutes (VM boot, the run, the release build if stale).
set -euo pipefail
cd "$(dirname "$0")/.."
cut=${1:-down}
rate=${2:-16mbit}
seconds=${3:-30}
cut_at=${4:-12}
case "$cut" in
    down) cut_cmd="/usr/bin/ip link set wire1 down" ;;
    loss) cut_cmd="/usr/bin/tc qdisc replace dev wire1 root netem loss 100%" ;;
    *) echo "cut: down or loss, not $cut" >&2; exit 2 ;;
esac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh
limit="for w in wire wire1; do /usr/bin/tc qdisc replace dev \$w root netem rate $rate || exit 1; done"
counters=/sys/class/infiniband
# The guest's clock: /proc/uptime, 10 ms resolution.
tests/rxe/run.sh --two --rails 2 --bin "$target_dir/release/ferry" -- "
sh -c '$limit' && on-peer '$limit' || exit 1
on-peer '(ferry serve --listen 10.99.0.1:7100 --size 16M --handle-file /tmp/h.json > /tmp/serve.log 2>&1 &)'
n=0; until on-peer test -s /tmp/h.json; do n=\$((n + 1)); [ \$n -lt 100 ] || exit 1; sleep 0.3; done
on-peer cat /tmp/h.json | head -n 1 > /tmp/h.json
(while :; do
    echo \"SAMPLE \$(cut -d' ' -f1 /proc/uptime) \$(cat $counters/rxe0/ports/1/hw_counters/sent_pkts) \$(cat $counters/rxe1/ports/1/hw_counters/sent_pkts)\"
    sleep 0.1
done) > /tmp/samples &
sampler=\$!
ferry bench --handle /tmp/h.json --size 16M --block 1M --op write --duration $seconds --json > /tmp/bench.json &
bench=\$!
sleep $cut_at
echo \"CUT \$(cut -d' ' -f1 /proc/uptime)\" > /tmp/cut
$cut_cmd && on-peer '$cut_cmd'
wait \$bench; rc=\$?
kill \$sampler
cat /tmp/samples /tmp/cut
sed 's/^{/BENCH {/' /tmp/bench.json
exit \$rc
" | tee "$out/console.log" >&2

grep -a '^SAMPLE\|^CUT\|^BENCH' "$out/console.log" >"$out/rows.txt"
python3 - "$out/rows.txt" "$cut" "$rate" <<'PY'
import json, statistics, sys

samples, cut, bench = [], None, None
for line in open(sys.argv[1]):
    tag, rest = line.split(" ", 1)
    if tag == "SAMPLE":
        t, a, b = rest.split()
        samples.append((float(t), int(a), int(b)))
    elif tag == "CUT":
        cut = float(rest)
    elif tag == "BENCH":
        bench = json.loads(rest)
if cut is None or len(samples) < 10:
    sys.exit("no samples or no cut recorded")
# RoCE payload per packet at the wires' 1500-byte MTU (path MTU 1024).
PAYLOAD = 1024
STEP = 0.5

def rate(rail, t0, t1):
    """MiB/s sent on `rail` (1 or 2 in a sample) from t0 to t1, between the
    samples around them: a busy one-vCPU guest sometimes runs the sampler
    late, so a window may hold no sample of its own."""
    first = max((s for s in samples if s[0] <= t0), default=samples[0], key=lambda s: s[0])
    last = min((s for s in samples if s[0] >= t1), default=samples[-1], key=lambda s: s[0])
    if last[0] <= first[0]:
        return 0.0
    return (last[rail] - first[rail]) * PAYLOAD / (last[0] - first[0]) / 2**20

start, end = samples[0][0], samples[-1][0]
print(f"wire1 cut ({sys.argv[2]}) {cut - start:.1f} s into the run; each wire limited to {sys.argv[3]}")
print("| t - cut (s) | rail 0 MiB/s | rail 1 MiB/s | total |")
print("|---|---|---|---|")
t = cut - 3.0
while t < min(cut + 6.0, end):
    r0, r1 = rate(1, t, t + STEP), rate(2, t, t + STEP)
    print(f"| {t - cut:+.1f} | {r0:.2f} | {r1:.2f} | {r0 + r1:.2f} |")
    t += STEP
before = rate(1, start + 2, cut) + rate(2, start + 2, cut)
after = rate(1, cut + 5, end) + rate(2, cut + 5, end)
print(f"total before the cut {before:.2f} MiB/s, from 5 s after it {after:.2f} MiB/s: "
      f"after / before = {after / before:.2f}")
# The survivor's pause: the longest run of samples after the cut in
# which rail 0 sent nothing, within the first 10 s.
pause, since = 0.0, None
prev = next(s for s in samples if s[0] >= cut)
for s in samples:
    if s[0] <= prev[0] or s[0] > cut + 10:
        continue
    if s[1] == prev[1]:
        since = since if since is not None else prev[0]
        pause = max(pause, s[0] - since)
    else:
        since = None
    prev = s
print(f"rail 0 sent nothing for at most {pause:.2f} s after the cut (sampled every 0.1 s)")
if bench:
    print(f"ferry bench: {bench['gbps'] * 1e9 / 2**20:.2f} MiB/s over the whole run")
PY
