//! `--cluster-secret-file`, on every subcommand that starts a node (`serve`,
//! `bench`): one flag, one help text, one way to apply it; and the secret
//! of `FERRY_CLUSTER_SECRET`, taken out of the environment before the
//! process starts threads.

use std::path::PathBuf;
use std::sync::OnceLock;

use clap::Args;
use ferry::NodeBuilder;

use crate::Failure;

/// The cluster secret a node proves to its peers and requires of them.
#[derive(Args, Debug, Default)]
pub struct SecretArgs {
    /// A file holding the cluster secret every peer must prove (its first
    /// line; a second line is a next secret also accepted, for a roll-out).
    /// Without it, FERRY_CLUSTER_SECRET or FERRY_CLUSTER_SECRET_FILE, if
    /// set. Never on the command line, where `ps` shows it.
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
}

impl SecretArgs {
    /// `builder` with the secret of `--cluster-secret-file`, if given, else
    /// that of `FERRY_CLUSTER_SECRET` as [`take_from_env`] took it (the
    /// builder itself reads `FERRY_CLUSTER_SECRET_FILE`).
    pub fn apply(&self, builder: NodeBuilder) -> Result<NodeBuilder, Failure> {
        let secret = match (&self.cluster_secret_file, from_env()) {
            (Some(path), _) => ferry::ClusterSecret::from_file(path),
            (None, Some(text)) => ferry::ClusterSecret::from_lines(text),
            (None, None) => return Ok(builder),
        };
        Ok(builder.cluster_secret(secret.map_err(|e| Failure(e.to_string()))?))
    }
}

/// `FERRY_CLUSTER_SECRET`'s text, taken from the environment at start.
static FROM_ENV: OnceLock<Option<String>> = OnceLock::new();

/// Takes `FERRY_CLUSTER_SECRET` out of the environment, so that nothing this
/// process starts (and nobody reading its `/proc/PID/environ`) sees it; its
/// text stays for [`SecretArgs::apply`] and a `--loopback` server. Text that
/// is not UTF-8 is refused, not replaced.
///
/// # Safety
///
/// Call it before the process starts any thread (`main`, before the
/// runtime): changing the environment races with threads reading it.
pub unsafe fn take_from_env() -> Result<(), Failure> {
    let text = match std::env::var_os(ferry::control::auth::SECRET_ENV) {
        Some(text) => Some(text.into_string().map_err(|_| {
            Failure(format!(
                "{} is not UTF-8 text",
                ferry::control::auth::SECRET_ENV
            ))
        })?),
        None => None,
    };
    // SAFETY: the caller's guarantee: no other thread runs yet.
    unsafe { std::env::remove_var(ferry::control::auth::SECRET_ENV) };
    let _ = FROM_ENV.set(text);
    Ok(())
}

/// The secret [`take_from_env`] took, if any.
pub fn from_env() -> Option<&'static str> {
    FROM_ENV.get().and_then(|text| text.as_deref())
}
