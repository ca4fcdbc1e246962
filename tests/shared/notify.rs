//! Notifications attached to a submit, checked the same way over every
//! transport: the TCP suite and the RDMA suite (in the VM) both run these
//! with two nodes of their kind.

use std::time::Duration;

use bytes::Bytes;
use ferry::prelude::*;
use ferry::{DeliveryKind, Inbox, NotifyError, SubmitWithNotification};

/// Every wait here ends by then, pass or fail.
const WAIT: Duration = Duration::from_secs(20);

fn pattern(len: u64, round: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(round * 7) as u8)
        .collect()
}

async fn next_notification(inbox: &mut Inbox, from: &Node) -> Bytes {
    let delivery = tokio::time::timeout(WAIT, inbox.recv())
        .await
        .expect("no notification within the deadline")
        .expect("the inbox closed");
    assert_eq!(delivery.kind, DeliveryKind::Notification);
    assert_eq!(delivery.from.id, from.addr().id);
    delivery.body
}

/// Nothing more arrives (within a short wait: absence has no event).
async fn nothing_more(inbox: &mut Inbox) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(inbox.try_recv(), None, "an unexpected delivery");
}

/// A handle to a region of `node` that was dropped: its owner refuses it.
async fn stale_handle(node: &Node, len: u64) -> RemoteBuffer {
    node.alloc(len, Access::ReadWrite).await.unwrap().remote()
}

/// Runs a notified batch that must fail at op `index`, and so notify nobody.
async fn fails_at(initiator: &Node, ops: Vec<RdmaOp>, index: usize) {
    let result = initiator
        .submit_with_notification(ops, WAIT, &b"never"[..])
        .await;
    assert!(
        matches!(
            result,
            Err(NotifyError::Submit(SubmitError::Op { index: i, .. })) if i == index
        ),
        "expected op {index} to fail: {result:?}"
    );
}

/// In each of `rounds` rounds the initiator writes a fresh 8 MiB pattern
/// into the owner's region with a notification, and the owner checks its
/// memory the moment the notification is handed to it: every byte is
/// there. (A flag written in the same batch landed before the payload in
/// up to 5 of 20 rounds.) Then one read: notified after it has finished.
pub async fn written_bytes_are_in_place_when_the_owner_is_notified(
    owner: &Node,
    initiator: &Node,
    rounds: u32,
) {
    let len = 8 << 20;
    let target = owner.alloc(len, Access::ReadWrite).await.unwrap();
    let src = initiator.alloc(len, Access::ReadWrite).await.unwrap();
    let mut inbox = owner.inbox().unwrap();
    for round in 0..rounds {
        let expected = pattern(len, round);
        src.write_at(0, &expected).unwrap();
        let ops = vec![RdmaOp::write(src.whole(), target.remote())];
        let sent = tokio::spawn({
            let initiator = initiator.clone();
            async move {
                initiator
                    .submit_with_notification(ops, WAIT, round.to_le_bytes().to_vec())
                    .await
            }
        });
        let body = next_notification(&mut inbox, initiator).await;
        // Checked before anything else happens: the notification alone
        // says the bytes are there.
        let landed = target.to_vec() == expected;
        assert_eq!(body[..], round.to_le_bytes());
        assert!(landed, "round {round}: notified before the payload landed");
        assert_eq!(sent.await.unwrap(), Ok(()));
    }
    // A read: the owner is told once it has finished.
    let dst = initiator.alloc(len, Access::ReadWrite).await.unwrap();
    let read = vec![RdmaOp::read(dst.whole(), target.remote())];
    initiator
        .submit_with_notification(read, WAIT, &b"read done"[..])
        .await
        .unwrap();
    assert_eq!(
        &next_notification(&mut inbox, initiator).await[..],
        b"read done"
    );
    assert_eq!(dst.to_vec(), target.to_vec());
    nothing_more(&mut inbox).await;
    owner.return_inbox(inbox);
}

/// A batch over two owners notifies each once; a failed batch, or one with
/// an oversized notification, notifies nobody (and the latter moves no
/// byte); the node's actor does the same for worker actors.
pub async fn each_owner_is_notified_once_and_failures_notify_nobody(
    owners: [&Node; 2],
    initiator: &Node,
) {
    let len = 64 * 1024;
    let targets = [
        owners[0].alloc(len, Access::ReadWrite).await.unwrap(),
        owners[1].alloc(len, Access::ReadWrite).await.unwrap(),
    ];
    let read_only = owners[1].alloc(len, Access::ReadOnly).await.unwrap();
    let src = initiator.alloc(len, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 1)).unwrap();
    let mut inboxes = [owners[0].inbox().unwrap(), owners[1].inbox().unwrap()];

    let both: Vec<RdmaOp> = targets
        .iter()
        .map(|t| RdmaOp::write(src.whole(), t.remote()))
        .collect();
    let submit = SubmitWithNotification {
        ops: both,
        timeout: WAIT,
        notification: Bytes::from_static(b"both"),
    };
    initiator.actor().ask(submit).await.unwrap();
    for (inbox, target) in inboxes.iter_mut().zip(&targets) {
        assert_eq!(&next_notification(inbox, initiator).await[..], b"both");
        assert_eq!(target.to_vec(), pattern(len, 1));
    }

    // Op 1 is refused: the batch fails and nobody hears of it.
    let failing = vec![
        RdmaOp::write(src.whole(), targets[0].remote()),
        RdmaOp::write(src.whole(), read_only.remote()),
    ];
    fails_at(initiator, failing, 1).await;

    // Op 3 of four to one owner reaches a region that is gone: the owner
    // refuses it, the batch fails, and the owner is not notified, though
    // it served the other three.
    let stale = stale_handle(owners[0], len).await;
    let quarter = len / 4;
    let mut failing: Vec<RdmaOp> = (0..3)
        .map(|i| {
            let range = i * quarter..(i + 1) * quarter;
            RdmaOp::write(
                src.slice(range.clone()).unwrap(),
                targets[0].remote().slice(range).unwrap(),
            )
        })
        .collect();
    failing.push(RdmaOp::write(
        src.slice(0..quarter).unwrap(),
        stale.slice(0..quarter).unwrap(),
    ));
    fails_at(initiator, failing, 3).await;
    // The same over two owners: the one whose op succeeded is not
    // notified either.
    let stale = stale_handle(owners[1], len).await;
    let failing = vec![
        RdmaOp::write(src.whole(), targets[0].remote()),
        RdmaOp::write(src.whole(), stale),
    ];
    fails_at(initiator, failing, 1).await;

    // Over the limit: refused before any op runs.
    src.write_at(0, &pattern(len, 2)).unwrap();
    let ops = vec![RdmaOp::write(src.whole(), targets[0].remote())];
    assert_eq!(
        initiator
            .submit_with_notification(ops, WAIT, vec![0; (64 << 10) + 1])
            .await,
        Err(NotifyError::TooLarge {
            len: (64 << 10) + 1,
            limit: 64 << 10
        })
    );
    assert_eq!(
        targets[0].to_vec(),
        pattern(len, 1),
        "the refused batch ran"
    );
    for inbox in &mut inboxes {
        nothing_more(inbox).await;
    }
}
