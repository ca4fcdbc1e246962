//! `Node::shutdown` closes every door: the shut-down node initiates nothing
//! (every call gets a `ShutDown` error, whichever way it comes), and it
//! serves nothing, on the same-host transport too, to peers it granted
//! regions before and to peers it never saw.

use std::time::Duration;

use ferry::prelude::*;
use ferry::{
    MessageError, NotifyError, RegisterError, RpcError, SendMessage, SubmitWithNotification,
};

use crate::common::pattern;
use crate::{DEADLINE, node};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_node_initiates_nothing_and_every_call_says_why() {
    let node = node().await;
    let owner = crate::node().await;
    let len = 64 * 1024;
    let local = node.alloc(len, Access::ReadWrite).await.unwrap();
    local.write_at(0, &pattern(len as usize, 1)).unwrap();
    let remote = owner.alloc(len, Access::ReadWrite).await.unwrap();
    let write = vec![RdmaOp::write(local.whole(), remote.remote())];
    // Same-host and working before.
    assert_eq!(node.route(&write[0]), Some(RdmaTransportLevel::Memory));
    node.submit(write.clone(), DEADLINE).await.unwrap();
    remote.write_at(0, &pattern(len as usize, 2)).unwrap();

    node.shutdown().await;
    assert_eq!(
        node.submit(write.clone(), DEADLINE).await,
        Err(SubmitError::ShutDown)
    );
    assert_eq!(
        node.submit_with_notification(write.clone(), DEADLINE, &b"n"[..])
            .await,
        Err(NotifyError::Submit(SubmitError::ShutDown))
    );
    assert_eq!(
        node.alloc(4096, Access::ReadWrite).await.err(),
        Some(RegisterError::ShutDown)
    );
    assert_eq!(
        node.send_message(owner.addr(), &b"m"[..], DEADLINE).await,
        Err(MessageError::ShutDown)
    );
    assert!(matches!(
        node.call(owner.addr(), "x", &b""[..], DEADLINE).await,
        Err(RpcError::ShutDown)
    ));
    // Through the node's actor: the same errors, not "not running".
    let actor = node.actor();
    let submitted = actor
        .ask(Submit {
            ops: write.clone(),
            timeout: DEADLINE,
        })
        .await;
    assert!(
        matches!(
            submitted,
            Err(kameo::error::SendError::HandlerError(SubmitError::ShutDown))
        ),
        "{submitted:?}"
    );
    let notified = actor
        .ask(SubmitWithNotification {
            ops: write,
            timeout: DEADLINE,
            notification: "n".into(),
        })
        .await;
    assert!(
        matches!(
            notified,
            Err(kameo::error::SendError::HandlerError(NotifyError::Submit(
                SubmitError::ShutDown
            )))
        ),
        "{notified:?}"
    );
    let sent = actor
        .ask(SendMessage {
            peer: owner.addr(),
            body: "m".into(),
            timeout: DEADLINE,
        })
        .await;
    assert!(
        matches!(
            sent,
            Err(kameo::error::SendError::HandlerError(
                MessageError::ShutDown
            ))
        ),
        "{sent:?}"
    );
    let allocated = actor
        .ask(Alloc {
            len: 4096,
            access: Access::ReadWrite,
        })
        .await;
    assert!(
        matches!(
            allocated,
            Err(kameo::error::SendError::HandlerError(
                RegisterError::ShutDown
            ))
        ),
        "{allocated:?}"
    );
    // Nothing moved after the shutdown.
    assert!(remote.to_vec() == pattern(len as usize, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_owner_serves_no_same_host_peer_old_or_new() {
    let owner = node().await;
    let granted = crate::node().await;
    let len = 64 * 1024;
    let region = owner.alloc(len, Access::ReadWrite).await.unwrap();
    region.write_at(0, &pattern(len as usize, 3)).unwrap();
    let handle = region.remote();
    let src = granted.alloc(len, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len as usize, 4)).unwrap();
    let dst = granted.alloc(len, Access::ReadWrite).await.unwrap();
    // `granted` maps the region (a read) and writes it: both same-host.
    let read = vec![RdmaOp::read(dst.whole(), handle.clone())];
    assert_eq!(granted.route(&read[0]), Some(RdmaTransportLevel::Memory));
    granted.submit(read, DEADLINE).await.unwrap();
    assert!(dst.to_vec() == pattern(len as usize, 3));
    region.write_at(0, &pattern(len as usize, 5)).unwrap();

    owner.shutdown().await;
    let stranger = crate::node().await;
    let stranger_src = stranger.alloc(len, Access::ReadWrite).await.unwrap();
    stranger_src.write_at(0, &pattern(len as usize, 6)).unwrap();
    let stranger_dst = stranger.alloc(len, Access::ReadWrite).await.unwrap();
    for (who, src, dst) in [
        ("a peer granted before", &granted, (&src, &dst)),
        (
            "a peer never granted",
            &stranger,
            (&stranger_src, &stranger_dst),
        ),
    ] {
        let (from, into) = dst;
        let before = into.to_vec();
        let wrote = src
            .submit(
                vec![RdmaOp::write(from.whole(), handle.clone())],
                Duration::from_secs(5),
            )
            .await;
        assert!(
            matches!(wrote, Err(SubmitError::Op { index: 0, .. })),
            "{who}: a write to a shut-down owner: {wrote:?}"
        );
        let read = src
            .submit(
                vec![RdmaOp::read(into.whole(), handle.clone())],
                Duration::from_secs(5),
            )
            .await;
        assert!(
            matches!(read, Err(SubmitError::Op { index: 0, .. })),
            "{who}: a read of a shut-down owner: {read:?}"
        );
        assert!(into.to_vec() == before, "{who}: bytes were read");
    }
    assert!(
        region.to_vec() == pattern(len as usize, 5),
        "a write landed in a shut-down owner's region"
    );
}
