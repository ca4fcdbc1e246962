//! The NIXL shape: prepared lists over the whole pool and per-request
//! index arrays, checked byte for byte against the reference.

mod common;

use common::{Req, borrow, check_pull_nixl};
use ferry_layout::{
    KvCache, KvPlacement, LayerPlacement, NixlShape, Part, PlanOptions, RankLayout, RequestError,
    Tensor, TensorLayout, TokenOrder, plan,
};

fn cache(block: u64, blocks: u64) -> KvCache {
    KvCache {
        layers: 2,
        heads: 8,
        head_dim: 4,
        elem_size: 2,
        tokens: 256,
        block_tokens: block,
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

/// Prefill TP 4 with blocks of 16, decode TP 2 with blocks of 32: rows
/// are sub-blocks of 16 tokens, two per decode block.
#[test]
fn tp4_blocks_16_to_tp2_blocks_32() {
    let (prefill_cache, decode_cache) = (cache(16, 20), cache(32, 10));
    let (prefill, decode) = (side(&prefill_cache, 4), side(&decode_cache, 2));
    let p = plan(&decode[1], &prefill, PlanOptions::default()).expect("plan");
    let shape = NixlShape::new(&p);
    // Layers × K/V × source ranks × blocks × sub-blocks × heads: a
    // source's 2 heads are 16 tokens long on its side but 32 apart in a
    // decode block, so each head is a row of its own.
    assert_eq!(shape.local_len(), 2 * 2 * 2 * 10 * 2 * 2);
    assert_eq!(
        shape.remote_lens(),
        &[(2, 2 * 2 * 20 * 2), (3, 2 * 2 * 20 * 2)]
    );
    let reqs = [Req::new(
        "kv",
        32..224,
        vec![9, 3, 0, 5, 1, 7, 2],
        (0..14).rev().collect(),
    )];
    let pairs = check_pull_nixl(&decode[1], &prefill, &reqs).expect("aligned");
    assert_eq!(pairs, 2 * 2 * 2 * (192 / 16) * 2);
    let mut indices = Vec::new();
    shape
        .indices(&borrow(&reqs), &mut indices)
        .expect("aligned");
    assert_eq!(
        indices.iter().map(|g| g.rank).collect::<Vec<_>>(),
        vec![2, 3]
    );
    // A range ending inside a sub-block cannot be expressed in rows.
    let bad = [Req::new("kv", 32..200, vec![0; 7], vec![0; 13])];
    let e = shape
        .indices(&borrow(&bad), &mut indices)
        .expect_err("unaligned");
    assert!(
        matches!(
            e,
            RequestError::Unaligned {
                granule: 16,
                start: 32,
                end: 200,
                ..
            }
        ),
        "{e:?}"
    );
}

/// Block sizes 16 and 24: sub-blocks of 8 tokens.
#[test]
fn blocks_that_do_not_divide() {
    let (a, b) = (cache(16, 20), cache(24, 12));
    let (prefill, decode) = (side(&a, 2), side(&b, 4));
    let reqs = [Req::new(
        "kv",
        8..248,
        (0..11).rev().collect(),
        (0..16).collect(),
    )];
    for local in &decode {
        check_pull_nixl(local, &prefill, &reqs).expect("aligned");
    }
}

/// An unpaged plan: one row per run, every row in every request.
#[test]
fn unpaged_rows() {
    let w = Tensor::new("w", 4, &[("out", 8), ("in", 12)]);
    let rank = |r: u32, tp: u64, axis: usize| {
        let mut parts = vec![Part::Full; 2];
        parts[axis] = Part::Split {
            parts: tp,
            index: u64::from(r),
        };
        RankLayout {
            rank: r,
            region_lens: vec![8 * 12 * 4 / tp],
            tensors: vec![
                TensorLayout::contiguous(w.clone(), parts, &["out", "in"], 0, 0).expect("layout"),
            ],
        }
    };
    let trainer: Vec<RankLayout> = (0..2).map(|r| rank(r, 2, 0)).collect();
    let engine = rank(1, 3, 1);
    assert_eq!(check_pull_nixl(&engine, &trainer, &[]).expect("unpaged"), 8);
    let p = plan(&engine, &trainer, PlanOptions::default()).expect("plan");
    let shape = NixlShape::new(&p);
    assert_eq!(shape.local_len(), 8);
    assert_eq!(shape.remote_list(7).len(), 0);
}
