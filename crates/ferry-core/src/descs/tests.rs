use super::*;
use crate::OpKind;
use crate::memory::tests::region;

#[test]
fn a_strided_list_is_its_four_numbers_and_reads_like_the_explicit_one() {
    let strided = Descs::strided(1, 64, 4096, 1024, 100_000);
    assert!(strided.is_strided());
    assert_eq!(strided.len(), 100_000);
    let mut explicit = Descs::new();
    for i in 0..100_000u64 {
        explicit.push(1, 64 + i * 4096, 1024);
    }
    assert!(strided.iter().eq(explicit.iter()));
    assert_eq!(
        strided.get(99_999),
        Some(Desc {
            region: 1,
            offset: 64 + 99_999 * 4096,
            len: 1024
        })
    );
    assert_eq!(strided.get(100_000), None);
    // Pushing onto it spells it out, keeping what it held.
    let mut grown = Descs::strided(0, 0, 8, 8, 3);
    grown.push(0, 100, 1);
    assert!(!grown.is_strided());
    assert_eq!(
        grown.iter().map(|d| d.offset).collect::<Vec<_>>(),
        [0, 8, 16, 100]
    );
}

#[test]
fn spans_bound_each_regions_descriptors_in_both_forms() {
    let strided = Descs::strided(1, 64, 4096, 1024, 100_000);
    let explicit = Descs::from_triples(&[[1, 64, 1024], [1, 64 + 99_999 * 4096, 1024]]).unwrap();
    let want = vec![None, Some(64..64 + 99_999 * 4096 + 1024), None];
    assert_eq!(strided.spans(3), want);
    assert_eq!(explicit.spans(3), want);
    // Out of order, overlapping, two regions; a region past `regions` is
    // left out (binding refuses such a list anyway).
    let mixed = Descs::from_triples(&[
        [0, 500, 10],
        [2, 7, 1],
        [0, 100, 50],
        [0, 490, 5],
        [9, 0, 1],
    ])
    .unwrap();
    assert_eq!(mixed.spans(3), vec![Some(100..510), None, Some(7..8)]);
    assert_eq!(Descs::strided(0, 0, 8, 8, 0).spans(1), vec![None]);
}

#[test]
fn triples_become_descriptors_and_a_huge_region_index_is_refused() {
    let descs = Descs::from_triples(&[[0, 0, 16], [1, 32, 8]]).unwrap();
    assert_eq!(
        descs.get(1),
        Some(Desc {
            region: 1,
            offset: 32,
            len: 8
        })
    );
    assert_eq!(
        Descs::from_triples(&[[0, 0, 1], [1 << 40, 0, 1]]),
        Err(DescError::NoSuchRegion {
            index: 1,
            region: 1 << 40,
            regions: 0
        })
    );
}

#[test]
fn binding_checks_every_descriptor_and_names_the_bad_one() {
    let (a, b) = (region(4096), region(100));
    let descs = Descs::from_triples(&[[0, 0, 4096], [1, 0, 100], [1, 50, 51]]).unwrap();
    assert_eq!(
        LocalDescList::new(vec![a.clone(), b.clone()], descs.clone()).err(),
        Some(DescError::Descriptor {
            index: 2,
            error: OpError::OutOfBounds {
                offset: 50,
                len: 51,
                bound: 100
            }
        })
    );
    assert_eq!(
        RemoteDescList::new(vec![a.remote()], descs).err(),
        Some(DescError::NoSuchRegion {
            index: 1,
            region: 1,
            regions: 1
        })
    );
    // A strided list is checked at its ends: the last block leaves.
    assert!(LocalDescList::new(vec![a.clone()], Descs::strided(0, 0, 1024, 1024, 4)).is_ok());
    assert_eq!(
        LocalDescList::new(vec![a.clone()], Descs::strided(0, 0, 1024, 1024, 5)).err(),
        Some(DescError::Descriptor {
            index: 4,
            error: OpError::OutOfBounds {
                offset: 4096,
                len: 1024,
                bound: 4096
            }
        })
    );
    // An offset past u64 is out of bounds, not a wrapped small one.
    assert!(matches!(
        LocalDescList::new(vec![a.clone()], Descs::strided(0, 0, u64::MAX / 2, 1, 3)).err(),
        Some(DescError::Descriptor { index: 2, .. })
    ));
    // Other descriptors over the same regions are checked the same way,
    // and share the regions.
    let list = RemoteDescList::new(vec![a.remote(), b.remote()], Descs::new()).unwrap();
    let other = list
        .with_descs(Descs::from_triples(&[[1, 0, 100], [0, 4000, 96]]).unwrap())
        .unwrap();
    assert_eq!(other.regions(), list.regions());
    assert!(std::ptr::eq(other.regions(), list.regions()));
    assert_eq!(other.descs().len(), 2);
    assert_eq!(
        list.with_descs(Descs::from_triples(&[[0, 0, 1], [1, 99, 2]]).unwrap())
            .err(),
        Some(DescError::Descriptor {
            index: 1,
            error: OpError::OutOfBounds {
                offset: 99,
                len: 2,
                bound: 100
            }
        })
    );
    assert_eq!(
        list.with_descs(Descs::strided(2, 0, 1, 1, 1)).err(),
        Some(DescError::NoSuchRegion {
            index: 0,
            region: 2,
            regions: 2
        })
    );
}

#[test]
fn a_long_explicit_list_names_its_first_bad_descriptor_as_a_short_one_does() {
    // More descriptors than regions: the bounds are looked up once per
    // region; the answers must be those of the per-descriptor check.
    let (a, b) = (region(4096), region(100));
    let mut triples: Vec<[u64; 3]> = (0..64).map(|i| [i % 2, i % 50, 50]).collect();
    let good = Descs::from_triples(&triples).unwrap();
    assert!(LocalDescList::new(vec![a.clone(), b.clone()], good).is_ok());
    // Of two bad ones, the first is named: a missing region before an
    // overflowing end.
    triples[40] = [2, 0, 1];
    triples[41] = [0, u64::MAX, 2];
    let bad = Descs::from_triples(&triples).unwrap();
    assert_eq!(
        LocalDescList::new(vec![a.clone(), b.clone()], bad).err(),
        Some(DescError::NoSuchRegion {
            index: 40,
            region: 2,
            regions: 2
        })
    );
    triples[40] = [0, 0, 1];
    let bad = Descs::from_triples(&triples).unwrap();
    assert_eq!(
        LocalDescList::new(vec![a.clone(), b.clone()], bad).err(),
        Some(DescError::Descriptor {
            index: 41,
            error: OpError::OutOfBounds {
                offset: u64::MAX,
                len: 2,
                bound: 4096
            }
        })
    );
    // A descriptor ending exactly at its region's end is inside it.
    triples[41] = [1, 60, 40];
    let bad = Descs::from_triples(&triples).unwrap();
    assert!(RemoteDescList::new(vec![a.remote(), b.remote()], bad).is_ok());
}

#[test]
fn a_request_pairs_descriptors_by_index_and_checks_before_making_ops() {
    let local = region(8 * 1024);
    let remote = region(8 * 1024);
    let locals =
        LocalDescList::new(vec![local.clone()], Descs::strided(0, 0, 1024, 1024, 8)).unwrap();
    let remotes =
        RemoteDescList::new(vec![remote.remote()], Descs::strided(0, 0, 1024, 1024, 8)).unwrap();
    // Repeated and interleaved indices, and a range.
    let ops = ops_between(
        OpKind::Write,
        &locals,
        &[3u32, 3, 0][..],
        &remotes,
        &[7u32, 1, 2][..],
    )
    .unwrap();
    let spans: Vec<(u64, u64, u64)> = ops
        .iter()
        .map(|op| {
            (
                op.local.offset(),
                op.remote.addr() - remote.memory().addr(),
                op.len(),
            )
        })
        .collect();
    assert_eq!(
        spans,
        [(3072, 7168, 1024), (3072, 1024, 1024), (0, 2048, 1024)]
    );
    assert!(ops.iter().all(|op| op.kind == OpKind::Write));
    assert_eq!(
        ops_between(OpKind::Read, &locals, 2..8, &remotes, 0..6)
            .unwrap()
            .len(),
        6
    );

    assert_eq!(
        ops_between(
            OpKind::Read,
            &locals,
            &[0u32, 8][..],
            &remotes,
            &[0u32, 0][..]
        )
        .err(),
        Some(DescError::IndexOutOfRange {
            position: 1,
            index: 8,
            len: 8
        })
    );
    assert_eq!(
        ops_between(OpKind::Read, &locals, 0..2, &remotes, 0..3).err(),
        Some(DescError::CountMismatch {
            local: 2,
            remote: 3
        })
    );
    let short =
        RemoteDescList::new(vec![remote.remote()], Descs::strided(0, 0, 512, 512, 4)).unwrap();
    assert_eq!(
        ops_between(OpKind::Read, &locals, 0..1, &short, 0..1).err(),
        Some(DescError::Descriptor {
            index: 0,
            error: OpError::LengthMismatch {
                local: 1024,
                remote: 512
            }
        })
    );
}

#[test]
fn a_strided_remote_list_of_100_000_blocks_crosses_the_wire_in_under_a_kib() {
    let remote = region(400 << 20);
    let list = RemoteDescList::new(
        vec![remote.remote()],
        Descs::strided(0, 0, 4096, 4096, 100_000),
    )
    .unwrap();
    let wire = serde_json::to_vec(&list).unwrap();
    assert!(wire.len() < 1024, "{} bytes", wire.len());
    let back: RemoteDescList = serde_json::from_slice(&wire).unwrap();
    assert_eq!(back, list);
}

/// A list arrives from another process: edited on the way (issue 37: a
/// strided list's `count` raised past its region, an offset moved, the
/// explicit arrays made uneven, a region index past the table), it is
/// refused when deserialized, naming what is wrong, and never reaches a
/// request.
#[test]
fn an_edited_remote_list_is_refused_when_deserialized() {
    let remote = region(256 * 100);
    let strided =
        RemoteDescList::new(vec![remote.remote()], Descs::strided(0, 0, 256, 256, 100)).unwrap();
    let edit = |list: &RemoteDescList, change: &dyn Fn(&mut serde_json::Value)| {
        let mut json = serde_json::to_value(list).unwrap();
        change(&mut json);
        serde_json::from_value::<RemoteDescList>(json).map_err(|e| e.to_string())
    };
    // Unedited, it comes back as it was.
    assert_eq!(edit(&strided, &|_| {}), Ok(strided.clone()));
    let raised = edit(&strided, &|j| j["descs"]["Strided"]["count"] = 200.into());
    let error = raised.expect_err("a count past the region");
    assert!(error.contains("descriptor 199"), "{error}");
    let moved = edit(&strided, &|j| j["descs"]["Strided"]["base"] = 1.into());
    assert!(moved.is_err(), "a base that pushes the last block out");
    let elsewhere = edit(&strided, &|j| j["descs"]["Strided"]["region"] = 1.into());
    assert!(elsewhere.unwrap_err().contains("names region 1"));

    let explicit = RemoteDescList::new(
        vec![remote.remote()],
        Descs::from_triples(&[[0, 0, 16], [0, 256, 16]]).unwrap(),
    )
    .unwrap();
    assert_eq!(edit(&explicit, &|_| {}), Ok(explicit.clone()));
    let uneven = edit(&explicit, &|j| {
        j["descs"]["Explicit"]["region"] = serde_json::json!([0, 0, 0]);
    });
    assert!(uneven.unwrap_err().contains("different lengths"));
    let far = edit(&explicit, &|j| {
        j["descs"]["Explicit"]["offset"] = serde_json::json!([0, 256 * 100]);
    });
    assert!(far.unwrap_err().contains("descriptor 1"));
    // A bare `Descs` with uneven arrays is refused too.
    let bare = serde_json::json!({"Explicit": {"region": [0], "offset": [], "len": [1]}});
    assert!(serde_json::from_value::<Descs>(bare).is_err());
}

/// `op_at` on a pair nobody checked is an error naming the position, not a
/// panic.
#[test]
fn op_at_refuses_an_index_out_of_range() {
    let local = region(1024);
    let locals =
        LocalDescList::new(vec![local.clone()], Descs::strided(0, 0, 256, 256, 4)).unwrap();
    let remotes =
        RemoteDescList::new(vec![local.remote()], Descs::strided(0, 0, 256, 256, 4)).unwrap();
    assert!(op_at(OpKind::Read, &locals, 3, &remotes, 3, 0).is_ok());
    assert_eq!(
        op_at(OpKind::Read, &locals, 0, &remotes, 4, 9).err(),
        Some(DescError::IndexOutOfRange {
            position: 9,
            index: 4,
            len: 4
        })
    );
    assert_eq!(
        op_at(OpKind::Write, &locals, u64::MAX, &remotes, 0, 2).err(),
        Some(DescError::IndexOutOfRange {
            position: 2,
            index: u64::MAX,
            len: 4
        })
    );
}

#[test]
fn ranges_over_explicit_lists_are_checked_as_whole_arrays_with_the_same_answers() {
    let local = region(8 * 1024);
    let remote = region(8 * 1024);
    let explicit = |lens: &[u64]| {
        let mut descs = Descs::new();
        let mut at = 0;
        for &len in lens {
            descs.push(0, at, len);
            at += len;
        }
        descs
    };
    let locals = LocalDescList::new(vec![local.clone()], explicit(&[100, 200, 300, 400])).unwrap();
    let remotes =
        RemoteDescList::new(vec![remote.remote()], explicit(&[200, 300, 400, 500])).unwrap();
    assert_eq!(locals.descs().lens_in(&(1..3)), Some(&[200, 300][..]));
    assert_eq!(locals.descs().lens_in(&(3..5)), None, "past the end");
    assert_eq!(locals.descs().lens_in(&&[0u32, 1][..]), None, "not a range");
    let strided = Descs::strided(0, 0, 1024, 1024, 8);
    assert_eq!(strided.lens_in(&(0..2)), None, "not explicit");

    // Equal lengths, shifted by one: accepted, the ops as the pairs say.
    let ops = ops_between(OpKind::Write, &locals, 1..4, &remotes, 0..3).unwrap();
    let lens: Vec<u64> = ops.iter().map(|op| op.len()).collect();
    assert_eq!(lens, [200, 300, 400]);
    assert!(
        check_pairs(
            &locals,
            &(1..4),
            &remotes,
            &Indices::Range { start: 0, count: 3 }
        )
        .is_ok()
    );

    // A difference is named by its position, as for index arrays.
    assert_eq!(
        check_pairs(&locals, &(0..3), &remotes, &(0..3)).err(),
        Some(DescError::Descriptor {
            index: 0,
            error: OpError::LengthMismatch {
                local: 100,
                remote: 200
            }
        })
    );
    let odd = RemoteDescList::new(vec![remote.remote()], explicit(&[200, 300, 999])).unwrap();
    assert_eq!(
        check_pairs(&locals, &(1..4), &odd, &(0..3)).err(),
        Some(DescError::Descriptor {
            index: 2,
            error: OpError::LengthMismatch {
                local: 400,
                remote: 999
            }
        })
    );
    // A range past a list's end: the index out of range, by position.
    assert_eq!(
        check_pairs(&locals, &(2..5), &remotes, &(1..4)).err(),
        Some(DescError::IndexOutOfRange {
            position: 2,
            index: 4,
            len: 4
        })
    );
}
