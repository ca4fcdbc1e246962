//! `--cluster-secret-file`, on every subcommand that starts a node (`serve`,
//! `bench`): one flag, one help text, one way to apply it.

use std::path::PathBuf;

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
    /// `builder` with the secret of `--cluster-secret-file`, if given (the
    /// environment's is the builder's default).
    pub fn apply(&self, builder: NodeBuilder) -> Result<NodeBuilder, Failure> {
        let Some(path) = &self.cluster_secret_file else {
            return Ok(builder);
        };
        let secret = ferry::ClusterSecret::from_file(path).map_err(|e| Failure(e.to_string()))?;
        Ok(builder.cluster_secret(secret))
    }
}
