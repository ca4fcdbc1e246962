//! What publishing a region grants, and to whom. A published region's
//! handle, tokens included, goes to whoever loads the node's metadata: over
//! its control sessions, and into etcd. With a cluster secret only members
//! open a session, and a handle is of no use to anyone else (every channel's
//! hello refuses them); without one, publishing opens the region to whoever
//! reaches the node's port, which the node says when it publishes.

use bytes::Bytes;
use ferry::prelude::*;
use ferry::{ClusterSecret, DiscoveryError, Node};

use crate::DEADLINE;

const SECRET: &str = "the publish test's secret, 32 B";

async fn node(secret: bool) -> Node {
    let mut builder = Node::builder().ibverbs(false).memory(false);
    if secret {
        builder = builder.cluster_secret(ClusterSecret::new(SECRET).unwrap());
    }
    builder.spawn().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_secret_a_stranger_gets_no_metadata_and_no_use_of_a_handle() {
    let owner = node(true).await;
    let region = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    region.write_at(0, &[3; 4096]).unwrap();
    owner.publish("kv", &region).unwrap();
    let member = node(true).await;
    let stranger = node(false).await;

    // A member fetches the handle, tokens and all, and reads with it.
    let (name, _) = member
        .fetch_metadata(owner.addr().endpoint, DEADLINE)
        .await
        .unwrap();
    let handle = member.remote_region(&name, "kv").unwrap();
    assert!(handle.transports().tcp.is_some());
    let dst = member.alloc(4096, Access::ReadWrite).await.unwrap();
    member
        .submit(vec![RdmaOp::read(dst.whole(), handle.clone())], DEADLINE)
        .await
        .unwrap();
    assert_eq!(dst.to_vec(), vec![3; 4096]);

    // A stranger's METADATA call is refused at the hello: the handler
    // never runs, so no token leaves.
    let fetched = stranger
        .fetch_metadata(owner.addr().endpoint, DEADLINE)
        .await;
    assert!(
        matches!(
            fetched,
            Err(DiscoveryError::Control(
                ferry::control::ControlError::AuthFailed { .. }
            ))
        ),
        "{fetched:?}"
    );
    // A stranger that got the handle anyway (copied from an etcd record, a
    // log, a leaked file) cannot use it: every channel's hello refuses it.
    let src = stranger.alloc(4096, Access::ReadWrite).await.unwrap();
    let write = stranger
        .submit(vec![RdmaOp::write(src.whole(), handle)], DEADLINE)
        .await;
    assert!(
        matches!(
            write,
            Err(SubmitError::Op {
                error: OpError::AuthFailed { .. },
                ..
            })
        ),
        "{write:?}"
    );
    assert_eq!(region.to_vec(), vec![3; 4096]);
    let called = stranger
        .call(owner.addr(), "anything", Bytes::new(), DEADLINE)
        .await;
    assert!(called.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_secret_publishing_opens_the_region_to_whoever_reaches_the_port() {
    let owner = node(false).await;
    let region = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    owner.publish("open", &region).unwrap();
    // Anyone: a node that nobody introduced, with the port alone.
    let anyone = node(false).await;
    let (name, _) = anyone
        .fetch_metadata(owner.addr().endpoint, DEADLINE)
        .await
        .unwrap();
    let handle = anyone.remote_region(&name, "open").unwrap();
    let src = anyone.alloc(4096, Access::ReadWrite).await.unwrap();
    src.write_at(0, &[9; 4096]).unwrap();
    anyone
        .submit(vec![RdmaOp::write(src.whole(), handle)], DEADLINE)
        .await
        .unwrap();
    assert_eq!(region.to_vec(), vec![9; 4096]);
}
