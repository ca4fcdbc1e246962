//! `Node::shutdown` with the ibverbs transport on its own (issue 37, item
//! 7): a shut-down initiator posts nothing more to a NIC and says why, and
//! a shut-down owner's memory is out of reach of a peer whose queue pair
//! was connected before (no byte moves either way). The same-host
//! transport's side of this is `tests/memory/shutdown.rs`.

use std::time::Duration;

use ferry::prelude::*;
use ferry::{Descs, LocalDescList, NotifyError, RegisterError, RemoteDescList, XferError};

use crate::common::pattern;
use crate::{DEADLINE, rdma_node};

const LEN: usize = 256 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_shut_down_initiator_posts_nothing_over_rdma_and_says_why() {
    let node = rdma_node().await;
    let owner = rdma_node().await;
    let local = node.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    local.write_at(0, &pattern(LEN, 1)).unwrap();
    let remote = owner.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    let write = vec![RdmaOp::write(local.whole(), remote.remote())];
    assert_eq!(node.route(&write[0]), Some(RdmaTransportLevel::Nic));
    node.submit(write.clone(), DEADLINE).await.unwrap();
    assert!(remote.to_vec() == pattern(LEN, 1));
    // A request prepared before the shutdown, over the connected QP.
    let blocks = Descs::strided(0, 0, 4096, 4096, (LEN / 4096) as u32);
    let locals = LocalDescList::new(vec![local.clone()], blocks.clone()).unwrap();
    let remotes = RemoteDescList::new(vec![remote.remote()], blocks).unwrap();
    let prepared = node.prepare_remote(remotes, DEADLINE).await.unwrap();
    assert_eq!(prepared.levels(), [RdmaTransportLevel::Nic]);
    let count = LEN / 4096;
    let xfer = node
        .make_xfer(OpKind::Write, &locals, 0..count, &prepared, 0..count)
        .unwrap();
    remote.write_at(0, &pattern(LEN, 2)).unwrap();
    local.write_at(0, &pattern(LEN, 3)).unwrap();

    node.shutdown().await;
    assert_eq!(
        node.submit(write.clone(), DEADLINE).await,
        Err(SubmitError::ShutDown)
    );
    assert_eq!(
        node.submit_with_notification(write, DEADLINE, &b"n"[..])
            .await,
        Err(NotifyError::Submit(SubmitError::ShutDown))
    );
    assert_eq!(
        node.alloc(4096, Access::ReadWrite).await.err(),
        Some(RegisterError::ShutDown)
    );
    xfer.post(DEADLINE).unwrap();
    assert_eq!(
        xfer.wait().await,
        Err(XferError::Submit(SubmitError::ShutDown))
    );
    assert!(
        remote.to_vec() == pattern(LEN, 2),
        "a byte moved after shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_shut_down_owner_is_out_of_reach_of_a_connected_rdma_peer() {
    let owner = rdma_node().await;
    let peer = rdma_node().await;
    let region = owner.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    region.write_at(0, &pattern(LEN, 4)).unwrap();
    let handle = region.remote();
    let src = peer.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(LEN, 5)).unwrap();
    let dst = peer.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    // Connected and working before: a read over the NIC.
    let read = RdmaOp::read(dst.whole(), handle.clone());
    assert_eq!(peer.route(&read), Some(RdmaTransportLevel::Nic));
    peer.submit(vec![read], DEADLINE).await.unwrap();
    assert!(dst.to_vec() == pattern(LEN, 4));
    dst.write_at(0, &pattern(LEN, 6)).unwrap();

    owner.shutdown().await;
    // The owner's queue pairs and registrations are gone: each op fails
    // (an error from the NIC, or no answer within the deadline), typed.
    let deadline = Duration::from_secs(10);
    let wrote = peer
        .submit(vec![RdmaOp::write(src.whole(), handle.clone())], deadline)
        .await;
    assert!(
        matches!(
            wrote,
            Err(SubmitError::Op { index: 0, .. } | SubmitError::Timeout { .. })
        ),
        "a write to a shut-down owner: {wrote:?}"
    );
    let read = peer
        .submit(vec![RdmaOp::read(dst.whole(), handle)], deadline)
        .await;
    assert!(
        matches!(
            read,
            Err(SubmitError::Op { index: 0, .. } | SubmitError::Timeout { .. })
        ),
        "a read of a shut-down owner: {read:?}"
    );
    assert!(dst.to_vec() == pattern(LEN, 6), "bytes were read");
    assert!(
        region.to_vec() == pattern(LEN, 4),
        "a write landed in a shut-down owner's region"
    );
}
