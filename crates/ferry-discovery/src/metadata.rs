//! A node's metadata as versioned bytes: who it is (name, node id, the
//! endpoint peers reach it at), which transports it runs, the regions it
//! published by name, each as the handle peers use, and the tensor layouts
//! it published over them (so that a peer plans from the owner's own
//! declaration).
//!
//! The blob is a fixed header (magic, format version, body length) and a
//! JSON body. The header lets a reader refuse what it cannot read with a
//! typed error (not ferry's, cut short, written by a newer ferry) before it
//! parses anything; JSON keeps the body readable with standard tools and
//! lets later versions add fields that older readers skip.

use std::collections::BTreeMap;

use bytes::Bytes;
use ferry_core::{NodeAddr, RdmaTransportLevel, RemoteBuffer};
use ferry_layout::RankLayout;
use serde::{Deserialize, Serialize};

const MAGIC: [u8; 4] = *b"FMD\0";
/// The format this code writes, and the newest it reads.
pub const METADATA_VERSION: u16 = 1;
/// magic (4), version (2), reserved (2), body length (4).
const HEADER_LEN: usize = 12;

/// What a node says about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeMetadata {
    /// Its name in its cluster namespace, if it has one.
    pub name: Option<String>,
    /// Its node id and advertised endpoint: a restarted process has a new
    /// id at the same name and endpoint.
    pub node: NodeAddr,
    /// The transports it runs, slowest first.
    pub transports: Vec<RdmaTransportLevel>,
    /// Its published regions by name: the handle a peer uses for each.
    pub regions: BTreeMap<String, RemoteBuffer>,
    /// Its published tensor layouts by name. (Absent from blobs of nodes
    /// that predate layouts: read as none.)
    #[serde(default)]
    pub layouts: BTreeMap<String, PublishedLayout>,
}

/// A rank's tensor layout as its node publishes it: the layout, and the
/// published names of the regions it names, in its region order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedLayout {
    /// The layout.
    pub layout: RankLayout,
    /// `regions[i]`: the published name of the layout's region `i`.
    pub regions: Vec<String>,
}

/// Why a blob is not metadata this node can use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Shorter than its header says: cut short in transit or in storage.
    #[error("metadata truncated: {len} bytes, {needed} needed")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes the header promises.
        needed: usize,
    },
    /// Not a ferry metadata blob at all.
    #[error("not ferry metadata (magic {0:02x?})")]
    NotMetadata([u8; 4]),
    /// Written by a newer ferry, in a format this one cannot read.
    #[error("metadata format {found} is newer than {supported}, the newest this node reads")]
    FutureVersion {
        /// The blob's format.
        found: u16,
        /// The newest this node reads.
        supported: u16,
    },
    /// The header is fine but the body is not valid metadata.
    #[error("malformed metadata: {0}")]
    Malformed(String),
    /// A region a handle names belongs to another node than the blob's.
    #[error("region {region:?} in the metadata of {node} belongs to another node")]
    ForeignRegion {
        /// The region's published name.
        region: String,
        /// The node the blob describes.
        node: NodeAddr,
    },
    /// A region published with narrowed credentials: a node publishes
    /// whole regions only, so the blob was edited.
    #[error("region {region:?} is published narrowed (scoped): a node publishes whole regions")]
    ScopedRegion {
        /// The region's published name.
        region: String,
    },
}

impl NodeMetadata {
    /// A node's metadata (the struct grows with what nodes say of
    /// themselves, so it is made here rather than field by field).
    /// `regions` are whole regions' handles, as nodes publish them: a
    /// narrowed one (a slice, a read-only view of a writable region) is
    /// refused when the blob is read ([`MetadataError::ScopedRegion`]).
    pub fn new(
        name: Option<String>,
        node: NodeAddr,
        transports: Vec<RdmaTransportLevel>,
        regions: BTreeMap<String, RemoteBuffer>,
    ) -> NodeMetadata {
        NodeMetadata {
            name,
            node,
            transports,
            regions,
            layouts: BTreeMap::new(),
        }
    }

    /// The same metadata with `layouts` published.
    pub fn with_layouts(mut self, layouts: BTreeMap<String, PublishedLayout>) -> NodeMetadata {
        self.layouts = layouts;
        self
    }

    /// The blob: header and body.
    pub fn encode(&self) -> Bytes {
        let body = serde_json::to_vec(self).expect("metadata always serializes");
        let mut blob = Vec::with_capacity(HEADER_LEN + body.len());
        blob.extend_from_slice(&MAGIC);
        blob.extend_from_slice(&METADATA_VERSION.to_le_bytes());
        blob.extend_from_slice(&[0, 0]);
        let len = u32::try_from(body.len()).expect("metadata body under 4 GiB");
        blob.extend_from_slice(&len.to_le_bytes());
        blob.extend_from_slice(&body);
        blob.into()
    }

    /// Reads a blob: checks its header, parses its body, and checks that
    /// every handle in it belongs to the node it describes.
    pub fn decode(blob: &[u8]) -> Result<Self, MetadataError> {
        let truncated = |needed| MetadataError::Truncated {
            len: blob.len(),
            needed,
        };
        let header: &[u8; HEADER_LEN] = blob
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| truncated(HEADER_LEN))?;
        let magic: [u8; 4] = header[..4].try_into().unwrap();
        if magic != MAGIC {
            return Err(MetadataError::NotMetadata(magic));
        }
        let version = u16::from_le_bytes([header[4], header[5]]);
        if version > METADATA_VERSION {
            return Err(MetadataError::FutureVersion {
                found: version,
                supported: METADATA_VERSION,
            });
        }
        let len = u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize;
        let needed = HEADER_LEN.saturating_add(len);
        let body = blob
            .get(HEADER_LEN..needed)
            .ok_or_else(|| truncated(needed))?;
        let metadata: NodeMetadata =
            serde_json::from_slice(body).map_err(|e| MetadataError::Malformed(e.to_string()))?;
        if let Some((region, _)) = metadata
            .regions
            .iter()
            .find(|(_, handle)| handle.owner().id != metadata.node.id)
        {
            return Err(MetadataError::ForeignRegion {
                region: region.clone(),
                node: metadata.node,
            });
        }
        // A whole region's handle reads back as itself, and always encodes.
        if let Some((region, _)) = (metadata.regions.iter()).find(|(_, h)| !h.scopes().is_empty()) {
            return Err(MetadataError::ScopedRegion {
                region: region.clone(),
            });
        }
        Ok(metadata)
    }

    /// The same metadata with only the regions and layouts named in
    /// `names` (names it does not publish are left out).
    pub fn only(&self, names: &[impl AsRef<str>]) -> NodeMetadata {
        let named = |name: &String| names.iter().any(|n| n.as_ref() == name);
        NodeMetadata {
            regions: (self.regions.iter())
                .filter(|(name, _)| named(name))
                .map(|(name, handle)| (name.clone(), handle.clone()))
                .collect(),
            layouts: (self.layouts.iter())
                .filter(|(name, _)| named(name))
                .map(|(name, layout)| (name.clone(), layout.clone()))
                .collect(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use ferry_core::{Access, MemoryBlock, NodeId, RegionIds, RegionParts, RemoteTransports};

    use super::*;

    fn node(id: u128) -> NodeAddr {
        NodeAddr {
            id: NodeId(id),
            endpoint: "127.0.0.1:4000".parse().unwrap(),
        }
    }

    fn handle(owner: NodeAddr, slots: &RegionIds) -> RemoteBuffer {
        RegionParts {
            slot: slots.allocate(),
            memory: std::sync::Arc::new(MemoryBlock::alloc(4096).unwrap()),
            access: Access::ReadWrite,
            owner,
            transports: RemoteTransports::default(),
            registrations: Vec::new(),
        }
        .into_region()
        .remote()
    }

    fn sample(regions: usize) -> NodeMetadata {
        let me = node(7);
        let slots = RegionIds::new();
        NodeMetadata {
            name: Some("prefill-0".into()),
            node: me,
            transports: vec![RdmaTransportLevel::Tcp],
            regions: (0..regions)
                .map(|i| (format!("weights/layer-{i}"), handle(me, &slots)))
                .collect(),
            layouts: BTreeMap::new(),
        }
    }

    #[test]
    fn layouts_travel_and_blobs_without_them_still_read() {
        let layout = ferry_layout::RankLayout {
            rank: 3,
            region_lens: vec![4096],
            tensors: Vec::new(),
        };
        let published = PublishedLayout {
            layout,
            regions: vec!["weights/layer-0".into()],
        };
        let full = sample(1).with_layouts([("w".to_string(), published)].into());
        assert_eq!(NodeMetadata::decode(&full.encode()), Ok(full.clone()));
        assert!(full.only(&["weights/layer-0"]).layouts.is_empty());
        assert_eq!(full.only(&["w"]).layouts.len(), 1);
        // A blob of a node that predates layouts.
        let mut older: serde_json::Value = serde_json::to_value(sample(1)).unwrap();
        older.as_object_mut().unwrap().remove("layouts");
        let older: NodeMetadata = serde_json::from_value(older).unwrap();
        assert!(older.layouts.is_empty());
    }

    #[test]
    fn metadata_round_trips_and_partial_exports_carry_only_the_named_regions() {
        let full = sample(3);
        assert_eq!(NodeMetadata::decode(&full.encode()), Ok(full.clone()));
        let partial = full.only(&["weights/layer-2", "no-such-region"]);
        assert_eq!(
            partial.regions.keys().collect::<Vec<_>>(),
            ["weights/layer-2"]
        );
        assert_eq!(NodeMetadata::decode(&partial.encode()), Ok(partial));
    }

    /// A node with 1,000 published regions: the blob round-trips, and its
    /// size is reported (`--nocapture`).
    #[test]
    fn a_thousand_regions_round_trip() {
        let big = sample(1000);
        let blob = big.encode();
        println!("metadata of 1,000 regions: {} bytes", blob.len());
        assert_eq!(NodeMetadata::decode(&blob), Ok(big));
    }

    #[test]
    fn garbage_truncated_future_and_foreign_blobs_are_refused_by_type() {
        let blob = sample(2).encode();
        for cut in [0, 5, HEADER_LEN, blob.len() - 1] {
            assert!(
                matches!(
                    NodeMetadata::decode(&blob[..cut]),
                    Err(MetadataError::Truncated { len, .. }) if len == cut
                ),
                "cut at {cut}"
            );
        }
        let mut garbage = blob.to_vec();
        garbage[0] = b'X';
        assert!(matches!(
            NodeMetadata::decode(&garbage),
            Err(MetadataError::NotMetadata(_))
        ));
        let mut future = blob.to_vec();
        future[4..6].copy_from_slice(&(METADATA_VERSION + 1).to_le_bytes());
        assert_eq!(
            NodeMetadata::decode(&future),
            Err(MetadataError::FutureVersion {
                found: METADATA_VERSION + 1,
                supported: METADATA_VERSION
            })
        );
        let mut body = blob.to_vec();
        let last = body.len() - 1;
        body[last] = b'!';
        assert!(matches!(
            NodeMetadata::decode(&body),
            Err(MetadataError::Malformed(_))
        ));
        let mut foreign = sample(1);
        foreign.node = node(8);
        assert!(matches!(
            NodeMetadata::decode(&foreign.encode()),
            Err(MetadataError::ForeignRegion { .. })
        ));
        // A handle narrowed to part of its region travels with a scope; a
        // node publishes whole regions, so such a blob was edited.
        let mut scoped = sample(1);
        for handle in scoped.regions.values_mut() {
            *handle = handle.slice(0..handle.len() / 2).unwrap();
        }
        assert_eq!(
            NodeMetadata::decode(&scoped.encode()),
            Err(MetadataError::ScopedRegion {
                region: "weights/layer-0".into()
            })
        );
    }
}
