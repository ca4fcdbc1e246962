//! The lane's tests: two memory transports in this process, the owner's
//! with an inbox, talking over the same abstract sockets as two processes.

use ferry_control::{DeliveryKind, Endpoint, EndpointConfig, Inbox, Messages};
use ferry_core::{NodeId, OpError};

use super::*;
use crate::{DataPathNotification, MemoryBackend};

/// The longest any one step may take.
const WAIT: Duration = Duration::from_secs(10);

/// A memory transport for a node of its own, whose lanes deliver to
/// an inbox of `capacity` (none when 0), and that node's address.
async fn node(capacity: usize) -> (MemoryBackend, NodeAddr, Option<(Arc<Messages>, Inbox)>) {
    let id = NodeId::random();
    let backend = MemoryBackend::start(id, Default::default()).unwrap();
    let endpoint = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        None,
        id,
        EndpointConfig::default(),
    )
    .await
    .unwrap();
    let addr = endpoint.local();
    let inbox = if capacity > 0 {
        let messages = Messages::start(&endpoint, 64 << 10, capacity).unwrap();
        backend.take_notifications(messages.notification_sink());
        let inbox = messages.take_inbox().unwrap();
        Some((messages, inbox))
    } else {
        None
    };
    (backend, addr, inbox)
}

fn deadline() -> Instant {
    Instant::now() + WAIT
}

/// The next delivery's body, which must be a notification from `from`.
async fn next(inbox: &mut Inbox, from: NodeAddr) -> Bytes {
    let delivery = tokio::time::timeout(WAIT, inbox.recv())
        .await
        .expect("no notification within the deadline")
        .expect("the inbox closed");
    assert_eq!(delivery.kind, DeliveryKind::Notification);
    assert_eq!(delivery.from, from);
    delivery.body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_delivers_every_notification_once_in_order() {
    const COUNT: u32 = 10_000;
    let (_owner, owner_addr, inbox) = node(256).await;
    let (_messages, mut inbox) = inbox.unwrap();
    let (sender, from, _) = node(0).await;
    let consumer = tokio::spawn(async move {
        for i in 0..COUNT {
            assert_eq!(next(&mut inbox, from).await, i.to_le_bytes()[..]);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(inbox.try_recv().is_none(), "a notification beyond the sent");
    });
    for i in 0..COUNT {
        let give_up = deadline();
        loop {
            match sender
                .notify(owner_addr, from, &i.to_le_bytes(), give_up)
                .await
            {
                DataPathNotification::Accepted => break,
                // The ring is full while the consumer catches up.
                DataPathNotification::NotSent if Instant::now() < give_up => {
                    tokio::task::yield_now().await
                }
                other => panic!("notification {i}: {other:?}"),
            }
        }
    }
    tokio::time::timeout(WAIT, consumer).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_ring_is_refused_until_the_consumer_reads_again() {
    let (_owner, owner_addr, inbox) = node(1).await;
    let (_messages, mut inbox) = inbox.unwrap();
    let (sender, from, _) = node(0).await;
    // Nobody reads: the inbox holds one, the ring SLOTS (one of them
    // the owner's, waiting for room).
    let accepted = fill(&sender, owner_addr, from).await;
    assert_eq!(accepted, SLOTS + 1, "the inbox's one and a full ring");
    for i in 0..accepted {
        assert_eq!(next(&mut inbox, from).await, i.to_le_bytes()[..]);
    }
    // Room again: the lane carries on where it was.
    let more = sender.notify(owner_addr, from, b"again", deadline()).await;
    assert_eq!(more, DataPathNotification::Accepted);
    assert_eq!(next(&mut inbox, from).await, b"again"[..]);
}

/// Sends numbered notifications to `owner` until the lane takes no
/// more, the owner given time to move what it can into its inbox;
/// returns how many it took.
async fn fill(sender: &MemoryBackend, owner: NodeAddr, from: NodeAddr) -> u32 {
    let mut accepted = 0u32;
    loop {
        let give_up = Instant::now() + Duration::from_secs(2);
        loop {
            match sender
                .notify(owner, from, &accepted.to_le_bytes(), deadline())
                .await
            {
                DataPathNotification::Accepted => break,
                DataPathNotification::NotSent if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                DataPathNotification::NotSent => return accepted,
                other => panic!("{other:?}"),
            }
        }
        accepted += 1;
        assert!(
            accepted <= SLOTS + 1,
            "more taken than the ring and inbox hold"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_closed_lane_held_is_still_delivered_in_order() {
    let (_owner, owner_addr, inbox) = node(1).await;
    let (_messages, mut inbox) = inbox.unwrap();
    let (sender, from, _) = node(0).await;
    let accepted = fill(&sender, owner_addr, from).await;
    assert_eq!(accepted, SLOTS + 1);
    // The initiator stops: its lane closes with the ring full.
    drop(sender);
    for i in 0..accepted {
        assert_eq!(next(&mut inbox, from).await, i.to_le_bytes()[..]);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(inbox.try_recv().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_larger_than_a_slot_goes_elsewhere() {
    let (_owner, owner_addr, inbox) = node(8).await;
    let (_messages, mut inbox) = inbox.unwrap();
    let (sender, from, _) = node(0).await;
    let largest: Vec<u8> = (0..MAX_BODY).map(|i| i as u8).collect();
    let too_large = vec![7u8; MAX_BODY + 1];
    let sent = sender
        .notify(owner_addr, from, &too_large, deadline())
        .await;
    assert_eq!(sent, DataPathNotification::NotSent);
    let sent = sender.notify(owner_addr, from, &largest, deadline()).await;
    assert_eq!(sent, DataPathNotification::Accepted);
    assert_eq!(next(&mut inbox, from).await, largest[..]);
    assert!(inbox.try_recv().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_without_an_inbox_refuses_lanes() {
    let (_owner, owner_addr, _) = node(0).await;
    let (sender, from, _) = node(0).await;
    let sent = sender.notify(owner_addr, from, b"x", deadline()).await;
    assert_eq!(sent, DataPathNotification::NotSent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_owner_fails_the_notification_with_a_typed_error() {
    let (owner, owner_addr, inbox) = node(8).await;
    let (_messages, mut inbox) = inbox.unwrap();
    let (sender, from, _) = node(0).await;
    let sent = sender.notify(owner_addr, from, b"1", deadline()).await;
    assert_eq!(sent, DataPathNotification::Accepted);
    assert_eq!(next(&mut inbox, from).await, b"1"[..]);
    // Held here, as a submit holds it: the sender's sweep forgets a
    // dead owner's link within a second, and then its notifications
    // are `NotSent`, for the control session to fail.
    let link = sender.0.links.get(owner_addr).expect("the link");
    drop(owner);
    let give_up = deadline();
    while link.is_alive() {
        assert!(Instant::now() < give_up, "the owner's socket is still open");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        link.notify(from, b"2", deadline()).await,
        DataPathNotification::Failed(OpError::connection_lost(owner_addr.endpoint))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scribbled_ring_ends_its_lane_and_nothing_else() {
    let (_owner, owner_addr, inbox) = node(8).await;
    let (_messages, mut inbox) = inbox.unwrap();
    let (_, from, _) = node(0).await;
    let lane = LaneSender::open(owner_addr, from, deadline(), &no_secret(from))
        .await
        .unwrap()
        .expect("a lane");
    assert_eq!(lane.push(b"fine").unwrap(), Pushed::Accepted);
    assert_eq!(next(&mut inbox, from).await, b"fine"[..]);
    // A length over the slot's, then a count past the ring's.
    for scribble in [0, 1] {
        let lane = LaneSender::open(owner_addr, from, deadline(), &no_secret(from))
            .await
            .unwrap()
            .expect("a lane");
        let ring = &lane.ring;
        if scribble == 0 {
            // SAFETY: slot 0 of the sender's own mapping.
            unsafe { ring.slot(0).cast::<u32>().write(SLOT_LEN) };
            ring.tail().store(1, Ordering::Release);
        } else {
            ring.tail().store(u64::from(SLOTS) + 1, Ordering::Release);
        }
        lane.socket.try_send(&[1]).unwrap();
        let give_up = deadline();
        while !lane.is_closed() {
            assert!(Instant::now() < give_up, "the lane was not closed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // Nothing was delivered from the scribbled rings, and the first
    // lane still works.
    assert!(inbox.try_recv().is_none());
    assert_eq!(lane.push(b"still").unwrap(), Pushed::Accepted);
    assert_eq!(next(&mut inbox, from).await, b"still"[..]);
}

fn no_secret(from: NodeAddr) -> crate::auth::SocketAuth {
    crate::auth::SocketAuth {
        me: from.id,
        secret: Default::default(),
    }
}
