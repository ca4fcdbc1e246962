#!/usr/bin/env bash
# Fuzzes every decoder of bytes from the network or another node (the
# targets in fuzz/fuzz_targets/) for SECONDS_PER_TARGET each (default 20),
# starting from the committed seeds in fuzz/corpus/<target>/.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Inputs the fuzzer finds interesting go to a temporary copy of the corpus,
# so a run leaves the checkout clean; set FERRY_FUZZ_KEEP_CORPUS=1 to grow
# fuzz/corpus/ instead. A crashing input is written to
# fuzz/regressions/<target>/ and the script fails: fix the bug, keep the
# file, and `cargo test --test fuzz_corpus` replays it from then on.
#
# Only the stable toolchain is needed: cargo-fuzz's flags (-Z sanitizer
# coverage) are allowed with RUSTC_BOOTSTRAP=1, set here for this build
# only. Targets run FERRY_FUZZ_JOBS at a time (default: one per core).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
seconds=${1:-20}
shift || true

if [ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION" >&2
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi
# libFuzzer itself is C++, built by libfuzzer-sys.
if ! command -v c++ >/dev/null && ! command -v clang++ >/dev/null; then
    source scripts/install-deps.sh
    ferry_install_deps g++
fi
# rdma-sys (under ferry-ibverbs, whose wire decoders are fuzzed without a
# device) runs bindgen: same libclang pin as the main build.
if [ -z "${LIBCLANG_PATH:-}" ] && [ -d /usr/lib/llvm-14/lib ]; then
    export LIBCLANG_PATH=/usr/lib/llvm-14/lib
fi
export RUSTC_BOOTSTRAP=1

# The decoders are safe Rust: bounds and arithmetic overflow are what can
# go wrong, and debug assertions turn both into crashes. AddressSanitizer
# would add nothing they can reach but double the build and run time.
# Release (cargo-fuzz's default): an unoptimized build took as long here
# and ran the targets ten times slower.
fuzz_flags=(--release --debug-assertions --sanitizer none)

if (($#)); then
    targets=("$@")
else
    mapfile -t targets < <(cd fuzz && cargo fuzz list)
fi

start=$(date +%s)
(cd fuzz && cargo fuzz build "${fuzz_flags[@]}")
built=$(date +%s)
echo "fuzz targets built in $((built - start)) s" >&2

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
jobs=${FERRY_FUZZ_JOBS:-$(nproc)}

root=$(pwd)
run_target() {
    local target=$1 corpus regressions=$root/fuzz/regressions/$1
    if [ "${FERRY_FUZZ_KEEP_CORPUS:-0}" = 1 ]; then
        corpus=$root/fuzz/corpus/$target
    else
        corpus=$work/corpus/$target
        mkdir -p "$corpus"
        cp fuzz/corpus/"$target"/* "$corpus"/
    fi
    mkdir -p "$regressions"
    # Crash inputs are written under the artifact prefix; -timeout makes a
    # hang a failure too, -rss_limit_mb an unbounded allocation.
    if (cd fuzz && cargo fuzz run "${fuzz_flags[@]}" "$target" "$corpus" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$regressions/") \
        >"$work/$target.log" 2>&1; then
        echo "fuzz $target: ok ($(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' \
            "$work/$target.log" | grep -o '[0-9]*$') runs)" >&2
        # Keep the checkout clean: no directory for a target that found nothing.
        rmdir "$regressions" 2>/dev/null || true
    else
        echo "fuzz $target: FAILED; crash input kept in fuzz/regressions/$target/" >&2
        tail -n 40 "$work/$target.log" >&2
        return 1
    fi
}

failed=0
running=0
for target in "${targets[@]}"; do
    run_target "$target" &
    running=$((running + 1))
    if ((running >= jobs)); then
        wait -n || failed=1
        running=$((running - 1))
    fi
done
while ((running > 0)); do
    wait -n || failed=1
    running=$((running - 1))
done
echo "fuzzing took $(($(date +%s) - built)) s after the build" >&2
exit "$failed"
