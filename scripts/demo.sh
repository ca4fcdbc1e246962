#!/usr/bin/env bash
# ferry's main demo: two nodes in two OS processes write and read a 128 MiB
# region over same-host memory and over TCP in several block sizes, verify
# every byte, and print throughput, the transport each row took and memory
# use. Extra arguments go to the demo
# (`scripts/demo.sh --help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps

cargo build --release --locked --example demo
source scripts/target-dir.sh
exec "$target_dir/release/examples/demo" --verify "$@"
