//! Descriptor counts of a realistic hand-off, exact, against what a
//! connector without a planner issues (one descriptor per layer, K or V,
//! block and source rank).

mod common;

use common::{Req, borrow, check_pull};
use ferry_layout::{
    Expansion, KvCache, KvPlacement, LayerPlacement, PlanOptions, RankLayout, TokenOrder, plan,
};

fn cache(layers: u64, head_dim: u64, blocks: u64) -> KvCache {
    KvCache {
        layers,
        heads: 8,
        head_dim,
        elem_size: 2,
        tokens: 16 * blocks,
        block_tokens: 16,
        blocks,
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

/// Prefill TP 4 to decode TP 2, 32 layers, K and V, HND, blocks of 16 on
/// both sides, 4096 tokens (256 blocks), consecutive block tables.
///
/// Each prefill rank holds 2 of the 8 heads, each decode rank 4, so a
/// remote block (2 heads × 16 tokens × 128) is half of a local block:
/// contiguous on the remote side from one block to the next, but not on
/// the local side, where the other half comes from the other source rank.
/// No merging is possible: the exact count is one descriptor per (layer,
/// K/V, block, source rank), the same as a planner-less connector's.
/// When both sides hold the same heads (TP 2 to TP 2), consecutive blocks
/// merge into one descriptor per layer and K/V.
#[test]
fn prefill_tp4_to_decode_tp2_32_layers_4096_tokens() {
    let (layers, blocks, tokens) = (32u64, 300u64, 4096u64);
    let c = cache(layers, 128, blocks);
    let (prefill, decode) = (side(&c, 4), side(&c, 2));
    let used = tokens / 16;
    let reqs = [Req::consecutive("kv", 0..tokens, 16, 16)];
    let vllm = layers * 2 * used * 2;
    for local in &decode {
        let p = plan(local, &prefill, PlanOptions::default()).expect("plan");
        let mut merged = Expansion::new();
        p.expand(&borrow(&reqs), &mut merged).expect("expand");
        let mut unmerged = Expansion::without_merging();
        p.expand(&borrow(&reqs), &mut unmerged).expect("expand");
        eprintln!(
            "decode rank {}: {} descriptors merged, {} unmerged, {vllm} as a connector counts them",
            local.rank,
            merged.len(),
            unmerged.len()
        );
        assert_eq!(unmerged.len() as u64, vllm);
        assert_eq!(merged.len() as u64, vllm);
        assert_eq!(merged.ranks().len(), 2);
        // Arrays sized ahead (too small here, so they also grow) give the
        // same descriptors.
        let mut sized = Expansion::with_capacity(merged.len() / 3);
        p.expand(&borrow(&reqs), &mut sized).expect("expand");
        assert_eq!(
            (sized.local(), sized.remote(), sized.ranks()),
            (merged.local(), merged.remote(), merged.ranks())
        );
        // Each descriptor moves a remote block: 2 heads × 16 × 128 × 2 B.
        assert!(merged.local().iter().all(|d| d.len == 2 * 16 * 128 * 2));
    }
    // Same heads on both sides: one descriptor per layer and K/V.
    let same = side(&c, 2);
    let p = plan(&same[0], &same, PlanOptions::default()).expect("plan");
    let mut merged = Expansion::new();
    p.expand(&borrow(&reqs), &mut merged).expect("expand");
    assert_eq!(merged.len() as u64, layers * 2);
    let mut unmerged = Expansion::without_merging();
    p.expand(&borrow(&reqs), &mut unmerged).expect("expand");
    assert_eq!(unmerged.len() as u64, layers * 2 * used);
}

/// The same geometry, smaller (2 layers, head_dim 4), byte for byte.
#[test]
fn prefill_tp4_to_decode_tp2_bytes() {
    let c = cache(2, 4, 40);
    let (prefill, decode) = (side(&c, 4), side(&c, 2));
    let reqs = [Req::consecutive("kv", 0..512, 16, 16)];
    for local in &decode {
        let outcome = check_pull(local, &prefill, &reqs);
        assert_eq!(outcome.descs as u64, 2 * 2 * 32 * 2);
    }
}
