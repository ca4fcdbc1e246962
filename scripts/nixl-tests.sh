#!/usr/bin/env bash
# ferry as a NIXL backend: a virtual environment of its own with the NIXL
# people pip install (nixl and nixl-cu12 1.5.1, without their declared torch
# dependency: host memory needs none), the FERRY plugin built and installed
# into it with `ferry nixl install`, and the pytest suite in
# crates/ferry-nixl/pytests (two processes per test, vLLM's and SGLang's
# call sequences, UCX beside FERRY, bad input). scripts/test.sh runs it; it
# runs alone too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
# g++: the plugin's C++ side; binutils: nm, for the ABI check.
ferry_install_deps g++ binutils
source scripts/target-dir.sh

NIXL=(nixl==1.5.1 nixl-cu12==1.5.1)
PY_TOOLS=(pytest==9.2.0 numpy==2.4.6)
venv="$target_dir/nixl-venv"
ferry_make_venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --no-deps "${NIXL[@]}"
"${pip[@]}" "${PY_TOOLS[@]}"

# The CLI and the plugin the test suite built.
source scripts/test-build.sh
ferry_test_build -q
"$ferry_bin" nixl install --python "$venv/bin/python" --plugin "$ferry_plugin" >/dev/null
# The planner's NIXL test (and docs/nixl.md's block) import the ferry package
# scripts/python-tests.sh built in place; without it, that test is skipped.
[ ! -e python/ferry/_ferry.abi3.so ] || echo "$PWD/python" >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/ferry-dev.pth"
# NIXL's own INFO lines would bury pytest's.
NIXL_LOG_LEVEL=WARN "$venv/bin/python" -m pytest -q -p no:cacheprovider crates/ferry-nixl/pytests
