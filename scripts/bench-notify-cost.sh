#!/usr/bin/env bash
# What a notification adds to a 4 KiB write (issue 9): one `ferry serve`
# (the owner), then ROUNDS alternating runs of
#   ferry bench --handle H --transport T --op write --block 4K --batch 1 --duration 3 [--notify 64]
# Each run prints one RESULT line: bench's p50 and p99 (µs), its ops, and
# the owner's CPU time per op (µs, from /proc/PID/stat around the run),
# which shows the owner's work per notification apart from the latency,
# which is noisy on a small machine. Then the medians and their ratio.
#
# usage: [NOTIFY_COALESCE_MS=N] scripts/bench-notify-cost.sh [tcp|memory|ibverbs|ibverbs-two (default tcp)] [ROUNDS (default 5)]
#   tcp          owner and initiator here, over loopback
#   memory       owner and initiator here, over the same-host memory transport
#                (notifications on its lane, a ring in shared memory)
#   ibverbs      both in the one-VM soft-RoCE harness (tests/rxe/run.sh, 2 vCPUs
#                shared by owner, initiator and rxe), one boot for all rounds
#   ibverbs-two  owner in VM a, initiator in VM b (run.sh --two, 1 vCPU each),
#                across the virtual wire: each end has its own CPU, as on two
#                hosts. Also prints perftest's ib_write_lat (4 KiB) and
#                ib_send_lat (64 B) across the same wire, in the same boot, as
#                PERF lines: the wire's own cost of one more small message.
#                ib_send_lat runs again before each round (BUDGET lines), and
#                the last MEDIAN line sets each round's gap (notified p50 -
#                plain p50) against the budget measured just before it.
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSPORT=${1:-tcp}
ROUNDS=${2:-5}
# The owner's IbvConfig::notify_coalesce in ms (ferry serve
# --notify-coalesce-ms): 0 wakes it on each notification; unset leaves it
# to the device (0 on a NIC, a few ms on soft-RoCE).
COALESCE=${NOTIFY_COALESCE_MS:-}
case $TRANSPORT in tcp | memory | ibverbs | ibverbs-two) ;; *) echo "transport: tcp, memory, ibverbs or ibverbs-two" >&2; exit 2 ;; esac
cargo build --release --locked -p ferry-cli >&2
source scripts/target-dir.sh

# The measurement, in POSIX sh and awk: it also runs in the VM's busybox.
measure=$(cat <<'EOF'
set -eu
ferry=$1 transport=$2 rounds=$3 where=${4:-here} coalesce=${5:-}
coalesce=${coalesce:+--notify-coalesce-ms $coalesce}
dir=$(mktemp -d)
hz=$(getconf CLK_TCK 2>/dev/null || echo 100)
if [ "$where" = peer ]; then
  # The owner in the peer VM, reached across the wire by name.
  on-peer "setsid $ferry serve --listen $FERRY_RXE_PEER_IP:7100 --size 4M --publish r $coalesce < /dev/null > /dev/null 2>&1 &"
  trap 'on-peer "kill \$(pidof ferry)" > /dev/null 2>&1; rm -rf "$dir"' EXIT
  target="--peer $FERRY_RXE_PEER_IP:7100 --region r"
  i=0
  # Listening: port 7100 (1BBC) in state LISTEN (0A).
  until on-peer cat /proc/net/tcp | grep -q ':1BBC [0-9A-F:]* 0A'; do
    i=$((i + 1)); [ $i -lt 120 ] || { echo "serve in the peer VM did not answer" >&2; exit 1; }
    sleep 0.5
  done
  cpu() { on-peer "awk '{ print \$14 + \$15 }' /proc/\$(pidof ferry)/stat"; }
else
  $ferry serve --size 4M --handle-file "$dir/h" $coalesce > /dev/null 2>&1 &
  owner=$!
  trap 'kill $owner 2>/dev/null; rm -rf "$dir"' EXIT
  target="--handle $dir/h"
  i=0
  while [ ! -s "$dir/h" ]; do
    i=$((i + 1)); [ $i -lt 600 ] || { echo "serve wrote no handle" >&2; exit 1; }
    sleep 0.1
  done
  cpu() { awk '{ print $14 + $15 }' "/proc/$owner/stat"; }
fi
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
r=0
while [ $r -lt "$rounds" ]; do
  r=$((r + 1))
  if [ "$where" = peer ]; then
    # The budget beside each round, not only before the first: the host's
    # speed drifts within a boot.
    rxe-pair --perf ib_send_lat -s 64 -n 1000 |
      sed -n 's/^PERF .*t_typical_us=\([0-9.]*\).*/BUDGET typical_us=\1/p'
  fi
  for kind in plain notified; do
    extra=; [ $kind = notified ] && extra="--notify 64"
    before=$(cpu)
    row=$($ferry bench $target --transport "$transport" --op write --block 4K \
      --batch 1 --duration 3 --json $extra 2>/dev/null | grep '^{') ||
      { echo "ferry bench failed ($kind)" >&2; exit 1; }
    after=$(cpu)
    p50=$(echo "$row" | field lat_p50_us) p99=$(echo "$row" | field lat_p99_us)
    mops=$(echo "$row" | field mops) secs=$(echo "$row" | field seconds)
    awk -v k=$kind -v p50="$p50" -v p99="$p99" -v mops="$mops" -v s="$secs" \
        -v t=$((after - before)) -v hz="$hz" 'BEGIN {
      ops = mops * 1e6 * s
      printf "RESULT %s p50_us=%.1f p99_us=%.1f ops=%d owner_cpu_us_per_op=%.1f\n",
        k, p50, p99, ops, (ops > 0 ? t * 1e6 / hz / ops : -1) }'
  done
done | tee "$dir/results"
awk '
  function median(a, n,   i, j, x) {
    for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j > 0 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  $1 == "BUDGET" { split($2, t, "="); budget = t[2]; next }
  { split($3, p, "="); split($6, c, "=")
    if ($2 == "plain") { pp[++np] = p[2]; pc[np] = c[2] } else {
      qp[++nq] = p[2]; qc[nq] = c[2]
      # This round: the gap over the budget measured just before it.
      if (budget > 0) { gb[++ng] = (p[2] - pp[np]) / budget; bu[ng] = budget } } }
  END {
    a = median(pp, np); b = median(qp, nq)
    printf "MEDIAN p50_us plain=%.1f notified=%.1f ratio=%.3f\n", a, b, (a > 0 ? b / a : 0)
    printf "MEDIAN owner_cpu_us_per_op plain=%.1f notified=%.1f\n", median(pc, np), median(qc, nq)
    if (ng > 0)
      printf "MEDIAN gap_us=%.1f budget_us=%.1f per_round_gap_over_budget=%.3f\n", b - a, median(bu, ng), median(gb, ng)
  }' "$dir/results"
EOF
)

if [ "$TRANSPORT" = tcp ] || [ "$TRANSPORT" = memory ]; then
  sh -c "$measure" sh "$target_dir/release/ferry" "$TRANSPORT" "$ROUNDS" here "$COALESCE"
  exit
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
printf '%s\n' "#!/bin/sh" "$measure" > "$stage/notify-cost"
chmod +x "$stage/notify-cost"
if [ "$TRANSPORT" = ibverbs ]; then
  tests/rxe/run.sh --bin "$target_dir/release/ferry" --bin "$stage/notify-cost" -- \
    "notify-cost ferry ibverbs $ROUNDS here $COALESCE" 2>&1 | grep -E '^(RESULT|MEDIAN)|rxe .*(error|status)'
else
  perf='for r in 1 2; do rxe-pair --perf ib_write_lat -s 4096 -n 1000; rxe-pair --perf ib_send_lat -s 64 -n 1000; done'
  tests/rxe/run.sh --two --bin "$target_dir/release/ferry" --bin "$stage/notify-cost" -- \
    "$perf; notify-cost ferry ibverbs $ROUNDS peer $COALESCE" 2>&1 |
    grep -E '^(RESULT|MEDIAN|PERF|BUDGET)|rxe .*(error|status)'
fi
