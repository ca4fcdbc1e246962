# Sourced by the demo and test scripts: installs the Debian packages ferry's
# build needs when they are missing, and checks for a Rust toolchain.
# Packages are checked by the command they provide, so a machine that has them
# some other way is left alone.

ferry_install_deps() {
    local missing=()
    command -v cc >/dev/null || missing+=(gcc libc6-dev)
    if ((${#missing[@]})); then
        echo "installing Debian packages: ${missing[*]}" >&2
        local sudo_cmd=()
        [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
        "${sudo_cmd[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
    fi
    if ! command -v cargo >/dev/null; then
        echo "error: cargo not found. ferry needs Rust >= 1.88 (edition 2024); install it with rustup." >&2
        return 1
    fi
}
