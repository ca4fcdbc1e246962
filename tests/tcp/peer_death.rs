//! A peer process that dies mid-call: the caller learns it from the
//! control session at once, long before the call's deadline.

use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry::{Node, RpcError};

use crate::common::PeerProcess;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rpc_to_a_peer_killed_mid_call_fails_connection_lost() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let addr = peer.node_addr().await.unwrap();
    peer.serve_forever("forever").await;
    let hour = Duration::from_secs(3600);
    let call = tokio::spawn({
        let node = node.clone();
        async move { node.call(addr, "forever", Bytes::new(), hour).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "the handler never answers");
    let killed = Instant::now();
    peer.kill().await;
    let result = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call outlived its peer by 10 s")
        .unwrap();
    assert_eq!(
        result,
        Err(RpcError::ConnectionLost {
            peer: addr.endpoint,
            name: "forever".into()
        }),
        "after {:?}",
        killed.elapsed()
    );
}
