#!/usr/bin/env bash
# ferry as a NIXL backend, from the wheel: a virtual environment of its own
# with the NIXL people pip install (nixl and nixl-cu12 1.5.1, without their
# declared torch dependency: host memory needs none), ferry's wheel
# installed into it and its FERRY plugin put beside NIXL's own with
# `python -m ferry.nixl install`, and the pytest suite in
# crates/ferry-nixl/pytests (two processes per test, vLLM's and SGLang's
# call sequences, UCX beside FERRY, the planner's lists, the installer's
# refusal of another NIXL release, bad input), with no cargo or rustc on
# the PATH. scripts/test.sh runs it with the wheel it built; it runs alone
# too.
#
#   scripts/nixl-tests.sh [WHEEL]   (default: builds one, scripts/wheel.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
# binutils: nm, for the ABI check.
ferry_install_deps binutils
source scripts/target-dir.sh

wheel=${1:-}
if [ -z "$wheel" ]; then
    wheel=$(scripts/wheel.sh | tail -n 1)
fi
[ -f "$wheel" ] || { echo "nixl-tests.sh: no wheel at $wheel" >&2; exit 1; }

NIXL=(nixl==1.5.1 nixl-cu12==1.5.1)
PY_TOOLS=(pytest==9.2.0 numpy==2.4.6)
venv="$target_dir/nixl-venv"
ferry_make_venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --no-deps "${NIXL[@]}"
"${pip[@]}" "${PY_TOOLS[@]}"
# The wheel just built, over whatever ferry an earlier run installed (same
# version, other bytes); and no path to a source tree's ferry (an earlier
# layout of this script added one).
rm -f "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/ferry-dev.pth"
"${pip[@]}" --force-reinstall --no-deps "$wheel"
# The PATH of the tests: the venv's, and every directory of this one that
# has neither cargo nor rustc.
test_path="$venv/bin"
IFS=: read -ra dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
    [ -x "$dir/cargo" ] || [ -x "$dir/rustc" ] || test_path="$test_path:$dir"
done
export PATH="$test_path"
"$venv/bin/python" -m ferry.nixl install >/dev/null
# NIXL's own INFO lines would bury pytest's.
NIXL_LOG_LEVEL=WARN "$venv/bin/python" -m pytest -q -p no:cacheprovider crates/ferry-nixl/pytests
