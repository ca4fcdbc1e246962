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

/// A request of no descriptors moves nothing, and a post of it still sends
/// its notification to the owner of the remote list, exactly once per post
/// (before issue 37 it completed `Done` and the notification went nowhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_no_descriptors_still_notifies_the_owner() {
    use ferry::{DeliveryKind, Descs, LocalDescList, RemoteDescList};
    use std::time::Duration;

    let owner = node().await;
    let initiator = node().await;
    let deadline = Duration::from_secs(20);
    let target = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    let mine = initiator.alloc(4096, Access::ReadWrite).await.unwrap();
    let locals = LocalDescList::new(vec![mine], Descs::new()).unwrap();
    let remotes = RemoteDescList::new(vec![target.remote()], Descs::new()).unwrap();
    let prepared = initiator.prepare_remote(remotes, deadline).await.unwrap();
    let xfer = initiator
        .make_xfer(OpKind::Write, &locals, 0..0, &prepared, 0..0)
        .unwrap()
        .with_notification("nothing to move");
    assert!(xfer.is_empty());
    let mut inbox = owner.inbox().unwrap();
    for _ in 0..2 {
        xfer.post(deadline).unwrap();
        xfer.wait().await.unwrap();
        let delivery = tokio::time::timeout(deadline, inbox.recv())
            .await
            .expect("the notification within the deadline")
            .expect("an open inbox");
        assert_eq!(delivery.kind, DeliveryKind::Notification);
        assert_eq!(delivery.from, initiator.addr());
        assert_eq!(&delivery.body[..], b"nothing to move");
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(200), inbox.recv())
            .await
            .is_err(),
        "one notification per post"
    );
}

/// `PreparedRemote::with_descs`: other descriptors over the regions one
/// list prepared, checked as a new list is, and moving their own bytes
/// (what the NIXL plugin does for every request after the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_list_takes_other_descriptors_over_its_regions() {
    use ferry::{DescError, Descs, LocalDescList, RemoteDescList};
    use std::time::Duration;

    let owner = node().await;
    let initiator = node().await;
    let deadline = Duration::from_secs(20);
    let target = owner.alloc(64 * 1024, Access::ReadWrite).await.unwrap();
    let mine = initiator.alloc(4096, Access::ReadWrite).await.unwrap();
    mine.write_at(0, &[7u8; 4096]).unwrap();
    let first = RemoteDescList::new(vec![target.remote()], Descs::strided(0, 0, 4096, 4096, 1));
    let prepared = initiator
        .prepare_remote(first.unwrap(), deadline)
        .await
        .unwrap();
    // Block 9 of the region, never named when it was prepared.
    let other = prepared
        .with_descs(Descs::from_triples(&[[0, 9 * 4096, 4096]]).unwrap())
        .unwrap();
    assert_eq!(other.levels(), prepared.levels());
    let locals = LocalDescList::new(vec![mine], Descs::strided(0, 0, 4096, 4096, 1)).unwrap();
    let xfer = initiator
        .make_xfer(OpKind::Write, &locals, 0..1, &other, 0..1)
        .unwrap();
    xfer.post(deadline).unwrap();
    xfer.wait().await.unwrap();
    let bytes = target.to_vec();
    assert!(bytes[9 * 4096..10 * 4096].iter().all(|&b| b == 7));
    assert!(bytes[..9 * 4096].iter().all(|&b| b == 0));
    // Outside the region: refused as a new list would be.
    assert!(matches!(
        prepared.with_descs(Descs::from_triples(&[[0, 64 * 1024 - 1, 2]]).unwrap()),
        Err(DescError::Descriptor { index: 0, .. })
    ));
}
