//! Notified batches from a peer process over TCP, with the peer's four
//! data connections (the checks: tests/shared/notified_batches.rs).

use ferry::Node;

#[path = "../shared/notified_batches.rs"]
mod shared;

async fn tcp_node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_notified_writes_each_find_their_bytes_in_place() {
    shared::notified_writes_each_find_their_bytes_in_place(&tcp_node().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_notified_reads_are_done_when_the_owner_hears() {
    shared::notified_reads_are_done_when_the_owner_hears(&tcp_node().await).await;
}
