//! Transfer requests over the same-host memory transport.

use ferry::DISABLE_MEMORY_ENV;
use ferry::prelude::*;

use crate::common::PeerProcess;

#[path = "../shared/xfers.rs"]
mod shared;

async fn node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

async fn sharing_peer() -> PeerProcess {
    PeerProcess::spawn_with_env(&[(DISABLE_MEMORY_ENV, "0")]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_request_lives_posts_again_and_refuses_bad_input() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    shared::a_request_lives_posts_again_and_refuses_bad_input(
        &node,
        &mut peer,
        RdmaTransportLevel::Memory,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_same_host_request_is_done_when_its_post_returns() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    shared::a_small_same_host_request_is_done_when_its_post_returns(&node, &mut peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_same_host_request_moves_at_most_one_window() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    shared::a_cancelled_request_moves_at_most_one_window(&node, &mut peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_peer_restarted_after_prepare_is_refused() {
    let node = node().await;
    shared::a_peer_restarted_after_prepare_is_refused_typed(&node, &[(DISABLE_MEMORY_ENV, "0")])
        .await;
}

/// `connect` to a same-host peer opens the link and the lane, not TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_same_host_peer_opens_its_link() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let addr = peer.node_addr().await.unwrap();
    let connected = node
        .connect(addr, std::time::Duration::from_secs(10))
        .await
        .unwrap();
    assert!(connected.memory && connected.control, "{connected:?}");
    assert_eq!(connected.tcp_connections, 0);
    assert_eq!(node.tcp().open_connections(), 0);
}
