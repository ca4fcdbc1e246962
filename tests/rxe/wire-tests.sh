#!/usr/bin/env bash
# Builds ferry's two-machine test suite (tests/rxe_wire) on the host and runs
# it inside two soft-RoCE VMs joined by a virtual wire (tests/rxe/run.sh
# --two): the suite runs in VM b, its peers in VM a. Exits non-zero if any
# in-guest test fails. Extra arguments are passed to the test binary (e.g. a
# test name filter).
#
# With --rails 2 first, each VM gets a second wire and a second soft-RoCE
# device, and only the two-rail tests (tests/rxe_wire/rails.rs) run; without
# it, everything else does, on one rail.
set -euo pipefail
cd "$(dirname "$0")/../.."
rails=1
if [ "${1:-}" = --rails ]; then
    rails=$2
    shift 2
fi
if [ "$rails" = 2 ]; then select='rails::'; else select='--skip rails::'; fi

# The test suite's own build (see ferry-tests.sh).
source scripts/test-build.sh
ferry_test_build --test rxe_wire
path=$(sed -n 's|^rxe_wire=||p' <<<"$ferry_tests")
[ -n "$path" ] || { echo "wire-tests: no test binary named rxe_wire was built" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp "$path" "$stage/rxe_wire"   # both VMs run it under its plain name

exec tests/rxe/run.sh --two --rails "$rails" --bin "$stage/rxe_wire" -- \
    "rxe_wire --include-ignored --test-threads=1 --nocapture $select $*"
