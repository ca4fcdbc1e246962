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

/// One notified 64-byte write of `[round; 64]` from `src` into `target`,
/// notified with `[round]`.
pub async fn notified_round(
    initiator: &Node,
    src: &Region,
    target: &Region,
    round: u8,
    timeout: Duration,
) -> Result<(), NotifyError> {
    src.write_at(0, &[round; 64]).unwrap();
    let ops = vec![RdmaOp::write(src.whole(), target.remote())];
    initiator
        .submit_with_notification(ops, timeout, vec![round])
        .await
}

/// A consumer that stops reading holds senders back, twice over: exactly
/// `room` notified submits are accepted (what the owner holds for one
/// initiator: its inbox, and over ibverbs the receive buffers it posted),
/// the next times out with a typed error, its bytes landed but its
/// notification never delivered. Once the consumer drains, every accepted
/// one arrives once (a fallback may overtake); then the same again, so whatever the owner
/// held back (its receive credits) came back, as it must also after a few
/// notifications read as they came. `owner`'s inbox must be empty
/// and hold fewer than `room` deliveries.
pub async fn a_stalled_consumer_holds_senders_back_and_resumes(
    owner: &Node,
    initiator: &Node,
    room: std::ops::RangeInclusive<usize>,
) {
    let target = owner.alloc(64, Access::ReadWrite).await.unwrap();
    let src = initiator.alloc(64, Access::ReadWrite).await.unwrap();
    let short = Duration::from_millis(300);
    let mut round = 0u8;
    // First a few read as they come: fewer than the owner returns credits
    // for at once (a quarter ring over ibverbs). What it holds back for
    // them must come back once it goes idle, or the first pass finds less
    // room.
    let mut inbox = owner.inbox().unwrap();
    for _ in 0..3 {
        notified_round(initiator, &src, &target, round, WAIT)
            .await
            .unwrap();
        assert_eq!(next_notification(&mut inbox, initiator).await[..], [round]);
        round += 1;
    }
    nothing_more(&mut inbox).await;
    owner.return_inbox(inbox);
    for pass in 0..2 {
        let first = round;
        loop {
            match notified_round(initiator, &src, &target, round, short).await {
                Ok(()) => round += 1,
                Err(e) => {
                    assert_eq!(
                        e,
                        NotifyError::Notification {
                            owner: owner.addr(),
                            error: ferry::MessageError::Timeout {
                                peer: owner.addr().endpoint,
                                after: short
                            }
                        }
                    );
                    break;
                }
            }
            assert!(
                usize::from(round - first) <= *room.end(),
                "pass {pass}: more than {room:?} accepted with nobody reading"
            );
        }
        assert!(
            room.contains(&usize::from(round - first)),
            "pass {pass}: {} accepted before the first timeout, not {room:?}",
            round - first
        );
        assert_eq!(target.to_vec(), [round; 64], "the timed-out batch's bytes");
        let timed_out = round;
        round += 1;
        // The owner's copy of the deadline ends a one-way trip after the
        // sender's, and the sender's cancel takes as long to arrive: a
        // consumer reading within that window could still be handed the
        // timed-out notification (documented on submit_with_notification).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut inbox = owner.inbox().unwrap();
        // Each accepted one once. Not necessarily in order: one that fell
        // back to the control session can overtake those still waiting on
        // the data path (documented on submit_with_notification).
        let mut got = Vec::new();
        for _ in first..timed_out {
            got.push(next_notification(&mut inbox, initiator).await[0]);
        }
        got.sort_unstable();
        assert_eq!(got, (first..timed_out).collect::<Vec<_>>());
        nothing_more(&mut inbox).await;
        owner.return_inbox(inbox);
    }
}

/// A notified batch that times out notifies nobody: a 64 MiB write given
/// 1 ms, far less than either transport needs, so the notification behind
/// it is never sent (over TCP: discarded; over ibverbs: flushed with the
/// queue pair); the next notified batch is delivered normally.
pub async fn a_timed_out_notified_batch_notifies_nobody(owner: &Node, initiator: &Node) {
    let len = 64 << 20;
    let target = owner.alloc(len, Access::ReadWrite).await.unwrap();
    let src = initiator.alloc(len, Access::ReadWrite).await.unwrap();
    let mut inbox = owner.inbox().unwrap();
    let small = || {
        vec![RdmaOp::write(
            src.slice(0..4096).unwrap(),
            target.remote().slice(0..4096).unwrap(),
        )]
    };
    // Connected first: 1 ms is too short to set up a session or a QP.
    initiator
        .submit_with_notification(small(), WAIT, &b"warm"[..])
        .await
        .unwrap();
    assert_eq!(&next_notification(&mut inbox, initiator).await[..], b"warm");
    let timeout = Duration::from_millis(1);
    let ops = vec![RdmaOp::write(src.whole(), target.remote())];
    let result = initiator
        .submit_with_notification(ops, timeout, &b"late"[..])
        .await;
    assert!(
        matches!(
            result,
            Err(NotifyError::Submit(SubmitError::Timeout { timeout: t, .. })) if t == timeout
        ),
        "{result:?}"
    );
    nothing_more(&mut inbox).await;
    initiator
        .submit_with_notification(small(), WAIT, &b"next"[..])
        .await
        .unwrap();
    assert_eq!(&next_notification(&mut inbox, initiator).await[..], b"next");
    owner.return_inbox(inbox);
}
