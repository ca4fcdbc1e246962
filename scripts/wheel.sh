#!/usr/bin/env bash
# Builds ferry's wheel: the Python extension (ferry._ferry), the `ferry`
# command (ferry/bin/ferry, the `ferry` script) and the NIXL plugin
# (ferry/nixl/libplugin_FERRY.so), as a
# manylinux_2_28 abi3 wheel (CPython 3.9 and later) that needs neither Rust
# nor rdma-core where it is installed (libibverbs is loaded at run time).
#
#   scripts/wheel.sh             debug build (the test suites install it)
#   scripts/wheel.sh --release   the wheel users get (optimized)
#
# Prints the wheel's path as its last line of stdout. Tools from PyPI, in a
# virtual environment of their own: maturin; zig (ziglang), which links
# against glibc 2.28's symbols; cargo-zigbuild, which drives cargo with zig
# for the command and the plugin; auditwheel, which checks the result.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
# g++: the plugin's C++ side, against libstdc++ (crates/ferry-nixl/build.rs).
ferry_install_deps g++
source scripts/target-dir.sh

profile=debug
cargo_flags=()
# Whether to strip the binaries' debug info (see below).
strip=0
case "${1:-}" in
    "") ;;
    --release) profile=release cargo_flags=(--release) strip=1 ;;
    *) echo "usage: scripts/wheel.sh [--release]" >&2; exit 2 ;;
esac

# The tools, pinned: a new release of one cannot break a run.
WHEEL_TOOLS=(maturin==1.16.0 ziglang==0.15.2 cargo-zigbuild==0.24.0 auditwheel==6.8.2)
tools="$target_dir/wheel-tools"
ferry_make_venv "$tools"
"$tools/bin/python" -m pip install -q --disable-pip-version-check "${WHEEL_TOOLS[@]}" >&2

export CARGO_TARGET_DIR="$target_dir"
export PATH="$tools/bin:$PATH"
target=x86_64-unknown-linux-gnu
glibc=2.28
wheels="$target_dir/wheels/$profile"

# Every cargo step runs in python/, the extension's workspace, whose lock
# file pins what the Rust workspace's does. From the repository root, zig
# (under $target_dir) would name its own files relative to the root, and
# bindgen, running in rdma-sys's directory, would not find them.
cd python
# The command and the plugin, in the extension's workspace (python/Cargo.toml
# depends on both so that `-p` names them there, with its lock file), into
# a target directory of their own. Maturin's build of the extension below
# compiles ferry again: cargo counts the linker in every crate's
# fingerprint, and maturin's zig wrapper is not cargo-zigbuild's, so in
# one target directory each build would recompile all the other compiled
# (about 2 minutes each on 2 cores, debug); apart, a second run of this
# script is incremental.
step() { echo "wheel.sh: ${SECONDS} s: $*" >&2; }
#
# Each of the three links the host's libgcc_s (by path; manylinux allows
# it) for the unwinder, not the libunwind zig would build into it: glibc
# unwinds a thread that pthread_exit ends (CPython ends its daemon threads
# that way at exit, some inside ferry calls) with libgcc_s, whose contexts
# zig's libunwind cannot read, and the process crashed in Rust's
# personality routine (python/tests/test_process.py, exit_child.py threads).
# (RUSTFLAGS for the command's build, whose rlibs ignore a link argument;
# maturin passes what follows `--` to the extension's final link.) The
# command, an executable, is linked with --allow-shlib-undefined: this
# host's libgcc_s names a newer glibc symbol than zig's glibc 2.28 stubs
# have, which the host it runs on resolves (or, a manylinux_2_28 host,
# whose libgcc_s is older, never asks for).
libgcc_s=$(readlink -f "$(gcc -print-file-name=libgcc_s.so.1)")
[ -f "$libgcc_s" ] || { echo "wheel.sh: no libgcc_s.so.1 ($libgcc_s)" >&2; exit 1; }
step "cargo zigbuild: the command and the plugin"
cli_target_dir="$target_dir/wheel-cli"
CARGO_TARGET_DIR="$cli_target_dir" RUSTFLAGS="-C link-arg=$libgcc_s -C link-arg=-Wl,--allow-shlib-undefined" \
    cargo-zigbuild build --locked --target "$target.$glibc" \
    "${cargo_flags[@]}" -p ferry-cli --bin ferry -p ferry-nixl --lib >&2
out="$cli_target_dir/$target/$profile"
mkdir -p ferry/bin ferry/nixl
install -m 755 "$out/ferry" ferry/bin/ferry
install -m 755 "$out/libplugin_FERRY.so" ferry/nixl/libplugin_FERRY.so
rm -rf "$wheels"
step "maturin build: the extension, the wheel"
maturin build --locked --zig --target "$target" --compatibility "manylinux_${glibc/./_}" \
    "${cargo_flags[@]}" -i "$tools/bin/python" -o "$wheels" -- -C "link-arg=$libgcc_s" >&2
cd ..
wheel=$(ls "$wheels"/ferry-*.whl)
binaries=(ferry/_ferry.abi3.so ferry/bin/ferry ferry/nixl/libplugin_FERRY.so)
# A release wheel's binaries lose their debug info (the release profile's
# line tables) but keep their symbols, so a backtrace still names its
# functions: 47 MiB of wheel became 14. Stripped after the build, not by
# the profile (a profile setting is in every crate's fingerprint: changing
# it recompiles them all) nor at the link (given rustc's -C
# strip=debuginfo, zig's linker drops the symbol table too). The debug
# wheel, which the test suites install, keeps its line tables.
if ((strip)); then
    step "strip: the binaries' debug info"
    "$tools/bin/python" scripts/strip_wheel.py "$wheel" "${binaries[@]}"
fi
step "checks"

# The wheel is what it says: manylinux_2_28 by auditwheel, one version
# everywhere, its three binaries there and needing neither libibverbs nor
# librdmacm (dlopen'd at run time), the command executable.
"$tools/bin/python" - "$wheel" "$tools/bin/auditwheel" "$strip" <<'EOF' >&2
import json, os, re, stat, subprocess, sys, tempfile, zipfile
wheel, auditwheel, stripped = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
shown = subprocess.run([auditwheel, "show", wheel], capture_output=True, text=True, check=True).stdout
assert re.search(r'consistent with the\s+following platform tag:\s+"manylinux_2_28_x86_64"', shown), shown
meta = json.loads(subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps", "--locked"],
                                 capture_output=True, text=True, check=True).stdout)
version = {p["name"]: p["version"] for p in meta["packages"]}["ferry"]
name = os.path.basename(wheel)
assert name.startswith(f"ferry-{version}-cp39-abi3-manylinux_2_28_x86_64"), (name, version)
with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
    for path in ("ferry/_ferry.abi3.so", "ferry/bin/ferry", "ferry/nixl/libplugin_FERRY.so"):
        info = zf.getinfo(path)
        extracted = zf.extract(info, tmp)
        needed = subprocess.run(["readelf", "-d", extracted], capture_output=True, text=True, check=True).stdout
        assert "libibverbs" not in needed and "librdmacm" not in needed, (path, needed)
        # The unwinder is libgcc_s's (see above), none of its own.
        assert "[libgcc_s.so.1]" in needed, (path, needed)
        symbols = subprocess.run(["nm", extracted], capture_output=True, text=True, check=True).stdout
        defined = [l for l in symbols.splitlines() if l.endswith(" _Unwind_RaiseException") and " U " not in l]
        assert not defined, (path, "has an unwinder of its own", defined)
        # Release binaries without debug info, their symbols kept.
        sections = subprocess.run(["readelf", "-S", "-W", extracted], capture_output=True, text=True,
                                  check=True).stdout
        assert (".debug_line" in sections) != stripped, (path, "stripped" if stripped else "debug", sections)
        assert ".symtab" in sections, (path, "has no symbols")
        if path == "ferry/bin/ferry":
            os.chmod(extracted, 0o755)
            shown = subprocess.run([extracted, "--version"], capture_output=True, text=True,
                                   check=True).stdout.strip()
            assert shown == f"ferry {version}", (shown, version)
    assert stat.S_IMODE(zf.getinfo("ferry/bin/ferry").external_attr >> 16) & 0o111, "ferry/bin/ferry not executable"
    scripts = zf.read(f"ferry-{version}.dist-info/entry_points.txt").decode().replace(" ", "")
    assert "\nferry=ferry._cli:main" in scripts, scripts
print(f"wheel.sh: {name}: {os.path.getsize(wheel) / 2**20:.1f} MiB, manylinux_2_28, ferry {version}")
EOF
echo "$wheel"
