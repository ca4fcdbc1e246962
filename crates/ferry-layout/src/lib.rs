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

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod error;
mod expand;
mod fingerprint;
mod helpers;
mod layout;
mod nixl;
mod plan;
mod validate;

pub use error::{LayoutError, RequestError, Side};
pub use expand::{Expansion, RankDescs, TableRequest};
pub use fingerprint::side_fingerprint;
pub use helpers::{KvCache, KvPlacement, LayerPlacement, TokenOrder, tp_part};
pub use layout::{Axis, Paged, Part, Place, RankLayout, RegionMap, Tensor, TensorLayout};
pub use nixl::{NixlIndices, NixlShape};
pub use plan::{Direction, Plan, PlanOptions, RemoteRegion, plan};
