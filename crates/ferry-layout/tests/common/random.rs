//! The random layouts of the property tests: both sides cut the same
//! tensors into random boxes held by 1..=3 replicas, each laid out in a
//! random memory order with padding, region maps, a paged axis with each
//! side's own block size, and K/V-style pairs interleaved in one region.

use std::ops::Range;

use fastrand::Rng;
use ferry_layout::{Paged, Part, Place, RankLayout, RegionMap, Tensor, TensorLayout};

use super::Req;

/// A generated case: `local` ranks pull from (or push to) `remote`.
pub struct Case {
    pub shape: Shape,
    /// Local and remote paging.
    pub pools: Option<(Pool, Pool)>,
    pub local: Vec<RankLayout>,
    pub remote: Vec<RankLayout>,
    pub reqs: Vec<Req>,
}

/// A random case.
pub fn generate(rng: &mut Rng) -> Case {
    let dims = rng.usize(1..=4);
    let sizes: Vec<u64> = (0..dims).map(|_| rng.u64(1..=6)).collect();
    let tensors = rng.usize(1..=2);
    let shape = Shape {
        elem: [1, 2, 4][rng.usize(0..3)],
        interleave: tensors == 2 && rng.bool(),
        paged: rng.bool().then(|| rng.usize(0..dims)),
        sizes,
        tensors,
    };
    let pools: Option<(Pool, Pool)> = shape.paged.map(|p| {
        let size = shape.sizes[p];
        let mut pool = || {
            let block = rng.u64(1..=4);
            Pool {
                block,
                blocks: size.div_ceil(block) + rng.u64(0..=2),
            }
        };
        (pool(), pool())
    });
    let remote = side(rng, &shape, pools.as_ref().map(|p| &p.1));
    let local = side(rng, &shape, pools.as_ref().map(|p| &p.0));
    let reqs = match (shape.paged, &pools) {
        (Some(p), Some((lp, rp))) => {
            let size = shape.sizes[p];
            let start = rng.u64(0..=size);
            let end = rng.u64(start..=size);
            let (l, r) = (table(rng, lp, size), table(rng, rp, size));
            vec![Req::new("kv", start..end, l, r)]
        }
        _ => Vec::new(),
    };
    Case {
        shape,
        pools,
        local,
        remote,
        reqs,
    }
}

/// One axis of a block's memory order, before strides are known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Level {
    /// A tensor axis (rank-local length).
    Axis(usize, u64),
    /// The paged axis's physical blocks.
    Blocks(u64),
    /// K or V: two tensors interleaved at this level.
    Kv,
}

/// What both sides share.
pub struct Shape {
    pub sizes: Vec<u64>,
    pub elem: u32,
    pub tensors: usize,
    pub interleave: bool,
    pub paged: Option<usize>,
}

/// One side's paging.
pub struct Pool {
    pub block: u64,
    pub blocks: u64,
}

fn part(rng: &mut Rng, r: &Range<u64>, size: u64) -> Part {
    let len = r.end - r.start;
    if len == size && rng.bool() {
        Part::Full
    } else if size.is_multiple_of(len) && r.start.is_multiple_of(len) && rng.bool() {
        Part::Split {
            parts: size / len,
            index: r.start / len,
        }
    } else {
        Part::Range {
            start: r.start,
            len,
        }
    }
}

/// Boxes cutting the tensor into 1..=3 intervals per axis (the paged
/// axis whole), at most 8 boxes.
fn partition(rng: &mut Rng, shape: &Shape) -> Vec<Vec<Range<u64>>> {
    let mut boxes: Vec<Vec<Range<u64>>> = vec![Vec::new()];
    for (d, &size) in shape.sizes.iter().enumerate() {
        let mut cuts = vec![0, size];
        if Some(d) != shape.paged {
            // At most 8 boxes: cases stay small and fast.
            let room = 8 / boxes.len() as u64;
            let k = rng.u64(1..=size.min(3).min(room));
            while (cuts.len() as u64) < k + 1 {
                let c = rng.u64(1..size);
                if !cuts.contains(&c) {
                    cuts.push(c);
                }
            }
            cuts.sort_unstable();
        }
        boxes = boxes
            .into_iter()
            .flat_map(|b| {
                cuts.windows(2).map(move |w| {
                    let mut b = b.clone();
                    b.push(w[0]..w[1]);
                    b
                })
            })
            .collect();
    }
    boxes
}

/// A region bump allocator.
struct Alloc<'r> {
    rng: &'r mut Rng,
    lens: Vec<u64>,
}

impl Alloc<'_> {
    fn take(&mut self, bytes: u64) -> (u32, u64) {
        let region = self.rng.usize(0..self.lens.len());
        let offset = self.lens[region] + self.rng.u64(0..=3);
        self.lens[region] = offset + bytes;
        (region as u32, offset)
    }
}

/// Strides for a random memory order of `levels` with random padding;
/// returns (per-level stride, footprint).
fn strides(rng: &mut Rng, levels: &mut [Level], elem: u32) -> (Vec<u64>, u64) {
    rng.shuffle(levels);
    let mut out = vec![0; levels.len()];
    let mut cur = u64::from(elem);
    for i in (0..levels.len()).rev() {
        out[i] = cur;
        let count = match levels[i] {
            Level::Axis(_, n) => n,
            Level::Blocks(n) => n,
            Level::Kv => 2,
        };
        let pad = if rng.u8(0..3) == 0 { rng.u64(1..=3) } else { 0 };
        cur = cur * count + pad;
    }
    (out, cur)
}

/// One rank's layout of the box `b`.
fn rank_layout(
    rng: &mut Rng,
    shape: &Shape,
    pool: Option<&Pool>,
    rank: u32,
    b: &[Range<u64>],
    replicated: bool,
) -> RankLayout {
    let dims = shape.sizes.len();
    let lens: Vec<u64> = b.iter().map(|r| r.end - r.start).collect();
    let parts: Vec<Part> = (0..dims)
        .map(|d| part(rng, &b[d], shape.sizes[d]))
        .collect();
    let map_axis = (rng.u8(0..4) == 0)
        .then(|| rng.usize(0..dims))
        .filter(|&d| Some(d) != shape.paged);
    let mut levels: Vec<Level> = Vec::new();
    for (d, &n) in lens.iter().enumerate() {
        if Some(d) == map_axis {
            continue;
        }
        match (shape.paged, pool) {
            (Some(p), Some(pool)) if p == d => {
                levels.push(Level::Axis(d, pool.block));
                levels.push(Level::Blocks(pool.blocks));
            }
            _ => levels.push(Level::Axis(d, n)),
        }
    }
    let nregions = rng.usize(1..=3);
    let mut alloc = Alloc {
        rng,
        lens: vec![0; nregions],
    };
    let mut tensors = Vec::new();
    let groups: Vec<Vec<usize>> = if shape.interleave {
        vec![vec![0, 1]]
    } else {
        (0..shape.tensors).map(|t| vec![t]).collect()
    };
    for group in groups {
        let mut lv = levels.clone();
        if group.len() == 2 {
            lv.push(Level::Kv);
        }
        let (st, footprint) = strides(alloc.rng, &mut lv, shape.elem);
        let mut axis_strides = vec![alloc.rng.u64(0..100); dims];
        let (mut block_stride, mut kv_stride) = (0, 0);
        for (level, &s) in lv.iter().zip(&st) {
            match *level {
                Level::Axis(d, _) => axis_strides[d] = s,
                Level::Blocks(_) => block_stride = s,
                Level::Kv => kv_stride = s,
            }
        }
        let places: Vec<(u32, u64)> = match map_axis {
            Some(m) => (0..lens[m]).map(|_| alloc.take(footprint)).collect(),
            None => vec![alloc.take(footprint)],
        };
        for (k, &t) in group.iter().enumerate() {
            let shift = kv_stride * k as u64;
            let axes: Vec<(String, u64)> = shape
                .sizes
                .iter()
                .enumerate()
                .map(|(d, &s)| (format!("a{d}"), s))
                .collect();
            let axes: Vec<(&str, u64)> = axes.iter().map(|(n, s)| (n.as_str(), *s)).collect();
            tensors.push(TensorLayout {
                tensor: Tensor::new(format!("t{t}"), shape.elem, &axes),
                parts: parts.clone(),
                replicated,
                region: places[0].0,
                offset: places[0].1 + shift,
                strides: axis_strides.clone(),
                region_map: map_axis.map(|m| RegionMap {
                    axis: m as u32,
                    places: places
                        .iter()
                        .map(|&(region, offset)| Place {
                            region,
                            offset: offset + shift,
                        })
                        .collect(),
                }),
                paged: match (shape.paged, pool) {
                    (Some(p), Some(pool)) => Some(Paged {
                        axis: p as u32,
                        block: pool.block,
                        block_stride,
                        blocks: pool.blocks,
                        table: "kv".into(),
                    }),
                    _ => None,
                },
            });
        }
    }
    let region_lens = alloc
        .lens
        .iter()
        .map(|&n| n + alloc.rng.u64(0..=3))
        .collect();
    tensors.sort_by_key(|t| t.tensor.name.clone());
    RankLayout {
        rank,
        region_lens,
        tensors,
    }
}

/// A side: the boxes of a partition, each held by 1..=3 ranks.
fn side(rng: &mut Rng, shape: &Shape, pool: Option<&Pool>) -> Vec<RankLayout> {
    let boxes = partition(rng, shape);
    let mut out = Vec::new();
    let mut ids: Vec<u32> = (0..256).collect();
    rng.shuffle(&mut ids);
    for b in boxes {
        let replicas = if rng.u8(0..3) == 0 {
            rng.usize(2..=3)
        } else {
            1
        };
        let replicated = replicas > 1 || rng.bool();
        for _ in 0..replicas {
            let rank = ids.pop().expect("ids");
            out.push(rank_layout(rng, shape, pool, rank, &b, replicated));
        }
    }
    rng.shuffle(&mut out);
    out
}

fn table(rng: &mut Rng, pool: &Pool, size: u64) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..pool.blocks).collect();
    rng.shuffle(&mut ids);
    ids.truncate(size.div_ceil(pool.block) as usize);
    ids
}
