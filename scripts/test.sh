#!/usr/bin/env bash
# Runs every check and test ferry has: formatting, clippy, unit, integration
# (multi-process), doc tests, the API docs, fuzzing, the deploy checks, the examples, and
# the RDMA tests inside one soft-RoCE VM and across two.
# `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
# etcd-server: the discovery tests start a real etcd on loopback ports
# (each test its own, with a temporary data directory). g++: libFuzzer,
# which the fuzz targets link, is C++.
ferry_install_deps etcd-server g++
# A CI run builds everything once from nothing: incremental compilation's
# caches (about half of the target directory, 6 GB) would only be written,
# never read, and a CI machine ran out of disk writing them.
if [ "${CI:-}" = true ]; then
    export CARGO_INCREMENTAL=0
fi
# Each step below is logged with the seconds since the start, so that a
# run's log says where its time went (CI's budget is 45 minutes).
trap 'echo "test.sh: ${SECONDS} s: $BASH_COMMAND" >&2' DEBUG

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
cargo test --workspace --all-targets --all-features --locked
cargo test --workspace --doc --all-features --locked
# The README and the guide: under 200 lines, perf markers, links and anchors,
# every page with Rust blocks compiled by src/doctests.rs (run above; the
# Python blocks run in python/tests/test_docs.py).
python3 scripts/check-docs.py
# The API docs build without a warning: a doc link to an item that was
# renamed or removed fails here instead of rotting.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --locked -q
# Every crate packages as a registry user would get it: manifests complete
# (description, license), path dependencies versioned, the file list whole,
# and the crates' unpublished interdependencies resolved through cargo's
# local overlay. --no-verify (seconds): verifying would compile each of the 7
# packages again, from its extracted sources in a target directory of its
# own, which is many minutes on 2 cores to prove what the build above
# already compiled from the same files. --allow-dirty: a local run with
# uncommitted edits checks them too.
cargo package --workspace --no-verify --allow-dirty --locked -q
# Fuzzing: every decoder of bytes from the network or another node, for
# FERRY_FUZZ_SECONDS per target (default 20), from the committed seeds; a
# crash fails the run and leaves its input in fuzz/regressions/. Adds about
# 7 minutes on 2 cores: cargo-fuzz install (2, skipped once installed),
# the instrumented build (4), the runs (1.5). See fuzz/README.md.
scripts/fuzz.sh "${FERRY_FUZZ_SECONDS:-20}"
# The deploy files: manifests validated, every ferry command line in them
# parsed by the binary just built (the image itself is not built here).
scripts/check-deploy.sh
# The examples a newcomer runs first exit non-zero when anything is wrong.
# Run as the test suite built them (scripts/test-build.sh): a `cargo run
# --example` would build tokio, kameo and ferry again for its own features.
source scripts/test-build.sh
ferry_test_build -q
for example in workers kv_handoff; do
    "$(sed -n "s|^$example=||p" <<<"$ferry_examples")" >/dev/null
done
# The wheel users install (scripts/wheel.sh: the extension, the `ferry`
# command and the NIXL plugin, manylinux_2_28, checked by auditwheel; a
# debug build), built once for the two suites below, which install it
# instead of building anything.
wheel=$(scripts/wheel.sh | tail -n 1)
# The Python package from the wheel, in a fresh virtual environment with
# no cargo on the PATH: type-checked, and its pytest suite, which runs the
# Python kv_handoff and weights examples, talks to the wheel's `ferry serve`, and runs
# once more with libibverbs hidden.
scripts/python-tests.sh "$wheel"
# ferry as a NIXL backend: the wheel and its FERRY plugin installed into a
# virtual environment with NIXL 1.5.1 from PyPI, driven through NIXL's
# Python API.
scripts/nixl-tests.sh "$wheel"
# The guide's NIXL example, in the NIXL venv with the plugin just installed.
source scripts/target-dir.sh
FERRY_NIXL_PYTHON="$target_dir/nixl-venv/bin/python" "$target_dir/python-venv/bin/python" \
    -m pytest -q -p no:cacheprovider python/tests/test_docs.py -k test_nixl_block_runs
# The performance page's generator, end to end on one short round of a few
# cells (the debug build; NIXL, through bench/peers/nixl_bench.py, in the
# NIXL venv made above; a peer whose venv is missing, as Mooncake's is
# unless bench/peers/setup.sh made it, is skipped): the page, its tables
# and its plots are produced and well formed. About a minute. The real
# page comes from `scripts/perf-page.sh` on an idle machine.
scripts/perf-page.sh --smoke

# Real RDMA: the ibverbs tests inside a soft-RoCE VM (no NIC or KVM needed;
# downloads Debian's kernel, QEMU and rdma-core into ~/.cache/ferry-rxe once),
# and the wheel's `ferry` command there, over the guest's libibverbs.
tests/rxe/ferry-tests.sh "$wheel"
# Two machines: two soft-RoCE VMs joined by a wire the tests make lossy,
# cut, flap, block TCP on, and whose owner they kill (tests/rxe_wire; about
# 1.5 minutes).
tests/rxe/wire-tests.sh
# The same two VMs with two rails each (a second wire and soft-RoCE device):
# striping, probing which rails reach, per-pair MTU (tests/rxe_wire/rails.rs).
tests/rxe/wire-tests.sh --rails 2
