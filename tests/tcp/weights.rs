//! Weight publication over TCP: see `tests/shared/weights.rs`.

use ferry::prelude::*;

#[path = "../shared/weights.rs"]
mod shared;

/// A node that moves region bytes over TCP only.
async fn tcp_node() -> Node {
    Node::builder()
        .ibverbs(false)
        .memory(false)
        .spawn()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_versions_reach_subscribers_of_another_sharding_whole() {
    shared::ten_versions_reach_subscribers_of_another_sharding_whole(&tcp_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_sees_two_versions_mixed() {
    shared::a_reader_never_sees_two_versions_mixed(&tcp_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_vanishes_holds_no_writer_up_and_an_overrun_one_fails_typed() {
    shared::a_reader_that_vanishes_holds_no_writer_up_and_an_overrun_one_fails_typed(&tcp_node)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_publisher_leaves_the_last_version_and_a_restart_is_planned_again() {
    shared::a_lost_publisher_leaves_the_last_version_and_a_restart_is_planned_again(&tcp_node)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_update_in_place_leaves_readers_waiting_not_reading_a_mix() {
    shared::a_failed_update_in_place_leaves_readers_waiting_not_reading_a_mix(&tcp_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_started_again_in_place_serves_the_set() {
    shared::a_publisher_started_again_in_place_serves_the_set(&tcp_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_carry_each_version_down_a_tree_of_subscribers() {
    shared::relays_carry_each_version_down_a_tree_of_subscribers(&tcp_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_to_waits_for_a_version_published_after_the_call() {
    shared::update_to_waits_for_a_version_published_after_the_call(&tcp_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksums_pass_what_each_rank_served_and_catch_a_source_that_differs() {
    shared::checksums_pass_what_each_rank_served_and_catch_a_source_that_differs(&tcp_node).await;
}

/// The two-VM test's scenario (tests/rxe_wire/weights.rs) on one host:
/// publisher ranks in peer processes, a subscriber here and one in a
/// third process, checksums on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_published_by_peer_processes_reach_subscribers_in_others() {
    use crate::common::PeerProcess;
    use crate::common::peer_weights::data::{held, layout, local};
    use ferry::weights::Subscriber;

    let deadline = std::time::Duration::from_secs(30);
    let mut ranks = Vec::new();
    let mut addrs = Vec::new();
    for rank in 0..2 {
        let mut peer = PeerProcess::spawn().await;
        assert_eq!(peer.weights_publish("procs", rank, 2, 1).await, 0);
        addrs.push(peer.node_addr().await.unwrap().endpoint);
        ranks.push(peer);
    }
    let node = tcp_node().await;
    let buffer = vec![local(&node, layout(1, 2, 1)).await];
    let mut here = Subscriber::new(&node, "procs", &addrs, buffer, deadline)
        .await
        .unwrap();
    here.verify_checksums(true);
    let mut there = PeerProcess::spawn().await;
    there.weights_subscribe("procs", 0, 1, &addrs).await;
    for version in 1..=3 {
        if version > 1 {
            for (rank, peer) in ranks.iter_mut().enumerate() {
                assert_eq!(
                    peer.weights_publish("procs", rank as u32, 2, version).await,
                    0
                );
            }
        }
        let update = here.update(deadline).await.unwrap();
        assert_eq!(update.version, version);
        assert_eq!(held(&here.buffers()[0]), Some(version));
        assert_eq!(
            there.weights_update("procs").await,
            (version, Some(version))
        );
    }
}
