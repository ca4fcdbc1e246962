//! KV-cache hand-offs between tensor-parallel degrees, block sizes and
//! memory orders, each checked byte for byte against the reference in
//! `common`.

mod common;

use std::collections::BTreeSet;

use common::{Req, check_pull, check_push};
use ferry_layout::{KvCache, KvPlacement, LayerPlacement, RankLayout, TokenOrder};

fn cache(heads: u64, block: u64) -> KvCache {
    KvCache {
        layers: 2,
        heads,
        head_dim: 4,
        elem_size: 2,
        tokens: 200,
        block_tokens: block,
        blocks: 200 / block + 5,
        order: TokenOrder::Hnd,
        kv: KvPlacement::Separate,
        layer_regions: LayerPlacement::RegionPerLayer,
        table: "kv".into(),
    }
}

fn side(c: &KvCache, tp: u64) -> Vec<RankLayout> {
    (0..tp as u32)
        .map(|r| c.rank(r, tp).expect("rank"))
        .collect()
}

/// A block table for `range`: a shuffled prefix of the pool.
fn shuffled(
    rng: &mut fastrand::Rng,
    range: &std::ops::Range<u64>,
    block: u64,
    blocks: u64,
) -> Vec<u64> {
    let mut pool: Vec<u64> = (0..blocks).collect();
    rng.shuffle(&mut pool);
    pool.truncate(range.end.div_ceil(block) as usize);
    pool
}

fn request(seed: u64, range: std::ops::Range<u64>, local: &KvCache, remote: &KvCache) -> Vec<Req> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let l = shuffled(&mut rng, &range, local.block_tokens, local.blocks);
    let r = shuffled(&mut rng, &range, remote.block_tokens, remote.blocks);
    vec![Req::new("kv", range, l, r)]
}

/// Every decode rank pulls from the prefill side; every prefill rank
/// pushes to the decode side. Returns, per decode rank, the prefill ranks
/// it read from.
fn handoff(prefill: &KvCache, p: u64, decode: &KvCache, d: u64) -> Vec<BTreeSet<u32>> {
    let (ps, ds) = (side(prefill, p), side(decode, d));
    let reqs = request(7, 5..173, decode, prefill);
    let sources = ds
        .iter()
        .map(|local| {
            let outcome = check_pull(local, &ps, &reqs);
            outcome.bytes_by_rank.keys().copied().collect()
        })
        .collect();
    // The same hand-off written by the prefill side (tables swapped).
    let swapped: Vec<Req> = reqs
        .iter()
        .map(|r| Req::new(&r.table, r.range.clone(), r.remote.clone(), r.local.clone()))
        .collect();
    check_push(&ps, &ds, &swapped, true);
    sources
}

#[test]
fn same_layout() {
    let c = cache(4, 16);
    let sources = handoff(&c, 1, &c, 1);
    assert_eq!(sources, vec![BTreeSet::from([0])]);
}

#[test]
fn tp_1_to_2() {
    let c = cache(4, 16);
    assert_eq!(handoff(&c, 1, &c, 2), vec![BTreeSet::from([0]); 2]);
}

#[test]
fn tp_2_to_1() {
    let c = cache(4, 16);
    assert_eq!(handoff(&c, 2, &c, 1), vec![BTreeSet::from([0, 1])]);
}

#[test]
fn tp_2_to_4() {
    let c = cache(4, 16);
    let want = vec![
        BTreeSet::from([0]),
        BTreeSet::from([0]),
        BTreeSet::from([1]),
        BTreeSet::from([1]),
    ];
    assert_eq!(handoff(&c, 2, &c, 4), want);
}

#[test]
fn tp_4_to_2() {
    let c = cache(4, 16);
    assert_eq!(
        handoff(&c, 4, &c, 2),
        vec![BTreeSet::from([0, 1]), BTreeSet::from([2, 3])]
    );
}

#[test]
fn tp_8_to_2_with_8_heads() {
    let c = cache(8, 16);
    assert_eq!(
        handoff(&c, 8, &c, 2),
        vec![BTreeSet::from([0, 1, 2, 3]), BTreeSet::from([4, 5, 6, 7])]
    );
}

/// 2 KV heads over 8 prefill ranks: ranks 0..3 hold head 0, 4..7 head 1.
/// Each decode rank reads its head from exactly one replica (the harness
/// checks every byte is written once), and the two decode ranks use
/// different replicas (rank % 4).
#[test]
fn tp_8_to_2_with_2_heads() {
    let c = cache(2, 16);
    assert_eq!(
        handoff(&c, 8, &c, 2),
        vec![BTreeSet::from([0]), BTreeSet::from([5])]
    );
}

/// The other way: decode TP 8 over 2 heads, prefill TP 2. Pushing, every
/// replica receives its head; pulling, each reads from the one holder.
#[test]
fn tp_2_to_8_with_2_heads() {
    let c = cache(2, 16);
    let want: Vec<BTreeSet<u32>> = (0..8).map(|r| BTreeSet::from([r / 4])).collect();
    assert_eq!(handoff(&c, 2, &c, 8), want);
}

/// Without the local peers, every prefill replica writes its head: each
/// decode byte is written 4 times (the harness counts).
#[test]
fn push_without_peers_writes_from_every_replica() {
    let c = cache(2, 16);
    let (ps, ds) = (side(&c, 8), side(&c, 2));
    let reqs = request(3, 0..64, &c, &c);
    check_push(&ps, &ds, &reqs, false);
}

#[test]
fn nhd_to_hnd_and_back() {
    let hnd = cache(4, 16);
    let nhd = KvCache {
        order: TokenOrder::Nhd,
        ..hnd.clone()
    };
    handoff(&nhd, 2, &hnd, 4);
    handoff(&hnd, 4, &nhd, 2);
    handoff(&nhd, 1, &hnd, 1);
}

#[test]
fn block_16_to_32_and_64_and_back() {
    let b16 = cache(4, 16);
    for big in [32, 64] {
        let b = cache(4, big);
        handoff(&b16, 2, &b, 1);
        handoff(&b, 1, &b16, 2);
        handoff(&b16, 4, &b, 2);
    }
    // Sizes that do not divide each other split at both sides' edges.
    let b24 = cache(4, 24);
    handoff(&b16, 2, &b24, 2);
    handoff(&b24, 2, &b16, 4);
}

#[test]
fn kv_interleaved_against_separate_regions() {
    let separate = cache(4, 16);
    let interleaved = KvCache {
        kv: KvPlacement::Interleaved,
        ..separate.clone()
    };
    handoff(&interleaved, 2, &separate, 1);
    handoff(&separate, 4, &interleaved, 2);
    handoff(&interleaved, 1, &interleaved, 2);
}

#[test]
fn layers_in_one_region_against_region_per_layer() {
    let per_layer = cache(4, 16);
    let one = KvCache {
        layer_regions: LayerPlacement::OneRegion,
        ..per_layer.clone()
    };
    handoff(&one, 2, &per_layer, 1);
    handoff(&per_layer, 4, &one, 2);
    let one_interleaved = KvCache {
        kv: KvPlacement::Interleaved,
        order: TokenOrder::Nhd,
        ..one.clone()
    };
    handoff(&one_interleaved, 2, &per_layer, 4);
}

/// Prefill and decode agree on everything: consecutive blocks on both
/// sides merge, down to one descriptor per layer and tensor.
#[test]
fn consecutive_blocks_merge() {
    let c = cache(4, 16);
    let ps = side(&c, 2);
    let reqs = vec![Req::consecutive("kv", 0..160, 16, 16)];
    let outcome = check_pull(&ps[1], &ps, &reqs);
    assert_eq!(outcome.descs, 2 * 2);
}

/// Rank `rank` of `tp` with vLLM's CPU cache layout: per block and head,
/// the head's K rows, then its V rows (`[block, head, K then V, token,
/// dim]`), all layers in one region.
fn per_head(c: &KvCache, rank: u32, tp: u64) -> RankLayout {
    let c = KvCache {
        kv: KvPlacement::Interleaved,
        layer_regions: LayerPlacement::OneRegion,
        ..c.clone()
    };
    let mut r = c.rank(rank, tp).expect("rank");
    let rows = c.block_tokens * c.head_dim * u64::from(c.elem_size);
    for (which, t) in r.tensors.iter_mut().enumerate() {
        t.offset = which as u64 * rows;
        t.strides[2] = 2 * rows;
    }
    r
}

/// K and V declared as two tensors over one block, as vLLM's CPU cache
/// lays them out: a head's K run and its V run continue each other on
/// both sides, and go as one descriptor. Counts per decode rank, tables
/// that never continue (local ascending, remote descending), whole blocks.
#[test]
fn k_and_v_of_a_head_go_as_one_descriptor() {
    let c = cache(4, 16);
    let blocks = 10;
    let reqs = vec![Req::new(
        "kv",
        0..blocks * c.block_tokens,
        (0..blocks).collect(),
        (0..blocks).rev().collect(),
    )];
    // Prefill TP 2 → decode TP 1: a source's two heads, K and V, are one
    // run on both sides: one descriptor per layer, block and source, as
    // vLLM's connector counts them (not 2 heads × K/V × that).
    let prefill: Vec<RankLayout> = (0..2).map(|r| per_head(&c, r, 2)).collect();
    let outcome = check_pull(&per_head(&c, 0, 1), &prefill, &reqs);
    assert_eq!(outcome.descs as u64, c.layers * blocks * 2);
    // Prefill TP 1 → decode TP 2: each decode rank reads its half.
    let prefill = vec![per_head(&c, 0, 1)];
    for rank in 0..2 {
        let outcome = check_pull(&per_head(&c, rank, 2), &prefill, &reqs);
        assert_eq!(outcome.descs as u64, c.layers * blocks);
    }
    // Blocks of 16 against 32: a K run of 16 rows no longer meets its V
    // run in the 32-row block; the bytes are still right.
    let big = cache(4, 32);
    let reqs = vec![Req::new(
        "kv",
        0..160,
        (0..5).collect(),
        (0..10).rev().collect(),
    )];
    check_pull(&per_head(&big, 0, 1), &prefill, &reqs);
}
