#!/usr/bin/env bash
# The churn tests of tests/churn/ run for minutes instead of seconds:
#
#  1. churn: waves of in-process peers (and a killed child process per
#     wave) come to one node, move bytes, and go, until --duration has
#     passed; every 10 s one line with the node's RSS, open descriptors and
#     the per-peer tables that are not empty. At the end the tables must be
#     empty and the descriptors back to their baseline (the test asserts it).
#  2. all-to-all: 16 processes, reads, writes, notifications, messages and
#     calls between every pair for --duration; two members (memory
#     transport on, off) log RSS, descriptors and tables every 10 s; every
#     byte and delivery is checked at the end.
#
# Usage: scripts/soak.sh [--duration SECONDS] [--peers N]
#   --duration  seconds each of the two runs lasts (default 150)
#   --peers     peers per block of four waves of the churn (default 1000)
set -euo pipefail
cd "$(dirname "$0")/.."

duration=150
peers=1000
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) duration=$2; shift 2 ;;
        --peers) peers=$2; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "soak.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done
[[ $duration =~ ^[0-9]+$ && $peers =~ ^[0-9]+$ && $peers -ge 4 ]] || {
    echo "soak.sh: --duration and --peers take whole numbers (peers >= 4)" >&2
    exit 2
}

export FERRY_SOAK_SECONDS=$duration FERRY_CHURN_PEERS=$peers
for test in thousand all_to_all; do
    echo "== $test for ${duration}s"
    cargo test --locked --all-features -q --test churn -- \
        --nocapture --test-threads=1 "$test::" 2>&1 |
        grep -E '^(soak|churn|all-to-all|test |thread|assertion|  left|  right)'
done
