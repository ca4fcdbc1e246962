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

/// Asks `python` where its NIXL wheels keep plugins: the directory beside
/// `libnixl.so`, `<site-packages>/.<wheel>.mesonpy.libs/plugins`, one line
/// for each NIXL wheel installed (`nixl_cu12`, `nixl_cu13`, ...). Every
/// one: `import nixl` picks the wheel by the CUDA it detects (torch's),
/// so a venv with both loads either.
const FIND_PLUGIN_DIRS: &str = r#"
import importlib.util, pathlib, sys
found = 0
for wheel in ("nixl_cu12", "nixl_cu13", "nixl_rocm"):
    spec = importlib.util.find_spec(wheel)
    if spec and spec.origin:
        site = pathlib.Path(spec.origin).parent.parent
        plugins = site / f".{wheel}.mesonpy.libs" / "plugins"
        if not plugins.is_dir():
            sys.exit(f"{wheel} is installed, but {plugins} does not exist")
        print(plugins)
        found += 1
if not found:
    sys.exit("no NIXL wheel (nixl_cu12, nixl_cu13, nixl_rocm) is installed for this Python")
"#;

/// Runs `ferry nixl ...`.
pub fn run(command: NixlCommand) -> Result<(), Failure> {
    match command {
        NixlCommand::Install(args) => {
            for installed in install(&args.python, args.plugin.as_deref())? {
                println!("{}", installed.display());
            }
            Ok(())
        }
    }
}

fn install(python: &Path, plugin: Option<&Path>) -> Result<Vec<PathBuf>, Failure> {
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
        .args(["-c", FIND_PLUGIN_DIRS])
        .output()
        .map_err(|e| Failure(format!("cannot run {}: {e}", python.display())))?;
    if !found.status.success() {
        return Err(Failure(format!(
            "{}: {}",
            python.display(),
            String::from_utf8_lossy(&found.stderr).trim()
        )));
    }
    let stdout = String::from_utf8_lossy(&found.stdout);
    stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let dir = PathBuf::from(line.trim());
            let target = dir.join(PLUGIN_FILE);
            // Copied beside, then renamed over: a NIXL loading plugins
            // meanwhile never maps a half-written file.
            let partial = dir.join(format!(".{PLUGIN_FILE}.partial"));
            std::fs::copy(&plugin, &partial)
                .map_err(|e| Failure(format!("cannot copy into {}: {e}", dir.display())))?;
            std::fs::rename(&partial, &target)
                .map_err(|e| Failure(format!("cannot install {}: {e}", target.display())))?;
            Ok(target)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A venv with both CUDA builds of NIXL (as torch for CUDA 13 beside
    /// the `nixl` package's default nixl-cu12 makes) gets the plugin in
    /// both: `import nixl` loads either, by the CUDA it detects.
    #[test]
    fn the_plugin_goes_beside_every_nixl_wheel_installed() {
        let root = std::env::temp_dir().join(format!("ferry-nixl-install-{}", std::process::id()));
        let site = root.join("site-packages");
        for wheel in ["nixl_cu12", "nixl_cu13"] {
            std::fs::create_dir_all(site.join(wheel)).unwrap();
            std::fs::write(site.join(wheel).join("__init__.py"), "").unwrap();
            std::fs::create_dir_all(site.join(format!(".{wheel}.mesonpy.libs/plugins"))).unwrap();
        }
        let python = root.join("python");
        std::fs::write(
            &python,
            format!(
                "#!/bin/sh\nPYTHONPATH={} exec python3 \"$@\"\n",
                site.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        let plugin = root.join(PLUGIN_FILE);
        std::fs::write(&plugin, b"not really a plugin").unwrap();

        let installed = install(&python, Some(&plugin)).unwrap();
        assert_eq!(installed.len(), 2, "{installed:?}");
        for wheel in ["nixl_cu12", "nixl_cu13"] {
            let target = site.join(format!(".{wheel}.mesonpy.libs/plugins/{PLUGIN_FILE}"));
            assert_eq!(std::fs::read(&target).unwrap(), b"not really a plugin");
        }
        std::fs::remove_dir_all(site.join("nixl_cu13")).unwrap();
        std::fs::remove_dir_all(site.join("nixl_cu12")).unwrap();
        let none = install(&python, Some(&plugin)).unwrap_err();
        assert!(none.0.contains("no NIXL wheel"), "{}", none.0);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
