//! Notified batches from a peer process over the memory transport: each
//! notification rides the lane the peer opened into this node (a ring in
//! shared memory), and arrives exactly once, after its batch's copies
//! (the checks: tests/shared/notified_batches.rs).

use crate::{node, sharing_peer};

#[path = "../shared/notified_batches.rs"]
mod shared;

const BATCHES: usize = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_notified_writes_from_another_process_find_their_bytes_in_place() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    shared::notified_writes_from(&node, &mut peer, BATCHES).await;
    // They came on a lane, not the control session.
    assert_eq!(node.peer_tables().memory_lanes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_notified_reads_from_another_process_are_done_when_the_owner_hears() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    shared::notified_reads_from(&node, &mut peer, BATCHES).await;
    assert_eq!(node.peer_tables().memory_lanes, 1);
}
