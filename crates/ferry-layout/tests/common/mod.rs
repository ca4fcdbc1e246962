//! The naive reference every test compares against: regions as plain
//! buffers, each byte of each element tagged with (tensor, global element
//! index, byte), element addresses computed one by one from the layouts
//! alone (no planner code), descriptors applied as copies, and every
//! destination byte checked for its tag and for being written exactly
//! once (and every other byte for not being written at all).
//!
//! A buffer byte is a `u64` tag rather than a `u8`, so that a misplaced
//! byte can never match by chance.

#![allow(dead_code)]

pub mod random;

use std::collections::BTreeMap;
use std::ops::Range;

use ferry_core::Desc;
use ferry_layout::{
    Direction, Expansion, NixlShape, Plan, PlanOptions, RankLayout, RequestError, TableRequest,
    TensorLayout, plan,
};

/// One block table of a request, owned.
#[derive(Clone, Debug)]
pub struct Req {
    pub table: String,
    pub range: Range<u64>,
    pub local: Vec<u64>,
    pub remote: Vec<u64>,
}

impl Req {
    pub fn new(table: &str, range: Range<u64>, local: Vec<u64>, remote: Vec<u64>) -> Self {
        Req {
            table: table.to_owned(),
            range,
            local,
            remote,
        }
    }

    /// Consecutive tables `0, 1, 2, ...` for both sides.
    pub fn consecutive(
        table: &str,
        range: Range<u64>,
        local_block: u64,
        remote_block: u64,
    ) -> Self {
        let l = range.end.div_ceil(local_block);
        let r = range.end.div_ceil(remote_block);
        Req::new(table, range, (0..l).collect(), (0..r).collect())
    }
}

pub fn borrow(reqs: &[Req]) -> Vec<TableRequest<'_>> {
    reqs.iter()
        .map(|r| TableRequest {
            table: &r.table,
            range: r.range.clone(),
            local: &r.local,
            remote: &r.remote,
        })
        .collect()
}

/// The tag of byte `byte` of the element at global index `index`.
pub fn tag(t: &TensorLayout, index: &[u64], byte: u64) -> u64 {
    let mut linear = 0u64;
    for (axis, &i) in t.tensor.axes.iter().zip(index) {
        linear = linear * axis.size + i;
    }
    let name = t
        .tensor
        .name
        .bytes()
        .fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
        & 0x7fff;
    (1 << 63) | (name << 48) | (linear << 4) | byte
}

/// Where the element at rank-local index `x` of a piece lies, from the
/// layout's definition ([`TensorLayout::locate`]); `None` when its logical
/// block has no entry in `table`.
pub fn locate(t: &TensorLayout, x: &[u64], table: Option<&[u64]>) -> Option<(u32, u64)> {
    t.locate(x, table)
}

/// Every element of a piece: (rank-local index, global index).
pub fn elements(t: &TensorLayout) -> Vec<(Vec<u64>, Vec<u64>)> {
    let ranges: Vec<Range<u64>> = (0..t.tensor.axes.len())
        .map(|d| t.range(d).expect("valid part"))
        .collect();
    let mut out = Vec::new();
    let mut x = vec![0u64; ranges.len()];
    if ranges.iter().any(|r| r.is_empty()) {
        return out;
    }
    loop {
        let g: Vec<u64> = x.iter().zip(&ranges).map(|(i, r)| r.start + i).collect();
        out.push((x.clone(), g));
        let mut d = x.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            x[d] += 1;
            if x[d] < ranges[d].end - ranges[d].start {
                break;
            }
            x[d] = 0;
        }
    }
}

/// The request entry (range and block table) a piece's side uses.
fn table_for<'r>(t: &TensorLayout, reqs: &'r [Req], local: bool) -> Option<(&'r Req, &'r [u64])> {
    let p = t.paged.as_ref()?;
    let r = reqs.iter().find(|r| r.table == p.table)?;
    Some((r, if local { &r.local } else { &r.remote }))
}

/// Whether the element at global index `g` is in the request's range.
fn requested(t: &TensorLayout, g: &[u64], reqs: &[Req]) -> bool {
    match (&t.paged, table_for(t, reqs, true)) {
        (Some(p), Some((r, _))) => r.range.contains(&g[p.axis as usize]),
        (Some(_), None) => false,
        (None, _) => true,
    }
}

/// What a checked transfer did.
#[derive(Debug)]
pub struct Outcome {
    pub plan: Plan,
    /// Descriptor pairs.
    pub descs: usize,
    /// Bytes moved, per remote rank.
    pub bytes_by_rank: BTreeMap<u32, u64>,
}

/// One rank's memory, and write counts per byte.
pub struct RankMem {
    pub bytes: Vec<Vec<u64>>,
    pub writes: Vec<Vec<u32>>,
}

impl RankMem {
    fn new(r: &RankLayout) -> Self {
        RankMem {
            bytes: r.region_lens.iter().map(|&n| vec![0; n as usize]).collect(),
            writes: r.region_lens.iter().map(|&n| vec![0; n as usize]).collect(),
        }
    }
}

/// One descriptor pair: remote rank, local and remote descriptors (region
/// indices into the plan's tables).
pub type Pair = (u32, Desc, Desc);

/// An expansion's pairs, checking its shape: lists in step, every
/// descriptor in the group of its remote rank.
fn expansion_pairs(plan: &Plan, out: &Expansion) -> Vec<Pair> {
    let (l, r) = (out.local(), out.remote());
    assert_eq!(l.len(), r.len(), "local and remote descriptors not in step");
    let mut pairs = Vec::new();
    for group in out.ranks() {
        for k in group.descs.clone() {
            let (ld, rd) = (l.get(k).expect("desc"), r.get(k).expect("desc"));
            let rank = plan.remote_regions()[rd.region as usize].rank;
            assert_eq!(rank, group.rank, "descriptor {k} in the wrong rank group");
            pairs.push((group.rank, ld, rd));
        }
    }
    assert_eq!(pairs.len(), l.len(), "descriptors outside every rank group");
    pairs
}

/// The pairs of a request through the NIXL shape: prepared lists and
/// index arrays.
pub fn nixl_pairs(plan: &Plan, reqs: &[Req]) -> Result<Vec<Pair>, RequestError> {
    let shape = NixlShape::new(plan);
    let local = shape.local_list();
    assert_eq!(local.len() as u64, shape.local_len());
    let mut indices = Vec::new();
    shape.indices(&borrow(reqs), &mut indices)?;
    let mut pairs = Vec::new();
    for group in &indices {
        let remote = shape.remote_list(group.rank);
        let len = shape
            .remote_lens()
            .iter()
            .find(|(r, _)| *r == group.rank)
            .expect("rank")
            .1;
        assert_eq!(remote.len() as u64, len);
        assert_eq!(group.local.len(), group.remote.len());
        for (&l, &r) in group.local.iter().zip(&group.remote) {
            let (ld, rd) = (
                local.get(l as usize).expect("row"),
                remote.get(r as usize).expect("row"),
            );
            let rank = plan.remote_regions()[rd.region as usize].rank;
            assert_eq!(
                rank, group.rank,
                "row {r} of rank {}'s list names another rank",
                group.rank
            );
            pairs.push((group.rank, ld, rd));
        }
    }
    Ok(pairs)
}

/// Applies descriptor pairs: copies from the source side to the other
/// (the local rank's memory `local`, the remote side's `remote`),
/// counting writes per destination byte.
fn apply(
    plan: &Plan,
    pairs: &[Pair],
    pull: bool,
    local: &mut RankMem,
    remote: &mut BTreeMap<u32, RankMem>,
) -> BTreeMap<u32, u64> {
    let mut by_rank = BTreeMap::new();
    for (k, &(rank, ld, rd)) in pairs.iter().enumerate() {
        assert_eq!(ld.len, rd.len, "descriptor {k}: lengths differ");
        assert!(ld.len > 0, "descriptor {k} is empty");
        let lregion = plan.local_regions()[ld.region as usize] as usize;
        let rregion = plan.remote_regions()[rd.region as usize];
        *by_rank.entry(rank).or_insert(0) += ld.len;
        let rmem = remote.get_mut(&rregion.rank).expect("rank");
        let rreg = rregion.region as usize;
        for i in 0..ld.len {
            let (lo, ro) = ((ld.offset + i) as usize, (rd.offset + i) as usize);
            if pull {
                local.bytes[lregion][lo] = rmem.bytes[rreg][ro];
                local.writes[lregion][lo] += 1;
            } else {
                rmem.bytes[rreg][ro] = local.bytes[lregion][lo];
                rmem.writes[rreg][ro] += 1;
            }
        }
    }
    by_rank
}

/// A side's memory with every element the block tables reach written.
fn filled_side(side: &[RankLayout], reqs: &[Req], local: bool) -> BTreeMap<u32, RankMem> {
    side.iter()
        .map(|r| {
            let mut mem = RankMem::new(r);
            fill(r, reqs, local, &mut mem.bytes);
            (r.rank, mem)
        })
        .collect()
}

/// Writes the tag of every element of `r` the block tables reach.
fn fill(r: &RankLayout, reqs: &[Req], local: bool, regions: &mut [Vec<u64>]) {
    for t in &r.tensors {
        let table = table_for(t, reqs, local).map(|(_, tab)| tab);
        for (x, g) in elements(t) {
            let Some((region, offset)) = locate(t, &x, table) else {
                continue;
            };
            for b in 0..u64::from(t.tensor.elem_size) {
                let cell = &mut regions[region as usize][(offset + b) as usize];
                assert_eq!(*cell, 0, "generator bug: two elements share a byte");
                *cell = tag(t, &g, b);
            }
        }
    }
}

/// Plans `local` reading from `remote`, expands `reqs`, applies the
/// descriptors and checks every local byte.
pub fn check_pull(local: &RankLayout, remote: &[RankLayout], reqs: &[Req]) -> Outcome {
    check_pull_with(local, remote, reqs, PlanOptions::default())
}

/// As [`check_pull`], planned with `opts`.
pub fn check_pull_with(
    local: &RankLayout,
    remote: &[RankLayout],
    reqs: &[Req],
    opts: PlanOptions<'_>,
) -> Outcome {
    let plan = plan(local, remote, opts).expect("plan");
    let mut out = Expansion::new();
    plan.expand(&borrow(reqs), &mut out).expect("expand");
    let pairs = expansion_pairs(&plan, &out);
    let bytes_by_rank = check_pull_pairs(local, remote, reqs, &plan, &pairs);
    Outcome {
        descs: out.len(),
        plan,
        bytes_by_rank,
    }
}

/// As [`check_pull`], through the NIXL shape; the request's error if the
/// NIXL shape refuses it.
pub fn check_pull_nixl(
    local: &RankLayout,
    remote: &[RankLayout],
    reqs: &[Req],
) -> Result<usize, RequestError> {
    let plan = plan(local, remote, PlanOptions::default()).expect("plan");
    let pairs = nixl_pairs(&plan, reqs)?;
    check_pull_pairs(local, remote, reqs, &plan, &pairs);
    Ok(pairs.len())
}

/// Applies `pairs` (pulling into `local`) and checks every local byte.
fn check_pull_pairs(
    local: &RankLayout,
    remote: &[RankLayout],
    reqs: &[Req],
    plan: &Plan,
    pairs: &[Pair],
) -> BTreeMap<u32, u64> {
    let mut remote_mem = filled_side(remote, reqs, false);
    let mut local_mem = RankMem::new(local);
    let bytes_by_rank = apply(plan, pairs, true, &mut local_mem, &mut remote_mem);
    let mut expected: Vec<Vec<u64>> = local
        .region_lens
        .iter()
        .map(|&n| vec![0; n as usize])
        .collect();
    let regions = &mut expected;
    for t in &local.tensors {
        let table = table_for(t, reqs, true).map(|(_, tab)| tab);
        for (x, g) in elements(t) {
            if !requested(t, &g, reqs) {
                continue;
            }
            let (region, offset) = locate(t, &x, table).expect("requested element has a block");
            for b in 0..u64::from(t.tensor.elem_size) {
                regions[region as usize][(offset + b) as usize] = tag(t, &g, b);
            }
        }
    }
    let (got, w) = (&local_mem.bytes, &local_mem.writes);
    for (region, want) in regions.iter().enumerate() {
        for (offset, &want) in want.iter().enumerate() {
            let (have, n) = (got[region][offset], w[region][offset]);
            if want != 0 {
                assert_eq!(
                    have, want,
                    "local region {region} byte {offset}: wrong byte"
                );
                assert_eq!(
                    n, 1,
                    "local region {region} byte {offset}: written {n} times"
                );
            } else {
                assert_eq!(
                    n, 0,
                    "local region {region} byte {offset}: written, not requested"
                );
            }
        }
    }
    bytes_by_rank
}

/// Every rank of `local_side` pushes to `remote` (with `local_peers` when
/// `dedupe`); checks every remote byte. Returns descriptors in all.
pub fn check_push(
    local_side: &[RankLayout],
    remote: &[RankLayout],
    reqs: &[Req],
    dedupe: bool,
) -> usize {
    let mut local_mems = filled_side(local_side, reqs, true);
    let mut remote_mem: BTreeMap<u32, RankMem> =
        remote.iter().map(|r| (r.rank, RankMem::new(r))).collect();
    let mut descs = 0;
    for local in local_side {
        let opts = PlanOptions {
            direction: Direction::Push,
            local_peers: if dedupe { local_side } else { &[] },
            ..PlanOptions::default()
        };
        let plan = plan(local, remote, opts).expect("plan");
        let mut out = Expansion::new();
        plan.expand(&borrow(reqs), &mut out).expect("expand");
        descs += out.len();
        let mem = local_mems.get_mut(&local.rank).expect("rank");
        let pairs = expansion_pairs(&plan, &out);
        apply(&plan, &pairs, false, mem, &mut remote_mem);
    }
    for r in remote {
        let mut want: BTreeMap<(u32, u64), (u64, u32)> = BTreeMap::new();
        for t in &r.tensors {
            let table = table_for(t, reqs, false).map(|(_, tab)| tab);
            let holders: Vec<&TensorLayout> = local_side
                .iter()
                .filter_map(|l| l.tensor(&t.tensor.name))
                .collect();
            for (x, g) in elements(t) {
                if !requested(t, &g, reqs) {
                    continue;
                }
                let held = holders
                    .iter()
                    .filter(|h| (0..g.len()).all(|d| h.range(d).expect("part").contains(&g[d])))
                    .count() as u32;
                if held == 0 {
                    continue;
                }
                let times = if dedupe { 1 } else { held };
                let (region, offset) = locate(t, &x, table).expect("block");
                for b in 0..u64::from(t.tensor.elem_size) {
                    want.insert((region, offset + b), (tag(t, &g, b), times));
                }
            }
        }
        let (got, w) = (&remote_mem[&r.rank].bytes, &remote_mem[&r.rank].writes);
        for (region, bytes) in got.iter().enumerate() {
            for offset in 0..bytes.len() {
                let n = w[region][offset];
                match want.get(&(region as u32, offset as u64)) {
                    Some(&(tag, times)) => {
                        assert_eq!(
                            bytes[offset], tag,
                            "remote rank {} region {region} byte {offset}: wrong byte",
                            r.rank
                        );
                        assert_eq!(
                            n, times,
                            "remote rank {} region {region} byte {offset}: written {n} times",
                            r.rank
                        );
                    }
                    None => assert_eq!(
                        n, 0,
                        "remote rank {} region {region} byte {offset}: written, not requested",
                        r.rank
                    ),
                }
            }
        }
    }
    descs
}
