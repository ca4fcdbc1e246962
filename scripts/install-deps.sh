# Sourced by the demo and test scripts: installs the Debian packages ferry's
# build needs when they are missing (and any named as arguments, e.g. the
# test servers), and checks for a Rust toolchain.

ferry_install_deps() {
    # gcc links everything; rdma-sys needs the verbs headers and libraries and
    # libclang for its bindgen step; etcd-client's build needs protoc; the
    # two-host tests need `ip netns`.
    local wanted=(gcc libc6-dev pkg-config libibverbs-dev librdmacm-dev libclang-dev
        protobuf-compiler iproute2 "$@")
    local missing=() pkg
    for pkg in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        echo "installing Debian packages: ${missing[*]}" >&2
        local sudo_cmd=()
        [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
        "${sudo_cmd[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
    fi
    # rdma-sys's bindgen fails with libclang >= 16; Debian 12's default is 14.
    # Pin it when several are installed and the caller has not chosen.
    if [ -z "${LIBCLANG_PATH:-}" ] && [ -d /usr/lib/llvm-14/lib ]; then
        export LIBCLANG_PATH=/usr/lib/llvm-14/lib
    fi
    if ! command -v cargo >/dev/null; then
        echo "error: cargo not found. ferry needs Rust >= 1.88 (edition 2024); install it with rustup." >&2
        return 1
    fi
}

# Makes a Python virtual environment at $1 unless one is there, with
# $FERRY_PYTHON (default python3), installing Debian's python3-venv when
# that Python cannot make one (Debian splits venv and ensurepip out of
# python3).
ferry_make_venv() {
    local venv=$1 python=${FERRY_PYTHON:-python3}
    if ! command -v "$python" >/dev/null || ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
        ferry_install_deps python3 python3-venv
        python=python3
    fi
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv "$venv"
    fi
}
