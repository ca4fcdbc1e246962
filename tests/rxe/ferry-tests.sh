#!/usr/bin/env bash
# Builds ferry's RDMA test binaries on the host and runs them, with their
# device-only tests included, inside one soft-RoCE VM boot (tests/rxe/run.sh).
# Exits non-zero if any in-guest test fails.
#
# Usage: tests/rxe/ferry-tests.sh [WHEEL]
# With WHEEL (scripts/wheel.sh's), the `ferry` command it packages runs the
# CLI's device tests too: built for manylinux and loading libibverbs at run
# time, it must find the guest's and move bytes over rxe0 with it.
set -euo pipefail
cd "$(dirname "$0")/../.."
wheel=${1:-}

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
guest='verbs_loopback --include-ignored --test-threads=1 && ibverbs --include-ignored --test-threads=1 && FERRY_BIN=ferry cli --test-threads=1 && engine_ibverbs --include-ignored'
if [ -n "$wheel" ]; then
    python3 - "$wheel" "$stage/ferry-wheel" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("ferry/bin/ferry") as packaged:
    with open(sys.argv[2], "wb") as out:
        shutil.copyfileobj(packaged, out)
PY
    chmod +x "$stage/ferry-wheel"
    bins+=(--bin "$stage/ferry-wheel")
    # It reports ibverbs available, and a served region moves over it.
    guest+=' && FERRY_BIN=ferry-wheel cli --test-threads=1 info_json_lists_the_transports_that_can_start_here serve_and_bench_over_a_handle_file'
fi

exec tests/rxe/run.sh "${bins[@]}" -- "$guest"
