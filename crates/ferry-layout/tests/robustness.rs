//! Layouts and requests come from other processes: no input may panic the
//! planner. Valid random cases are corrupted one field at a time (zeros,
//! off-by-ones, huge values, wrong indices) and planned, expanded and
//! shaped for NIXL with random, often wrong, requests: each step must
//! return a value or a typed error, and any descriptor it returns must lie
//! inside its region. Seeded like the property test.

mod common;

use common::random::{Case, generate};
use fastrand::Rng;
use ferry_layout::{
    Direction, Expansion, NixlShape, Part, Place, PlanOptions, RankLayout, TableRequest, plan,
};

/// A value near `v` or at an edge of `u64`.
fn nasty(rng: &mut Rng, v: u64) -> u64 {
    match rng.u8(0..8) {
        0 => 0,
        1 => 1,
        2 => v.wrapping_sub(1),
        3 => v.wrapping_add(1),
        4 => u64::MAX,
        5 => u64::MAX / 2 + rng.u64(0..3),
        6 => rng.u64(0..64),
        _ => v.wrapping_mul(2),
    }
}

/// Corrupts one field of one rank of `side`.
fn corrupt(rng: &mut Rng, side: &mut Vec<RankLayout>) {
    let r = rng.usize(0..side.len());
    let n = side.len();
    let rank = &mut side[r];
    if rng.u8(0..8) == 0 {
        match rng.u8(0..3) {
            0 => rank.rank = rng.u32(0..4),
            1 if !rank.region_lens.is_empty() => {
                let i = rng.usize(0..rank.region_lens.len());
                rank.region_lens[i] = nasty(rng, rank.region_lens[i]);
            }
            _ if n > 1 => drop(side.remove(r)),
            _ => {}
        }
        return;
    }
    let Some(t) = (!rank.tensors.is_empty())
        .then(|| rng.usize(0..rank.tensors.len()))
        .map(|i| &mut rank.tensors[i])
    else {
        return;
    };
    let dims = t.strides.len();
    let d = rng.usize(0..dims.max(1));
    match rng.u8(0..14) {
        0 => t.tensor.elem_size = nasty(rng, u64::from(t.tensor.elem_size)) as u32,
        1 if dims > 0 => t.tensor.axes[d].size = nasty(rng, t.tensor.axes[d].size),
        2 if dims > 0 => {
            t.parts[d] = match rng.u8(0..2) {
                0 => Part::Split {
                    parts: nasty(rng, 2),
                    index: nasty(rng, 1),
                },
                _ => Part::Range {
                    start: nasty(rng, 1),
                    len: nasty(rng, 2),
                },
            }
        }
        3 if dims > 0 => t.strides[d] = nasty(rng, t.strides[d]),
        4 => t.offset = nasty(rng, t.offset),
        5 => t.region = nasty(rng, u64::from(t.region)) as u32,
        6 => t.replicated = !t.replicated,
        7 => drop(t.strides.pop()),
        8 => t.tensor.name = "t9".into(),
        _ => {
            if let Some(p) = &mut t.paged {
                match rng.u8(0..5) {
                    0 => p.block = nasty(rng, p.block),
                    1 => p.blocks = nasty(rng, p.blocks),
                    2 => p.block_stride = nasty(rng, p.block_stride),
                    3 => p.axis = nasty(rng, u64::from(p.axis)) as u32,
                    _ => p.table = "other".into(),
                }
            } else if let Some(m) = &mut t.region_map {
                match rng.u8(0..3) {
                    0 => drop(m.places.pop()),
                    1 => m.places.push(Place {
                        region: 0,
                        offset: nasty(rng, 0),
                    }),
                    _ => m.axis = nasty(rng, u64::from(m.axis)) as u32,
                }
            }
        }
    }
}

/// A request, right or wrong.
fn requests(rng: &mut Rng, case: &Case) -> (Vec<u64>, Vec<u64>, std::ops::Range<u64>) {
    let base = case.reqs.first();
    let mut l = base.map(|r| r.local.clone()).unwrap_or_default();
    let mut r = base.map(|r| r.remote.clone()).unwrap_or_default();
    let mut range = base.map(|r| r.range.clone()).unwrap_or(0..0);
    match rng.u8(0..5) {
        0 => drop(l.pop()),
        1 if !r.is_empty() => {
            let i = rng.usize(0..r.len());
            r[i] = nasty(rng, r[i]);
        }
        2 => range.end = nasty(rng, range.end),
        3 => range.start = nasty(rng, range.start),
        _ => {}
    }
    (l, r, range)
}

fn round(seed: u64, tally: &mut Tally) {
    let mut rng = Rng::with_seed(seed);
    let mut case = generate(&mut rng);
    for _ in 0..rng.usize(1..=2) {
        if rng.bool() {
            corrupt(&mut rng, &mut case.remote);
        } else {
            corrupt(&mut rng, &mut case.local);
        }
    }
    let (l, r, range) = requests(&mut rng, &case);
    let tables = [TableRequest {
        table: "kv",
        range,
        local: &l,
        remote: &r,
    }];
    let tables: &[TableRequest<'_>] = if case.shape.paged.is_some() {
        &tables
    } else {
        &[]
    };
    for local in &case.local {
        for direction in [Direction::Pull, Direction::Push] {
            let opts = PlanOptions {
                direction,
                local_peers: &case.local,
                ..PlanOptions::default()
            };
            let Ok(p) = plan(local, &case.remote, opts) else {
                tally.refused += 1;
                continue;
            };
            tally.planned += 1;
            let mut out = Expansion::new();
            if p.expand(tables, &mut out).is_ok() {
                tally.expanded += 1;
                for (k, (ld, rd)) in out.local().iter().zip(out.remote().iter()).enumerate() {
                    let lr = p.local_regions()[ld.region as usize];
                    let rr = p.remote_regions()[rd.region as usize];
                    let remote_rank = case
                        .remote
                        .iter()
                        .find(|x| x.rank == rr.rank)
                        .expect("rank");
                    let lend = local.region_lens[lr as usize];
                    let rend = remote_rank.region_lens[rr.region as usize];
                    assert!(
                        ld.offset + ld.len <= lend,
                        "descriptor {k} leaves local region {lr}"
                    );
                    assert!(
                        rd.offset + rd.len <= rend,
                        "descriptor {k} leaves remote region {rr:?}"
                    );
                }
            }
            let shape = NixlShape::new(&p);
            let mut indices = Vec::new();
            let _ = shape.indices(tables, &mut indices);
            if shape.local_len() < 100_000 {
                let _ = shape.local_list();
            }
        }
    }
}

/// How far corrupted cases got: both outcomes must occur.
#[derive(Debug, Default)]
struct Tally {
    refused: usize,
    planned: usize,
    expanded: usize,
}

struct Seed(u64);

impl Drop for Seed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "failing case: FERRY_LAYOUT_SEED={} FERRY_LAYOUT_CASES=1",
                self.0
            );
        }
    }
}

#[test]
fn corrupted_layouts_and_requests_never_panic() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let first = env("FERRY_LAYOUT_SEED").unwrap_or(0xbad_0000);
    let cases = env("FERRY_LAYOUT_CASES").unwrap_or(1500);
    let mut tally = Tally::default();
    for seed in first..first + cases {
        let guard = Seed(seed);
        round(seed, &mut tally);
        drop(guard);
    }
    eprintln!("{tally:?}");
    if cases >= 100 {
        assert!(tally.refused > 0 && tally.expanded > 0, "{tally:?}");
    }
}
