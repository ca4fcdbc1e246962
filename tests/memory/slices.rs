//! Slices handed to a same-host process are boundaries too: a memfd
//! region's slice is never answered with the region's memfd (it goes over
//! the next transport, which checks its range), a `process_vm` region's
//! slice is granted its own range only, and a slice widened in its JSON
//! is refused either way with the owner's bytes unchanged. A stranger
//! probing slots over the same-host socket hears `AccessDenied` for all.

use ferry::prelude::*;
use ferry::{MemoryPath, TransportPath};

use crate::common::{PeerProcess, PeerRegion, digest, forge, pattern};
use crate::{DEADLINE, assert_op_error, node, sharing_peer};

const LEN: usize = 64 * 1024;
const SLICE: std::ops::Range<u64> = 4096..8192;

/// `handle` as another process receives it: through its serialized form.
fn handed_over(handle: &RemoteBuffer) -> RemoteBuffer {
    serde_json::from_str(&serde_json::to_string(handle).unwrap()).unwrap()
}

/// Writes through a slice handed over and through that slice widened,
/// moved and re-narrowed: the first lands in the slice alone, the others
/// are refused. Returns the region's expected contents.
async fn widened_slices_are_refused(node: &Node, peer: &mut PeerProcess, target: &PeerRegion) {
    let src = node.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(LEN, 0xEE)).unwrap();
    let write = |remote: RemoteBuffer| {
        let len = remote.len();
        vec![RdmaOp::write(src.slice(0..len).unwrap(), remote)]
    };
    let slice = handed_over(&target.handle.slice(SLICE).unwrap());
    let whole = forge(&slice, |j| {
        j["addr"] = target.handle.addr().into();
        j["len"] = (LEN as u64).into();
    });
    assert_op_error(node.submit(write(whole.clone()), DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    let moved = forge(&slice, |j| j["addr"] = (slice.addr() + 4096).into());
    assert_op_error(node.submit(write(moved), DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    assert_op_error(
        node.submit(write(handed_over(&whole)), DEADLINE).await,
        |e| *e == OpError::AccessDenied,
    );
    assert_eq!(
        peer.digest(target).await,
        digest(&target.original()),
        "a widened slice changed the owner's bytes"
    );
    // The slice itself, and a slice of it, work.
    node.submit(write(slice.clone()), DEADLINE).await.unwrap();
    let sub = handed_over(&slice.slice(100..200).unwrap());
    let back = node.alloc(100, Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), sub)], DEADLINE)
        .await
        .unwrap();
    assert!(back.to_vec() == pattern(LEN, 0xEE)[100..200]);
    let mut expected = target.original();
    let span = SLICE.start as usize..SLICE.end as usize;
    expected[span.clone()].copy_from_slice(&pattern(LEN, 0xEE)[..span.len()]);
    assert_eq!(peer.digest(target).await, digest(&expected));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_widened_slice_of_a_memfd_region_is_refused() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let target = peer.alloc(LEN, Access::ReadWrite, 3).await;
    widened_slices_are_refused(&node, &mut peer, &target).await;
    // Handing out the memfd would hand out the whole region: a slice
    // goes over TCP, whose owner checks its range. The whole handle, and
    // one narrowed to reads only, are still mapped.
    let local = node.alloc(4096, Access::ReadWrite).await.unwrap();
    let slice = handed_over(&target.handle.slice(SLICE).unwrap());
    let op = RdmaOp::read(local.whole(), slice);
    assert_eq!(node.route(&op), Some(RdmaTransportLevel::Tcp));
    let whole = RdmaOp::read(local.whole(), target.handle.slice(0..4096).unwrap());
    assert_eq!(node.route(&whole), Some(RdmaTransportLevel::Memory));
    let read_only = handed_over(&target.handle.read_only());
    let op = RdmaOp::read(local.whole(), read_only.slice(0..4096).unwrap());
    assert_eq!(
        node.path(&op),
        Some(TransportPath::Memory(MemoryPath::Mapped))
    );
    node.submit(vec![op], DEADLINE).await.unwrap();
    let write = RdmaOp::write(local.whole(), read_only.slice(0..4096).unwrap());
    assert_op_error(node.submit(vec![write], DEADLINE).await, |e| {
        *e == OpError::ReadOnly
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_hands_no_memfd_to_credentials_for_part_of_it() {
    // A holder of the whole handle derives a slice's same-host token itself
    // and asks for the memfd with it, as a peer that does not leave such
    // credentials out would: the owner refuses, since the memfd opens the
    // whole region. The owner's bytes do not change.
    let node = node().await;
    let mut peer = sharing_peer().await;
    let target = peer.alloc(LEN, Access::ReadWrite, 7).await;
    let slice = handed_over(&target.handle.slice(SLICE).unwrap());
    assert_eq!(slice.transports().memory, None);
    let memory = target.handle.transports().memory.unwrap();
    let scope = slice.scopes().as_slice()[0];
    let forged = forge(&slice, |j| {
        j["transports"]["memory"] = serde_json::json!({
            "boot_id": format!("{:032x}", memory.boot_id),
            "token": format!("{:032x}", ferry::scope_token(memory.token, &scope)),
        })
    });
    let src = node
        .alloc(SLICE.end - SLICE.start, Access::ReadWrite)
        .await
        .unwrap();
    for op in [
        RdmaOp::write(src.whole(), forged.clone()),
        RdmaOp::read(src.whole(), forged),
    ] {
        assert_eq!(node.route(&op), Some(RdmaTransportLevel::Memory));
        assert_op_error(node.submit(vec![op], DEADLINE).await, |e| {
            *e == OpError::AccessDenied
        });
    }
    assert_eq!(peer.digest(&target).await, digest(&target.original()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_widened_slice_of_a_process_vm_region_is_refused() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let target = peer.alloc_raw(LEN, Access::ReadWrite, 4).await;
    let local = node.alloc(4096, Access::ReadWrite).await.unwrap();
    let slice = handed_over(&target.handle.slice(SLICE).unwrap());
    let op = RdmaOp::read(local.whole(), slice);
    assert_eq!(
        node.path(&op),
        Some(TransportPath::Memory(MemoryPath::ProcessVm))
    );
    widened_slices_are_refused(&node, &mut peer, &target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_on_the_same_host_cannot_tell_which_regions_exist() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let live = peer.alloc(4096, Access::ReadWrite, 5).await;
    let gone = peer.alloc(4096, Access::ReadWrite, 6).await;
    peer.drop_region(&gone).await;
    let src = node.alloc(4096, Access::ReadWrite).await.unwrap();
    let write = |remote: RemoteBuffer| vec![RdmaOp::write(src.whole(), remote)];
    let wrong = |handle: &RemoteBuffer| {
        forge(handle, |j| {
            let token = &mut j["transports"]["memory"]["token"];
            let value = u128::from_str_radix(token.as_str().unwrap(), 16).unwrap();
            *token = format!("{:032x}", value ^ 1).into();
        })
    };
    let generation = live.handle.generation().0;
    let probes = [
        ("a wrong token", wrong(&live.handle)),
        (
            "an empty slot",
            forge(&live.handle, |j| j["region"] = 999.into()),
        ),
        ("a region gone", wrong(&gone.handle)),
        (
            "a later generation",
            forge(&live.handle, |j| j["generation"] = (generation + 1).into()),
        ),
    ];
    for (what, probe) in probes {
        let op = write(probe);
        assert_eq!(node.route(&op[0]), Some(RdmaTransportLevel::Memory));
        assert_op_error(node.submit(op, DEADLINE).await, |e| {
            assert_eq!(*e, OpError::AccessDenied, "{what}");
            true
        });
    }
    assert_op_error(
        node.submit(write(gone.handle.clone()), DEADLINE).await,
        |e| *e == OpError::UnknownRegion,
    );
    assert_eq!(peer.digest(&live).await, digest(&live.original()));
}
