//! Descriptor lists: the way KV-cache connectors name memory. A region is
//! registered once, then cut into many small blocks (one layer's K or V for
//! 16 tokens, say); a request moves blocks `i` of one side to blocks `j` of
//! the other, thousands at a time. Cloning a handle per block and checking
//! it again per request is what made such requests slow elsewhere, so a
//! list is checked once, when it is made, and keeps its descriptors as
//! plain arrays (struct of arrays, three words each), or as four numbers
//! when the blocks are evenly spaced (strided), which also crosses the wire
//! in a few bytes however many blocks it names.
//!
//! A request is built from two lists and two index sequences
//! ([`ops_between`]); indices are checked at build time and nothing moves
//! when one is out of range.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{LocalSlice, OpError, Region, RemoteBuffer};

/// One descriptor: `len` bytes at `offset` in region `region` of its list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Index of the region in its list's region table.
    pub region: u32,
    /// Byte offset into that region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// How a list stores its descriptors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Layout {
    /// Any descriptors, as three parallel arrays.
    Explicit {
        region: Vec<u32>,
        offset: Vec<u64>,
        len: Vec<u64>,
    },
    /// `count` blocks of `len` bytes in region `region`, the first at
    /// `base`, each `stride` bytes after the one before.
    Strided {
        region: u32,
        base: u64,
        stride: u64,
        len: u64,
        count: u32,
    },
}

/// Descriptors, without the regions they point into: see the module docs.
/// Build them with [`Descs::push`], [`Descs::from_triples`] or
/// [`Descs::strided`], then bind them to regions in a [`LocalDescList`] or
/// [`RemoteDescList`], which checks every one.
///
/// Deserializing refuses explicit arrays of different lengths: every
/// accessor may then index the three in step.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Layout")]
pub struct Descs(Layout);

impl Serialize for Descs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl TryFrom<Layout> for Descs {
    type Error = String;

    fn try_from(layout: Layout) -> Result<Self, String> {
        if let Layout::Explicit {
            region,
            offset,
            len,
        } = &layout
            && (offset.len() != region.len() || len.len() != region.len())
        {
            return Err(format!(
                "descriptor arrays of different lengths: {} regions, {} offsets, {} lengths",
                region.len(),
                offset.len(),
                len.len()
            ));
        }
        Ok(Descs(layout))
    }
}

impl Drop for Descs {
    fn drop(&mut self) {
        if let Layout::Explicit {
            region,
            offset,
            len,
        } = &mut self.0
        {
            spare::give(spare::Arrays {
                region: std::mem::take(region),
                offset: std::mem::take(offset),
                len: std::mem::take(len),
            });
        }
    }
}

impl Default for Descs {
    fn default() -> Self {
        Self::new()
    }
}

impl Descs {
    /// No descriptors yet.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// Room for `n` descriptors before the arrays grow.
    pub fn with_capacity(n: usize) -> Self {
        let spare::Arrays {
            region,
            offset,
            len,
        } = spare::take(n);
        Descs(Layout::Explicit {
            region,
            offset,
            len,
        })
    }

    /// `count` blocks of `len` bytes in region `region`, at `base`,
    /// `base + stride`, ...: O(1) in memory and on the wire however large
    /// `count` is. Blocks may overlap (`stride < len`); bounds are checked
    /// when the list is bound to its regions.
    pub fn strided(region: u32, base: u64, stride: u64, len: u64, count: u32) -> Self {
        Descs(Layout::Strided {
            region,
            base,
            stride,
            len,
            count,
        })
    }

    /// Descriptors from `(region, offset, len)` rows, e.g. an N×3 integer
    /// array made with numpy. A region index over `u32::MAX` is
    /// [`DescError::NoSuchRegion`].
    pub fn from_triples(rows: &[[u64; 3]]) -> Result<Self, DescError> {
        let mut descs = Self::with_capacity(rows.len());
        for (index, &[region, offset, len]) in rows.iter().enumerate() {
            let region = u32::try_from(region).map_err(|_| DescError::NoSuchRegion {
                index,
                region,
                regions: 0,
            })?;
            descs.push(region, offset, len);
        }
        Ok(descs)
    }

    /// Appends a descriptor. On a strided list this first spells its
    /// descriptors out (it stops being O(1)).
    pub fn push(&mut self, region: u32, offset: u64, len: u64) {
        if let Layout::Strided { .. } = self.0 {
            let mut explicit = Self::with_capacity(self.len() + 1);
            for desc in self.iter() {
                explicit.push(desc.region, desc.offset, desc.len);
            }
            *self = explicit;
        }
        let Layout::Explicit {
            region: regions,
            offset: offsets,
            len: lens,
        } = &mut self.0
        else {
            unreachable!("made explicit above")
        };
        // Full and large: into arrays twice the size, kept ones where
        // there are (see `spare`), the old ones kept in turn.
        if regions.len() >= spare::MIN / 2 && regions.len() == regions.capacity() {
            let mut larger = spare::take(2 * regions.len());
            larger.region.append(regions);
            larger.offset.append(offsets);
            larger.len.append(lens);
            spare::give(spare::Arrays {
                region: std::mem::replace(regions, larger.region),
                offset: std::mem::replace(offsets, larger.offset),
                len: std::mem::replace(lens, larger.len),
            });
        }
        regions.push(region);
        offsets.push(offset);
        lens.push(len);
    }

    /// How many descriptors.
    pub fn len(&self) -> usize {
        match &self.0 {
            Layout::Explicit { region, .. } => region.len(),
            Layout::Strided { count, .. } => *count as usize,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the list is in the O(1) strided form.
    pub fn is_strided(&self) -> bool {
        matches!(self.0, Layout::Strided { .. })
    }

    /// Descriptor `i`, if there is one. A strided descriptor whose offset
    /// would overflow `u64` reads as `u64::MAX` there, which no region
    /// holds: binding the list refuses it.
    pub fn get(&self, i: usize) -> Option<Desc> {
        match &self.0 {
            Layout::Explicit {
                region,
                offset,
                len,
            } => Some(Desc {
                region: *region.get(i)?,
                offset: offset[i],
                len: len[i],
            }),
            &Layout::Strided {
                region,
                base,
                stride,
                len,
                count,
            } => (i < count as usize).then(|| Desc {
                region,
                offset: stride
                    .checked_mul(i as u64)
                    .and_then(|o| o.checked_add(base))
                    .unwrap_or(u64::MAX),
                len,
            }),
        }
    }

    /// For each of `regions` regions, the byte range its descriptors span
    /// (from the lowest offset to the highest end), or `None` if none
    /// names it. One pass; O(1) for a strided list.
    pub fn spans(&self, regions: usize) -> Vec<Option<Range<u64>>> {
        let mut spans: Vec<Option<Range<u64>>> = vec![None; regions];
        let mut widen = |desc: Desc| {
            let Some(span) = spans.get_mut(desc.region as usize) else {
                return;
            };
            let end = desc.offset.saturating_add(desc.len);
            match span {
                Some(span) => {
                    span.start = span.start.min(desc.offset);
                    span.end = span.end.max(end);
                }
                None => *span = Some(desc.offset..end),
            }
        };
        match &self.0 {
            Layout::Strided { count: 0, .. } => {}
            &Layout::Strided { count, .. } => {
                // The first and the last block bound every other one.
                widen(self.get(0).expect("count > 0"));
                widen(self.get(count as usize - 1).expect("last < count"));
            }
            Layout::Explicit { .. } => self.iter().for_each(widen),
        }
        spans
    }

    /// Every descriptor, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Desc> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("i < len"))
    }

    /// Checks every descriptor against the byte lengths of the list's
    /// `regions` (`len_of(i)` for region `i`): the first that names no
    /// region or leaves its region is the error, with its index.
    fn check(&self, regions: usize, len_of: impl Fn(usize) -> u64) -> Result<(), DescError> {
        let bad = |index: usize, desc: Desc| -> Option<DescError> {
            if desc.region as usize >= regions {
                return Some(DescError::NoSuchRegion {
                    index,
                    region: u64::from(desc.region),
                    regions,
                });
            }
            let bound = len_of(desc.region as usize);
            let outside = desc
                .offset
                .checked_add(desc.len)
                .is_none_or(|end| end > bound);
            outside.then_some(DescError::Descriptor {
                index,
                error: OpError::OutOfBounds {
                    offset: desc.offset,
                    len: desc.len,
                    bound,
                },
            })
        };
        match &self.0 {
            // The last block is the farthest: one check covers them all,
            // so a strided list of any size is checked in O(1).
            Layout::Strided { count: 0, .. } => Ok(()),
            Layout::Strided { count, .. } => {
                let last = *count as usize - 1;
                match bad(0, self.get(0).expect("count > 0")) {
                    Some(error) => Err(error),
                    None => bad(last, self.get(last).expect("last < count")).map_or(Ok(()), Err),
                }
            }
            // A list of more descriptors than regions (a request's tens of
            // thousands) looks each region's bound up once, not per
            // descriptor: 3.5 ns a descriptor went to about 1 (a plan's
            // request of 32,768 pairs is checked on both sides).
            Layout::Explicit {
                region,
                offset,
                len,
            } if region.len() > regions => {
                let bounds: Vec<u64> = (0..regions).map(&len_of).collect();
                let within = |(r, (o, l)): (&u32, (&u64, &u64))| {
                    (bounds.get(*r as usize))
                        .is_some_and(|b| o.checked_add(*l).is_some_and(|e| e <= *b))
                };
                let mut descs = region.iter().zip(offset.iter().zip(len));
                match descs.position(|d| !within(d)) {
                    None => Ok(()),
                    Some(index) => {
                        let desc = self.get(index).expect("index < len");
                        Err(bad(index, desc).expect("found outside"))
                    }
                }
            }
            Layout::Explicit { .. } => self
                .iter()
                .enumerate()
                .find_map(|(index, desc)| bad(index, desc))
                .map_or(Ok(()), Err),
        }
    }

    /// The lengths of the descriptors `indices` names, as one slice: when
    /// the list is explicit and `indices` a range inside it (`None`
    /// otherwise). Lets a request's checks compare whole arrays.
    pub fn lens_in(&self, indices: &impl DescIndices) -> Option<&[u64]> {
        let Layout::Explicit { len, .. } = &self.0 else {
            return None;
        };
        len.get(indices.as_range()?)
    }
}

/// Why a descriptor list or a request built from lists was refused. Each
/// names the position it is about, so a caller can find the bad entry in
/// the arrays it passed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescError {
    /// Descriptor `index` names a region the list does not have.
    #[error("descriptor {index} names region {region}, but the list has {regions} regions")]
    NoSuchRegion {
        /// The descriptor's index.
        index: usize,
        /// The region index it names.
        region: u64,
        /// Regions in the list.
        regions: usize,
    },
    /// Descriptor `index` is not usable: it leaves its region, or (in a
    /// request) its two sides differ in length.
    #[error("descriptor {index}: {error}")]
    Descriptor {
        /// The descriptor's index (in a request: the position in the index
        /// arrays).
        index: usize,
        /// What is wrong with it.
        error: OpError,
    },
    /// A region handle of a remote list is unusable (its range wraps the
    /// address space: forged or corrupt).
    #[error("region {region} of the list: {error}")]
    Region {
        /// The region's index in the list.
        region: usize,
        /// What is wrong with it.
        error: OpError,
    },
    /// Position `position` of a request's index array names descriptor
    /// `index` of a list of `len`.
    #[error("index {index} at position {position} is out of range for a list of {len}")]
    IndexOutOfRange {
        /// Position in the index array.
        position: usize,
        /// The index found there.
        index: u64,
        /// Descriptors in the list.
        len: usize,
    },
    /// The two index arrays of a request differ in length.
    #[error("{local} local indices but {remote} remote ones")]
    CountMismatch {
        /// Local indices.
        local: usize,
        /// Remote indices.
        remote: usize,
    },
}

/// Descriptors into this node's regions, checked once when made. Cheap to
/// clone (shared): every request built from it refers to the one list.
#[derive(Clone, Debug)]
pub struct LocalDescList {
    regions: Arc<[Region]>,
    descs: Arc<Descs>,
}

impl LocalDescList {
    /// Binds `descs` to `regions` (descriptor region `i` is `regions[i]`),
    /// checking every descriptor's bounds.
    pub fn new(regions: Vec<Region>, descs: Descs) -> Result<Self, DescError> {
        descs.check(regions.len(), |i| regions[i].len())?;
        Ok(LocalDescList {
            regions: regions.into(),
            descs: Arc::new(descs),
        })
    }

    /// The list's descriptors.
    pub fn descs(&self) -> &Descs {
        &self.descs
    }

    /// The list's regions.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Descriptor `i` as a local slice.
    fn slice(&self, i: usize) -> Option<LocalSlice> {
        let desc = self.descs.get(i)?;
        let region = self.regions.get(desc.region as usize)?;
        // Checked when the list was made: in bounds.
        region
            .slice(desc.offset..desc.offset.checked_add(desc.len)?)
            .ok()
    }
}

/// Descriptors into a peer's regions, checked once when made; serializable
/// (a strided list in a few hundred bytes, its handles included, however
/// many blocks it names).
///
/// A list arrives from another process, so it is untrusted: deserializing
/// checks it exactly as [`RemoteDescList::new`] does, and a list whose
/// descriptors leave their handles (a `count` raised, an offset moved) is
/// refused with the [`DescError`] in the message, never accepted to fail
/// later.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RemoteDescFields")]
pub struct RemoteDescList {
    /// Shared: lists over the same regions with other descriptors
    /// ([`RemoteDescList::with_descs`]) are made per request.
    regions: Arc<[RemoteBuffer]>,
    descs: Descs,
}

/// A [`RemoteDescList`] as deserialized, before its checks.
#[derive(Deserialize)]
struct RemoteDescFields {
    regions: Vec<RemoteBuffer>,
    descs: Descs,
}

/// A [`RemoteDescList`] as serialized: the fields [`RemoteDescFields`]
/// reads back, under the list's own name.
#[derive(Serialize)]
#[serde(rename = "RemoteDescList")]
struct RemoteDescFieldsRef<'a> {
    regions: &'a [RemoteBuffer],
    descs: &'a Descs,
}

impl Serialize for RemoteDescList {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RemoteDescFieldsRef {
            regions: &self.regions,
            descs: &self.descs,
        }
        .serialize(serializer)
    }
}

impl TryFrom<RemoteDescFields> for RemoteDescList {
    type Error = DescError;

    fn try_from(fields: RemoteDescFields) -> Result<Self, DescError> {
        RemoteDescList::new(fields.regions, fields.descs)
    }
}

impl RemoteDescList {
    /// Binds `descs` to `regions` (descriptor region `i` is `regions[i]`),
    /// checking every descriptor's bounds against its handle. The owner
    /// still checks every op against the region as registered.
    pub fn new(regions: Vec<RemoteBuffer>, descs: Descs) -> Result<Self, DescError> {
        for (region, handle) in regions.iter().enumerate() {
            handle
                .check_address_range()
                .map_err(|error| DescError::Region { region, error })?;
        }
        descs.check(regions.len(), |i| regions[i].len())?;
        Ok(RemoteDescList {
            regions: regions.into(),
            descs,
        })
    }

    /// The same regions (shared, not copied) with other descriptors,
    /// checked as [`RemoteDescList::new`] checks them.
    pub fn with_descs(&self, descs: Descs) -> Result<Self, DescError> {
        descs.check(self.regions.len(), |i| self.regions[i].len())?;
        Ok(RemoteDescList {
            regions: self.regions.clone(),
            descs,
        })
    }

    /// The list's descriptors.
    pub fn descs(&self) -> &Descs {
        &self.descs
    }

    /// The list's region handles.
    pub fn regions(&self) -> &[RemoteBuffer] {
        &self.regions
    }

    /// Descriptor `i` as a handle to its bytes.
    fn slice(&self, i: usize) -> Option<RemoteBuffer> {
        let desc = self.descs.get(i)?;
        let handle = self.regions.get(desc.region as usize)?;
        handle
            .slice(desc.offset..desc.offset.checked_add(desc.len)?)
            .ok()
    }
}

mod pairs;
mod spare;

pub use pairs::{DescIndices, Indices, check_pairs, op_at, ops_between};

#[cfg(test)]
mod tests;
