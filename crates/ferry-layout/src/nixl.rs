//! The plan in the shape NIXL's prepared transfers take, so that a
//! connector on NIXL can use ferry's planner: per side a descriptor list
//! prepared once (`prep_xfer_dlist`), enumerating every physical block of
//! the pool for every piece of geometry, and per request two index arrays
//! into those lists (`make_prepped_xfer`).
//!
//! Prepared rows cannot merge across blocks (which blocks are adjacent is
//! only known per request), and cannot split blocks where a request
//! happens to: a block is cut into sub-blocks of `granule` elements, the
//! greatest common divisor of both sides' block sizes, and a request's
//! range must start and end on a sub-block edge. The lists are
//! O(pool blocks × pieces), as NIXL needs them; [`Plan::expand`] stays the
//! cheaper path when the transport takes descriptors per request.

use ferry_core::Descs;

use crate::error::RequestError;
use crate::expand::{Nest, TableRequest};
use crate::plan::{Dim, Plan, Segment};

/// Where one segment's rows lie in the lists, and how they are indexed.
#[derive(Clone, Debug)]
struct Rows {
    /// First row of the segment in the local list and in its rank's list.
    local: u64,
    remote: u64,
    /// Steps of the loops outside the block walk (all loops, unpaged).
    outer: u64,
    /// Rows per sub-block (paged); 1 when unpaged.
    inner: u64,
    /// Paged: sub-blocks per block and blocks in the pool, per side.
    sub: (u64, u64),
    blocks: (u64, u64),
    granule: u64,
}

/// A plan's NIXL shape: row positions computed once from the plan; the
/// lists and index arrays derive from it.
#[derive(Clone, Debug)]
pub struct NixlShape<'p> {
    plan: &'p Plan,
    rows: Vec<Rows>,
    local_rows: u64,
    /// Rows in each remote rank's list, in the plan's rank order.
    remote_rows: Vec<(u32, u64)>,
}

/// Index arrays of one request for one remote rank: pair `k` moves local
/// row `local[k]` to or from row `remote[k]` of that rank's list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NixlIndices {
    /// The remote rank.
    pub rank: u32,
    /// Rows of the local list.
    pub local: Vec<u64>,
    /// Rows of the rank's list.
    pub remote: Vec<u64>,
}

/// Product of the counts of `dims`.
fn steps(dims: &[Dim]) -> u64 {
    dims.iter().map(|d| d.count).product()
}

/// Byte offsets (local, remote) of every step of `dims`, in loop order.
fn offsets(dims: &[Dim], base: (u64, u64), f: &mut impl FnMut(u64, u64)) {
    match dims {
        [] => f(base.0, base.1),
        [d, rest @ ..] => {
            for i in 0..d.count {
                offsets(rest, (base.0 + i * d.local, base.1 + i * d.remote), f);
            }
        }
    }
}

impl<'p> NixlShape<'p> {
    /// Lays out the rows of `plan`'s lists.
    pub fn new(plan: &'p Plan) -> Self {
        let mut rows = Vec::with_capacity(plan.segments.len());
        let mut local_rows = 0;
        let mut remote_rows = Vec::with_capacity(plan.ranks.len());
        let mut nest = Nest::default();
        for (rank, segs) in &plan.ranks {
            let mut remote = 0;
            for seg in &plan.segments[segs.start as usize..segs.end as usize] {
                let outer = steps(&plan.dims[seg.outer.start as usize..seg.outer.end as usize]);
                let r = match seg.paged {
                    None => Rows {
                        local: local_rows,
                        remote,
                        outer,
                        inner: 1,
                        sub: (0, 0),
                        blocks: (0, 0),
                        granule: 0,
                    },
                    Some(p) => {
                        let t = &plan.tables[p.table as usize];
                        let granule = gcd(t.local_block, t.remote_block);
                        plan.build_nest(&mut nest, seg, granule);
                        Rows {
                            local: local_rows,
                            remote,
                            outer,
                            inner: steps(&nest.dims),
                            sub: (t.local_block / granule, t.remote_block / granule),
                            blocks: (t.local_blocks, t.remote_blocks),
                            granule,
                        }
                    }
                };
                let per_outer = |side: usize| match seg.paged {
                    None => 1,
                    Some(_) => {
                        let (sub, blocks) = if side == 0 {
                            (r.sub.0, r.blocks.0)
                        } else {
                            (r.sub.1, r.blocks.1)
                        };
                        blocks.saturating_mul(sub).saturating_mul(r.inner)
                    }
                };
                local_rows = local_rows.saturating_add(r.outer.saturating_mul(per_outer(0)));
                remote = remote.saturating_add(r.outer.saturating_mul(per_outer(1)));
                rows.push(r);
            }
            remote_rows.push((*rank, remote));
        }
        NixlShape {
            plan,
            rows,
            local_rows,
            remote_rows,
        }
    }

    /// Rows in the local list.
    pub fn local_len(&self) -> u64 {
        self.local_rows
    }

    /// Rows in each remote rank's list, by ascending rank.
    pub fn remote_lens(&self) -> &[(u32, u64)] {
        &self.remote_rows
    }

    /// The local list, regions indexing [`Plan::local_regions`].
    pub fn local_list(&self) -> Descs {
        let mut out = Descs::with_capacity(reserve(self.local_rows));
        for (seg, rows) in self.plan.segments.iter().zip(&self.rows) {
            self.list_rows(seg, rows, true, &mut out);
        }
        out
    }

    /// Remote rank `rank`'s list, regions indexing
    /// [`Plan::remote_regions`]; empty for a rank the plan does not use.
    pub fn remote_list(&self, rank: u32) -> Descs {
        let Some((len, segs)) = self
            .remote_rows
            .iter()
            .zip(&self.plan.ranks)
            .find(|((r, _), _)| *r == rank)
            .map(|((_, len), (_, segs))| (*len, segs.clone()))
        else {
            return Descs::new();
        };
        let mut out = Descs::with_capacity(reserve(len));
        for i in segs.start as usize..segs.end as usize {
            self.list_rows(&self.plan.segments[i], &self.rows[i], false, &mut out);
        }
        out
    }

    /// Appends one side's rows of one segment.
    fn list_rows(&self, seg: &Segment, rows: &Rows, local: bool, out: &mut Descs) {
        let plan = self.plan;
        let outer = &plan.dims[seg.outer.start as usize..seg.outer.end as usize];
        let pick = |pair: (u64, u64)| if local { pair.0 } else { pair.1 };
        let region = if local {
            seg.local_region
        } else {
            seg.remote_region
        };
        let base = (seg.local_base, seg.remote_base);
        let Some(p) = seg.paged else {
            offsets(outer, base, &mut |l, r| {
                out.push(region, pick((l, r)), seg.run)
            });
            return;
        };
        let mut nest = Nest::default();
        plan.build_nest(&mut nest, seg, rows.granule);
        let (block_stride, in_block) = if local {
            (p.local_block_stride, p.local)
        } else {
            (p.remote_block_stride, p.remote)
        };
        let (sub, blocks) = (pick(rows.sub), pick(rows.blocks));
        offsets(outer, base, &mut |l, r| {
            let start = pick((l, r));
            for block in 0..blocks {
                for s in 0..sub {
                    let at = start + block * block_stride + s * rows.granule * in_block;
                    let shift = if local { (at, 0) } else { (0, at) };
                    offsets(&nest.dims, shift, &mut |l, r| {
                        out.push(region, pick((l, r)), nest.run)
                    });
                }
            }
        });
    }

    /// Appends one request's index arrays to `out`, one entry per remote
    /// rank in the plan's order (cleared first). The request is checked
    /// as [`Plan::expand`] checks it, and each range must be aligned to
    /// the table's granule ([`RequestError::Unaligned`]).
    pub fn indices(
        &self,
        tables: &[TableRequest<'_>],
        out: &mut Vec<NixlIndices>,
    ) -> Result<(), RequestError> {
        let plan = self.plan;
        let mut served_by = Vec::new();
        plan.check_request(tables, &mut served_by)?;
        for (seg, rows) in plan.segments.iter().zip(&self.rows) {
            if let Some(p) = seg.paged {
                let request = &tables[served_by[p.table as usize]];
                let range = &request.range;
                let g = rows.granule;
                if range.start < range.end
                    && (!range.start.is_multiple_of(g) || !range.end.is_multiple_of(g))
                {
                    return Err(RequestError::Unaligned {
                        table: request.table.to_owned(),
                        start: range.start,
                        end: range.end,
                        granule: g,
                    });
                }
            }
        }
        out.resize_with(plan.ranks.len(), NixlIndices::default);
        for (group, (rank, segs)) in out.iter_mut().zip(&plan.ranks) {
            group.rank = *rank;
            group.local.clear();
            group.remote.clear();
            for i in segs.start as usize..segs.end as usize {
                let (seg, rows) = (&plan.segments[i], &self.rows[i]);
                let Some(p) = seg.paged else {
                    group
                        .local
                        .extend((0..rows.outer).map(|k| rows.local.wrapping_add(k)));
                    group
                        .remote
                        .extend((0..rows.outer).map(|k| rows.remote.wrapping_add(k)));
                    continue;
                };
                let request = &tables[served_by[p.table as usize]];
                let t = &plan.tables[p.table as usize];
                for o in 0..rows.outer {
                    let mut at = request.range.start;
                    while at < request.range.end {
                        // Row numbers fit: each is below its list's
                        // length, which fits unless a layout claims more
                        // than 2^64 rows (then wrapping, never panicking).
                        let row = |first: u64, ids: &[u64], block: u64, sub: u64, blocks: u64| {
                            let id = ids[(at / block) as usize];
                            let sub_block = (o.wrapping_mul(blocks).wrapping_add(id))
                                .wrapping_mul(sub)
                                .wrapping_add((at % block) / rows.granule);
                            first.wrapping_add(sub_block.wrapping_mul(rows.inner))
                        };
                        let l = row(
                            rows.local,
                            request.local,
                            t.local_block,
                            rows.sub.0,
                            rows.blocks.0,
                        );
                        let r = row(
                            rows.remote,
                            request.remote,
                            t.remote_block,
                            rows.sub.1,
                            rows.blocks.1,
                        );
                        group
                            .local
                            .extend((0..rows.inner).map(|k| l.wrapping_add(k)));
                        group
                            .remote
                            .extend((0..rows.inner).map(|k| r.wrapping_add(k)));
                        at += rows.granule;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Room to reserve for `rows` rows: all of them up to a bound, so that a
/// layout claiming absurd pools fails while pushing, not by reserving.
fn reserve(rows: u64) -> usize {
    rows.min(1 << 24) as usize
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
