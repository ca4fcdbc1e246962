#!/usr/bin/env bash
# Runs every check and test ferry has: formatting, clippy, unit, integration
# (two-process TCP) and doc tests. `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --all-targets --locked
cargo test --workspace --doc --locked
