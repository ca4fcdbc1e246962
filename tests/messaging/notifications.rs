//! Notifications attached to a submit, over TCP (the checks are shared with
//! the RDMA suite: tests/shared/notify.rs).

use ferry::Node;

#[path = "../shared/notify.rs"]
mod notify;

async fn tcp_node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_bytes_are_in_place_when_the_owner_is_notified() {
    let (owner, initiator) = (tcp_node().await, tcp_node().await);
    notify::written_bytes_are_in_place_when_the_owner_is_notified(&owner, &initiator, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_owner_is_notified_once_and_failures_notify_nobody() {
    let owners = [tcp_node().await, tcp_node().await];
    let initiator = tcp_node().await;
    notify::each_owner_is_notified_once_and_failures_notify_nobody(
        [&owners[0], &owners[1]],
        &initiator,
    )
    .await;
}
