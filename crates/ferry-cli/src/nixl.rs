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

/// The NIXL releases whose plugin ABI the plugin is built for: the
/// plugin's own list (`ferry_nixl::NIXL_RELEASES`, which refuses the others
/// at load; a test here checks the two agree). The install refuses the
/// others first, with one line, rather than leave a plugin NIXL will not load.
pub const NIXL_RELEASES: &[&str] = &["1.4.", "1.5."];

/// Set to `1` to install into (and load in) a NIXL release not in
/// [`NIXL_RELEASES`] anyway (`ferry_nixl::ANY_RELEASE_ENV`).
pub const ANY_RELEASE_ENV: &str = "FERRY_NIXL_ANY_RELEASE";

/// Asks `python` where its NIXL wheels keep plugins: the directory beside
/// `libnixl.so`, `<site-packages>/.<wheel>.mesonpy.libs/plugins`, and the
/// wheel's release (its `*.dist-info`, as the plugin reads it at load),
/// one tab-separated line for each NIXL wheel installed (`nixl_cu12`,
/// `nixl_cu13`, ...). Every one: `import nixl` picks the wheel by the
/// CUDA it detects (torch's), so a venv with both loads either.
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
        infos = sorted(site.glob(f"{wheel}-*.dist-info"))
        release = infos[0].name[len(wheel) + 1:-len(".dist-info")] if infos else "unknown"
        print(f"{plugins}	{release}")
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
    let wheels: Vec<(PathBuf, String)> = stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let (dir, release) = line
                .trim()
                .split_once('\t')
                .unwrap_or((line.trim(), "unknown"));
            (PathBuf::from(dir), release.to_string())
        })
        .collect();
    let any_release = std::env::var(ANY_RELEASE_ENV).as_deref() == Ok("1");
    // A wheel without a release to read (a NIXL built from source) is
    // taken at its word, as the plugin does at load.
    if let Some((dir, release)) = wheels.iter().find(|(_, release)| {
        release != "unknown" && !NIXL_RELEASES.iter().any(|r| release.starts_with(r))
    }) && !any_release
    {
        return Err(Failure(format!(
            "not installing: the FERRY plugin is built for NIXL {} (plugin API 1), and {} is \
             NIXL {release}, which would refuse it; use one of those NIXL releases, or set \
             {ANY_RELEASE_ENV}=1 to install it anyway",
            NIXL_RELEASES.join("x, ") + "x",
            dir.display(),
        )));
    }
    wheels
        .into_iter()
        .map(|(dir, _)| {
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

    /// The install refuses what the plugin would refuse at load.
    #[test]
    fn the_releases_are_the_plugins() {
        assert_eq!(NIXL_RELEASES, plugin_FERRY::NIXL_RELEASES);
        assert_eq!(ANY_RELEASE_ENV, plugin_FERRY::ANY_RELEASE_ENV);
    }

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
        // A NIXL release the plugin is not built for: refused, in one
        // line, and nothing is copied.
        std::fs::create_dir_all(site.join("nixl_cu12-1.5.1.dist-info")).unwrap();
        std::fs::create_dir_all(site.join("nixl_cu13-1.9.0.dist-info")).unwrap();
        std::fs::write(&plugin, b"a newer plugin").unwrap();
        let refused = install(&python, Some(&plugin)).unwrap_err();
        assert!(
            refused.0.contains("NIXL 1.9.0, which would refuse it"),
            "{}",
            refused.0
        );
        assert!(refused.0.contains(ANY_RELEASE_ENV), "{}", refused.0);
        assert_eq!(refused.0.lines().count(), 1, "{}", refused.0);
        for wheel in ["nixl_cu12", "nixl_cu13"] {
            let target = site.join(format!(".{wheel}.mesonpy.libs/plugins/{PLUGIN_FILE}"));
            assert_eq!(std::fs::read(&target).unwrap(), b"not really a plugin");
        }
        std::fs::remove_dir_all(site.join("nixl_cu13-1.9.0.dist-info")).unwrap();
        std::fs::create_dir_all(site.join("nixl_cu13-1.5.1.dist-info")).unwrap();
        assert_eq!(install(&python, Some(&plugin)).unwrap().len(), 2);

        std::fs::remove_dir_all(site.join("nixl_cu13")).unwrap();
        std::fs::remove_dir_all(site.join("nixl_cu12")).unwrap();
        let none = install(&python, Some(&plugin)).unwrap_err();
        assert!(none.0.contains("no NIXL wheel"), "{}", none.0);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
