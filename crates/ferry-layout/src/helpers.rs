//! Constructors for the common cases, so that callers write axis orders
//! and sizes instead of byte strides: a dense piece in a given memory
//! order, a tensor-parallel part, and a paged K/V cache.

use crate::error::LayoutError;
use crate::layout::{Paged, Part, Place, RankLayout, RegionMap, Tensor, TensorLayout};

impl TensorLayout {
    /// A dense piece: the rank-local part of `tensor` given by `parts`,
    /// laid out with axes in memory order `order` (axis names, outermost
    /// first), no padding, from byte `offset` of region `region`. Not
    /// replicated, not paged, no region map: set those fields afterwards
    /// if needed. Parts are checked when planning; a part that does not
    /// fit its axis counts as one element here.
    pub fn contiguous(
        tensor: Tensor,
        parts: Vec<Part>,
        order: &[&str],
        region: u32,
        offset: u64,
    ) -> Result<TensorLayout, LayoutError> {
        let dims = tensor.axes.len();
        let positions: Vec<Option<usize>> = order.iter().map(|name| tensor.axis(name)).collect();
        let mut seen = vec![false; dims];
        let permutation = order.len() == dims
            && positions
                .iter()
                .all(|p| p.is_some_and(|p| !std::mem::replace(&mut seen[p], true)));
        if !permutation || parts.len() != dims {
            return Err(LayoutError::BadAxisOrder {
                tensor: tensor.name.clone(),
                order: order.iter().map(|s| (*s).to_owned()).collect(),
            });
        }
        let mut strides = vec![0; dims];
        let mut stride = u64::from(tensor.elem_size);
        for &axis in positions.iter().rev().flatten() {
            strides[axis] = stride;
            let len = parts[axis]
                .range(tensor.axes[axis].size)
                .map_or(1, |r| r.end - r.start);
            stride = stride.saturating_mul(len);
        }
        Ok(TensorLayout {
            tensor,
            parts,
            replicated: false,
            region,
            offset,
            strides,
            region_map: None,
            paged: None,
        })
    }
}

impl TensorLayout {
    /// This dense piece (as [`TensorLayout::contiguous`] makes it) turned
    /// into a pool of `blocks` physical blocks, each holding `block`
    /// elements of axis `axis` and everything else of the piece, in the
    /// same memory order, blocks outermost; paged through table `table`.
    /// Mamba state slots are `block` 1.
    pub fn paged_by(
        mut self,
        axis: &str,
        block: u64,
        blocks: u64,
        table: &str,
    ) -> Result<TensorLayout, LayoutError> {
        let Some(paged) = self.tensor.axis(axis) else {
            return Err(LayoutError::BadAxisOrder {
                tensor: self.tensor.name.clone(),
                order: vec![axis.to_owned()],
            });
        };
        let mut order: Vec<usize> = (0..self.strides.len()).collect();
        order.sort_by(|&a, &b| self.strides[b].cmp(&self.strides[a]));
        let mut stride = u64::from(self.tensor.elem_size);
        for &d in order.iter().rev() {
            self.strides[d] = stride;
            let len = if d == paged {
                block
            } else {
                self.range(d).map_or(1, |r| r.end - r.start)
            };
            stride = stride.saturating_mul(len);
        }
        self.paged = Some(Paged {
            axis: paged as u32,
            block,
            block_stride: stride,
            blocks,
            table: table.to_owned(),
        });
        Ok(self)
    }
}

/// Rank `rank`'s part of an axis of `size` shared by `tp` ranks, and
/// whether it is replicated: an equal split when `tp` divides `size`, else
/// (more ranks than elements, e.g. 8 ranks over 2 KV heads) each element
/// held by `tp / size` consecutive ranks.
pub fn tp_part(size: u64, tp: u64, rank: u64) -> Result<(Part, bool), LayoutError> {
    if tp == 0 || size == 0 || rank >= tp {
        return Err(LayoutError::BadTp { size, tp });
    }
    if size.is_multiple_of(tp) {
        Ok((
            Part::Split {
                parts: tp,
                index: rank,
            },
            false,
        ))
    } else if tp.is_multiple_of(size) {
        Ok((
            Part::Split {
                parts: size,
                index: rank / (tp / size),
            },
            true,
        ))
    } else {
        Err(LayoutError::BadTp { size, tp })
    }
}

/// Order of a K or V block's axes in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenOrder {
    /// Tokens, then heads, then head_dim (`[block_tokens, heads, dim]`).
    Nhd,
    /// Heads, then tokens, then head_dim (`[heads, block_tokens, dim]`).
    Hnd,
}

/// Where K and V lie relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPlacement {
    /// Two pools: K blocks in one region (or region per layer), V blocks
    /// in another.
    Separate,
    /// One pool whose blocks hold K's block and then V's.
    Interleaved,
}

/// Where the layers lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerPlacement {
    /// A region per layer (a region map on the layer axis).
    RegionPerLayer,
    /// All layers in one region, layer-major.
    OneRegion,
}

/// A paged K/V cache of one model, as one engine lays it out: two logical
/// tensors `"k"` and `"v"` with axes `layer`, `token`, `head`, `dim`,
/// paged on `token` through one table. [`KvCache::rank`] gives each
/// tensor-parallel rank's layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCache {
    /// Layers.
    pub layers: u64,
    /// KV heads, over all ranks.
    pub heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Bytes per element.
    pub elem_size: u32,
    /// The token axis's logical size: the longest sequence a request can
    /// name.
    pub tokens: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Physical blocks in the pool.
    pub blocks: u64,
    /// Axis order inside a block.
    pub order: TokenOrder,
    /// K and V apart or interleaved per block.
    pub kv: KvPlacement,
    /// A region per layer or one for all.
    pub layer_regions: LayerPlacement,
    /// The block table's name.
    pub table: String,
}

impl KvCache {
    /// The logical tensor named `name` (`"k"` or `"v"`).
    pub fn tensor(&self, name: &str) -> Tensor {
        Tensor::new(
            name,
            self.elem_size,
            &[
                ("layer", self.layers),
                ("token", self.tokens),
                ("head", self.heads),
                ("dim", self.head_dim),
            ],
        )
    }

    /// Rank `rank`'s layout among `tp` tensor-parallel ranks sharing the
    /// heads ([`tp_part`]); regions numbered as described on
    /// [`KvPlacement`] and [`LayerPlacement`]: K's before V's when
    /// separate.
    pub fn rank(&self, rank: u32, tp: u64) -> Result<RankLayout, LayoutError> {
        let (heads_part, replicated) = tp_part(self.heads, tp, u64::from(rank))?;
        let local_heads = match heads_part {
            Part::Split { parts, .. } => self.heads / parts,
            _ => self.heads,
        };
        let e = u64::from(self.elem_size);
        // Saturating: absurd sizes become layouts that validation refuses
        // (out of region), never an overflow here.
        let mul = |factors: &[u64]| factors.iter().fold(1u64, |p, &f| p.saturating_mul(f));
        let (token, head) = match self.order {
            TokenOrder::Nhd => (
                mul(&[local_heads, self.head_dim, e]),
                mul(&[self.head_dim, e]),
            ),
            TokenOrder::Hnd => (
                mul(&[self.head_dim, e]),
                mul(&[self.block_tokens, self.head_dim, e]),
            ),
        };
        // Bytes of one K (or V) block.
        let block = mul(&[self.block_tokens, local_heads, self.head_dim, e]);
        let (block_stride, v_shift, pools) = match self.kv {
            KvPlacement::Separate => (block, 0, 2),
            KvPlacement::Interleaved => (mul(&[2, block]), block, 1),
        };
        // Bytes of one layer's pool (K and V together when interleaved).
        let pool = mul(&[self.blocks, block_stride]);
        let layers = self.layers;
        let piece = |name: &str, which: u64| {
            let (region, offset, layer_stride, region_map) = match self.layer_regions {
                LayerPlacement::RegionPerLayer => {
                    // V's regions follow K's when the pools are separate;
                    // interleaved, V lies in K's regions, half a block on.
                    let first = if pools == 2 { which * layers } else { 0 };
                    let places = (0..layers)
                        .map(|l| Place {
                            region: (first + l) as u32,
                            offset: v_shift * which,
                        })
                        .collect();
                    let map = RegionMap { axis: 0, places };
                    (first as u32, v_shift * which, 0, Some(map))
                }
                LayerPlacement::OneRegion => {
                    let region = if pools == 2 { which } else { 0 };
                    (region as u32, v_shift * which, pool, None)
                }
            };
            TensorLayout {
                tensor: self.tensor(name),
                parts: vec![Part::Full, Part::Full, heads_part, Part::Full],
                replicated,
                region,
                offset,
                strides: vec![layer_stride, token, head, e],
                region_map,
                paged: Some(Paged {
                    axis: 1,
                    block: self.block_tokens,
                    block_stride,
                    blocks: self.blocks,
                    table: self.table.clone(),
                }),
            }
        };
        let region_lens = match self.layer_regions {
            LayerPlacement::RegionPerLayer => vec![pool; (pools * layers) as usize],
            LayerPlacement::OneRegion => vec![mul(&[layers, pool]); pools as usize],
        };
        Ok(RankLayout {
            rank,
            region_lens,
            tensors: vec![piece("k", 0), piece("v", 1)],
        })
    }
}
