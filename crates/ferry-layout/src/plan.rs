//! The planner: both sides' layouts in, a compiled [`Plan`] out. A plan is
//! a list of segments, one per (local piece, remote source piece, place of
//! a region-mapped axis), each a short loop nest of byte strides on both
//! sides with an innermost contiguous run. Its size grows with pieces and
//! dimensions, never with blocks or elements: the per-request work (block
//! tables) is left to [`Plan::expand`](crate::Plan::expand).

use std::collections::BTreeSet;
use std::ops::Range;

use crate::error::{LayoutError, Side};
use crate::fingerprint::side_fingerprint;
use crate::layout::RankLayout;
use crate::nest::{coalesce, fuse_translates};
use crate::validate::{
    Piece, SideIndex, boxes_meet, check_piece_cover, check_rank, check_side, tensor_diff,
};

/// Which way the bytes go; decides who must be served, not the geometry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The local rank READs from the remote ranks: every local byte comes
    /// from exactly one remote source, replicas spread over local ranks
    /// (replica `local rank % replicas`, by ascending remote rank id).
    #[default]
    Pull,
    /// The local rank WRITEs to the remote ranks: every remote replica of
    /// a byte the local rank holds receives it. With
    /// [`PlanOptions::local_peers`], a byte several local ranks hold is
    /// written by one of them only (the one at `remote rank % replicas`).
    Push,
}

/// How to plan.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanOptions<'a> {
    /// Pull (READ) or push (WRITE).
    pub direction: Direction,
    /// Refuse remote tensors the local rank does not hold
    /// ([`LayoutError::MissingLocal`]). Off by default: a decode rank may
    /// well want only some of what a prefill rank publishes.
    pub every_remote_tensor: bool,
    /// The other ranks of the local side, for [`Direction::Push`]: lets
    /// local replicas share the writes instead of each writing every byte.
    /// Empty: every local replica writes everything it holds.
    pub local_peers: &'a [RankLayout],
    /// The remote ranks need hold only what the local rank holds, not
    /// every element of each tensor: a subscriber that pulls its shard
    /// from a relay holding the same shard, or a decode rank planning
    /// against just the prefill ranks it reads. Off by default: a remote
    /// side with a gap is then most often a rank missing
    /// ([`LayoutError::Gap`]), which is still refused here for any element
    /// the local rank holds.
    pub remote_covers_local_only: bool,
}

/// A remote region a plan touches: region `region` of remote rank `rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteRegion {
    /// The remote rank.
    pub rank: u32,
    /// Index into that rank's region table.
    pub region: u32,
}

/// One loop of a segment's nest: `count` steps of `local` bytes on the
/// local side and `remote` bytes on the remote side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Dim {
    pub count: u64,
    pub local: u64,
    pub remote: u64,
}

/// The paged axis of a segment: walked per request through block tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct PagedDim {
    /// Index into the plan's tables.
    pub table: u32,
    /// In-block stride, per side.
    pub local: u64,
    pub remote: u64,
    /// Bytes between physical blocks, per side.
    pub local_block_stride: u64,
    pub remote_block_stride: u64,
}

/// A box of elements moved between one local place and one remote place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Index into the plan's local regions.
    pub local_region: u32,
    /// Index into the plan's remote regions.
    pub remote_region: u32,
    /// Byte offset of the segment's first element (physical block 0 of a
    /// paged axis), per side.
    pub local_base: u64,
    pub remote_base: u64,
    /// Bytes of the innermost run, contiguous on both sides.
    pub run: u64,
    /// Loops outside the block walk (all loops when unpaged), outermost
    /// first, as a range of the plan's `dims`.
    pub outer: Range<u32>,
    /// Loops inside one block (paged only), outermost first.
    pub inner: Range<u32>,
    pub paged: Option<PagedDim>,
}

/// How one block table maps on both sides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Table {
    pub name: String,
    /// The paged axis's size: request ranges must stay inside it.
    pub axis_size: u64,
    /// Elements per block, per side.
    pub local_block: u64,
    pub remote_block: u64,
    /// Physical blocks in the pool, per side (the smallest pool of the
    /// tensors that share the table).
    pub local_blocks: u64,
    pub remote_blocks: u64,
}

/// A compiled transfer plan between one local rank and a remote side;
/// see the crate docs. Build with [`plan`], use with
/// [`Plan::expand`](crate::Plan::expand).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub(crate) direction: Direction,
    pub(crate) local_rank: u32,
    pub(crate) local_regions: Vec<u32>,
    pub(crate) remote_regions: Vec<RemoteRegion>,
    /// Per remote rank with work, by ascending id: its segments.
    pub(crate) ranks: Vec<(u32, Range<u32>)>,
    pub(crate) segments: Vec<Segment>,
    pub(crate) dims: Vec<Dim>,
    pub(crate) tables: Vec<Table>,
    pub(crate) local_fingerprint: u64,
    pub(crate) remote_fingerprint: u64,
    pub(crate) remote_fingerprints: Vec<(u32, u64)>,
}

impl Plan {
    /// Pull or push, as planned.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The local rank's id.
    pub fn local_rank(&self) -> u32 {
        self.local_rank
    }

    /// The local regions the plan touches, ascending; local descriptors
    /// name regions by index into this table.
    pub fn local_regions(&self) -> &[u32] {
        &self.local_regions
    }

    /// The remote regions the plan touches, by (rank, region); remote
    /// descriptors name regions by index into this table.
    pub fn remote_regions(&self) -> &[RemoteRegion] {
        &self.remote_regions
    }

    /// The remote ranks the plan moves bytes with, ascending.
    pub fn remote_ranks(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.ranks.iter().map(|(rank, _)| *rank)
    }

    /// The block tables a request must give, by name.
    pub fn tables(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.tables.iter().map(|t| t.name.as_str())
    }

    /// Whether requests need block tables (some tensor is paged).
    pub fn is_paged(&self) -> bool {
        !self.tables.is_empty()
    }

    /// Fingerprint of the local rank's layout the plan was built from.
    pub fn local_fingerprint(&self) -> u64 {
        self.local_fingerprint
    }

    /// Fingerprint of the whole remote side the plan was built from
    /// ([`side_fingerprint`]).
    pub fn remote_fingerprint(&self) -> u64 {
        self.remote_fingerprint
    }

    /// Fingerprint of each remote rank's layout, by ascending rank id: a
    /// change in any of them means the plan may be stale.
    pub fn remote_fingerprints(&self) -> &[(u32, u64)] {
        &self.remote_fingerprints
    }

    /// Segments (loop nests) in the plan: O(pieces × region-map places).
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Bytes the plan holds on the heap (capacity, not length): what
    /// caching one plan per peer costs.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.local_regions.capacity() * size_of::<u32>()
            + self.remote_regions.capacity() * size_of::<RemoteRegion>()
            + self.ranks.capacity() * size_of::<(u32, Range<u32>)>()
            + self.segments.capacity() * size_of::<Segment>()
            + self.dims.capacity() * size_of::<Dim>()
            + self.tables.capacity() * size_of::<Table>()
            + self.tables.iter().map(|t| t.name.capacity()).sum::<usize>()
            + self.remote_fingerprints.capacity() * size_of::<(u32, u64)>()
    }
}

/// A segment before region indices are resolved into the plan's tables.
pub(crate) struct Draft {
    pub rank: u32,
    pub local_region: u32,
    pub remote_region: u32,
    pub local_base: u64,
    pub remote_base: u64,
    pub run: u64,
    pub outer: Vec<Dim>,
    pub inner: Vec<Dim>,
    pub paged: Option<PagedDim>,
}

/// Compiles the plan that moves, for every tensor `local` holds, its bytes
/// between `local` and the ranks of `remote`. Validates both sides first
/// (see [`LayoutError`]); nothing is planned on an error.
pub fn plan(
    local: &RankLayout,
    remote: &[RankLayout],
    opts: PlanOptions<'_>,
) -> Result<Plan, LayoutError> {
    let local_pieces = check_rank(local)?;
    let remote_index = check_side(remote, !opts.remote_covers_local_only)?;
    if opts.remote_covers_local_only {
        for piece in &local_pieces {
            let name = piece.layout.tensor.name.as_str();
            if let Some(tensor) = remote_index.get(name) {
                check_piece_cover(piece, tensor)?;
            }
        }
    }
    let peers = local_side(local, opts)?;
    let peer_index = match &peers {
        Some(peers) => Some(check_side(peers, false)?),
        None => None,
    };
    if opts.every_remote_tensor {
        for (name, tensor) in &remote_index {
            if local.tensor(name).is_none() {
                return Err(LayoutError::MissingLocal {
                    tensor: (*name).to_owned(),
                    rank: tensor.groups[0].replicas[0].rank,
                });
            }
        }
    }
    let mut drafts = Vec::new();
    let mut tables: Vec<Table> = Vec::new();
    for piece in &local_pieces {
        let name = piece.layout.tensor.name.as_str();
        let Some(remote_tensor) = remote_index.get(name) else {
            return Err(LayoutError::MissingRemote {
                tensor: name.to_owned(),
            });
        };
        let first = &remote_tensor.groups[0].replicas[0];
        if let Some(what) = tensor_diff(&piece.layout.tensor, &first.layout.tensor) {
            return Err(LayoutError::TensorMismatch {
                tensor: name.to_owned(),
                rank: local.rank,
                other: first.rank,
                what,
            });
        }
        for group in &remote_tensor.groups {
            let other = &group.replicas[0];
            if !boxes_meet(&piece.lo, &piece.len, &other.lo, &other.len) {
                continue;
            }
            let sources: Vec<&Piece<'_>> = match opts.direction {
                Direction::Pull => {
                    let n = group.replicas.len();
                    vec![&group.replicas[local.rank as usize % n]]
                }
                Direction::Push => group
                    .replicas
                    .iter()
                    .filter(|r| writes_to(local.rank, piece, r.rank, peer_index.as_ref()))
                    .collect(),
            };
            // Every replica pages alike, and registers the table even
            // when this rank moves nothing with it (a push replica that
            // another writes for): requests stay the same for all ranks.
            let paged = group
                .replicas
                .iter()
                .map(|replica| paged_dim(piece, replica, &mut tables))
                .collect::<Result<Vec<_>, _>>()?;
            for (source, paged) in group.replicas.iter().zip(paged) {
                if sources.iter().any(|s| s.rank == source.rank) {
                    segments_between(piece, source, paged, &mut drafts);
                }
            }
        }
    }
    fuse_translates(&mut drafts);
    Ok(assemble(local, remote, opts.direction, drafts, tables))
}

/// The local side for push deduplication: the peers, with the local rank
/// (which must match if it is listed).
fn local_side(
    local: &RankLayout,
    opts: PlanOptions<'_>,
) -> Result<Option<Vec<RankLayout>>, LayoutError> {
    if opts.direction != Direction::Push || opts.local_peers.is_empty() {
        return Ok(None);
    }
    let mut side = opts.local_peers.to_vec();
    match side.iter().find(|r| r.rank == local.rank) {
        Some(listed) if listed != local => {
            return Err(LayoutError::LocalPeerMismatch { rank: local.rank });
        }
        Some(_) => {}
        None => side.push(local.clone()),
    }
    Ok(Some(side))
}

/// Whether the local rank is the one of its replicas that writes `piece`
/// to remote rank `to`.
fn writes_to(me: u32, piece: &Piece<'_>, to: u32, peers: Option<&SideIndex<'_>>) -> bool {
    let Some(group) = peers
        .and_then(|index| index.get(piece.layout.tensor.name.as_str()))
        .and_then(|t| {
            t.groups
                .iter()
                .find(|g| g.replicas.iter().any(|r| r.rank == me))
        })
    else {
        return true;
    };
    group.replicas[to as usize % group.replicas.len()].rank == me
}

/// Checks that both pieces page alike and registers their table.
fn paged_dim(
    local: &Piece<'_>,
    remote: &Piece<'_>,
    tables: &mut Vec<Table>,
) -> Result<Option<PagedDim>, LayoutError> {
    let (l, r) = match (&local.layout.paged, &remote.layout.paged) {
        (None, None) => return Ok(None),
        (Some(l), Some(r)) if l.axis == r.axis && l.table == r.table => (l, r),
        _ => {
            return Err(LayoutError::PagingMismatch {
                tensor: local.layout.tensor.name.clone(),
                rank: local.rank,
                other: remote.rank,
            });
        }
    };
    let axis_size = local.len[l.axis as usize];
    let index = match tables.iter().position(|t| t.name == l.table) {
        Some(i) => {
            let t = &mut tables[i];
            for (side, have, new) in [
                (Side::Local, t.local_block, l.block),
                (Side::Remote, t.remote_block, r.block),
            ] {
                if have != new {
                    return Err(LayoutError::TableMismatch {
                        table: t.name.clone(),
                        side,
                        block: have,
                        other: new,
                    });
                }
            }
            t.axis_size = t.axis_size.min(axis_size);
            t.local_blocks = t.local_blocks.min(l.blocks);
            t.remote_blocks = t.remote_blocks.min(r.blocks);
            i
        }
        None => {
            tables.push(Table {
                name: l.table.clone(),
                axis_size,
                local_block: l.block,
                remote_block: r.block,
                local_blocks: l.blocks,
                remote_blocks: r.blocks,
            });
            tables.len() - 1
        }
    };
    let axis = l.axis as usize;
    Ok(Some(PagedDim {
        table: index as u32,
        local: local.layout.strides[axis],
        remote: remote.layout.strides[axis],
        local_block_stride: l.block_stride,
        remote_block_stride: r.block_stride,
    }))
}

/// Appends the segments moving the intersection of two pieces: one per
/// combination of indices along region-mapped axes (either side's).
fn segments_between(
    local: &Piece<'_>,
    remote: &Piece<'_>,
    paged: Option<PagedDim>,
    drafts: &mut Vec<Draft>,
) {
    let (lt, rt) = (local.layout, remote.layout);
    let dims = lt.tensor.axes.len();
    let lo: Vec<u64> = (0..dims).map(|d| local.lo[d].max(remote.lo[d])).collect();
    let len: Vec<u64> = (0..dims)
        .map(|d| (local.lo[d] + local.len[d]).min(remote.lo[d] + remote.len[d]) - lo[d])
        .collect();
    let paged_axis = lt.paged.as_ref().map(|p| p.axis as usize);
    let lmap = lt.region_map.as_ref().map(|m| m.axis as usize);
    let rmap = rt.region_map.as_ref().map(|m| m.axis as usize);
    let mut mapped: Vec<usize> = lmap.into_iter().chain(rmap).collect();
    mapped.dedup();
    let mut loops: Vec<Dim> = (0..dims)
        .filter(|&d| Some(d) != paged_axis && !mapped.contains(&d))
        .map(|d| Dim {
            count: len[d],
            local: lt.strides[d],
            remote: rt.strides[d],
        })
        .collect();
    let mut run = u64::from(lt.tensor.elem_size);
    coalesce(&mut loops, &mut run);
    let (outer, inner) = match paged {
        Some(p) => loops.iter().partition(|d| d.local > p.local_block_stride),
        None => (loops, Vec::new()),
    };
    // Global index of the segment's first element; mapped axes vary.
    let mut at = lo.clone();
    loop {
        let (local_region, local_base) = base(local, &at, lmap, paged_axis);
        let (remote_region, remote_base) = base(remote, &at, rmap, paged_axis);
        drafts.push(Draft {
            rank: remote.rank,
            local_region,
            remote_region,
            local_base,
            remote_base,
            run,
            outer: outer.clone(),
            inner: inner.clone(),
            paged,
        });
        // Odometer over the mapped axes.
        let mut carry = true;
        for &d in &mapped {
            at[d] += 1;
            if at[d] < lo[d] + len[d] {
                carry = false;
                break;
            }
            at[d] = lo[d];
        }
        if carry {
            break;
        }
    }
}

/// Region and byte offset of the element at global index `at` in a piece
/// (physical block 0 and in-block position 0 on the paged axis).
fn base(piece: &Piece<'_>, at: &[u64], mapped: Option<usize>, paged: Option<usize>) -> (u32, u64) {
    let t = piece.layout;
    let (region, mut offset) = match (&t.region_map, mapped) {
        (Some(map), Some(axis)) => {
            let place = map.places[(at[axis] - piece.lo[axis]) as usize];
            (place.region, place.offset)
        }
        _ => (t.region, t.offset),
    };
    for (d, &stride) in t.strides.iter().enumerate() {
        if Some(d) != mapped && Some(d) != paged {
            offset += (at[d] - piece.lo[d]) * stride;
        }
    }
    (region, offset)
}

/// Resolves region indices into the plan's tables and groups segments by
/// remote rank.
fn assemble(
    local: &RankLayout,
    remote: &[RankLayout],
    direction: Direction,
    mut drafts: Vec<Draft>,
    tables: Vec<Table>,
) -> Plan {
    drafts.sort_by_key(|d| d.rank);
    let local_regions: Vec<u32> = drafts
        .iter()
        .map(|d| d.local_region)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let remote_regions: Vec<RemoteRegion> = drafts
        .iter()
        .map(|d| RemoteRegion {
            rank: d.rank,
            region: d.remote_region,
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut ranks: Vec<(u32, Range<u32>)> = Vec::new();
    let mut segments = Vec::with_capacity(drafts.len());
    let mut dims = Vec::new();
    for (i, d) in drafts.into_iter().enumerate() {
        let i = i as u32;
        match ranks.last_mut() {
            Some((rank, range)) if *rank == d.rank => range.end = i + 1,
            _ => ranks.push((d.rank, i..i + 1)),
        }
        let mut push = |loops: &[Dim]| {
            let start = dims.len() as u32;
            dims.extend_from_slice(loops);
            start..dims.len() as u32
        };
        let outer = push(&d.outer);
        let inner = push(&d.inner);
        segments.push(Segment {
            local_region: local_regions
                .binary_search(&d.local_region)
                .unwrap_or_default() as u32,
            remote_region: remote_regions
                .binary_search(&RemoteRegion {
                    rank: d.rank,
                    region: d.remote_region,
                })
                .unwrap_or_default() as u32,
            local_base: d.local_base,
            remote_base: d.remote_base,
            run: d.run,
            outer,
            inner,
            paged: d.paged,
        });
    }
    let mut remote_fingerprints: Vec<(u32, u64)> =
        remote.iter().map(|r| (r.rank, r.fingerprint())).collect();
    remote_fingerprints.sort_unstable();
    Plan {
        direction,
        local_rank: local.rank,
        local_regions,
        remote_regions,
        ranks,
        segments,
        dims,
        tables,
        local_fingerprint: local.fingerprint(),
        remote_fingerprint: side_fingerprint(remote),
        remote_fingerprints,
    }
}
