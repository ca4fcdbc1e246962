//! The layout vocabulary: a logical tensor both sides agree on, which
//! part of it one rank holds, and where that part lies in the rank's
//! registered regions. Plain data (serde), so a peer can publish its
//! layout once and the other side can plan against it.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// One axis of a logical tensor: its name (both sides must agree on it, so
/// that "head" on one side cannot be matched against "token" on the other)
/// and its global size in elements.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Axis {
    /// The axis's name, e.g. `"layer"`, `"token"`, `"head"`.
    pub name: String,
    /// Global size in elements, over all ranks.
    pub size: u64,
}

impl Axis {
    /// An axis named `name` of `size` elements.
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        Axis {
            name: name.into(),
            size,
        }
    }
}

/// The logical tensor, with global sizes: what both sides must describe
/// identically (name, element size, axis names and sizes in order) before
/// bytes may move between them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tensor {
    /// Identifies the tensor across ranks and sides, e.g. `"k"`.
    pub name: String,
    /// Bytes per element. Elements are never split: descriptors always
    /// move whole elements.
    pub elem_size: u32,
    /// The axes, in logical order (the order `parts` and `strides` use).
    pub axes: Vec<Axis>,
}

impl Tensor {
    /// A tensor named `name` with elements of `elem_size` bytes and the
    /// given `(name, size)` axes.
    pub fn new(name: impl Into<String>, elem_size: u32, axes: &[(&str, u64)]) -> Self {
        Tensor {
            name: name.into(),
            elem_size,
            axes: axes.iter().map(|&(n, s)| Axis::new(n, s)).collect(),
        }
    }

    /// The index of the axis named `name`.
    pub fn axis(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|a| a.name == name)
    }
}

/// Which contiguous part of one axis a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Part {
    /// The whole axis.
    Full,
    /// The `index`-th of `parts` equal contiguous parts (tensor-parallel
    /// sharding); `parts` must divide the axis size.
    Split {
        /// How many equal parts the axis is cut into.
        parts: u64,
        /// Which of them this rank holds.
        index: u64,
    },
    /// `len` elements from `start`: uneven splits such as pipeline stages.
    Range {
        /// First index held.
        start: u64,
        /// Elements held.
        len: u64,
    },
}

impl Part {
    /// The global index range this part covers of an axis of `size`, or
    /// `None` when it does not fit (checked with a typed error during
    /// validation).
    pub fn range(&self, size: u64) -> Option<Range<u64>> {
        match *self {
            Part::Full => Some(0..size),
            Part::Split { parts, index } => {
                if parts == 0 || index >= parts || !size.is_multiple_of(parts) {
                    return None;
                }
                let len = size / parts;
                Some(index * len..index * len + len)
            }
            Part::Range { start, len } => {
                let end = start.checked_add(len)?;
                (len > 0 && end <= size).then_some(start..end)
            }
        }
    }
}

/// Where one index of a region-mapped axis lies: the element of the piece
/// with that index and all other rank-local indices 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Place {
    /// Index into the rank's region table.
    pub region: u32,
    /// Byte offset in that region.
    pub offset: u64,
}

/// An axis whose indices lie in places of their own instead of at
/// `offset + i * stride`: frameworks that register one region per layer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionMap {
    /// The mapped axis (logical index). Its stride is not used.
    pub axis: u32,
    /// One place per rank-local index of that axis.
    pub places: Vec<Place>,
}

/// An axis stored in a pool of fixed-size physical blocks found through a
/// per-request block table (paged attention's KV cache, Mamba state
/// slots): logical index `t` lies in physical block `table[t / block]`, at
/// in-block position `t % block`, whose stride is the axis's stride.
///
/// The paged axis must be held whole (e.g. [`Part::Full`]) on both sides, and
/// both sides must page the same axis through the same table name: one
/// request range then means the same elements on both.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Paged {
    /// The paged axis (logical index).
    pub axis: u32,
    /// Elements of that axis per block (block size in tokens; 1 for state
    /// slots). All `block` slots of every physical block must lie in the
    /// region, even when the axis is shorter than a block.
    pub block: u64,
    /// Bytes between the starts of consecutive physical blocks.
    pub block_stride: u64,
    /// Physical blocks in the pool: a block id must be below this.
    pub blocks: u64,
    /// Which block table of a request applies: `"kv"`, `"state"`, ...
    pub table: String,
}

/// One rank's piece of a tensor and where it lies in memory.
///
/// The byte address of the element with rank-local indices `x` is
/// `offset + sum(x[d] * strides[d])` in region `region`, with two
/// exceptions: the region-mapped axis (if any) takes its `(region,
/// offset)` from [`RegionMap::places`], and the paged axis (if any)
/// contributes `table[x / block] * block_stride + (x % block) *
/// strides[axis]`. Strides are in logical axis order whatever the order in
/// memory, so NHD and HND, blocks-first, K and V interleaved (two tensors
/// over one region, offset by half a block) and padding are all strides
/// and offsets.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorLayout {
    /// The logical tensor (global sizes).
    pub tensor: Tensor,
    /// Per axis, which part this rank holds.
    pub parts: Vec<Part>,
    /// Other ranks may hold exactly this piece too (GQA heads when the
    /// tensor-parallel degree exceeds the KV head count; MLA's latent on
    /// every rank). Identical pieces on several ranks are an error unless
    /// all are marked.
    pub replicated: bool,
    /// Index into the rank's region table (unused with a region map).
    pub region: u32,
    /// Byte offset of the piece's element `[0, 0, ...]` (unused with a
    /// region map).
    pub offset: u64,
    /// Byte stride per axis, for the rank-local index, in logical order.
    pub strides: Vec<u64>,
    /// One axis whose indices lie in places of their own.
    #[serde(default)]
    pub region_map: Option<RegionMap>,
    /// One axis stored in physical blocks through a block table.
    #[serde(default)]
    pub paged: Option<Paged>,
}

impl TensorLayout {
    /// The global index range held along `axis`, if the part fits.
    pub fn range(&self, axis: usize) -> Option<Range<u64>> {
        let size = self.tensor.axes.get(axis)?.size;
        self.parts.get(axis)?.range(size)
    }

    /// Whether `other` describes the same logical tensor (name, element
    /// size, axis names and sizes).
    pub fn same_tensor(&self, other: &TensorLayout) -> bool {
        self.tensor == other.tensor
    }

    /// Where the element at rank-local index `x` lies, by the definition
    /// above, as `(region, byte offset)`; `table` is the paged axis's block
    /// table (logical block `i` in physical block `table[i]`). `None` when
    /// `x` has the wrong number of axes, or its block has no entry in
    /// `table`. No other check: it is the layout's meaning, element by
    /// element, for references and debugging (the planner never walks
    /// elements).
    pub fn locate(&self, x: &[u64], table: Option<&[u64]>) -> Option<(u32, u64)> {
        if x.len() != self.strides.len() {
            return None;
        }
        let mapped = self.region_map.as_ref().map(|m| m.axis as usize);
        let (region, mut offset) = match &self.region_map {
            Some(m) => {
                let place = m.places.get(*x.get(m.axis as usize)? as usize)?;
                (place.region, place.offset)
            }
            None => (self.region, self.offset),
        };
        for (d, (&i, &stride)) in x.iter().zip(&self.strides).enumerate() {
            if Some(d) == mapped {
                continue;
            }
            let step = match &self.paged {
                Some(p) if p.axis as usize == d && p.block > 0 => {
                    let block = *table?.get((i / p.block) as usize)?;
                    block
                        .checked_mul(p.block_stride)?
                        .checked_add((i % p.block).checked_mul(stride)?)?
                }
                _ => i.checked_mul(stride)?,
            };
            offset = offset.checked_add(step)?;
        }
        Some((region, offset))
    }
}

/// What one rank holds: its regions (by length; the facade knows their
/// handles) and its pieces of tensors. A side is a slice of these.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankLayout {
    /// The rank's id on its side (tensor-parallel rank, say).
    pub rank: u32,
    /// Byte length of each of the rank's registered regions; layouts name
    /// regions by index into this table.
    pub region_lens: Vec<u64>,
    /// The rank's pieces, at most one per tensor name.
    pub tensors: Vec<TensorLayout>,
}

impl RankLayout {
    /// The piece of the tensor named `name`, if this rank holds one.
    pub fn tensor(&self, name: &str) -> Option<&TensorLayout> {
        self.tensors.iter().find(|t| t.tensor.name == name)
    }
}
