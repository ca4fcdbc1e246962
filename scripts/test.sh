#!/usr/bin/env bash
# Runs every check and test ferry has: formatting, clippy, unit, integration
# (two-process TCP) and doc tests. Installs the system packages it needs on
# Debian/Ubuntu when they are missing. `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build needs; checked by command so a machine that has
# them installed some other way is left alone.
missing=()
command -v cc >/dev/null || missing+=(gcc libc6-dev)
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi
if ! command -v cargo >/dev/null; then
    echo "error: cargo not found. ferry needs Rust >= 1.88 (edition 2024); install it with rustup." >&2
    exit 1
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --all-targets --locked
cargo test --workspace --doc --locked
