#!/usr/bin/env bash
# What a notification adds to a 4 KiB write (issue 9): one `ferry serve`
# (the owner), then ROUNDS alternating runs of
#   ferry bench --handle H --transport T --op write --block 4K --batch 1 --duration 3 [--notify 64]
# Each run prints one RESULT line: bench's p50 and p99 (µs), its ops, and
# the owner's CPU time per op (µs, from /proc/PID/stat around the run),
# which shows the owner's work per notification apart from the latency,
# which is noisy on a small machine. Then the medians and their ratio.
#
# usage: scripts/bench-notify-cost.sh [tcp|ibverbs (default tcp)] [ROUNDS (default 5)]
#   on soft-RoCE: scripts/bench-notify-cost.sh ibverbs
# ibverbs runs inside the one-VM soft-RoCE harness (tests/rxe/run.sh), one
# boot for all rounds; tcp runs here.
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSPORT=${1:-tcp}
ROUNDS=${2:-5}
case $TRANSPORT in tcp | ibverbs) ;; *) echo "transport: tcp or ibverbs" >&2; exit 2 ;; esac
cargo build --release --locked -p ferry-cli >&2

# The measurement, in POSIX sh and awk: it also runs in the VM's busybox.
measure=$(cat <<'EOF'
set -eu
ferry=$1 transport=$2 rounds=$3
dir=$(mktemp -d)
hz=$(getconf CLK_TCK 2>/dev/null || echo 100)
$ferry serve --size 4M --handle-file "$dir/h" > /dev/null 2>&1 &
owner=$!
trap 'kill $owner 2>/dev/null; rm -rf "$dir"' EXIT
i=0
while [ ! -s "$dir/h" ]; do
  i=$((i + 1)); [ $i -lt 600 ] || { echo "serve wrote no handle" >&2; exit 1; }
  sleep 0.1
done
cpu() { awk '{ print $14 + $15 }' "/proc/$owner/stat"; }
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
r=0
while [ $r -lt "$rounds" ]; do
  r=$((r + 1))
  for kind in plain notified; do
    extra=; [ $kind = notified ] && extra="--notify 64"
    before=$(cpu)
    row=$($ferry bench --handle "$dir/h" --transport "$transport" --op write --block 4K \
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
  { split($3, p, "="); split($6, c, "=")
    if ($2 == "plain") { pp[++np] = p[2]; pc[np] = c[2] } else { qp[++nq] = p[2]; qc[nq] = c[2] } }
  END {
    a = median(pp, np); b = median(qp, nq)
    printf "MEDIAN p50_us plain=%.1f notified=%.1f ratio=%.3f\n", a, b, (a > 0 ? b / a : 0)
    printf "MEDIAN owner_cpu_us_per_op plain=%.1f notified=%.1f\n", median(pc, np), median(qc, nq)
  }' "$dir/results"
EOF
)

if [ "$TRANSPORT" = tcp ]; then
  sh -c "$measure" sh target/release/ferry tcp "$ROUNDS"
else
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  printf '%s\n' "#!/bin/sh" "$measure" > "$stage/notify-cost"
  chmod +x "$stage/notify-cost"
  tests/rxe/run.sh --bin target/release/ferry --bin "$stage/notify-cost" -- \
    "notify-cost ferry ibverbs $ROUNDS" 2>&1 | grep -E '^(RESULT|MEDIAN)|rxe .*(error|status)'
fi
