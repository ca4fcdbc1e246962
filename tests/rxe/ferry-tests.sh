#!/usr/bin/env bash
# Builds ferry's RDMA test binaries on the host and runs them, with their
# device-only tests included, inside one soft-RoCE VM boot (tests/rxe/run.sh).
# Exits non-zero if any in-guest test fails.
set -euo pipefail
cd "$(dirname "$0")/../.."

# cargo names each test binary it builds on stderr:
#   Executable tests/ibverbs/main.rs (target/debug/deps/ibverbs-0123abcd)
# (a relative path under ./target, an absolute one under CARGO_TARGET_DIR)
# (Echoed to fd 2 as it is: `tee /dev/stderr` would reopen a redirected log
# file and truncate it.)
built=$(cargo test --locked -p ferry -p ferry-ibverbs -p ferry-cli --test ibverbs --test verbs_loopback --test cli --no-run 2>&1)
echo "$built" >&2
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
bins=()
for name in verbs_loopback ibverbs cli; do
    path=$(sed -n "s|.*Executable .* (\([^)]*/${name}-[0-9a-f]*\))|\1|p" <<<"$built" | tail -n 1)
    [ -n "$path" ] || { echo "ferry-tests: no test binary named $name was built" >&2; exit 1; }
    cp "$path" "$stage/$name"   # the guest runs it under its plain name
    bins+=(--bin "$stage/$name")
done
# The CLI tests run the real `ferry` binary, found on the guest's PATH.
source scripts/target-dir.sh
bins+=(--bin "$target_dir/debug/ferry")

exec tests/rxe/run.sh "${bins[@]}" -- \
    'verbs_loopback --include-ignored --test-threads=1 && ibverbs --include-ignored --test-threads=1 && FERRY_BIN=ferry cli --test-threads=1'
