//! Names, metadata and discovery for ferry nodes.
//!
//! A node describes itself as [`NodeMetadata`]: its name, identity,
//! transports and the regions it published by name, as versioned bytes.
//! Peers learn it peer-to-peer, straight from the node's endpoint over the
//! control session ([`serve_metadata`], [`fetch`]), keep it in a [`Peers`]
//! cache, and look handles up by `(peer name, region name)`. A peer that
//! restarted under the same name has a new node id: loading its metadata
//! replaces the old incarnation's, and the old handles fail at the hello
//! with a typed error (`OpError::UnknownNode`) rather than reach the new
//! process's memory.

#![warn(missing_docs)]

mod metadata;
mod p2p;
mod peers;

pub use metadata::{METADATA_VERSION, MetadataError, NodeMetadata, PublishedLayout};
pub use p2p::{DiscoveryError, fetch, fetch_from, serve_metadata};
pub use peers::{Loaded, LookupError, Peers, key_of};

#[cfg(feature = "etcd")]
pub mod etcd;
