//! Requests, the hot path: a plan plus block tables in, descriptor arrays
//! out. The tables are checked once (O(blocks)), then every segment's loop
//! nest is walked block by block, splitting where either side's block
//! ends, and each run is appended, merged into the previous one when both
//! sides continue it (consecutive physical blocks on both sides).

use std::ops::Range;

use ferry_core::Descs;

use crate::error::{RequestError, Side};
use crate::plan::{Dim, Plan, Segment, Table};

/// One block table of a request: which indices of the paged axis move,
/// and where each side keeps them. All remote ranks share the remote
/// table (as tensor-parallel ranks of one engine share block ids).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableRequest<'a> {
    /// The table's name, as in [`Paged::table`](crate::Paged::table).
    pub table: &'a str,
    /// Logical indices of the paged axis to move (tokens `32..4128`, or
    /// slot `0..1` of a state table).
    pub range: Range<u64>,
    /// Local physical block of each logical block: index `t` lies in
    /// block `local[t / local block size]`.
    pub local: &'a [u64],
    /// The same for the remote side, with its own block size.
    pub remote: &'a [u64],
}

/// The descriptors a request moves between one remote rank and the local
/// rank: `descs` indexes [`Expansion::local`] and [`Expansion::remote`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankDescs {
    /// The remote rank.
    pub rank: u32,
    /// Its descriptors.
    pub descs: Range<usize>,
}

/// Reusable output of [`Plan::expand`]: two descriptor lists in step
/// (descriptor `k` of one moves to or from descriptor `k` of the other,
/// with the same length), local ones naming regions by index into
/// [`Plan::local_regions`], remote ones into [`Plan::remote_regions`],
/// grouped by remote rank so the facade can notify each source once.
#[derive(Clone, Debug)]
pub struct Expansion {
    local: Descs,
    remote: Descs,
    ranks: Vec<RankDescs>,
    merge: bool,
    /// Per plan table, the request entry that serves it.
    served_by: Vec<usize>,
    nest: Nest,
}

/// A block's loop nest for a given number of elements of the paged axis:
/// recomputed only when that number changes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Nest {
    pub count: u64,
    pub run: u64,
    pub dims: Vec<Dim>,
}

impl Default for Expansion {
    fn default() -> Self {
        Self::new()
    }
}

impl Expansion {
    /// Empty, merging adjacent descriptors.
    pub fn new() -> Self {
        Expansion {
            local: Descs::new(),
            remote: Descs::new(),
            ranks: Vec::new(),
            merge: true,
            served_by: Vec::new(),
            nest: Nest::default(),
        }
    }

    /// Empty, merging adjacent descriptors, with room for `n` pairs before
    /// its arrays grow: a caller that expands requests of one shape again
    /// and again passes the last one's size, and each request's arrays are
    /// allocated once instead of doubled from small.
    pub fn with_capacity(n: usize) -> Self {
        Expansion {
            local: Descs::with_capacity(n),
            remote: Descs::with_capacity(n),
            ..Self::new()
        }
    }

    /// Empty, never merging descriptors across blocks: one descriptor per
    /// run per block, as connectors without a planner issue them (for
    /// comparison, and for peers that need block-aligned descriptors).
    pub fn without_merging() -> Self {
        Expansion {
            merge: false,
            ..Self::new()
        }
    }

    /// Forgets the descriptors, keeping room for as many. (`Descs` has no
    /// `clear`, so its arrays are allocated again at their last size.)
    pub fn clear(&mut self) {
        self.local = Descs::with_capacity(self.local.len());
        self.remote = Descs::with_capacity(self.remote.len());
        self.ranks.clear();
    }

    /// Local descriptors.
    pub fn local(&self) -> &Descs {
        &self.local
    }

    /// Remote descriptors, in step with the local ones.
    pub fn remote(&self) -> &Descs {
        &self.remote
    }

    /// Descriptors by remote rank, in the order appended.
    pub fn ranks(&self) -> &[RankDescs] {
        &self.ranks
    }

    /// Descriptor pairs appended so far.
    pub fn len(&self) -> usize {
        self.local.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.local.is_empty()
    }

    /// Both lists and the rank groups, by value.
    pub fn into_parts(self) -> (Descs, Descs, Vec<RankDescs>) {
        (self.local, self.remote, self.ranks)
    }
}

/// What walking one paged segment's blocks needs.
struct BlockWalk<'s, 'o> {
    sink: &'s mut Sink<'o>,
    nest: &'s mut Nest,
    seg: &'s Segment,
    request: &'s TableRequest<'s>,
    table: &'s Table,
}

/// Appends descriptor pairs, merging each into the previous one when both
/// sides continue it.
struct Sink<'o> {
    local: &'o mut Descs,
    remote: &'o mut Descs,
    merge: bool,
    /// The current segment's regions.
    local_region: u32,
    remote_region: u32,
    /// The pair not yet appended (`len == 0`: none).
    pending: (u32, u64, u32, u64),
    len: u64,
}

impl Sink<'_> {
    #[inline]
    fn emit(&mut self, local: u64, remote: u64, len: u64) {
        let (lr, lo, rr, ro) = self.pending;
        if self.merge
            && self.len > 0
            && lo + self.len == local
            && ro + self.len == remote
            && lr == self.local_region
            && rr == self.remote_region
        {
            self.len += len;
            return;
        }
        self.flush();
        self.pending = (self.local_region, local, self.remote_region, remote);
        self.len = len;
    }

    fn flush(&mut self) {
        if self.len > 0 {
            let (lr, lo, rr, ro) = self.pending;
            self.local.push(lr, lo, self.len);
            self.remote.push(rr, ro, self.len);
            self.len = 0;
        }
    }

    /// Every run of a loop nest from `(local, remote)`.
    fn walk(&mut self, dims: &[Dim], local: u64, remote: u64, run: u64) {
        match dims {
            [] => self.emit(local, remote, run),
            [d] => {
                for i in 0..d.count {
                    self.emit(local + i * d.local, remote + i * d.remote, run);
                }
            }
            [d, rest @ ..] => {
                for i in 0..d.count {
                    self.walk(rest, local + i * d.local, remote + i * d.remote, run);
                }
            }
        }
    }
}

impl Plan {
    /// Appends the descriptors of one request to `out`. `tables` gives one
    /// entry per block table the plan uses ([`Plan::tables`]); an unpaged
    /// plan takes none. The tables are checked first: on an error nothing
    /// is appended. Cost: O(blocks) to check, O(descriptors) to append.
    pub fn expand(
        &self,
        tables: &[TableRequest<'_>],
        out: &mut Expansion,
    ) -> Result<(), RequestError> {
        self.check_request(tables, &mut out.served_by)?;
        let mut nest = std::mem::take(&mut out.nest);
        let mut sink = Sink {
            local: &mut out.local,
            remote: &mut out.remote,
            merge: out.merge,
            local_region: 0,
            remote_region: 0,
            pending: (0, 0, 0, 0),
            len: 0,
        };
        for (rank, segments) in &self.ranks {
            let start = sink.local.len();
            for seg in &self.segments[segments.start as usize..segments.end as usize] {
                sink.local_region = seg.local_region;
                sink.remote_region = seg.remote_region;
                let outer = &self.dims[seg.outer.start as usize..seg.outer.end as usize];
                match seg.paged {
                    None => sink.walk(outer, seg.local_base, seg.remote_base, seg.run),
                    Some(p) => {
                        let request = &tables[out.served_by[p.table as usize]];
                        let table = &self.tables[p.table as usize];
                        nest.count = 0;
                        let mut cx = BlockWalk {
                            sink: &mut sink,
                            nest: &mut nest,
                            seg,
                            request,
                            table,
                        };
                        self.walk_outer(&mut cx, outer, (seg.local_base, seg.remote_base));
                    }
                }
            }
            sink.flush();
            let end = sink.local.len();
            if end > start {
                out.ranks.push(RankDescs {
                    rank: *rank,
                    descs: start..end,
                });
            }
        }
        out.nest = nest;
        Ok(())
    }

    /// Checks a request's tables as [`Plan::expand`] does, without
    /// expanding them: O(blocks). A request that passes expands without
    /// error, so a caller can check on its own thread and leave the
    /// O(descriptors) expansion to another.
    pub fn check(&self, tables: &[TableRequest<'_>]) -> Result<(), RequestError> {
        self.check_request(tables, &mut Vec::new())
    }

    /// The descriptors of an unpaged plan, once: what to prepare ahead
    /// (a weight transfer moves them all every time).
    pub fn static_descs(&self) -> Result<Expansion, RequestError> {
        let mut out = Expansion::new();
        self.expand(&[], &mut out)?;
        Ok(out)
    }

    /// Checks a request against the plan's tables and records, per plan
    /// table, which entry serves it.
    pub(crate) fn check_request(
        &self,
        tables: &[TableRequest<'_>],
        served_by: &mut Vec<usize>,
    ) -> Result<(), RequestError> {
        served_by.clear();
        served_by.resize(self.tables.len(), usize::MAX);
        for (i, request) in tables.iter().enumerate() {
            let Some(t) = self.tables.iter().position(|t| t.name == request.table) else {
                return Err(RequestError::UnknownTable {
                    table: request.table.to_owned(),
                });
            };
            if served_by[t] != usize::MAX {
                return Err(RequestError::DuplicateTable {
                    table: request.table.to_owned(),
                });
            }
            served_by[t] = i;
            check_table(&self.tables[t], request)?;
        }
        if let Some(t) = served_by.iter().position(|&s| s == usize::MAX) {
            return Err(RequestError::MissingTable {
                table: self.tables[t].name.clone(),
            });
        }
        Ok(())
    }

    /// The loops outside the block walk, then the walk, from `base`
    /// (local, remote).
    fn walk_outer(&self, cx: &mut BlockWalk<'_, '_>, outer: &[Dim], base: (u64, u64)) {
        match outer {
            [] => self.walk_blocks(cx, base),
            [d, rest @ ..] => {
                for i in 0..d.count {
                    self.walk_outer(cx, rest, (base.0 + i * d.local, base.1 + i * d.remote));
                }
            }
        }
    }

    /// Walks the requested range of the paged axis in pieces that stay
    /// inside one block on both sides.
    fn walk_blocks(&self, cx: &mut BlockWalk<'_, '_>, base: (u64, u64)) {
        let BlockWalk {
            sink,
            nest,
            seg,
            request,
            table,
        } = cx;
        let Some(p) = seg.paged else { return };
        let Range { start, end } = request.range;
        if start >= end {
            return;
        }
        let (lb, rb) = (table.local_block, table.remote_block);
        let (mut lblock, mut lpos) = ((start / lb) as usize, start % lb);
        let (mut rblock, mut rpos) = ((start / rb) as usize, start % rb);
        let mut t = start;
        while t < end {
            let count = (lb - lpos).min(rb - rpos).min(end - t);
            let local = base.0 + request.local[lblock] * p.local_block_stride + lpos * p.local;
            let remote = base.1 + request.remote[rblock] * p.remote_block_stride + rpos * p.remote;
            if nest.count != count {
                self.build_nest(nest, seg, count);
            }
            if nest.dims.is_empty() {
                // The common case: one run per block piece.
                sink.emit(local, remote, nest.run);
            } else {
                sink.walk(&nest.dims, local, remote, nest.run);
            }
            t += count;
            lpos += count;
            if lpos == lb {
                lpos = 0;
                lblock += 1;
            }
            rpos += count;
            if rpos == rb {
                rpos = 0;
                rblock += 1;
            }
        }
    }

    /// The loop nest inside one block for `count` elements of the paged
    /// axis: the segment's inner loops plus the paged one, folded into the
    /// run where contiguous on both sides.
    pub(crate) fn build_nest(&self, nest: &mut Nest, seg: &Segment, count: u64) {
        nest.count = count;
        nest.run = seg.run;
        nest.dims.clear();
        nest.dims
            .extend_from_slice(&self.dims[seg.inner.start as usize..seg.inner.end as usize]);
        if let Some(p) = seg.paged
            && count > 1
        {
            nest.dims.push(Dim {
                count,
                local: p.local,
                remote: p.remote,
            });
        }
        while let Some(i) = nest
            .dims
            .iter()
            .position(|d| d.local == nest.run && d.remote == nest.run)
        {
            nest.run *= nest.dims.remove(i).count;
        }
        nest.dims.sort_by_key(|d| std::cmp::Reverse(d.local));
    }
}

/// Checks one table entry of a request: its range, its block tables'
/// lengths and every block id the range uses.
fn check_table(table: &Table, request: &TableRequest<'_>) -> Result<(), RequestError> {
    let Range { start, end } = request.range;
    if start > end || end > table.axis_size {
        return Err(RequestError::RangeOutOfAxis {
            table: table.name.clone(),
            start,
            end,
            size: table.axis_size,
        });
    }
    if start == end {
        return Ok(());
    }
    for (side, ids, block, blocks) in [
        (
            Side::Local,
            request.local,
            table.local_block,
            table.local_blocks,
        ),
        (
            Side::Remote,
            request.remote,
            table.remote_block,
            table.remote_blocks,
        ),
    ] {
        let first = start / block;
        let needed = end.div_ceil(block);
        if (ids.len() as u64) < needed {
            return Err(RequestError::TableTooShort {
                table: table.name.clone(),
                side,
                len: ids.len(),
                needed,
            });
        }
        for (position, &id) in ids[first as usize..needed as usize].iter().enumerate() {
            if id >= blocks {
                return Err(RequestError::BlockOutOfPool {
                    table: table.name.clone(),
                    side,
                    position: first as usize + position,
                    block: id,
                    blocks,
                });
            }
        }
    }
    Ok(())
}
