//! Notifications attached to a submit, over TCP and over the same-host
//! memory transport's lanes (the checks are shared with the RDMA suite:
//! tests/shared/notify.rs).

use std::time::Duration;

use ferry::prelude::*;
use ferry::{DeliveryKind, MessageError, Node, NotifyError};

use crate::DEADLINE;

#[path = "../shared/notify.rs"]
mod notify;

/// Nodes in one process also reach each other through shared memory,
/// which these TCP tests turn off.
async fn tcp_node() -> Node {
    Node::builder()
        .ibverbs(false)
        .memory(false)
        .spawn()
        .await
        .unwrap()
}

/// A TCP node whose inbox holds two deliveries.
async fn small_inbox_owner() -> Node {
    Node::builder()
        .ibverbs(false)
        .memory(false)
        .inbox_capacity(2)
        .spawn()
        .await
        .unwrap()
}

/// A node that reaches same-host nodes through shared memory.
async fn same_host_node() -> Node {
    Node::builder()
        .ibverbs(false)
        .require(RdmaTransportLevel::Memory)
        .spawn()
        .await
        .unwrap()
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

/// A write of one pattern byte per round into `target`, notified with
/// `[round]`, from a source region of its own.
async fn notified_write(
    initiator: &Node,
    target: &ferry::prelude::Region,
    round: u8,
    timeout: Duration,
) -> Result<(), NotifyError> {
    let src = initiator.alloc(64, Access::ReadWrite).await.unwrap();
    notify::notified_round(initiator, &src, target, round, timeout).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_holds_notified_submits_back_until_their_deadline() {
    let owner = small_inbox_owner().await;
    let initiator = tcp_node().await;
    let target = owner.alloc(64, Access::ReadWrite).await.unwrap();
    for round in 0..2 {
        notified_write(&initiator, &target, round, DEADLINE)
            .await
            .unwrap();
    }
    // Nobody consumes: the third batch's bytes land, but its notification
    // waits for room, then times out undelivered.
    let short = Duration::from_millis(300);
    assert_eq!(
        notified_write(&initiator, &target, 2, short).await,
        Err(NotifyError::Notification {
            owner: owner.addr(),
            error: MessageError::Timeout {
                peer: owner.addr().endpoint,
                after: short
            }
        })
    );
    assert_eq!(target.to_vec(), [2; 64]);
    // A fourth waits until the consumer makes room, then is delivered.
    let waiting = tokio::spawn({
        let (initiator, target) = (initiator.clone(), target.clone());
        async move { notified_write(&initiator, &target, 3, DEADLINE).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "delivered into a full inbox");
    let mut inbox = owner.inbox().unwrap();
    let mut bodies = Vec::new();
    for _ in 0..3 {
        let delivery = tokio::time::timeout(DEADLINE, inbox.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(delivery.kind, DeliveryKind::Notification);
        bodies.push(delivery.body[0]);
    }
    assert_eq!(waiting.await.unwrap(), Ok(()));
    assert_eq!(
        bodies,
        [0, 1, 3],
        "the timed-out notification was delivered"
    );
    assert_eq!(inbox.try_recv(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_over_the_owners_own_limit_is_refused_by_it() {
    for memory in [false, true] {
        over_the_owners_own_limit(memory).await;
    }
}

/// Over TCP or a same-host lane, whose owner tells its limit when the lane
/// opens.
async fn over_the_owners_own_limit(memory: bool) {
    let owner = Node::builder()
        .ibverbs(false)
        .memory(memory)
        .message_max_len(100)
        .spawn()
        .await
        .unwrap();
    let initiator = if memory {
        same_host_node().await
    } else {
        tcp_node().await
    };
    let target = owner.alloc(64, Access::ReadWrite).await.unwrap();
    let src = initiator.alloc(64, Access::ReadWrite).await.unwrap();
    let ops = vec![RdmaOp::write(src.whole(), target.remote())];
    assert_eq!(
        initiator
            .submit_with_notification(ops, DEADLINE, vec![7; 101])
            .await,
        Err(NotifyError::Notification {
            owner: owner.addr(),
            error: MessageError::TooLarge {
                len: 101,
                limit: 100
            }
        })
    );
    let mut inbox = owner.inbox().unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(inbox.try_recv(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_holds_senders_back_and_resumes() {
    let owner = small_inbox_owner().await;
    let initiator = tcp_node().await;
    // Over TCP the owner holds nothing beyond its inbox.
    notify::a_stalled_consumer_holds_senders_back_and_resumes(&owner, &initiator, 2..=2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_notified_batch_notifies_nobody() {
    let (owner, initiator) = (tcp_node().await, tcp_node().await);
    notify::a_timed_out_notified_batch_notifies_nobody(&owner, &initiator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_written_bytes_are_in_place_when_the_owner_is_notified() {
    let (owner, initiator) = (same_host_node().await, same_host_node().await);
    notify::written_bytes_are_in_place_when_the_owner_is_notified(&owner, &initiator, 200).await;
    // They came on a lane, not the control session.
    assert_eq!(owner.peer_tables().memory_lanes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_owners_are_notified_once_and_failures_notify_nobody() {
    let owners = [same_host_node().await, same_host_node().await];
    let initiator = same_host_node().await;
    notify::each_owner_is_notified_once_and_failures_notify_nobody(
        [&owners[0], &owners[1]],
        &initiator,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_holds_same_host_senders_back_and_resumes() {
    let owner = Node::builder()
        .ibverbs(false)
        .require(RdmaTransportLevel::Memory)
        .inbox_capacity(2)
        .spawn()
        .await
        .unwrap();
    let initiator = same_host_node().await;
    // The owner holds its inbox's two and the lane's ring; the ring may
    // fill before the owner moved the first two into the inbox.
    let ring = ferry::memory::LANE_SLOTS as usize;
    notify::a_stalled_consumer_holds_senders_back_and_resumes(&owner, &initiator, ring..=ring + 2)
        .await;
    assert_eq!(owner.peer_tables().memory_lanes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_same_host_batch_notifies_nobody() {
    let (owner, initiator) = (same_host_node().await, same_host_node().await);
    notify::a_timed_out_notified_batch_notifies_nobody(&owner, &initiator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_notification_arrives_as_one_and_a_shut_node_sends_none() {
    let (owner, sender) = (tcp_node().await, tcp_node().await);
    let mut inbox = owner.inbox().unwrap();
    sender
        .notify(owner.addr(), b"blocks 3,4 freed", DEADLINE)
        .await
        .unwrap();
    let delivery = tokio::time::timeout(DEADLINE, inbox.recv())
        .await
        .expect("the notification within the deadline")
        .expect("the node runs");
    assert_eq!(delivery.kind, DeliveryKind::Notification);
    assert_eq!(delivery.from, sender.addr());
    assert_eq!(&delivery.body[..], b"blocks 3,4 freed");

    sender.shutdown().await;
    let refused = sender.notify(owner.addr(), b"late", DEADLINE).await;
    assert_eq!(refused, Err(MessageError::ShutDown));
    assert!(
        inbox.try_recv().is_none(),
        "nothing arrives from a shut node"
    );
}
