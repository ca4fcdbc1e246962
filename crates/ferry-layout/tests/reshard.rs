//! Beyond plain K/V: MLA's replicated latent, Mamba state slots sharded in
//! sub-ranges, weights split by rows against columns, pipeline stages.
//! Each checked byte for byte against the reference in `common`.

mod common;

use std::collections::BTreeSet;

use common::{Req, check_pull, check_pull_with, check_push};
use ferry_layout::{
    LayoutError, Part, PlanOptions, RankLayout, Tensor, TensorLayout, plan, tp_part,
};

/// MLA: one latent per token, the same on every rank. Each decode rank
/// reads it from exactly one prefill rank, and different decode ranks
/// from different ones.
#[test]
fn mla_latent_is_read_once_from_spread_sources() {
    let latent = Tensor::new("latent", 2, &[("layer", 3), ("token", 100), ("dim", 12)]);
    let rank = |rank: u32, block: u64, order: &[&str]| {
        let mut t = TensorLayout::contiguous(latent.clone(), vec![Part::Full; 3], order, 0, 64)
            .and_then(|t| t.paged_by("token", block, 100 / block + 3, "kv"))
            .expect("layout");
        t.replicated = true;
        let len = t.offset + t.paged.as_ref().map_or(0, |p| p.block_stride * p.blocks);
        RankLayout {
            rank,
            region_lens: vec![len],
            tensors: vec![t],
        }
    };
    let prefill: Vec<RankLayout> = (0..4)
        .map(|r| rank(r, 16, &["layer", "token", "dim"]))
        .collect();
    let decode: Vec<RankLayout> = (0..2)
        .map(|r| rank(r, 32, &["token", "layer", "dim"]))
        .collect();
    let mut rng = fastrand::Rng::with_seed(11);
    let mut pool = |n: u64, take: u64| {
        let mut p: Vec<u64> = (0..n).collect();
        rng.shuffle(&mut p);
        p.truncate(take as usize);
        p
    };
    let reqs = vec![Req::new("kv", 3..97, pool(6, 4), pool(9, 7))];
    let sources: Vec<BTreeSet<u32>> = decode
        .iter()
        .map(|d| {
            check_pull(d, &prefill, &reqs)
                .bytes_by_rank
                .keys()
                .copied()
                .collect()
        })
        .collect();
    assert_eq!(sources, vec![BTreeSet::from([0]), BTreeSet::from([1])]);
}

/// A hybrid layer's Mamba conv state: per request one slot (a paged axis
/// of block 1, table "state"), each rank's slot holding its shard of x,
/// then of B, then of C (three tensors over one region), and the SSM
/// state sharded by heads in another region. Prefill TP 2, decode TP 1.
#[test]
fn mamba_state_slot_tp_2_to_1() {
    let kernel = 3;
    let (xs, bs, cs, heads) = (8u64, 4u64, 4u64, 4u64);
    let conv = |name: &str, channels: u64| {
        Tensor::new(
            name,
            2,
            &[("slot", 6), ("channel", channels), ("k", kernel)],
        )
    };
    let ssm = Tensor::new("ssm", 4, &[("slot", 6), ("head", heads), ("state", 5)]);
    let rank = |rank: u32, tp: u64, slots: u64| {
        let mut tensors = Vec::new();
        let mut offset = 0;
        for (name, channels) in [("conv_x", xs), ("conv_b", bs), ("conv_c", cs)] {
            let (part, _) = tp_part(channels, tp, u64::from(rank)).expect("part");
            let t = TensorLayout::contiguous(
                conv(name, channels),
                vec![Part::Full, part, Part::Full],
                &["slot", "channel", "k"],
                0,
                offset,
            )
            .expect("layout");
            offset += channels / tp * kernel * 2;
            tensors.push(t);
        }
        // One slot holds x, B and C side by side.
        for t in &mut tensors {
            t.paged = Some(ferry_layout::Paged {
                axis: 0,
                block: 1,
                block_stride: offset,
                blocks: slots,
                table: "state".into(),
            });
        }
        let (part, _) = tp_part(heads, tp, u64::from(rank)).expect("part");
        let s = TensorLayout::contiguous(
            ssm.clone(),
            vec![Part::Full, part, Part::Full],
            &["slot", "head", "state"],
            1,
            0,
        )
        .and_then(|t| t.paged_by("slot", 1, slots, "state"))
        .expect("layout");
        let ssm_len = s.paged.as_ref().map_or(0, |p| p.block_stride * slots);
        tensors.push(s);
        RankLayout {
            rank,
            region_lens: vec![offset * slots, ssm_len],
            tensors,
        }
    };
    let prefill: Vec<RankLayout> = (0..2).map(|r| rank(r, 2, 6)).collect();
    let decode = rank(0, 1, 6);
    let reqs = vec![Req::new("state", 0..1, vec![4], vec![2])];
    let outcome = check_pull(&decode, &prefill, &reqs);
    assert_eq!(outcome.bytes_by_rank.len(), 2);
    // Per prefill rank: its x, B and C shards, then its SSM heads.
    assert_eq!(outcome.descs, 2 * 4);
    check_push(&prefill, std::slice::from_ref(&decode), &reqs, true);
}

/// A trainer splits a weight matrix by rows (TP 2), the engine by columns
/// (TP 3): each engine rank gathers a column block from both trainer
/// ranks, a row at a time.
#[test]
fn weight_rows_against_columns() {
    let w = Tensor::new("w", 4, &[("out", 8), ("in", 12)]);
    let side = |tp: u64, axis: usize| -> Vec<RankLayout> {
        (0..tp as u32)
            .map(|r| {
                let mut parts = vec![Part::Full; 2];
                parts[axis] = Part::Split {
                    parts: tp,
                    index: u64::from(r),
                };
                let t = TensorLayout::contiguous(w.clone(), parts, &["out", "in"], 0, 8)
                    .expect("layout");
                RankLayout {
                    rank: r,
                    region_lens: vec![8 + 8 * 12 * 4 / tp],
                    tensors: vec![t],
                }
            })
            .collect()
    };
    let (rows, cols) = (side(2, 0), side(3, 1));
    for engine in &cols {
        let outcome = check_pull(engine, &rows, &[]);
        // 4 rows from each trainer rank, one 4-column run per row.
        assert_eq!(outcome.descs, 8);
        let statics = outcome.plan.static_descs().expect("unpaged");
        assert_eq!(statics.len(), 8);
    }
    for trainer in &rows {
        // 4 rows, each gathered from 3 column blocks: contiguous on the
        // engine side, so one run per (row, engine rank).
        assert_eq!(check_pull(trainer, &cols, &[]).descs, 4 * 3);
    }
    check_push(&rows, &cols, &[], false);
    check_push(&cols, &rows, &[], false);
}

/// A relay of weights: an engine rank pulls its column shard from another
/// engine process holding the same shard (which covers only that shard of
/// the tensor), or from just the trainer ranks that hold its rows. The
/// default plan refuses a remote side with a gap; asking for local cover
/// only, it plans, still refusing a remote side that misses a local byte.
#[test]
fn a_shard_plans_against_a_relay_holding_just_that_shard() {
    let w = Tensor::new("w", 4, &[("out", 8), ("in", 12)]);
    let shard = |rank: u32, tp: u64, index: u64, axis: usize| {
        let mut parts = vec![Part::Full; 2];
        parts[axis] = Part::Split { parts: tp, index };
        let t = TensorLayout::contiguous(w.clone(), parts, &["out", "in"], 0, 8).expect("layout");
        RankLayout {
            rank,
            region_lens: vec![8 + 8 * 12 * 4 / tp],
            tensors: vec![t],
        }
    };
    let local_only = PlanOptions {
        remote_covers_local_only: true,
        ..PlanOptions::default()
    };
    let engine = shard(1, 3, 1, 1);
    let relay = [shard(0, 3, 1, 1)];
    let e = plan(&engine, &relay, PlanOptions::default()).expect_err("a gap");
    assert!(matches!(e, LayoutError::Gap { .. }), "{e:?}");
    let outcome = check_pull_with(&engine, &relay, &[], local_only);
    // The same layout on both sides: one run.
    assert_eq!(outcome.descs, 1);
    assert_eq!(outcome.bytes_by_rank.values().sum::<u64>(), 8 * 4 * 4);
    // Rows: an engine holding rows 0..4 (TP 2, rank 0) needs trainer rank
    // 0 of TP 2 only, and is refused against rank 1 alone.
    let top = shard(0, 2, 0, 0);
    let outcome = check_pull_with(&top, &[shard(0, 2, 0, 0)], &[], local_only);
    assert_eq!(outcome.bytes_by_rank.values().sum::<u64>(), 4 * 12 * 4);
    let e = plan(&top, &[shard(1, 2, 1, 0)], local_only).expect_err("rows missing");
    assert!(
        matches!(e, LayoutError::Gap { ref index, .. } if index[0] < 4),
        "{e:?}"
    );
}

/// Two uneven pipeline stages (layers 0..3 and 3..5, `Part::Range`) into
/// one process holding the whole stack in one region per layer.
#[test]
fn pipeline_stages_into_one_process() {
    let stack = Tensor::new("mlp", 2, &[("layer", 5), ("row", 4), ("col", 6)]);
    let stage = |rank: u32, start: u64, len: u64| {
        let t = TensorLayout::contiguous(
            stack.clone(),
            vec![Part::Range { start, len }, Part::Full, Part::Full],
            &["layer", "row", "col"],
            0,
            0,
        )
        .expect("layout");
        RankLayout {
            rank,
            region_lens: vec![len * 4 * 6 * 2],
            tensors: vec![t],
        }
    };
    let stages = vec![stage(0, 0, 3), stage(1, 3, 2)];
    let mut whole = TensorLayout::contiguous(
        stack.clone(),
        vec![Part::Full; 3],
        &["layer", "col", "row"],
        0,
        0,
    )
    .expect("layout");
    whole.region_map = Some(ferry_layout::RegionMap {
        axis: 0,
        places: (0..5)
            .map(|l| ferry_layout::Place {
                region: 4 - l,
                offset: 16,
            })
            .collect(),
    });
    let process = RankLayout {
        rank: 0,
        region_lens: vec![16 + 4 * 6 * 2; 5],
        tensors: vec![whole],
    };
    let outcome = check_pull(&process, &stages, &[]);
    assert_eq!(outcome.bytes_by_rank.len(), 2);
    // Transposed (col-major locally): one element per descriptor.
    assert_eq!(outcome.descs, 5 * 4 * 6);
    check_push(std::slice::from_ref(&process), &stages, &[], false);
}
