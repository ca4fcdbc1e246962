//! Layouts as published data: serde round trips and stable fingerprints.

use ferry_layout::{
    KvCache, KvPlacement, LayerPlacement, PlanOptions, RankLayout, TokenOrder, plan,
    side_fingerprint,
};

fn rank(r: u32, tp: u64) -> RankLayout {
    KvCache {
        layers: 2,
        heads: 4,
        head_dim: 8,
        elem_size: 2,
        tokens: 64,
        block_tokens: 16,
        blocks: 8,
        order: TokenOrder::Hnd,
        kv: KvPlacement::Interleaved,
        layer_regions: LayerPlacement::RegionPerLayer,
        table: "kv".into(),
    }
    .rank(r, tp)
    .expect("rank")
}

#[test]
fn json_round_trip_keeps_layout_and_fingerprint() {
    let layout = rank(1, 2);
    let json = serde_json::to_string(&layout).expect("serialize");
    let back: RankLayout = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, layout);
    assert_eq!(back.fingerprint(), layout.fingerprint());
}

#[test]
fn optional_fields_may_be_left_out() {
    let json = r#"{"rank": 3, "region_lens": [64], "tensors": [{
        "tensor": {"name": "w", "elem_size": 4, "axes": [{"name": "row", "size": 16}]},
        "parts": ["Full"], "replicated": false, "region": 0, "offset": 0, "strides": [4]
    }]}"#;
    let layout: RankLayout = serde_json::from_str(json).expect("deserialize");
    assert!(layout.tensors[0].paged.is_none() && layout.tensors[0].region_map.is_none());
    let p = plan(
        &layout,
        std::slice::from_ref(&layout),
        PlanOptions::default(),
    )
    .expect("plan");
    assert_eq!(p.static_descs().expect("unpaged").len(), 1);
}

/// The value is part of the format: if this changes, peers built from
/// different versions disagree, and `FORMAT` in fingerprint.rs must be
/// bumped on purpose.
#[test]
fn fingerprint_is_stable() {
    assert_eq!(rank(1, 2).fingerprint(), 0xefe1_9d47_6fc5_d6ee);
    assert_eq!(
        side_fingerprint(&[rank(0, 2), rank(1, 2)]),
        0x4175_a462_f7df_8571
    );
}

#[test]
fn fingerprint_sees_every_change() {
    let base = rank(1, 2);
    let changes: Vec<fn(&mut RankLayout)> = vec![
        |r| r.rank = 0,
        |r| r.region_lens[0] += 1,
        |r| r.tensors[0].tensor.name = "q".into(),
        |r| r.tensors[0].tensor.elem_size = 4,
        |r| r.tensors[0].tensor.axes[1].size += 1,
        |r| r.tensors[0].tensor.axes[1].name = "tok".into(),
        |r| r.tensors[0].replicated = true,
        |r| r.tensors[0].offset += 1,
        |r| r.tensors[0].strides[2] += 1,
        |r| r.tensors[0].region_map = None,
        |r| r.tensors[0].paged.as_mut().expect("paged").block_stride += 1,
        |r| r.tensors[0].paged.as_mut().expect("paged").table = "kv2".into(),
        |r| r.tensors.swap(0, 1),
    ];
    let mut seen = std::collections::BTreeSet::from([base.fingerprint()]);
    for change in changes {
        let mut changed = base.clone();
        change(&mut changed);
        assert!(
            seen.insert(changed.fingerprint()),
            "a change kept the fingerprint"
        );
    }
}

#[test]
fn plan_records_the_fingerprints() {
    let local = rank(0, 1);
    let remote = [rank(0, 2), rank(1, 2)];
    let p = plan(&local, &remote, PlanOptions::default()).expect("plan");
    assert_eq!(p.local_fingerprint(), local.fingerprint());
    assert_eq!(p.remote_fingerprint(), side_fingerprint(&remote));
    let per_rank: Vec<(u32, u64)> = remote.iter().map(|r| (r.rank, r.fingerprint())).collect();
    assert_eq!(p.remote_fingerprints(), per_rank.as_slice());
}
