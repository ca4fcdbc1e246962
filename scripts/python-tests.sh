#!/usr/bin/env bash
# The Python package's checks and tests: builds `ferry._ferry` into a
# virtual environment of its own (maturin, pytest, numpy and mypy from PyPI),
# checks the extension crate (fmt, clippy), type-checks the examples against
# the package's annotations and stubs, and runs the pytest suite (two
# processes per test, a Rust `ferry serve` among the peers). scripts/test.sh
# runs it; it runs alone too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps
source scripts/target-dir.sh

# The tools, pinned: a new release of one cannot break a run.
PY_TOOLS=(maturin==1.16.0 pytest==9.2.0 numpy==2.4.6 mypy==2.4.1)
venv="$target_dir/python-venv"
ferry_make_venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${PY_TOOLS[@]}"

# The extension crate is a workspace of its own (python/Cargo.toml), built
# into the same target directory: what it shares with the workspace's
# build is reused.
export CARGO_TARGET_DIR="$target_dir"
cargo fmt --manifest-path python/Cargo.toml -- --check
PYO3_PYTHON="$venv/bin/python" cargo clippy --manifest-path python/Cargo.toml --all-targets --locked -- -D warnings
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop --manifest-path python/Cargo.toml --locked -q

# The peer of the interoperability tests: the CLI the test suite built.
source scripts/test-build.sh
ferry_test_build -q
export FERRY_BIN="$ferry_bin"
"$venv/bin/python" -m pytest -q python/tests
