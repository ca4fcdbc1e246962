//! End-to-end checksums of an update, asked for by the subscriber
//! ([`super::Subscriber::verify_checksums`]): per tensor, for each box of
//! elements a source and the subscriber both hold, XXH3-64 over the box's
//! bytes in the tensor's logical (row-major) order. Both sides hash the
//! same elements in the same order whatever their layouts, so the sums
//! agree exactly when the subscriber holds the bytes the source held
//! under the subscriber's lease.
//!
//! Computed when asked, not at publish time: a publisher does not know
//! which boxes its subscribers hold (each may shard differently), and a
//! subscriber that does not ask costs the publisher nothing. One that
//! asks costs the source a second read of what it served.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use ferry_layout::{RankLayout, walk_box};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use super::Answer;
use super::leases::Shared;
use crate::LocalLayout;

/// The most boxes one ask may name: a layout holds a few thousand tensors
/// at most, and a subscriber asks for one box per tensor it shares.
const MAX_BOXES: usize = 1 << 16;

/// A box of one tensor's elements: global index ranges, one per axis.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(super) struct TensorBox {
    pub tensor: String,
    pub bounds: Vec<Range<u64>>,
}

/// The boxes `local` (the subscriber's buffer) and `source` (a publisher
/// rank's, or a relay buffer's, layout) both hold: per tensor of both, the
/// intersection of their pieces where it is not empty.
pub(super) fn shared_boxes(local: &RankLayout, source: &RankLayout) -> Vec<TensorBox> {
    let mut boxes = Vec::new();
    for mine in &local.tensors {
        let Some(theirs) = source.tensor(&mine.tensor.name) else {
            continue;
        };
        let bounds: Option<Vec<Range<u64>>> = (0..mine.tensor.axes.len())
            .map(|axis| {
                let (a, b) = (mine.range(axis)?, theirs.range(axis)?);
                let both = a.start.max(b.start)..a.end.min(b.end);
                (both.start < both.end).then_some(both)
            })
            .collect();
        if let Some(bounds) = bounds {
            boxes.push(TensorBox {
                tensor: mine.tensor.name.clone(),
                bounds,
            });
        }
    }
    boxes
}

/// A source's memory (a publisher rank's, a relay buffer's) as checksums
/// are served from it, with the sums of its current version computed so
/// far: subscribers that shard alike ask for the same boxes, and each box
/// is hashed once per version, not once per subscriber.
pub(super) struct Served {
    memory: LocalLayout,
    /// The version the sums are of, and each box's sum.
    cache: Mutex<(u64, HashMap<TensorBox, u64>)>,
    /// Held while boxes are hashed: subscribers updating together ask at
    /// once, and the later ones wait for the sums the first one computes
    /// rather than hash the same bytes beside it.
    hashing: tokio::sync::Mutex<()>,
}

impl Served {
    pub(super) fn new(memory: LocalLayout) -> Served {
        Served {
            memory,
            cache: Mutex::new((0, HashMap::new())),
            hashing: tokio::sync::Mutex::new(()),
        }
    }

    /// The answer to a checksums ask for `lease`: the sums of `boxes` over
    /// the memory (those not known yet hashed on a blocking thread) while
    /// `shared` holds the lease intact; refused, as a lease is, when it
    /// does not. Versions only grow, and a version is never written while
    /// a lease on it is intact, so sums cached for a version stay true of
    /// it (a writer that overruns a lease meanwhile fails its reader
    /// `Overwritten` whatever the sums say).
    pub(super) async fn answer(
        self: &Arc<Self>,
        shared: &Shared,
        lease: u64,
        boxes: Vec<TensorBox>,
    ) -> Result<Answer, String> {
        if boxes.len() > MAX_BOXES {
            return Err(format!("{} boxes asked; at most {MAX_BOXES}", boxes.len()));
        }
        let Some(version) = shared.holds(lease) else {
            let refused = super::Ask::Checksums {
                lease,
                boxes: Vec::new(),
            };
            return Ok(shared.answer(refused).0);
        };
        let known = |cache: &mut (u64, HashMap<TensorBox, u64>)| {
            if cache.0 != version {
                *cache = (version, HashMap::new());
            }
            boxes
                .iter()
                .map(|b| cache.1.get(b).copied())
                .collect::<Vec<_>>()
        };
        let _hashing = self.hashing.lock().await;
        let mut sums = known(&mut self.lock());
        let missing: Vec<TensorBox> = (boxes.iter().zip(&sums))
            .filter(|(_, sum)| sum.is_none())
            .map(|(b, _)| b.clone())
            .collect();
        if !missing.is_empty() {
            let served = self.clone();
            let hashed = tokio::task::spawn_blocking(move || checksums(&served.memory, &missing))
                .await
                .map_err(|e| format!("the checksum thread failed: {e}"))??;
            let mut fresh = hashed.into_iter();
            let mut cache = self.lock();
            // Bounded: a version's boxes are one per tensor per way of
            // sharding it; past this, someone asks for arbitrary boxes.
            if cache.1.len() > MAX_BOXES {
                cache.1.clear();
            }
            for (sum, b) in sums.iter_mut().zip(&boxes).filter(|(s, _)| s.is_none()) {
                let value = fresh.next().expect("one sum per missing box");
                *sum = Some(value);
                if cache.0 == version {
                    cache.1.insert(b.clone(), value);
                }
            }
        }
        Ok(Answer::Checksums {
            sums: sums.into_iter().map(|s| s.expect("filled")).collect(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, HashMap<TensorBox, u64>)> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Bytes staged per hash update: runs are copied out of the memory first
/// (a peer's copy may write it; no reference to it is ever formed), and
/// short runs (a transposed layout's single elements) hash in batches.
const STAGE: usize = 64 << 10;

/// Each box's checksum over `memory`'s bytes; an error names the first
/// box that cannot be read (a tensor `memory` does not hold, a box outside
/// its piece, a paged tensor). Reads the memory: run it where blocking is
/// allowed.
pub(super) fn checksums(memory: &LocalLayout, boxes: &[TensorBox]) -> Result<Vec<u64>, String> {
    let layout = memory.layout();
    let regions = memory.regions();
    let mut stage: Vec<u8> = Vec::with_capacity(STAGE);
    boxes
        .iter()
        .map(|b| {
            let tensor = layout
                .tensor(&b.tensor)
                .ok_or_else(|| format!("no tensor {:?} here", b.tensor))?;
            let mut hasher = Xxh3::new();
            let mut outside = None;
            walk_box(tensor, &b.bounds, |region, offset, len| {
                let block = regions.get(region as usize).map(|r| r.memory());
                let fits = block
                    .is_some_and(|m| offset.checked_add(len).is_some_and(|end| end <= m.len()));
                let (Some(block), true) = (block, fits) else {
                    outside.get_or_insert((region, offset, len));
                    return;
                };
                let mut at = offset as usize;
                let mut left = len as usize;
                while left > 0 {
                    let take = left.min(STAGE - stage.len());
                    let from = stage.len();
                    // SAFETY: `at..at + take` lies in the block (checked
                    // above), which `memory` keeps registered; the bytes
                    // are copied, as a transport's copy reads them, into
                    // spare capacity of `stage`, then made its length.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            block.as_ptr().add(at),
                            stage.as_mut_ptr().add(from),
                            take,
                        );
                        stage.set_len(from + take);
                    }
                    if stage.len() == STAGE {
                        hasher.update(&stage);
                        stage.clear();
                    }
                    at += take;
                    left -= take;
                }
            })
            .map_err(|e| format!("tensor {:?}: {e}", b.tensor))?;
            if let Some((region, offset, len)) = outside {
                return Err(format!(
                    "tensor {:?}: {len} bytes at {offset} lie outside region {region}",
                    b.tensor
                ));
            }
            hasher.update(&stage);
            stage.clear();
            Ok(hasher.digest())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_layout::{Part, Tensor, TensorLayout};

    fn rank(rank: u32, parts: Vec<Part>) -> RankLayout {
        RankLayout {
            rank,
            region_lens: vec![1 << 10],
            tensors: vec![TensorLayout {
                tensor: Tensor::new("w", 4, &[("row", 8), ("col", 8)]),
                parts,
                replicated: false,
                region: 0,
                offset: 0,
                strides: vec![32, 4],
                region_map: None,
                paged: None,
            }],
        }
    }

    #[test]
    fn boxes_are_the_pieces_intersections() {
        let split = |parts, index| Part::Split { parts, index };
        let rows = rank(0, vec![split(2, 1), Part::Full]);
        let cols = rank(1, vec![Part::Full, split(4, 2)]);
        assert_eq!(
            shared_boxes(&rows, &cols),
            [TensorBox {
                tensor: "w".into(),
                bounds: vec![4..8, 4..6]
            }]
        );
        let top = rank(2, vec![split(2, 0), Part::Full]);
        assert!(shared_boxes(&rows, &top).is_empty());
    }
}
