//! A slice handed to another process is a boundary: a holder who edits its
//! JSON to reach more of the region (wider, moved, or narrowed again from
//! a widened view) is refused by the owner with a typed error and nothing
//! changes; a sub-slice of a slice still works; a read-only slice still
//! refuses writes. And a stranger without a region's credentials cannot
//! tell which slots and generations exist: every probe gets
//! `AccessDenied`, while the holder of a region's handle still hears that
//! it is gone or stale.

use std::time::Duration;

use ferry::prelude::*;

use crate::common::{PeerProcess, PeerRegion, digest, forge, pattern, with_wrong_token};

const DEADLINE: Duration = Duration::from_secs(20);
const LEN: u64 = 64 * 1024;
/// The slice handed out: bytes 4096..8192 of the region.
const SLICE: std::ops::Range<u64> = 4096..8192;

/// `handle` as another process receives it: through its serialized form.
fn handed_over(handle: &RemoteBuffer) -> RemoteBuffer {
    serde_json::from_str(&serde_json::to_string(handle).unwrap()).unwrap()
}

fn assert_refused(result: Result<(), SubmitError>, check: impl FnOnce(&OpError) -> bool) {
    match result {
        Err(SubmitError::Op { index: 0, error }) if check(&error) => {}
        other => panic!("expected the owner to refuse op 0 with the right error, got {other:?}"),
    }
}

async fn setup() -> (Node, PeerProcess, PeerRegion, Region) {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let target = peer.alloc(LEN as usize, Access::ReadWrite, 7).await;
    let src = node.alloc(LEN, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(LEN as usize, 0xEE)).unwrap();
    (node, peer, target, src)
}

async fn assert_unchanged(peer: &mut PeerProcess, target: &PeerRegion) {
    assert_eq!(
        peer.digest(target).await,
        digest(&target.original()),
        "the owner's bytes changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_widened_slice_handle_is_refused() {
    let (node, mut peer, target, src) = setup().await;
    let slice = handed_over(&target.handle.slice(SLICE).unwrap());
    let write = |remote: RemoteBuffer| {
        let len = remote.len();
        vec![RdmaOp::write(src.slice(0..len).unwrap(), remote)]
    };
    // Widened back to the whole region.
    let whole = forge(&slice, |j| {
        j["addr"] = target.handle.addr().into();
        j["len"] = LEN.into();
    });
    assert_refused(node.submit(write(whole.clone()), DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    // Moved past its end, at the same length.
    let moved = forge(&slice, |j| j["addr"] = (slice.addr() + 4096).into());
    assert_refused(node.submit(write(moved), DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    // Reaching one byte before it.
    let before = forge(&slice, |j| {
        j["addr"] = (slice.addr() - 1).into();
        j["len"] = 2.into();
    });
    assert_refused(node.submit(write(before), DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    // Narrowed again from the widened view, as a holder could through
    // the API: the new, wider range does not lie inside the old one.
    let rederived = handed_over(&whole);
    assert_refused(node.submit(write(rederived), DEADLINE).await, |e| {
        *e == OpError::AccessDenied
    });
    assert_unchanged(&mut peer, &target).await;
    // Reads are refused the same way.
    let back = node.alloc(LEN, Access::ReadWrite).await.unwrap();
    let read = node
        .submit(vec![RdmaOp::read(back.whole(), whole)], DEADLINE)
        .await;
    assert_refused(read, |e| matches!(e, OpError::OutOfBounds { .. }));
    assert!(
        back.to_vec().iter().all(|&b| b == 0),
        "a refused read landed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_of_a_slice_works_and_is_a_boundary_too() {
    let (node, mut peer, target, src) = setup().await;
    let slice = handed_over(&target.handle.slice(SLICE).unwrap());
    // Bytes 1024..2048 of the slice, handed on again.
    let sub = handed_over(&slice.slice(1024..2048).unwrap());
    assert_eq!(sub.addr(), target.handle.addr() + SLICE.start + 1024);
    node.submit(
        vec![RdmaOp::write(src.slice(0..1024).unwrap(), sub.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    let mut expected = target.original();
    let at = (SLICE.start + 1024) as usize;
    expected[at..at + 1024].copy_from_slice(&pattern(LEN as usize, 0xEE)[..1024]);
    assert_eq!(peer.digest(&target).await, digest(&expected));
    // The sub-slice widened to its parent slice is refused: each slice
    // handed over is a boundary of its own.
    let widened = forge(&sub, |j| {
        j["addr"] = slice.addr().into();
        j["len"] = slice.len().into();
    });
    let write = RdmaOp::write(src.slice(0..slice.len()).unwrap(), widened);
    assert_refused(node.submit(vec![write], DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    assert_eq!(peer.digest(&target).await, digest(&expected));
    // The parent slice still reads its bytes.
    let back = node.alloc(slice.len(), Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), slice)], DEADLINE)
        .await
        .unwrap();
    assert!(back.to_vec() == expected[SLICE.start as usize..SLICE.end as usize]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_slice_refuses_writes_and_reads_its_bytes() {
    let (node, mut peer, target, src) = setup().await;
    let ro = handed_over(&target.handle.slice(SLICE).unwrap().read_only());
    assert_eq!(ro.access(), Access::ReadOnly);
    let len = ro.len();
    let write = |remote: RemoteBuffer| vec![RdmaOp::write(src.slice(0..len).unwrap(), remote)];
    assert_refused(node.submit(write(ro.clone()), DEADLINE).await, |e| {
        *e == OpError::ReadOnly
    });
    // Its access edited back: the owner still refuses.
    let upgraded = forge(&ro, |j| j["access"] = "ReadWrite".into());
    assert_refused(node.submit(write(upgraded), DEADLINE).await, |e| {
        matches!(e, OpError::ReadOnly | OpError::AccessDenied)
    });
    assert_unchanged(&mut peer, &target).await;
    let back = node.alloc(len, Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), ro)], DEADLINE)
        .await
        .unwrap();
    assert!(back.to_vec() == target.original()[SLICE.start as usize..SLICE.end as usize]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_tell_which_regions_exist() {
    let (node, mut peer, live, src) = setup().await;
    let gone = peer.alloc(4096, Access::ReadWrite, 8).await;
    peer.drop_region(&gone).await;
    let write = |remote: RemoteBuffer| vec![RdmaOp::write(src.slice(0..4096).unwrap(), remote)];
    let small = live.handle.slice(0..4096).unwrap();
    let generation = live.handle.generation().0;
    // What a stranger may try: a guessed token on a live region, on a
    // slot that holds nothing, on a region that is gone, on a generation
    // that never was or is no more. Each answer is the same.
    let probes = [
        ("a wrong token", with_wrong_token(&small)),
        (
            "an empty slot",
            forge(&with_wrong_token(&small), |j| j["region"] = 999.into()),
        ),
        (
            "an empty slot, the live token",
            forge(&small, |j| j["region"] = 999.into()),
        ),
        ("a region gone", with_wrong_token(&gone.handle)),
        (
            "a later generation",
            forge(&small, |j| j["generation"] = (generation + 1).into()),
        ),
        (
            "an earlier generation",
            forge(&small, |j| j["generation"] = (generation - 1).into()),
        ),
    ];
    for (what, probe) in probes {
        let result = node.submit(write(probe), DEADLINE).await;
        assert_eq!(
            result,
            Err(SubmitError::Op {
                index: 0,
                error: OpError::AccessDenied
            }),
            "{what}"
        );
    }
    assert_unchanged(&mut peer, &live).await;
    // Whoever holds the gone region's handle still hears why.
    assert_refused(
        node.submit(write(gone.handle.clone()), DEADLINE).await,
        |e| *e == OpError::UnknownRegion,
    );
    let reused = peer.alloc(4096, Access::ReadWrite, 9).await;
    assert_eq!(reused.handle.region(), gone.handle.region(), "slot reused");
    assert_refused(
        node.submit(write(gone.handle.clone()), DEADLINE).await,
        |e| {
            *e == OpError::StaleGeneration {
                handle: gone.handle.generation(),
                current: reused.handle.generation(),
            }
        },
    );
    // A slice of it, handed over, too.
    let gone_slice = handed_over(&gone.handle.slice(0..100).unwrap());
    let write_slice = vec![RdmaOp::write(src.slice(0..100).unwrap(), gone_slice)];
    assert_refused(node.submit(write_slice, DEADLINE).await, |e| {
        matches!(e, OpError::StaleGeneration { .. })
    });
    // And a stranger probing the reused slot with the old generation.
    let probe = with_wrong_token(&gone.handle);
    assert_refused(node.submit(write(probe), DEADLINE).await, |e| {
        *e == OpError::AccessDenied
    });
    assert_unchanged(&mut peer, &reused).await;
}
