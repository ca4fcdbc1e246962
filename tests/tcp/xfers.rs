//! Transfer requests over TCP between two processes.

use ferry::prelude::*;

use crate::common::PeerProcess;

#[path = "../shared/xfers.rs"]
mod shared;

async fn node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_tcp_lives_posts_again_and_refuses_bad_input() {
    let node = node().await;
    let mut peer = PeerProcess::spawn().await;
    shared::a_request_lives_posts_again_and_refuses_bad_input(
        &node,
        &mut peer,
        RdmaTransportLevel::Tcp,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_over_tcp_moves_at_most_one_window() {
    let node = node().await;
    let mut peer = PeerProcess::spawn().await;
    shared::a_cancelled_request_moves_at_most_one_window(&node, &mut peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_tcp_cancelled_against_a_stopped_owner_ends_cancelled() {
    let node = node().await;
    let mut peer = PeerProcess::spawn().await;
    shared::a_request_cancelled_against_a_stopped_owner_ends_cancelled(&node, &mut peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_restarted_after_prepare_is_refused_over_tcp() {
    let node = node().await;
    shared::a_peer_restarted_after_prepare_is_refused_typed(&node, &[]).await;
}

/// `connect` opens the TCP data connections ahead of the first transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_opens_the_data_connections_ahead() {
    let node = node().await;
    let mut peer = PeerProcess::spawn().await;
    let addr = peer.node_addr().await.unwrap();
    assert_eq!(node.tcp().open_connections(), 0);
    let connected = node
        .connect(addr, std::time::Duration::from_secs(10))
        .await
        .unwrap();
    assert!(connected.control && !connected.memory && !connected.ibverbs);
    assert!(connected.tcp_connections > 0);
    assert_eq!(node.tcp().open_connections(), connected.tcp_connections);
    // A node nobody listens for: refused, typed.
    let gone = ferry::NodeAddr {
        id: addr.id,
        endpoint: std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap(),
    };
    assert!(matches!(
        node.connect(gone, std::time::Duration::from_secs(5)).await,
        Err(ferry::PrepareError::Connect { .. })
    ));
}
