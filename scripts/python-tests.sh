#!/usr/bin/env bash
# The Python package's checks and tests, against the wheel users install:
# checks the extension crate (fmt, clippy), installs the wheel into a fresh
# virtual environment (with pytest, numpy and mypy from PyPI), and runs the
# pytest suite there with no cargo or rustc on the PATH: the `ferry`
# package imported is the installed one, and the Rust `ferry serve` peer of
# the interoperability tests is the wheel's `ferry` command. Among the
# tests, test_no_verbs.py runs once more with every libibverbs.so.1
# hidden (a mount namespace). scripts/test.sh runs it with the wheel it
# built; it runs alone too.
#
#   scripts/python-tests.sh [WHEEL]   (default: builds one, scripts/wheel.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
ferry_install_deps
source scripts/target-dir.sh

wheel=${1:-}
if [ -z "$wheel" ]; then
    wheel=$(scripts/wheel.sh | tail -n 1)
fi
[ -f "$wheel" ] || { echo "python-tests.sh: no wheel at $wheel" >&2; exit 1; }

# The extension crate is a workspace of its own (python/Cargo.toml), checked
# into the same target directory: what it shares with the workspace's
# build is reused. (abi3: any Python 3.9 or later configures pyo3.)
export CARGO_TARGET_DIR="$target_dir"
cargo fmt --manifest-path python/Cargo.toml -- --check
PYO3_PYTHON=python3 cargo clippy --manifest-path python/Cargo.toml --all-targets --locked -- -D warnings

# The tools, pinned: a new release of one cannot break a run.
PY_TOOLS=(pytest==9.2.0 numpy==2.4.6 mypy==2.4.1)
venv="$target_dir/python-venv"
rm -rf "$venv"
ferry_make_venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${PY_TOOLS[@]}" "$wheel"

# The PATH of the tests: the venv's, and every directory of this one that
# has neither cargo nor rustc.
test_path="$venv/bin"
IFS=: read -ra dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
    [ -x "$dir/cargo" ] || [ -x "$dir/rustc" ] || test_path="$test_path:$dir"
done
export PATH="$test_path"
if command -v cargo >/dev/null || command -v rustc >/dev/null; then
    echo "python-tests.sh: cargo or rustc is still on the PATH: $PATH" >&2
    exit 1
fi
# The package imported is the wheel's, not python/ferry, and its command
# and plugin are there, with the one version.
(cd / && "$venv/bin/python" - "$wheel" <<'PY'
import os, subprocess, sys
import ferry, ferry.nixl
wheel = os.path.basename(sys.argv[1])
assert "site-packages" in ferry.__file__, ferry.__file__
assert wheel.startswith(f"ferry-{ferry.__version__}-"), (wheel, ferry.__version__)
shown = subprocess.run(["ferry", "--version"], capture_output=True, text=True, check=True).stdout
assert shown.strip() == f"ferry {ferry.__version__}", shown
assert ferry.nixl.PLUGIN.is_file(), ferry.nixl.PLUGIN
print(f"python-tests.sh: ferry {ferry.__version__} from {os.path.dirname(ferry.__file__)}")
PY
)
FERRY_BIN="$venv/bin/ferry" "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
