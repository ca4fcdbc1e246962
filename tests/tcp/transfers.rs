//! Data moved between two processes, verified byte for byte on both sides.

use ferry::prelude::*;

use crate::common::{PeerProcess, digest};

#[path = "../shared/workers.rs"]
mod workers;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_back_sizes_1_byte_to_256_mib() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let sizes = [
        1usize,
        7,
        4096,
        65_537,
        1 << 20,
        (3 << 20) + 5,
        64 << 20,
        256 << 20,
    ];
    for (i, len) in sizes.into_iter().enumerate() {
        crate::common::write_then_read_back(&node, &mut peer, len, i as u8, None).await;
    }
}

/// Ops of one batch run concurrently, so they target disjoint ranges; even
/// ops write, odd ops read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_1_to_1024_mixed_reads_and_writes() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    for (round, batch) in [1usize, 2, 16, 333, 1024].into_iter().enumerate() {
        // Op sizes cycle through awkward lengths, including ones above the chunk size.
        let sizes: Vec<usize> = (0..batch)
            .map(|i| [1, 100, 4096, 5000, (1 << 20) + 3][i % 5])
            .collect();
        crate::common::mixed_batch_round_trip(&node, &mut peer, &sizes, round as u8).await;
    }
}

/// 16 worker actors, each holding only the node's actor, write and read
/// back their slices of one remote region concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_worker_actors_submit_concurrently_to_the_node_actor() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let slice = (1 << 20) + 77;
    let target = peer.alloc(16 * slice, Access::ReadWrite, 9).await;
    let expected = workers::worker_round_trips(&node, &target.handle, target.original(), 16).await;
    assert_eq!(peer.digest(&target).await, digest(&expected));
}

/// The node's actor answers other messages while it has a transfer running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_actor_answers_while_a_transfer_runs() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let len = 256 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 4).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    // 2 GiB: far longer than one message takes.
    workers::the_actor_answers_while_a_transfer_runs(&node, &src, &target.handle, 8).await;
}

/// A bad op in a batch sent to the node's actor fails the batch with a
/// typed error naming it, and no byte of the batch moves; an empty batch is
/// answered `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_actor_refuses_a_bad_batch_whole() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let writable = peer.alloc(4096, Access::ReadWrite, 3).await;
    let read_only = peer.alloc(4096, Access::ReadOnly, 5).await;
    let src = node.alloc(4096, Access::ReadWrite).await.unwrap();
    src.write_at(0, &[0xEE; 4096]).unwrap();
    let submit = |ops| Submit {
        ops,
        timeout: std::time::Duration::from_secs(10),
    };
    let ops = vec![
        RdmaOp::write(src.whole(), writable.handle.clone()),
        RdmaOp::write(src.whole(), read_only.handle.clone()),
    ];
    let result = node.actor().ask(submit(ops)).await;
    assert_eq!(
        result.map_err(SubmitError::from),
        Err(SubmitError::Op {
            index: 1,
            error: OpError::ReadOnly
        })
    );
    assert_eq!(peer.digest(&writable).await, digest(&writable.original()));
    assert_eq!(node.actor().ask(submit(vec![])).await.ok(), Some(()));
}

#[path = "../shared/descs.rs"]
mod descs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_100_000_descriptors_over_tcp_is_verified_byte_for_byte() {
    let node = Node::builder().ibverbs(false).spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    descs::descriptors_round_trip(&node, &mut peer, RdmaTransportLevel::Tcp, 100_000).await;
}
