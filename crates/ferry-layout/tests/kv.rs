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
