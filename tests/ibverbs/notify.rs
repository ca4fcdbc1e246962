//! Notifications attached to a submit, over RDMA: the same checks as the
//! TCP suite (tests/shared/notify.rs), with nodes that run ibverbs.

#[path = "../shared/notify.rs"]
mod shared;

use ferry::ibverbs;
use ferry::prelude::*;

use crate::rdma_node;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn written_bytes_are_in_place_when_the_owner_is_notified() {
    let (owner, initiator) = (rdma_node().await, rdma_node().await);
    shared::written_bytes_are_in_place_when_the_owner_is_notified(&owner, &initiator, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn each_owner_is_notified_once_and_failures_notify_nobody() {
    let owners = [rdma_node().await, rdma_node().await];
    let initiator = rdma_node().await;
    shared::each_owner_is_notified_once_and_failures_notify_nobody(
        [&owners[0], &owners[1]],
        &initiator,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn ten_thousand_notified_writes_from_a_peer_process_find_their_bytes_in_place() {
    crate::notified_batches::notified_writes_each_find_their_bytes_in_place(&rdma_node().await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn notified_writes_each_waking_the_owner_each_arrive_once_with_their_bytes_in_place() {
    // The owner wakes on each notification's event, as on a NIC (on this
    // software device it coalesces them by default, which the test above
    // covers): every one still reaches the inbox once, after its bytes.
    let config = ibverbs::IbvConfig {
        notify_coalesce: Some(std::time::Duration::ZERO),
        ..Default::default()
    };
    let owner = crate::rdma_node_with(config).await;
    crate::notified_batches::notified_writes_each_find_their_bytes_in_place(&owner).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn ten_thousand_notified_reads_from_a_peer_process_are_done_when_the_owner_hears() {
    crate::notified_batches::notified_reads_are_done_when_the_owner_hears(&rdma_node().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_stalled_consumer_holds_senders_back_and_resumes() {
    let owner = Node::builder()
        .memory(false)
        .inbox_capacity(2)
        .spawn()
        .await
        .unwrap();
    let initiator = rdma_node().await;
    // Each notification rides the queue pair into a receive buffer the
    // owner posted, one credit each, and its credit comes back only once
    // the inbox took it: the owner holds its buffers' worth, where the
    // control session alone would hold back at the inbox's 2 (plus those
    // 2 slots, if a notification that found no credit reaches them before
    // the buffers' own do). The inbox is smaller than a credit return (a
    // quarter ring).
    let slots = usize::from(ibverbs::IbvConfig::default().notify_slots);
    shared::a_stalled_consumer_holds_senders_back_and_resumes(
        &owner,
        &initiator,
        slots..=slots + 2,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_timed_out_notified_batch_notifies_nobody() {
    let (owner, initiator) = (rdma_node().await, rdma_node().await);
    shared::a_timed_out_notified_batch_notifies_nobody(&owner, &initiator).await;
}
