#!/usr/bin/env bash
# Makes the virtual environments the peers' benchmarks (nixl_bench.py,
# mooncake_bench.py) run in, from PyPI, at pinned versions, and checks
# that each library loads. Idempotent: a venv whose pins are already
# installed is only checked (a second or so). Every script that measures a
# peer runs this first (scripts/peers-here.sh: peers_setup).
#
#   bench/peers/setup.sh [nixl] [mooncake]      (both when none is named)
#
# Where: $FERRY_PEERS_VENVS/{nixl,mooncake} (bench/peers/venvs.sh; default
# ~/.cache/ferry-peers). What:
#
#   nixl      nixl==1.5.1 and nixl-$NIXL_VARIANT==1.5.1 (cu12 by default,
#             as scripts/nixl-tests.sh and docs/nixl.md install it; cu13
#             works too), numpy. Installed with --no-deps: the nixl
#             packages declare torch as a dependency, and pip would fetch
#             the CUDA build of torch and several GB of nvidia-* wheels,
#             which host memory never touches. Each nixl-cuXX wheel
#             bundles its own UCX.
#   mooncake  mooncake-transfer-engine-non-cuda==0.3.13.post1 (with its
#             dependencies), numpy. The package without "-non-cuda" is
#             the CUDA 12 build: its engine links libcudart.so.12 and does
#             not import on a host without the NVIDIA driver. The engine
#             links libibverbs, libnuma and libcurl from the system (no
#             RDMA device is needed): installed with apt-get when missing.
#
# Needs Python 3.10 to 3.13 ($FERRY_PYTHON, default python3: Mooncake's
# wheels are built for those) and the network to PyPI the first time.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/install-deps.sh
source bench/peers/venvs.sh

NIXL_VERSION=1.5.1
NIXL_VARIANT=${NIXL_VARIANT:-cu12}
MOONCAKE_VERSION=0.3.13.post1
NUMPY_VERSION=2.4.6

# venv PIN... [-- PIP ARGS...]: makes the venv at $venv unless it is
# there, and pip-installs PIN... unless exactly those were installed by
# this script before (the list is kept in the venv).
install() {
    local venv=$1 pins=() extra=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do pins+=("$1"); shift; done
    [ $# -gt 0 ] && shift && extra=("$@")
    ferry_make_venv "$venv"
    local want="${pins[*]} ${extra[*]}"
    if [ "$(cat "$venv/ferry-peers.pins" 2>/dev/null)" != "$want" ]; then
        echo "setup: installing ${pins[*]} into $venv" >&2
        "$venv/bin/python" -m pip install -q --disable-pip-version-check "${extra[@]}" "${pins[@]}"
        echo "$want" >"$venv/ferry-peers.pins"
    fi
}

setup_nixl() {
    local venv=$FERRY_PEERS_VENVS/nixl
    case $NIXL_VARIANT in cu12 | cu13) ;; *) echo "NIXL_VARIANT is cu12 or cu13" >&2; exit 2 ;; esac
    # The other variant would be imported first by the nixl meta package.
    local other=cu12
    [ "$NIXL_VARIANT" = cu12 ] && other=cu13
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip show -q "nixl-$other" >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall -q -y "nixl-$other"
    fi
    install "$venv" "nixl==$NIXL_VERSION" "nixl-$NIXL_VARIANT==$NIXL_VERSION" "numpy==$NUMPY_VERSION" -- --no-deps
    # The library loads, and says what it is. (os._exit: the UCX bundled
    # in the wheel crashes in a destructor at a normal exit.)
    NIXL_LOG_LEVEL=WARN "$venv/bin/python" - <<'PY' >&2
import os, sys
from importlib import metadata
import nixl._api
agent = nixl._api.nixl_agent("setup-check", nixl._api.nixl_agent_config(backends=[]))
wheel = sys.modules["nixl"]._pkg.__name__
print(f"setup: nixl {metadata.version('nixl')} ({wheel}), numpy {metadata.version('numpy')}, "
      f"Python {sys.version.split()[0]}; plugins: {' '.join(sorted(agent.get_plugin_list()))}")
sys.stdout.flush()
os._exit(0)
PY
    echo "setup: NIXL's venv: $venv" >&2
}

setup_mooncake() {
    local venv=$FERRY_PEERS_VENVS/mooncake
    ferry_install_deps libibverbs1 libnuma1 libcurl4
    install "$venv" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" "numpy==$NUMPY_VERSION"
    local engine
    engine=$("$venv/bin/python" -c 'import importlib.util, os
print(os.path.join(os.path.dirname(importlib.util.find_spec("mooncake").origin), "engine.so"))')
    if ldd "$engine" | grep -q "not found"; then
        echo "setup: $engine needs libraries this host does not have:" >&2
        ldd "$engine" | grep "not found" >&2
        exit 1
    fi
    "$venv/bin/python" - <<'PY' >&2
import sys
from importlib import metadata
import mooncake.engine
print(f"setup: mooncake-transfer-engine-non-cuda {metadata.version('mooncake-transfer-engine-non-cuda')}, "
      f"numpy {metadata.version('numpy')}, Python {sys.version.split()[0]}")
PY
    echo "setup: Mooncake's venv: $venv" >&2
}

peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(nixl mooncake)
for peer in "${peers[@]}"; do
    case $peer in
        nixl) setup_nixl ;;
        mooncake) setup_mooncake ;;
        *) echo "setup: unknown peer $peer (nixl or mooncake)" >&2; exit 2 ;;
    esac
done
