#!/usr/bin/env bash
# Builds ferry's RDMA test binaries on the host and runs them, with their
# device-only tests included, inside one soft-RoCE VM boot (tests/rxe/run.sh).
# Exits non-zero if any in-guest test fails.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The test suite's own build (scripts/test-build.sh): in scripts/test.sh
# this compiles nothing.
source scripts/test-build.sh
ferry_test_build --test ibverbs --test verbs_loopback --test cli --test engine_ibverbs
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
bins=()
for name in verbs_loopback ibverbs cli engine_ibverbs; do
    path=$(sed -n "s|^$name=||p" <<<"$ferry_tests")
    [ -n "$path" ] || { echo "ferry-tests: no test binary named $name was built" >&2; exit 1; }
    cp "$path" "$stage/$name"   # the guest runs it under its plain name
    bins+=(--bin "$stage/$name")
done
# The CLI tests run the real `ferry` binary, found on the guest's PATH.
bins+=(--bin "$ferry_bin")

exec tests/rxe/run.sh "${bins[@]}" -- \
    'verbs_loopback --include-ignored --test-threads=1 && ibverbs --include-ignored --test-threads=1 && FERRY_BIN=ferry cli --test-threads=1 && engine_ibverbs --include-ignored'
