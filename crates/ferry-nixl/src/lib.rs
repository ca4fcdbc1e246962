//! ferry as a NIXL backend: `libplugin_FERRY.so`, the plugin NIXL's agent
//! loads when a program asks for backend `"FERRY"` (vLLM's
//! `kv_connector_extra_config={"backends": ["FERRY"]}`, SGLang's
//! `SGLANG_DISAGGREGATION_NIXL_BACKEND=FERRY`,
//! `nixl_agent_config(backends=["FERRY"])`).
//!
//! NIXL's backend interface is a C++ class; `shim/ferry_nixl.cpp` defines
//! it against ferry's own declaration of that ABI (`shim/nixl_abi.h`) and
//! forwards each call over a C interface (`shim/ferry_nixl.h`) to the Rust
//! engine here ([`engine`]), which drives a [`ferry::Node`] on the
//! process's runtime; NIXL's polling caller moves the bytes ([`drive`]).
//! Routing is ferry's: same-host memory between agents of one host,
//! ibverbs where both ends have a device, TCP otherwise.
//!
//! Host memory (DRAM) only for now: GPU memory is left to another backend
//! loaded beside it (UCX). `ferry nixl install` puts the plugin where a
//! virtual environment's NIXL looks for plugins.

// NIXL finds plugins by file name: the library must be `libplugin_FERRY`.
#![allow(non_snake_case)]

pub mod descs;
pub mod drive;
pub mod engine;
mod ffi;
mod notif;
pub mod options;
mod place;
pub mod request;

use std::ffi::c_void;
use std::path::{Path, PathBuf};

/// The NIXL releases whose backend ABI `shim/nixl_abi.h` declares (its
/// layout was checked against 1.5.1's binaries; 1.4's headers are the
/// same). Another release may lay out the engine differently while still
/// saying plugin API version 1, so it is refused at load.
pub const NIXL_RELEASES: &[&str] = &["1.4.", "1.5."];

/// Set to `1` to load into a NIXL release not in [`NIXL_RELEASES`] anyway.
pub const ANY_RELEASE_ENV: &str = "FERRY_NIXL_ANY_RELEASE";

unsafe extern "C" {
    /// The plugin table (`shim/ferry_nixl.cpp`).
    fn ferry_nixl_plugin_table() -> *mut c_void;
}

/// NIXL's entry point: the plugin table, or null (with one line on
/// stderr saying why) in a NIXL this plugin was not built for. Logs
/// ferry's version and NIXL's at load (`FERRY_LOG=info` shows it).
#[unsafe(no_mangle)]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    let host = std::panic::catch_unwind(host_nixl).unwrap_or(None);
    if let Some((release, path)) = &host
        && !NIXL_RELEASES.iter().any(|r| release.starts_with(r))
        && std::env::var(ANY_RELEASE_ENV).as_deref() != Ok("1")
    {
        eprintln!(
            "FERRY: not loading: this plugin was built for NIXL {} (plugin API 1), and this \
             process runs NIXL {release} ({}); rebuild ferry against it, or set {ANY_RELEASE_ENV}=1 \
             to try anyway",
            NIXL_RELEASES.join("x, ") + "x",
            path.display()
        );
        return std::ptr::null_mut();
    }
    init_logging();
    tracing::info!(
        "FERRY plugin of ferry {} loaded into NIXL {}",
        env!("CARGO_PKG_VERSION"),
        host.map_or_else(
            || "(release unknown)".to_string(),
            |(release, path)| format!("{release} ({})", path.display())
        ),
    );
    // SAFETY: a static table, valid for the life of the library.
    unsafe { ferry_nixl_plugin_table() }
}

/// NIXL's exit point: nothing to undo (engines are destroyed by NIXL).
#[unsafe(no_mangle)]
pub extern "C" fn nixl_plugin_fini() {}

/// The release of the NIXL loaded in this process and where, when it can
/// be told: the `libnixl.so` mapped here, and the `*.dist-info` of the
/// wheel it came from. `None` for a NIXL built from source (no wheel).
fn host_nixl() -> Option<(String, PathBuf)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let lib = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libnixl.so"))
        .map(PathBuf::from)?;
    // site-packages/.nixl_cu12.mesonpy.libs/libnixl.so
    let libs = lib.parent()?;
    let wheel = libs
        .file_name()?
        .to_str()?
        .strip_prefix('.')?
        .strip_suffix(".mesonpy.libs")?
        .to_string();
    release_of(libs.parent()?, &wheel).map(|release| (release, lib))
}

/// The version in `site_packages/<wheel>-<version>.dist-info`.
fn release_of(site_packages: &Path, wheel: &str) -> Option<String> {
    std::fs::read_dir(site_packages).ok()?.find_map(|entry| {
        let name = entry.ok()?.file_name().into_string().ok()?;
        let version = name
            .strip_prefix(wheel)?
            .strip_prefix('-')?
            .strip_suffix(".dist-info")?;
        Some(version.to_string())
    })
}

/// Logs to stderr, warnings by default (`FERRY_LOG` to change it), unless
/// the process installed a subscriber of its own.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wheel_release_is_read_from_its_dist_info() {
        let dir = std::env::temp_dir().join(format!("ferry-nixl-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("nixl_cu12-1.5.1.dist-info")).unwrap();
        std::fs::create_dir_all(dir.join("nixl-1.5.1.dist-info")).unwrap();
        assert_eq!(release_of(&dir, "nixl_cu12").as_deref(), Some("1.5.1"));
        assert_eq!(release_of(&dir, "nixl_cu13"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
