//! Every validation error, each from a layout that is right but for one
//! thing, matched by variant and by what it names.

use ferry_layout::{
    Direction, Expansion, KvCache, KvPlacement, LayerPlacement, LayoutError, Paged, Part, Place,
    PlanOptions, RankLayout, RegionMap, RequestError, Side, TableRequest, Tensor, TensorLayout,
    TokenOrder, plan, tp_part,
};

/// `assert!(matches!(..))` that shows what it got.
macro_rules! is {
    ($e:expr, $p:pat $(if $g:expr)?) => {{
        let e = $e;
        assert!(matches!(e, $p $(if $g)?), "got {e:?}");
    }};
}

fn cache() -> KvCache {
    KvCache {
        layers: 2,
        heads: 4,
        head_dim: 4,
        elem_size: 2,
        tokens: 64,
        block_tokens: 16,
        blocks: 8,
        order: TokenOrder::Hnd,
        kv: KvPlacement::Separate,
        layer_regions: LayerPlacement::OneRegion,
        table: "kv".into(),
    }
}

fn side(tp: u64) -> Vec<RankLayout> {
    (0..tp as u32)
        .map(|r| cache().rank(r, tp).expect("rank"))
        .collect()
}

/// The error of planning rank 0 of TP 1 against TP 2, after `edit`
/// changes the local rank.
fn local_error(edit: impl FnOnce(&mut RankLayout)) -> LayoutError {
    let mut local = side(1).remove(0);
    edit(&mut local);
    plan(&local, &side(2), PlanOptions::default()).expect_err("refused")
}

/// The same, with `edit` changing the remote side.
fn remote_error(edit: impl FnOnce(&mut Vec<RankLayout>)) -> LayoutError {
    let mut remote = side(2);
    edit(&mut remote);
    plan(&side(1)[0], &remote, PlanOptions::default()).expect_err("refused")
}

/// A small unpaged matrix, dense, on rank `rank`.
fn matrix(rank: u32, parts: Vec<Part>) -> RankLayout {
    let t = Tensor::new("w", 4, &[("row", 8), ("col", 6)]);
    let layout = TensorLayout::contiguous(t, parts, &["row", "col"], 0, 0).expect("layout");
    RankLayout {
        rank,
        region_lens: vec![8 * 6 * 4],
        tensors: vec![layout],
    }
}

#[test]
fn tensor_shape_errors() {
    let e = local_error(|l| l.tensors[0].tensor.elem_size = 0);
    is!(e, LayoutError::ZeroElemSize { rank: 0, ref tensor } if tensor == "k");
    let e = local_error(|l| l.tensors[1].tensor.axes[3].size = 0);
    is!(e, LayoutError::EmptyAxis { ref tensor, ref axis, .. } if tensor == "v" && axis == "dim");
    let e = local_error(|l| {
        for a in &mut l.tensors[0].tensor.axes {
            a.size = u64::MAX / 2;
        }
    });
    is!(e, LayoutError::TooLarge { .. });
    let e = local_error(|l| l.tensors[0].parts.pop().map(drop).unwrap_or(()));
    is!(
        e,
        LayoutError::WrongDims {
            field: "parts",
            expected: 4,
            found: 3,
            ..
        }
    );
    let e = local_error(|l| l.tensors[0].strides.push(1));
    is!(
        e,
        LayoutError::WrongDims {
            field: "strides",
            expected: 4,
            found: 5,
            ..
        }
    );
}

#[test]
fn part_errors() {
    let e = local_error(|l| l.tensors[0].parts[2] = Part::Split { parts: 3, index: 0 });
    is!(e, LayoutError::BadSplit { ref axis, size: 4, parts: 3, index: 0, .. } if axis == "head");
    let e = local_error(|l| l.tensors[0].parts[2] = Part::Split { parts: 2, index: 2 });
    is!(e, LayoutError::BadSplit { index: 2, .. });
    let e = local_error(|l| l.tensors[0].parts[2] = Part::Split { parts: 0, index: 0 });
    is!(e, LayoutError::BadSplit { parts: 0, .. });
    let e = local_error(|l| l.tensors[0].parts[2] = Part::Range { start: 3, len: 2 });
    is!(
        e,
        LayoutError::PartOutOfAxis {
            start: 3,
            len: 2,
            size: 4,
            ..
        }
    );
    let e = local_error(|l| l.tensors[0].parts[2] = Part::Range { start: 0, len: 0 });
    is!(e, LayoutError::PartOutOfAxis { len: 0, .. });
    let e = local_error(|l| {
        l.tensors[0].parts[2] = Part::Range {
            start: u64::MAX,
            len: 2,
        }
    });
    is!(e, LayoutError::PartOutOfAxis { .. });
}

#[test]
fn region_and_map_errors() {
    let e = local_error(|l| l.tensors[1].region = 2);
    is!(e, LayoutError::NoSuchRegion { region: 2, regions: 2, ref tensor, .. } if tensor == "v");
    let map = |places: Vec<Place>| RegionMap { axis: 0, places };
    let place = |region, offset| Place { region, offset };
    let e = local_error(|l| {
        l.tensors[0].region_map = Some(RegionMap {
            axis: 4,
            places: vec![],
        })
    });
    is!(
        e,
        LayoutError::NoSuchAxis {
            what: "region map",
            axis: 4,
            dims: 4,
            ..
        }
    );
    let e = local_error(|l| l.tensors[0].region_map = Some(map(vec![place(0, 0)])));
    is!(e, LayoutError::RegionMapLen { expected: 2, found: 1, ref axis, .. } if axis == "layer");
    let e = local_error(|l| l.tensors[0].region_map = Some(map(vec![place(0, 0), place(7, 0)])));
    is!(e, LayoutError::NoSuchRegion { region: 7, .. });
    // Two layers' places overlapping in one region.
    let e = local_error(|l| l.tensors[0].region_map = Some(map(vec![place(0, 0), place(0, 16)])));
    is!(e, LayoutError::Aliased { ref axis, .. } if axis == "layer places");
}

#[test]
fn paging_errors() {
    let e = local_error(|l| l.tensors[0].paged.as_mut().expect("paged").axis = 9);
    is!(
        e,
        LayoutError::NoSuchAxis {
            what: "paged axis",
            axis: 9,
            ..
        }
    );
    let e = local_error(|l| l.tensors[0].paged.as_mut().expect("paged").block = 0);
    is!(
        e,
        LayoutError::BadPaging {
            reason: "blocks of 0 elements",
            ..
        }
    );
    let e = local_error(|l| l.tensors[0].paged.as_mut().expect("paged").blocks = 0);
    is!(
        e,
        LayoutError::BadPaging {
            reason: "a pool of 0 blocks",
            ..
        }
    );
    let e = local_error(|l| l.tensors[0].parts[1] = Part::Split { parts: 2, index: 0 });
    is!(
        e,
        LayoutError::BadPaging {
            reason: "the paged axis must be held whole",
            ..
        }
    );
    let e = local_error(|l| {
        let places = vec![
            Place {
                region: 0,
                offset: 0
            };
            64
        ];
        l.tensors[0].region_map = Some(RegionMap { axis: 1, places });
    });
    is!(
        e,
        LayoutError::BadPaging {
            reason: "the paged axis is also region-mapped",
            ..
        }
    );
}

#[test]
fn placement_errors() {
    // Heads closer than a head's extent.
    let e = local_error(|l| l.tensors[0].strides[2] = 8);
    is!(e, LayoutError::Aliased { ref axis, .. } if axis == "head");
    let e = local_error(|l| l.tensors[0].paged.as_mut().expect("paged").block_stride -= 2);
    is!(e, LayoutError::Aliased { ref axis, .. } if axis == "token blocks");
    // A stride of 0 over more than one element.
    let e = local_error(|l| l.tensors[0].strides[3] = 0);
    is!(e, LayoutError::Aliased { ref axis, .. } if axis == "dim");
    // The last physical block of the pool past the region's end.
    let per_layer = KvCache {
        layer_regions: LayerPlacement::RegionPerLayer,
        ..cache()
    };
    let mut local = per_layer.rank(0, 1).expect("rank");
    local.tensors[0].paged.as_mut().expect("paged").blocks += 1;
    let e = plan(&local, &side(2), PlanOptions::default()).expect_err("refused");
    is!(e, LayoutError::OutOfRegion { region: 0, .. });
    let e = local_error(|l| l.tensors[1].offset += 1);
    is!(e, LayoutError::OutOfRegion { region: 1, ref tensor, .. } if tensor == "v");
    let e = local_error(|l| l.tensors[1].strides[0] = u64::MAX - 10);
    is!(e, LayoutError::OutOfRegion { end: u64::MAX, .. });
}

#[test]
fn side_errors() {
    let e = local_error(|l| {
        let k = l.tensors[0].clone();
        l.tensors.push(k);
    });
    is!(e, LayoutError::DuplicateTensor { rank: 0, ref tensor } if tensor == "k");
    let e = remote_error(|r| r[1].rank = 0);
    is!(e, LayoutError::DuplicateRank { rank: 0 });
    let e = remote_error(|r| r[1].tensors[0].tensor.elem_size = 1);
    is!(
        e,
        LayoutError::TensorMismatch {
            rank: 0,
            other: 1,
            what: "element size",
            ..
        }
    );
    let e = remote_error(|r| r[1].tensors[0].tensor.axes[2].name = "heads".into());
    is!(e, LayoutError::TensorMismatch { what: "axes", .. });
    // The local side disagrees with the remote one.
    let e = local_error(|l| l.tensors[0].tensor.axes[1].size = 128);
    is!(
        e,
        LayoutError::TensorMismatch {
            rank: 0,
            other: 0,
            what: "axes",
            ..
        }
    );
}

#[test]
fn coverage_errors() {
    // Rank 1 of 2 missing: heads 2..4 held by nobody.
    let e = remote_error(|r| drop(r.pop()));
    is!(e, LayoutError::Gap { ref tensor, ref index } if tensor == "k" && index == &[0, 0, 2, 0]);
    // Two ranks claim the same heads, not marked replicated.
    let e = remote_error(|r| r[1].tensors[0].parts[2] = Part::Split { parts: 2, index: 0 });
    is!(e, LayoutError::Overlap { rank: 0, other: 1, ref tensor } if tensor == "k");
    // Marked replicated, but only partly the same piece.
    let a = matrix(0, vec![Part::Range { start: 0, len: 5 }, Part::Full]);
    let b = matrix(1, vec![Part::Range { start: 4, len: 4 }, Part::Full]);
    let (mut a, mut b) = (a, b);
    a.tensors[0].replicated = true;
    b.tensors[0].replicated = true;
    let e = plan(
        &matrix(9, vec![Part::Full; 2]),
        &[a, b],
        PlanOptions::default(),
    )
    .expect_err("overlap");
    is!(e, LayoutError::Overlap { .. });
    // A gap inside the row range, found past the first axis.
    let a = matrix(0, vec![Part::Full, Part::Range { start: 0, len: 2 }]);
    let b = matrix(1, vec![Part::Full, Part::Range { start: 3, len: 3 }]);
    let e = plan(
        &matrix(9, vec![Part::Full; 2]),
        &[a, b],
        PlanOptions::default(),
    )
    .expect_err("gap");
    is!(e, LayoutError::Gap { ref index, .. } if index == &[0, 2]);
}

#[test]
fn tensor_presence_errors() {
    let e = local_error(|l| l.tensors[1].tensor.name = "q".into());
    is!(e, LayoutError::MissingRemote { ref tensor } if tensor == "q");
    // A remote tensor the local rank lacks: fine unless asked.
    let mut local = side(1).remove(0);
    local.tensors.truncate(1);
    let remote = side(2);
    assert!(plan(&local, &remote, PlanOptions::default()).is_ok());
    let opts = PlanOptions {
        every_remote_tensor: true,
        ..PlanOptions::default()
    };
    let e = plan(&local, &remote, opts).expect_err("missing");
    is!(e, LayoutError::MissingLocal { rank: 0, ref tensor } if tensor == "v");
}

#[test]
fn paging_agreement_errors() {
    let e = local_error(|l| l.tensors[0].paged.as_mut().expect("paged").table = "other".into());
    is!(e, LayoutError::PagingMismatch { rank: 0, other: 0, ref tensor } if tensor == "k");
    let e = remote_error(|r| {
        for rank in r {
            rank.tensors[1].paged.as_mut().expect("paged").block = 8;
        }
    });
    is!(
        e,
        LayoutError::TableMismatch {
            side: Side::Remote,
            block: 16,
            other: 8,
            ..
        }
    );
    // One side paged, the other not: a matrix against a paged one.
    let mut paged = matrix(0, vec![Part::Full; 2]);
    paged.tensors[0].paged = Some(Paged {
        axis: 0,
        block: 8,
        block_stride: 192,
        blocks: 1,
        table: "t".into(),
    });
    let e = plan(
        &matrix(0, vec![Part::Full; 2]),
        &[paged],
        PlanOptions::default(),
    )
    .expect_err("paging");
    is!(e, LayoutError::PagingMismatch { .. });
}

#[test]
fn helper_errors() {
    let t = Tensor::new("w", 4, &[("row", 8), ("col", 6)]);
    let e = TensorLayout::contiguous(t.clone(), vec![Part::Full; 2], &["row", "row"], 0, 0)
        .expect_err("order");
    is!(e, LayoutError::BadAxisOrder { .. });
    let e = TensorLayout::contiguous(t.clone(), vec![Part::Full; 2], &["row"], 0, 0)
        .expect_err("order");
    is!(e, LayoutError::BadAxisOrder { .. });
    let dense =
        TensorLayout::contiguous(t, vec![Part::Full; 2], &["col", "row"], 0, 0).expect("order");
    let e = dense.paged_by("token", 16, 4, "kv").expect_err("axis");
    is!(e, LayoutError::BadAxisOrder { .. });
    is!(tp_part(6, 4, 0), Err(LayoutError::BadTp { size: 6, tp: 4 }));
    is!(tp_part(6, 3, 3), Err(LayoutError::BadTp { .. }));
    assert_eq!(
        tp_part(2, 8, 5).expect("tp"),
        (Part::Split { parts: 2, index: 1 }, true)
    );
}

#[test]
fn local_peer_mismatch() {
    let local = side(2);
    let mut peers = local.clone();
    peers[0].region_lens[0] += 1;
    let opts = PlanOptions {
        direction: Direction::Push,
        local_peers: &peers,
        ..PlanOptions::default()
    };
    let e = plan(&local[0], &side(1), opts).expect_err("peer");
    is!(e, LayoutError::LocalPeerMismatch { rank: 0 });
}

#[test]
fn request_errors() {
    let p = plan(&side(1)[0], &side(2), PlanOptions::default()).expect("plan");
    let ids: Vec<u64> = (0..4).collect();
    let req =
        |range: std::ops::Range<u64>, local: &'static [u64], remote: &'static [u64]| TableRequest {
            table: "kv",
            range,
            local,
            remote,
        };
    let mut out = Expansion::new();
    let mut fails = |tables: &[TableRequest<'_>]| {
        let e = p.expand(tables, &mut out).expect_err("refused");
        assert!(out.is_empty(), "appended on error");
        e
    };
    is!(fails(&[]), RequestError::MissingTable { ref table } if table == "kv");
    let other = TableRequest {
        table: "state",
        range: 0..1,
        local: &ids,
        remote: &ids,
    };
    is!(fails(&[other]), RequestError::UnknownTable { .. });
    let ok = req(0..16, &[0], &[1]);
    is!(
        fails(&[ok.clone(), ok]),
        RequestError::DuplicateTable { .. }
    );
    is!(
        fails(&[req(0..65, &[0; 5], &[0; 5])]),
        RequestError::RangeOutOfAxis {
            end: 65,
            size: 64,
            ..
        }
    );
    is!(
        fails(&[req(std::ops::Range { start: 9, end: 3 }, &[0], &[0])]),
        RequestError::RangeOutOfAxis { start: 9, .. }
    );
    is!(
        fails(&[req(0..33, &[0, 1, 2], &[0, 1])]),
        RequestError::TableTooShort {
            side: Side::Remote,
            len: 2,
            needed: 3,
            ..
        }
    );
    is!(
        fails(&[req(0..33, &[0, 1], &[0, 1, 2])]),
        RequestError::TableTooShort {
            side: Side::Local,
            len: 2,
            needed: 3,
            ..
        }
    );
    is!(
        fails(&[req(16..48, &[9, 1, 8], &[0, 1, 2])]),
        RequestError::BlockOutOfPool {
            side: Side::Local,
            position: 2,
            block: 8,
            blocks: 8,
            ..
        }
    );
    is!(
        fails(&[req(16..48, &[0, 1, 2], &[0, 1, 99])]),
        RequestError::BlockOutOfPool {
            side: Side::Remote,
            position: 2,
            block: 99,
            ..
        }
    );
    // Entries outside the range are not looked at; an empty range moves
    // nothing.
    p.expand(&[req(16..32, &[99, 1], &[99, 2])], &mut out)
        .expect("fine");
    assert!(!out.is_empty());
    let mut empty = Expansion::new();
    p.expand(&[req(5..5, &[], &[])], &mut empty).expect("fine");
    assert!(empty.is_empty());
}
