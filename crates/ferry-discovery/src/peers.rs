//! The peers a node knows by name, and their published regions.

use std::collections::BTreeMap;
use std::sync::Mutex;

use ferry_core::{NodeAddr, RemoteBuffer};

use crate::metadata::NodeMetadata;

/// What loading a peer's metadata changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loaded {
    /// A peer this node did not know under that name.
    New,
    /// The same incarnation again: its regions are refreshed.
    Refreshed,
    /// Another process under a known name: the old one's metadata is
    /// dropped, and handles from it fail with `OpError::UnknownNode`.
    Restarted {
        /// The incarnation it replaced.
        previous: NodeAddr,
    },
}

/// Why a lookup found no handle.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
    /// No metadata is loaded for a peer of that name.
    #[error("no peer named {0:?} is known (load or fetch its metadata)")]
    UnknownPeer(String),
    /// The peer publishes no region of that name (in the metadata loaded).
    #[error("peer {peer:?} publishes no region named {region:?}")]
    UnknownRegion {
        /// The peer.
        peer: String,
        /// The region name asked for.
        region: String,
    },
}

/// Loaded metadata of peers, by name. A peer without a name is kept under
/// its node id, written as 32 hex digits.
#[derive(Default)]
pub struct Peers(Mutex<BTreeMap<String, NodeMetadata>>);

/// The key a peer is kept under.
pub fn key_of(metadata: &NodeMetadata) -> String {
    metadata
        .name
        .clone()
        .unwrap_or_else(|| format!("{:032x}", metadata.node.id.0))
}

impl Peers {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, NodeMetadata>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `metadata`, replacing what was known under its name.
    pub fn load(&self, metadata: NodeMetadata) -> Loaded {
        let node = metadata.node;
        match self.lock().insert(key_of(&metadata), metadata) {
            None => Loaded::New,
            Some(old) if old.node.id == node.id => Loaded::Refreshed,
            Some(old) => Loaded::Restarted { previous: old.node },
        }
    }

    /// The handle of region `region` published by peer `peer`.
    pub fn remote(&self, peer: &str, region: &str) -> Result<RemoteBuffer, LookupError> {
        let peers = self.lock();
        let metadata = peers
            .get(peer)
            .ok_or_else(|| LookupError::UnknownPeer(peer.into()))?;
        metadata
            .regions
            .get(region)
            .cloned()
            .ok_or_else(|| LookupError::UnknownRegion {
                peer: peer.into(),
                region: region.into(),
            })
    }

    /// The metadata known for `peer`.
    pub fn get(&self, peer: &str) -> Option<NodeMetadata> {
        self.lock().get(peer).cloned()
    }

    /// Forgets `peer`; returns whether it was known.
    pub fn forget(&self, peer: &str) -> bool {
        self.lock().remove(peer).is_some()
    }

    /// Forgets `peer` if what is known under that name is still the
    /// incarnation `node` (a restarted peer's newer metadata stays);
    /// returns whether it was forgotten.
    pub fn forget_incarnation(&self, peer: &str, node: NodeAddr) -> bool {
        let mut peers = self.lock();
        if peers.get(peer).is_some_and(|m| m.node.id == node.id) {
            peers.remove(peer);
            true
        } else {
            false
        }
    }

    /// How many peers are known. For leak checks and `ferry info`.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no peer is known.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}
