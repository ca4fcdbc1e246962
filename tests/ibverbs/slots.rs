//! Per-peer queue-pair slots are released when their peers go.

use std::time::{Duration, Instant};

use ferry::prelude::*;

use crate::common::{PeerProcess, reads_back, submit_until_it_fails};
use crate::{DEADLINE, rdma_node};

/// Waits (up to 10 s) for `node` to hold queue-pair slots for exactly
/// `count` peers; returns how many it holds.
async fn qp_slots_settle(node: &Node, count: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let held = node.peer_tables().ibverbs_peers;
        if held == count || Instant::now() >= deadline {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn queue_pair_slots_go_with_their_peers() {
    let node = rdma_node().await;
    let mut peers = Vec::new();
    for seed in 0..3u8 {
        let mut peer = PeerProcess::spawn().await;
        let target = peer.alloc(4096, Access::ReadWrite, seed).await;
        peers.push((peer, target));
    }
    let back = node.alloc(4096, Access::ReadWrite).await.unwrap();
    for (_, target) in &peers {
        reads_back(&node, &back, target, DEADLINE).await;
    }
    assert_eq!(node.peer_tables().ibverbs_peers, 3);

    // One peer dies idle, one in the middle of a long read. The reads go
    // on, batch after batch, until one fails: a fast link may finish a
    // batch before the kill lands, and that must not pass for a read that
    // succeeded from a dead peer.
    peers[0].0.kill().await;
    let big = 16 << 20;
    let long_target = peers[1].0.alloc(big, Access::ReadWrite, 9).await;
    let local = node.alloc(big as u64, Access::ReadWrite).await.unwrap();
    let transfer = tokio::spawn({
        let node = node.clone();
        let ops: Vec<_> = (0..64)
            .map(|_| RdmaOp::read(local.whole(), long_target.handle.clone()))
            .collect();
        async move {
            let give_up = Instant::now() + DEADLINE;
            submit_until_it_fails(&node, &ops, DEADLINE, give_up)
                .await
                .0
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    peers[1].0.kill().await;
    let result = tokio::time::timeout(2 * DEADLINE, transfer)
        .await
        .expect("no hang")
        .unwrap();
    assert!(
        result.is_err(),
        "reads from a killed peer went on succeeding"
    );
    assert_eq!(
        qp_slots_settle(&node, 1).await,
        1,
        "slots of the two dead peers"
    );

    // The survivor's queue pair is untouched and still works.
    let (peer, target) = &mut peers[2];
    reads_back(&node, &back, target, DEADLINE).await;
    peer.kill().await;
    assert_eq!(qp_slots_settle(&node, 0).await, 0, "slot of the last peer");
}
