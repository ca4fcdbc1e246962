//! `ferry nixl install`: puts ferry's NIXL plugin (`libplugin_FERRY.so`,
//! built by crates/ferry-nixl) where a Python environment's NIXL looks for
//! plugins, beside its own (UCX, ...), so that `backends=["FERRY"]` finds
//! it with no environment variable. (`NIXL_PLUGIN_DIR` also works, but it
//! replaces NIXL's own plugin directory: UCX disappears.)

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{Args, Subcommand};

use crate::Failure;

/// The plugin's file name: NIXL loads `libplugin_<NAME>.so`.
pub const PLUGIN_FILE: &str = "libplugin_FERRY.so";

/// `ferry nixl ...`.
#[derive(Subcommand)]
pub enum NixlCommand {
    /// Copy the FERRY plugin into the plugin directory of the NIXL that a
    /// Python interpreter imports; prints where it went.
    Install(InstallArgs),
}

/// `ferry nixl install`.
#[derive(Args)]
pub struct InstallArgs {
    /// The Python whose NIXL gets the plugin (a virtual environment's
    /// `bin/python`).
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// The plugin to install [default: `libplugin_FERRY.so` beside this
    /// `ferry` binary, where cargo builds both].
    #[arg(long)]
    plugin: Option<PathBuf>,
}

/// Asks `python` where its NIXL wheel keeps plugins: the directory beside
/// `libnixl.so`, `<site-packages>/.<wheel>.mesonpy.libs/plugins`, for the
/// first NIXL wheel installed (`nixl_cu12`, `nixl_cu13`, ...).
const FIND_PLUGIN_DIR: &str = r#"
import importlib.util, pathlib, sys
for wheel in ("nixl_cu12", "nixl_cu13", "nixl_rocm"):
    spec = importlib.util.find_spec(wheel)
    if spec and spec.origin:
        site = pathlib.Path(spec.origin).parent.parent
        plugins = site / f".{wheel}.mesonpy.libs" / "plugins"
        if plugins.is_dir():
            print(plugins)
            sys.exit(0)
        sys.exit(f"{wheel} is installed, but {plugins} does not exist")
sys.exit("no NIXL wheel (nixl_cu12, nixl_cu13, nixl_rocm) is installed for this Python")
"#;

/// Runs `ferry nixl ...`.
pub fn run(command: NixlCommand) -> Result<(), Failure> {
    match command {
        NixlCommand::Install(args) => {
            let installed = install(&args.python, args.plugin.as_deref())?;
            println!("{}", installed.display());
            Ok(())
        }
    }
}

fn install(python: &Path, plugin: Option<&Path>) -> Result<PathBuf, Failure> {
    let plugin = match plugin {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe()?
            .parent()
            .ok_or_else(|| Failure("cannot tell where this binary is".into()))?
            .join(PLUGIN_FILE),
    };
    if !plugin.is_file() {
        return Err(Failure(format!(
            "{} not found: build it with `cargo build -p ferry-nixl` (or name it with --plugin)",
            plugin.display()
        )));
    }
    let found = Command::new(python)
        .args(["-c", FIND_PLUGIN_DIR])
        .output()
        .map_err(|e| Failure(format!("cannot run {}: {e}", python.display())))?;
    if !found.status.success() {
        return Err(Failure(format!(
            "{}: {}",
            python.display(),
            String::from_utf8_lossy(&found.stderr).trim()
        )));
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&found.stdout).trim());
    let target = dir.join(PLUGIN_FILE);
    // Copied beside, then renamed over: a NIXL loading plugins meanwhile
    // never maps a half-written file.
    let partial = dir.join(format!(".{PLUGIN_FILE}.partial"));
    std::fs::copy(&plugin, &partial)
        .map_err(|e| Failure(format!("cannot copy into {}: {e}", dir.display())))?;
    std::fs::rename(&partial, &target)
        .map_err(|e| Failure(format!("cannot install {}: {e}", target.display())))?;
    Ok(target)
}
