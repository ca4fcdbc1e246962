//! Names and discovery on the command line: the etcd options `serve`,
//! `bench` and `ls` share, finding a bench target by `--peer`, and
//! `ferry ls`.

use std::time::Duration;

use clap::Args;
use ferry::{Node, NodeBuilder, RemoteBuffer};
use serde::Serialize;

use crate::Failure;

/// How long `bench --peer` waits for the peer's metadata.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Where etcd is, for the commands that use it.
#[derive(Args, Clone, Debug)]
pub struct EtcdArgs {
    /// etcd's client URL (e.g. http://127.0.0.1:2379), where nodes publish
    /// themselves by name and are found.
    #[arg(long, value_name = "URL")]
    pub etcd: Option<String>,
    /// The cluster namespace in etcd: keys live under /ferry/<cluster>/nodes/.
    #[arg(long, default_value = "default")]
    pub cluster: String,
}

#[cfg(feature = "etcd")]
impl EtcdArgs {
    fn config(&self, url: &str) -> ferry::discovery::etcd::EtcdConfig {
        ferry::discovery::etcd::EtcdConfig::new(url).cluster(self.cluster.clone())
    }

    /// `builder` finding peers (and, when named, publishing) in etcd;
    /// `lease_ttl` for a node that publishes.
    pub fn apply(
        &self,
        builder: NodeBuilder,
        lease_ttl: Option<Duration>,
    ) -> Result<NodeBuilder, Failure> {
        let Some(url) = &self.etcd else {
            return Ok(builder);
        };
        let mut config = self.config(url);
        if let Some(ttl) = lease_ttl {
            config = config.lease_ttl(ttl);
        }
        Ok(builder.etcd(config))
    }
}

#[cfg(not(feature = "etcd"))]
impl EtcdArgs {
    /// Without the `etcd` feature, `--etcd` is refused.
    pub fn apply(
        &self,
        builder: NodeBuilder,
        _lease_ttl: Option<Duration>,
    ) -> Result<NodeBuilder, Failure> {
        match self.etcd {
            None => Ok(builder),
            Some(_) => Err(Failure(
                "--etcd: this ferry was built without the `etcd` feature".into(),
            )),
        }
    }
}

/// The handle of region `region` of `peer`: a name, looked up through
/// etcd, or HOST:PORT, whose metadata is fetched from it directly.
pub async fn resolve(
    node: &Node,
    peer: &str,
    region: &str,
    etcd: &EtcdArgs,
) -> Result<RemoteBuffer, Failure> {
    if peer.contains(':') {
        let addr = tokio::net::lookup_host(peer)
            .await
            .map_err(|e| Failure(format!("--peer {peer}: {e}")))?
            .next()
            .ok_or_else(|| Failure(format!("--peer {peer}: no address")))?;
        let (key, _) = node.fetch_metadata(addr, LOOKUP_TIMEOUT).await?;
        return Ok(node.remote_region(&key, region)?);
    }
    if etcd.etcd.is_none() {
        return Err(Failure(format!(
            "--peer {peer}: a name is found through --etcd URL (or give HOST:PORT)"
        )));
    }
    Ok(node.lookup_region(peer, region, LOOKUP_TIMEOUT).await?)
}

/// Arguments of `ferry ls`. It reads etcd alone and connects to no node,
/// so it takes no cluster secret.
#[derive(Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// One JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A published region, as `ls` shows it.
#[derive(Serialize)]
pub struct RegionRow {
    /// Its published name.
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// What remote handles may do.
    pub access: String,
}

/// One node, as `ls` shows it.
#[derive(Serialize)]
pub struct NodeRow {
    /// Its name.
    pub name: String,
    /// Its node id (32 hex digits; changes on restart).
    pub node_id: Option<String>,
    /// Where peers reach it.
    pub endpoint: Option<String>,
    /// Its running transports, slowest first.
    pub transports: Vec<String>,
    /// Seconds its lease has left (`null`: no lease).
    pub lease_left_s: Option<u64>,
    /// Its published regions.
    pub regions: Vec<RegionRow>,
    /// Why its metadata could not be read, if it could not.
    pub error: Option<String>,
}

/// Runs `ferry ls`.
#[cfg(feature = "etcd")]
pub async fn ls(args: &LsArgs) -> Result<Vec<NodeRow>, Failure> {
    let url = args
        .etcd
        .etcd
        .as_deref()
        .ok_or_else(|| Failure("ls lists the nodes in etcd: give --etcd URL".into()))?;
    let etcd = ferry::discovery::etcd::Etcd::connect(args.etcd.config(url)).await?;
    let listings = etcd.list().await?;
    Ok(listings
        .into_iter()
        .map(|listing| {
            let lease_left_s = listing.lease_left.map(|d| d.as_secs());
            match listing.metadata {
                Ok(metadata) => NodeRow {
                    name: listing.name,
                    node_id: Some(format!("{:032x}", metadata.node.id.0)),
                    endpoint: Some(metadata.node.endpoint.to_string()),
                    transports: metadata
                        .transports
                        .iter()
                        .map(|t| t.backend().to_string())
                        .collect(),
                    lease_left_s,
                    regions: metadata
                        .regions
                        .iter()
                        .map(|(name, remote)| RegionRow {
                            name: name.clone(),
                            len: remote.len(),
                            access: format!("{:?}", remote.access()),
                        })
                        .collect(),
                    error: None,
                },
                Err(e) => NodeRow {
                    name: listing.name,
                    node_id: None,
                    endpoint: None,
                    transports: Vec::new(),
                    lease_left_s,
                    regions: Vec::new(),
                    error: Some(e.to_string()),
                },
            }
        })
        .collect())
}

/// Without the `etcd` feature there is nothing to list.
#[cfg(not(feature = "etcd"))]
pub async fn ls(_args: &LsArgs) -> Result<Vec<NodeRow>, Failure> {
    Err(Failure(
        "ls: this ferry was built without the `etcd` feature".into(),
    ))
}

/// Prints `rows` as a table.
pub fn print_ls(rows: &[NodeRow]) {
    if rows.is_empty() {
        println!("no nodes published");
        return;
    }
    println!(
        "{:<20} {:<22} {:<14} {:>6}  REGIONS",
        "NAME", "ENDPOINT", "TRANSPORTS", "LEASE"
    );
    for row in rows {
        let lease = row
            .lease_left_s
            .map_or_else(|| "-".to_string(), |s| format!("{s}s"));
        let regions = match &row.error {
            Some(e) => format!("unreadable: {e}"),
            None => row
                .regions
                .iter()
                .map(|r| format!("{} ({} B, {})", r.name, r.len, r.access))
                .collect::<Vec<_>>()
                .join(", "),
        };
        println!(
            "{:<20} {:<22} {:<14} {:>6}  {regions}",
            row.name,
            row.endpoint.as_deref().unwrap_or("-"),
            row.transports.join(","),
            lease
        );
    }
}
