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
    DiscoveryError, Loaded, LookupError, MetadataError, NodeMetadata, Peers, PublishedLayout,
    fetch, key_of,
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
    /// Published layouts, over published regions.
    layouts: Mutex<BTreeMap<String, PublishedLayout>>,
    /// Whether the node said that, without a cluster secret, what it
    /// publishes is open to whoever reaches its port.
    said_open: std::sync::atomic::AtomicBool,
    peers: Arc<Peers>,
    #[cfg(feature = "etcd")]
    etcd: std::sync::OnceLock<EtcdNames>,
}

/// The node's etcd side: its leased key and the lookups of its peers.
#[cfg(feature = "etcd")]
struct EtcdNames {
    discovery: ferry_discovery::etcd::EtcdDiscovery,
    /// Taken at shutdown, to withdraw the key.
    publication: Mutex<Option<ferry_discovery::etcd::Publication>>,
}

impl Names {
    pub fn new(name: Option<String>, addr: NodeAddr, transports: Vec<RdmaTransportLevel>) -> Self {
        Names {
            name,
            addr,
            transports,
            published: Mutex::default(),
            layouts: Mutex::default(),
            said_open: std::sync::atomic::AtomicBool::new(false),
            peers: Arc::default(),
            #[cfg(feature = "etcd")]
            etcd: std::sync::OnceLock::new(),
        }
    }

    /// Publishes this node in etcd and watches its peers there.
    #[cfg(feature = "etcd")]
    pub fn start_etcd(&self, etcd: ferry_discovery::etcd::Etcd) {
        // A node without a name only looks others up.
        let publication = self
            .name
            .as_ref()
            .map(|name| etcd.publish(name, self.export(None)));
        let discovery = ferry_discovery::etcd::EtcdDiscovery::start(etcd, self.peers.clone());
        let _ = self.etcd.set(EtcdNames {
            discovery,
            publication: Mutex::new(publication),
        });
    }

    /// Pushes the current metadata to etcd, where the node publishes.
    fn republish(&self) {
        #[cfg(feature = "etcd")]
        if let Some(etcd) = self.etcd.get()
            && let Some(publication) = &*etcd.publication.lock().unwrap_or_else(|e| e.into_inner())
        {
            publication.update(self.export(None));
        }
    }

    /// Deletes the node's key in etcd, if it publishes there.
    pub async fn withdraw(&self) {
        #[cfg(feature = "etcd")]
        if let Some(etcd) = self.etcd.get() {
            let publication = etcd
                .publication
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(publication) = publication {
                let timeout = etcd.discovery.etcd().config().request_timeout;
                if let Err(e) = publication.withdraw(timeout).await {
                    tracing::warn!("{e}; the key expires with its lease");
                }
            }
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
        let layouts = self
            .layouts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(name, _)| names.is_none_or(|names| names.contains(name)))
            .map(|(name, layout)| (name.clone(), layout.clone()))
            .collect();
        NodeMetadata::new(
            self.name.clone(),
            self.addr,
            self.transports.clone(),
            regions,
        )
        .with_layouts(layouts)
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
    ///
    /// What that grants: the handle, its tokens included, goes to whoever
    /// loads the metadata (over a control session, or from etcd), and a
    /// handle is what moves bytes. Under a cluster secret only members open
    /// a session, and nobody else can use a handle (every channel's hello
    /// refuses them). Without one, whoever reaches this node's port can
    /// read (and, for a read-write region, write) what it publishes; the
    /// node logs that once.
    pub fn publish(&self, name: impl Into<String>, region: &Region) -> Result<(), NameTaken> {
        use std::sync::atomic::Ordering;
        let name = name.into();
        let names = &self.0.router.names;
        if !self.has_cluster_secret() && !names.said_open.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                endpoint = %self.addr().endpoint,
                "this node has no cluster secret: the regions it publishes are open to whoever \
                 reaches its port (set a cluster secret to keep them to members)"
            );
        }
        let mut published = self.0.router.names.published();
        if published.contains_key(&name) {
            return Err(NameTaken(name));
        }
        published.insert(name, region.clone());
        drop(published);
        self.0.router.names.republish();
        Ok(())
    }

    /// Publishes a rank's tensor layout under `name`, with its regions
    /// (each published as `name/0`, `name/1`, ...): a peer that loads this
    /// node's metadata plans from it ([`Node::peer_layout`]). What it
    /// grants is what publishing the regions grants ([`Node::publish`]).
    /// A name in use (the layout's, or one of its regions') is refused,
    /// and nothing is published.
    pub fn publish_layout(&self, name: &str, local: &crate::LocalLayout) -> Result<(), NameTaken> {
        let names = &self.0.router.names;
        let region_names: Vec<String> = (0..local.regions().len())
            .map(|i| format!("{name}/{i}"))
            .collect();
        {
            let mut published = names.published();
            let mut layouts = names.layouts.lock().unwrap_or_else(|e| e.into_inner());
            if layouts.contains_key(name) {
                return Err(NameTaken(name.to_string()));
            }
            if let Some(taken) = region_names.iter().find(|n| published.contains_key(*n)) {
                return Err(NameTaken(taken.clone()));
            }
            for (region_name, region) in region_names.iter().zip(local.regions()) {
                published.insert(region_name.clone(), region.clone());
            }
            layouts.insert(
                name.to_string(),
                PublishedLayout {
                    layout: local.layout().clone(),
                    regions: region_names,
                },
            );
        }
        names.republish();
        Ok(())
    }

    /// The layout `peer` published as `name`, with handles to its regions,
    /// from the metadata loaded for it (see [`Node::fetch_metadata`]): what
    /// [`Node::plan_transfer`] takes for a peer.
    /// Its regions must be as long as the layout declares
    /// ([`crate::PlanError::RegionTooShort`] otherwise).
    pub fn peer_layout(
        &self,
        peer: &str,
        name: &str,
    ) -> Result<crate::PeerLayout, crate::PlanError> {
        let metadata = self
            .0
            .router
            .names
            .peers
            .get(peer)
            .ok_or_else(|| LookupError::UnknownPeer(peer.into()))?;
        let unknown = |region: &str| LookupError::UnknownRegion {
            peer: peer.into(),
            region: region.into(),
        };
        let published = metadata.layouts.get(name).ok_or_else(|| unknown(name))?;
        let handles = published
            .regions
            .iter()
            .map(|region| {
                metadata
                    .regions
                    .get(region)
                    .cloned()
                    .ok_or_else(|| unknown(region))
            })
            .collect::<Result<Vec<_>, _>>()?;
        crate::PeerLayout::new(published.layout.clone(), handles)
    }

    /// Stops publishing `name`; returns whether it was published. Peers
    /// that loaded the handle keep it for as long as the region lives.
    pub fn unpublish(&self, name: &str) -> bool {
        let removed = self.0.router.names.published().remove(name).is_some();
        if removed {
            self.0.router.names.republish();
        }
        removed
    }

    /// Withdraws the layout published as `name` and its regions
    /// (`name/0`, ...): peers that load this node's metadata from now on
    /// plan without it, and the name may be published again. Whether it
    /// was published.
    pub fn unpublish_layout(&self, name: &str) -> bool {
        let names = &self.0.router.names;
        let removed = {
            let mut published = names.published();
            let mut layouts = names.layouts.lock().unwrap_or_else(|e| e.into_inner());
            let removed = layouts.remove(name);
            for region in removed.iter().flat_map(|l| &l.regions) {
                published.remove(region);
            }
            removed.is_some()
        };
        if removed {
            names.republish();
        }
        removed
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
    ///
    /// A peer without a name is known by its node id, which no later
    /// incarnation shares: its metadata lasts as long as this node's
    /// control session to it, and is forgotten when the session closes
    /// (the peer shut down or vanished; at the latest when keepalive gives
    /// up on it), so unnamed peers that come and go leave nothing behind.
    /// A named peer's metadata stays until [`Node::forget_peer`] or until
    /// a new incarnation under its name replaces it (which a fetch reports
    /// as [`Loaded::Restarted`]): one entry per name. (Metadata given to
    /// [`Node::load_metadata`] stays until [`Node::forget_peer`]; through
    /// etcd, until its key goes.)
    pub async fn fetch_metadata(
        &self,
        address: SocketAddr,
        timeout: Duration,
    ) -> Result<(String, Loaded), DiscoveryError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let endpoint = &self.0.router.endpoint;
        let metadata = fetch(endpoint, address, None, timeout).await?;
        let node = metadata.node;
        let key = key_of(&metadata);
        if metadata.name.is_some() {
            return Ok((key, self.0.router.names.peers.load(metadata)));
        }
        // The session the fetch used: open unless the peer has just gone.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let session = endpoint.session(node, left).await?;
        let loaded = self.0.router.names.peers.load(metadata);
        let peers = Arc::downgrade(&self.0.router.names.peers);
        let forget = key.clone();
        // Ends with the session (which ends with this node's endpoint).
        tokio::spawn(async move {
            session.closed().await;
            if let Some(peers) = peers.upgrade() {
                peers.forget_incarnation(&forget, node);
            }
        });
        Ok((key, loaded))
    }

    /// How many peers' metadata this node holds (see
    /// [`Node::fetch_metadata`] for when each goes).
    pub fn known_peers(&self) -> usize {
        self.0.router.names.peers.len()
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

    /// `peer`'s metadata: as loaded, or, on a node with etcd
    /// ([`crate::NodeBuilder::etcd`]), looked up there, waiting up to
    /// `timeout` for the peer to be published. A peer looked up through
    /// etcd stays current: the node's watch drops it when its key goes and
    /// reloads it when it is republished (a restart included).
    pub async fn lookup(
        &self,
        peer: &str,
        timeout: Duration,
    ) -> Result<NodeMetadata, DiscoveryError> {
        self.lookup_where(peer, timeout, |_| true).await
    }

    /// The handle of the region `peer` published as `region`, looking the
    /// peer up as [`Node::lookup`] does; through etcd, it also waits up to
    /// `timeout` for a peer that is published but has not published that
    /// region yet.
    pub async fn lookup_region(
        &self,
        peer: &str,
        region: &str,
        timeout: Duration,
    ) -> Result<RemoteBuffer, DiscoveryError> {
        let metadata = self
            .lookup_where(peer, timeout, |m| m.regions.contains_key(region))
            .await?;
        metadata.regions.get(region).cloned().ok_or_else(|| {
            LookupError::UnknownRegion {
                peer: peer.into(),
                region: region.into(),
            }
            .into()
        })
    }

    async fn lookup_where(
        &self,
        peer: &str,
        timeout: Duration,
        wanted: impl Fn(&NodeMetadata) -> bool,
    ) -> Result<NodeMetadata, DiscoveryError> {
        let names = &self.0.router.names;
        #[cfg(feature = "etcd")]
        if let Some(etcd) = names.etcd.get() {
            let (metadata, _) = etcd.discovery.lookup(peer, timeout, wanted).await?;
            return Ok(metadata);
        }
        let _ = (timeout, wanted);
        names
            .peers
            .get(peer)
            .ok_or_else(|| LookupError::UnknownPeer(peer.into()).into())
    }

    /// Whether this node's key is in etcd now (`None`: it does not
    /// publish there), waiting up to `timeout` for it to be.
    pub async fn published_in_etcd(&self, timeout: Duration) -> Option<bool> {
        #[cfg(feature = "etcd")]
        if let Some(etcd) = self.0.router.names.etcd.get() {
            let published = etcd
                .publication
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(|p| p.watch_published());
            let Some(mut published) = published else {
                // Unnamed, or shut down.
                return Some(false);
            };
            let waited = tokio::time::timeout(timeout, published.wait_for(|p| *p)).await;
            return Some(waited.is_ok_and(|r| r.is_ok()));
        }
        let _ = timeout;
        None
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
