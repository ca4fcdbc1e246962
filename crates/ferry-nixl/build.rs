//! Compiles the C++ side of the plugin (`shim/`): NIXL's engine class,
//! defined against ferry's declaration of NIXL's ABI, in C++20 as NIXL
//! builds its own plugins.

fn main() {
    println!("cargo:rerun-if-changed=shim");
    cc::Build::new()
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
