//! Weight publication through same-host memory: see `tests/shared/weights.rs`.

use ferry::prelude::*;

#[path = "../shared/weights.rs"]
mod shared;

/// A node that moves region bytes through same-host memory only.
async fn memory_node() -> Node {
    Node::builder()
        .ibverbs(false)
        .tcp(false)
        .spawn()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_versions_reach_subscribers_of_another_sharding_whole() {
    shared::ten_versions_reach_subscribers_of_another_sharding_whole(&memory_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_sees_two_versions_mixed() {
    shared::a_reader_never_sees_two_versions_mixed(&memory_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_vanishes_holds_no_writer_up_and_an_overrun_one_fails_typed() {
    shared::a_reader_that_vanishes_holds_no_writer_up_and_an_overrun_one_fails_typed(&memory_node)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_publisher_leaves_the_last_version_and_a_restart_is_planned_again() {
    shared::a_lost_publisher_leaves_the_last_version_and_a_restart_is_planned_again(&memory_node)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_update_in_place_leaves_readers_waiting_not_reading_a_mix() {
    shared::a_failed_update_in_place_leaves_readers_waiting_not_reading_a_mix(&memory_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_started_again_in_place_serves_the_set() {
    shared::a_publisher_started_again_in_place_serves_the_set(&memory_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_carry_each_version_down_a_tree_of_subscribers() {
    shared::relays_carry_each_version_down_a_tree_of_subscribers(&memory_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_to_waits_for_a_version_published_after_the_call() {
    shared::update_to_waits_for_a_version_published_after_the_call(&memory_node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksums_pass_what_each_rank_served_and_catch_a_source_that_differs() {
    shared::checksums_pass_what_each_rank_served_and_catch_a_source_that_differs(&memory_node)
        .await;
}
