//! Layouts and plans over TCP: see `tests/shared/plans.rs`.

use ferry::prelude::*;

#[path = "../shared/plans.rs"]
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
async fn a_kv_cache_moves_from_tp4_to_tp2_over_tcp() {
    shared::a_kv_cache_moves_from_tp4_to_tp2_byte_for_byte(tcp_node, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_cache_moves_as_its_owners_published_their_layouts() {
    shared::a_kv_cache_moves_from_tp4_to_tp2_byte_for_byte(tcp_node, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_layouts_are_refused_at_plan_time() {
    shared::bad_layouts_are_refused_at_plan_time(tcp_node).await;
}
