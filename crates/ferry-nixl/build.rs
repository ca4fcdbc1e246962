//! Compiles the C++ side of the plugin (`shim/`): NIXL's engine class,
//! defined against ferry's declaration of NIXL's ABI, in C++20 as NIXL
//! builds its own plugins.
//!
//! Under zig (the wheel's build: `cargo zigbuild`, `maturin --zig`, for a
//! manylinux glibc), zig's C++ compiler would use its own libc++, whose
//! `std::string` and containers are not the libstdc++ ones NIXL's ABI is
//! made of. The shim is then compiled by the host's g++ (or
//! `FERRY_NIXL_CXX`) and linked against libstdc++.so.6 by path (zig's
//! linker reads `-lstdc++` as its libc++), with `FERRY_NIXL_PORTABLE`:
//! the one libstdc++ function newer than manylinux_2_28 allows that g++
//! 11+ calls is defined in the shim (shim/portable.h).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rerun-if-env-changed=FERRY_NIXL_CXX");
    println!("cargo:rerun-if-env-changed=CARGO_ZIGBUILD_TARGET");
    let mut build = cc::Build::new();
    let zig = std::env::var_os("CARGO_ZIGBUILD_TARGET").is_some();
    let cxx = std::env::var("FERRY_NIXL_CXX")
        .ok()
        .or_else(|| zig.then(|| "g++".to_string()));
    if let Some(cxx) = &cxx {
        let libstdcxx = libstdcxx(cxx);
        build
            .compiler(cxx)
            .cpp_link_stdlib(None)
            .define("FERRY_NIXL_PORTABLE", None);
        println!("cargo:rustc-link-arg={}", libstdcxx.display());
    }
    build
        .cpp(true)
        .std("c++20")
        .file("shim/ferry_nixl.cpp")
        .include("shim")
        .flag("-fvisibility=hidden")
        .flag("-Wall")
        .flag("-Wextra")
        .warnings_into_errors(true)
        .define(
            "FERRY_NIXL_VERSION",
            Some(format!("\"{}\"", env!("CARGO_PKG_VERSION")).as_str()),
        )
        .compile("ferry_nixl_shim");
}

/// The libstdc++ shared library `cxx` links against, by its real path.
fn libstdcxx(cxx: &str) -> PathBuf {
    let out = Command::new(cxx)
        .arg("-print-file-name=libstdc++.so")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    std::fs::canonicalize(&path).unwrap_or_else(|e| {
        panic!(
            "{cxx} names {} as libstdc++.so, which is not there: {e}",
            path.display()
        )
    })
}
