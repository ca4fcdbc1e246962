//! ferry's transfer planner: which bytes go where when two sides hold the
//! same tensors in different memory layouts.
//!
//! Inference and RL systems move tensors whose layout differs on each
//! side: a KV cache handed from prefill workers (tensor-parallel degree P)
//! to decode workers (degree D) with other block sizes, NHD against HND, K
//! and V interleaved or apart, a region per layer or one for all; weights
//! resharded from a trainer (split by rows) to an inference engine (split
//! by columns, pipeline stages). Connectors usually spell out, per request,
//! which bytes of which remote rank land where, 10^5 to 10^6 descriptors at
//! a time. This crate compiles both sides' layouts into a [`Plan`] once;
//! each request then gives only block tables, and [`Plan::expand`] appends
//! descriptor arrays in O(descriptors), merging runs that continue on both
//! sides.
//!
//! It is the pure part of that work, like `quinn-proto` for QUIC: plain
//! data in ([`RankLayout`], serde), [`ferry_core::Descs`] out; no I/O, no
//! async, no `unsafe`. The `ferry` facade turns the output into transfer
//! requests.
//!
//! The model:
//! - a [`Tensor`] is the logical tensor both sides agree on (name, element
//!   size, named axes with global sizes);
//! - a [`TensorLayout`] is one rank's piece of it: per axis a [`Part`]
//!   (whole, equal split, range), whether other ranks hold the same piece
//!   (`replicated`), and where it lies: region, offset and byte strides in
//!   logical axis order, optionally a [`RegionMap`] (an axis whose indices
//!   lie in regions of their own) and a [`Paged`] axis (stored in physical
//!   blocks found through a per-request block table);
//! - a [`RankLayout`] lists one rank's regions (by length) and pieces; a
//!   side is a slice of them.
//!
//! [`plan`] validates both sides ([`LayoutError`]), intersects each local
//! piece with the remote pieces, picks one source per byte among replicas
//! (or, pushing, serves every replica), and keeps each intersection as a
//! short loop nest of strides: its size is O(pieces × dims), never
//! O(blocks). [`NixlShape`] gives the same plan in the shape NIXL's
//! prepared descriptor lists take.
//!
//! A decode rank of tensor-parallel degree 2 reading a KV cache from
//! prefill ranks of degree 4, compiled once, expanded per request:
//!
//! ```
//! use ferry_layout::{
//!     Expansion, KvCache, KvPlacement, LayerPlacement, PlanOptions, TableRequest, TokenOrder,
//!     plan,
//! };
//!
//! let cache = KvCache {
//!     layers: 2,
//!     heads: 8,
//!     head_dim: 128,
//!     elem_size: 2,
//!     tokens: 4096,
//!     block_tokens: 16,
//!     blocks: 1024,
//!     order: TokenOrder::Hnd,
//!     kv: KvPlacement::Separate,
//!     layer_regions: LayerPlacement::RegionPerLayer,
//!     table: "kv".into(),
//! };
//! let prefill = (0..4).map(|r| cache.rank(r, 4)).collect::<Result<Vec<_>, _>>()?;
//! let plan = plan(&cache.rank(0, 2)?, &prefill, PlanOptions::default())?;
//!
//! // Per request: the tokens and both sides' block tables.
//! let (local, remote): (Vec<u64>, Vec<u64>) = ((0..8).collect(), (100..108).collect());
//! let request = TableRequest { table: "kv", range: 0..128, local: &local, remote: &remote };
//! let mut out = Expansion::new();
//! plan.expand(&[request], &mut out)?;
//! // Layers × K and V × blocks × source ranks (prefill ranks 0 and 1).
//! assert_eq!(out.len(), 2 * 2 * 8 * 2);
//! assert_eq!(out.ranks().iter().map(|g| g.rank).collect::<Vec<_>>(), [0, 1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod error;
mod expand;
mod fingerprint;
mod helpers;
mod layout;
mod nest;
mod nixl;
mod order;
mod plan;
mod validate;

pub use error::{LayoutError, RequestError, Side};
pub use expand::{Expansion, RankDescs, TableRequest};
pub use fingerprint::side_fingerprint;
pub use helpers::{KvCache, KvPlacement, LayerPlacement, TokenOrder, tp_part};
pub use layout::{Axis, Paged, Part, Place, RankLayout, RegionMap, Tensor, TensorLayout};
pub use nixl::{NixlIndices, NixlShape};
pub use order::{WalkError, walk_box};
pub use plan::{Direction, Plan, PlanOptions, RemoteRegion, plan};
