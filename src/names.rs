//! Names and metadata, the facade's side: a node's name, the regions it
//! publishes by name, its metadata blob (served to peers on its control
//! sessions), and the peers it knows by name. The blob, the cache and the
//! fetch are `ferry-discovery`'s.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{NodeAddr, RdmaTransportLevel, Region, RemoteBuffer};
use ferry_discovery::{
    DiscoveryError, Loaded, LookupError, MetadataError, NodeMetadata, Peers, fetch, key_of,
};

use crate::Node;

/// A region name already in use on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a region is already published as {0:?}")]
pub struct NameTaken(pub String);

/// This node's names: its own, its published regions', and its peers'.
pub(crate) struct Names {
    name: Option<String>,
    addr: NodeAddr,
    transports: Vec<RdmaTransportLevel>,
    /// Published regions stay registered while published.
    published: Mutex<BTreeMap<String, Region>>,
    peers: Peers,
}

impl Names {
    pub fn new(name: Option<String>, addr: NodeAddr, transports: Vec<RdmaTransportLevel>) -> Self {
        Names {
            name,
            addr,
            transports,
            published: Mutex::default(),
            peers: Peers::default(),
        }
    }

    fn published(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Region>> {
        self.published.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This node's metadata: every published region, or those in `names`.
    pub fn metadata(&self, names: Option<&[String]>) -> NodeMetadata {
        let published = self.published();
        let regions = published
            .iter()
            .filter(|(name, _)| names.is_none_or(|names| names.contains(name)))
            .map(|(name, region)| (name.clone(), region.remote()))
            .collect();
        NodeMetadata {
            name: self.name.clone(),
            node: self.addr,
            transports: self.transports.clone(),
            regions,
        }
    }

    /// The blob peers fetch (`Service::METADATA`).
    pub fn export(&self, names: Option<Vec<String>>) -> Bytes {
        self.metadata(names.as_deref()).encode()
    }
}

impl Node {
    /// The node's name in its cluster namespace, if it was given one
    /// ([`crate::NodeBuilder::name`]).
    pub fn name(&self) -> Option<&str> {
        self.0.router.names.name.as_deref()
    }

    /// Publishes `region` under `name` (e.g. `kv-cache`,
    /// `weights/layer-3`): peers that load this node's metadata find its
    /// handle, with the region's access, by that name. The region stays
    /// registered while published.
    pub fn publish(&self, name: impl Into<String>, region: &Region) -> Result<(), NameTaken> {
        let name = name.into();
        let mut published = self.0.router.names.published();
        if published.contains_key(&name) {
            return Err(NameTaken(name));
        }
        published.insert(name, region.clone());
        Ok(())
    }

    /// Stops publishing `name`; returns whether it was published. Peers
    /// that loaded the handle keep it for as long as the region lives.
    pub fn unpublish(&self, name: &str) -> bool {
        self.0.router.names.published().remove(name).is_some()
    }

    /// This node's metadata: identity, transports, published regions.
    pub fn metadata(&self) -> NodeMetadata {
        self.0.router.names.metadata(None)
    }

    /// This node's metadata as a blob (see [`NodeMetadata::encode`]), with
    /// every published region, or only those named in `names`.
    pub fn export_metadata(&self, names: Option<&[String]>) -> Bytes {
        self.0.router.names.metadata(names).encode()
    }

    /// Loads a peer's metadata blob, replacing what was known under its
    /// name (a new incarnation of a restarted peer included).
    pub fn load_metadata(&self, blob: &[u8]) -> Result<Loaded, MetadataError> {
        let metadata = NodeMetadata::decode(blob)?;
        Ok(self.0.router.names.peers.load(metadata))
    }

    /// Fetches the metadata of the node listening at `address` from it
    /// directly (no server needed) within `timeout`, and loads it. Returns
    /// the name it is known under, and what loading changed.
    pub async fn fetch_metadata(
        &self,
        address: SocketAddr,
        timeout: Duration,
    ) -> Result<(String, Loaded), DiscoveryError> {
        let metadata = fetch(&self.0.router.endpoint, address, None, timeout).await?;
        let key = key_of(&metadata);
        Ok((key, self.0.router.names.peers.load(metadata)))
    }

    /// The handle of the region `peer` published as `region`, from the
    /// metadata loaded for it.
    pub fn remote_region(&self, peer: &str, region: &str) -> Result<RemoteBuffer, LookupError> {
        self.0.router.names.peers.remote(peer, region)
    }

    /// The metadata loaded for `peer`.
    pub fn peer_metadata(&self, peer: &str) -> Option<NodeMetadata> {
        self.0.router.names.peers.get(peer)
    }

    /// Forgets `peer`'s metadata; returns whether it was known.
    pub fn forget_peer(&self, peer: &str) -> bool {
        self.0.router.names.peers.forget(peer)
    }
}

/// Serves `names`' metadata on the node's endpoint.
pub(crate) fn serve(
    endpoint: &ferry_control::Endpoint,
    names: &Arc<Names>,
) -> Result<(), ferry_control::EndpointError> {
    // Weak: the endpoint holds its handlers.
    let weak = Arc::downgrade(names);
    ferry_discovery::serve_metadata(endpoint, move |wanted| {
        weak.upgrade()
            .map(|names| names.export(wanted))
            .unwrap_or_default()
    })
}
