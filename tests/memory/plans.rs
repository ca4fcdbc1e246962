//! Layouts and plans over the same-host memory transport: see
//! `tests/shared/plans.rs`.

use ferry::prelude::*;

#[path = "../shared/plans.rs"]
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
async fn a_kv_cache_moves_from_tp4_to_tp2_through_same_host_memory() {
    shared::a_kv_cache_moves_from_tp4_to_tp2_byte_for_byte(memory_node, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_layouts_are_refused_at_plan_time() {
    shared::bad_layouts_are_refused_at_plan_time(memory_node).await;
}
