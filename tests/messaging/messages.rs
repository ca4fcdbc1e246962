//! Messages: delivered once, in order, with the sender; a full inbox holds
//! senders back until their deadline; oversized ones never leave; an actor
//! can subscribe, and what it does not take waits for the next consumer.

use std::time::Duration;

use bytes::Bytes;
use ferry::{Delivery, InboxTaken, MessageError, Node, SendMessage};
use kameo::Actor;
use kameo::actor::Spawn;
use kameo::message::{Context, Message};

use crate::{DEADLINE, two_nodes};

/// The next delivery, within the test deadline.
async fn next(inbox: &mut ferry::Inbox) -> Delivery {
    tokio::time::timeout(DEADLINE, inbox.recv())
        .await
        .expect("no delivery within the deadline")
        .expect("the inbox closed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_once_in_order_with_their_sender() {
    let (receiver, sender) = two_nodes().await;
    let mut inbox = receiver.inbox().unwrap();
    assert_eq!(receiver.inbox().err(), Some(InboxTaken));
    for i in 0..200u32 {
        sender
            .send_message(receiver.addr(), i.to_le_bytes().to_vec(), DEADLINE)
            .await
            .unwrap();
    }
    for i in 0..200u32 {
        let delivery = next(&mut inbox).await;
        assert_eq!(delivery.from.id, sender.addr().id);
        assert_eq!(delivery.body[..], i.to_le_bytes());
    }
    assert_eq!(inbox.try_recv(), None, "a message was delivered twice");

    // Many at once from one node: each exactly once.
    let sends: Vec<_> = (0..100u32)
        .map(|i| {
            let (sender, peer) = (sender.clone(), receiver.addr());
            tokio::spawn(async move {
                sender
                    .send_message(peer, i.to_le_bytes().to_vec(), DEADLINE)
                    .await
            })
        })
        .collect();
    for send in sends {
        send.await.unwrap().unwrap();
    }
    let mut seen: Vec<u32> = Vec::new();
    for _ in 0..100 {
        let body = next(&mut inbox).await.body;
        seen.push(u32::from_le_bytes(body[..].try_into().unwrap()));
    }
    seen.sort();
    assert_eq!(seen, (0..100).collect::<Vec<_>>());
    assert_eq!(inbox.try_recv(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_holds_senders_back_until_their_deadline() {
    let receiver = Node::builder().inbox_capacity(4).spawn().await.unwrap();
    let sender = Node::builder().spawn().await.unwrap();
    let peer = receiver.addr();
    for i in 0..4u8 {
        sender.send_message(peer, vec![i], DEADLINE).await.unwrap();
    }
    // Nobody consumes: the fifth waits for room, then times out undelivered.
    let short = Duration::from_millis(300);
    assert_eq!(
        sender.send_message(peer, vec![4], short).await,
        Err(MessageError::Timeout {
            peer: peer.endpoint,
            after: short
        })
    );
    // A sixth waits until the consumer makes room, then is delivered.
    let waiting = tokio::spawn({
        let sender = sender.clone();
        async move { sender.send_message(peer, vec![5], DEADLINE).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "delivered into a full inbox");
    let mut inbox = receiver.inbox().unwrap();
    let mut bodies = Vec::new();
    for _ in 0..5 {
        bodies.push(next(&mut inbox).await.body[0]);
    }
    assert_eq!(waiting.await.unwrap(), Ok(()));
    assert_eq!(
        bodies,
        [0, 1, 2, 3, 5],
        "the timed-out message was delivered"
    );
    assert_eq!(inbox.try_recv(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_undeliverable_messages_fail_with_typed_errors() {
    let (receiver, sender) = two_nodes().await;
    let mut inbox = receiver.inbox().unwrap();
    assert_eq!(
        sender
            .send_message(receiver.addr(), vec![0; (64 << 10) + 1], DEADLINE)
            .await,
        Err(MessageError::TooLarge {
            len: (64 << 10) + 1,
            limit: 64 << 10
        })
    );
    // The limit itself is fine; the refused one never arrived.
    sender
        .send_message(receiver.addr(), vec![9; 64 << 10], DEADLINE)
        .await
        .unwrap();
    assert_eq!(next(&mut inbox).await.body.len(), 64 << 10);
    assert_eq!(inbox.try_recv(), None);

    let gone = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let nobody = ferry::NodeAddr {
        id: receiver.addr().id,
        endpoint: gone,
    };
    assert!(matches!(
        sender.send_message(nobody, Bytes::new(), DEADLINE).await,
        Err(MessageError::Unreachable { peer, .. }) if peer == gone
    ));
}

/// Keeps what it is told; answers `Received` with it.
#[derive(Actor, Default)]
struct Collector {
    got: Vec<Delivery>,
}

impl Message<Delivery> for Collector {
    type Reply = ();

    async fn handle(&mut self, delivery: Delivery, _: &mut Context<Self, ()>) {
        self.got.push(delivery);
    }
}

struct Received;

impl Message<Received> for Collector {
    type Reply = Vec<Delivery>;

    async fn handle(&mut self, _: Received, _: &mut Context<Self, Self::Reply>) -> Vec<Delivery> {
        self.got.clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribed_actor_gets_every_delivery_and_the_rest_outlive_it() {
    let (receiver, sender) = two_nodes().await;
    let collector = Collector::spawn(Collector::default());
    receiver.subscribe(collector.clone()).unwrap();
    assert_eq!(receiver.inbox().err(), Some(InboxTaken));
    // Sent through the sender's node actor, as a worker actor would.
    for i in 0..3u8 {
        let send = SendMessage {
            peer: receiver.addr(),
            body: Bytes::from(vec![i]),
            timeout: DEADLINE,
        };
        sender.actor().ask(send).await.unwrap();
    }
    let mut got = Vec::new();
    for _ in 0..100 {
        got = collector.ask(Received).await.unwrap();
        if got.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bodies: Vec<u8> = got.iter().map(|d| d.body[0]).collect();
    assert_eq!(bodies, [0, 1, 2]);

    // The subscriber stops: the next message waits in the inbox, which
    // goes back to the node for the next consumer.
    collector.stop_gracefully().await.unwrap();
    collector.wait_for_shutdown().await;
    sender
        .send_message(receiver.addr(), vec![3], DEADLINE)
        .await
        .unwrap();
    let mut inbox = None;
    for _ in 0..100 {
        if let Ok(taken) = receiver.inbox() {
            inbox = Some(taken);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut inbox = inbox.expect("the inbox never came back from the stopped subscriber");
    assert_eq!(next(&mut inbox).await.body[..], [3]);
}

/// Messages waiting for room in a full inbox are delivered in the order
/// they were sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_waiting_for_room_keep_their_order() {
    let receiver = Node::builder().inbox_capacity(1).spawn().await.unwrap();
    let sender = Node::builder().spawn().await.unwrap();
    let peer = receiver.addr();
    sender.send_message(peer, vec![0], DEADLINE).await.unwrap();
    let mut waiting = Vec::new();
    for i in 1..=8u8 {
        let sender = sender.clone();
        waiting.push(tokio::spawn(async move {
            sender.send_message(peer, vec![i], DEADLINE).await
        }));
        // Each one is on the wire, and in line, before the next is sent.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let mut inbox = receiver.inbox().unwrap();
    let mut bodies = Vec::new();
    for _ in 0..=8 {
        bodies.push(next(&mut inbox).await.body[0]);
    }
    assert_eq!(bodies, (0..=8).collect::<Vec<u8>>());
    for send in waiting {
        assert_eq!(send.await.unwrap(), Ok(()));
    }
}

/// Eight nodes send to one at once: each sender's messages arrive in the
/// order it sent them, each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_senders_each_keep_their_order() {
    let receiver = Node::builder().spawn().await.unwrap();
    let mut inbox = receiver.inbox().unwrap();
    let mut senders = Vec::new();
    for _ in 0..8 {
        senders.push(Node::builder().spawn().await.unwrap());
    }
    const EACH: u32 = 200;
    let sends: Vec<_> = senders
        .iter()
        .cloned()
        .map(|sender| {
            let peer = receiver.addr();
            tokio::spawn(async move {
                for i in 0..EACH {
                    sender
                        .send_message(peer, i.to_le_bytes().to_vec(), DEADLINE)
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    let mut next_of = std::collections::HashMap::new();
    for _ in 0..8 * EACH {
        let delivery = next(&mut inbox).await;
        let i = u32::from_le_bytes(delivery.body[..].try_into().unwrap());
        let expected = next_of.entry(delivery.from.id).or_insert(0u32);
        assert_eq!(i, *expected, "out of order from {:?}", delivery.from);
        *expected += 1;
    }
    for send in sends {
        send.await.unwrap();
    }
    assert_eq!(next_of.len(), 8);
    assert!(next_of.values().all(|&n| n == EACH));
    assert_eq!(inbox.try_recv(), None);
}

/// Runs `futures` concurrently, polling every pending one in index order on
/// every wake-up, so the first to wait for a turn is the first to get one.
/// (`join_all` over more than 30 futures polls them in the order they were
/// woken; one that yielded for tokio's cooperative budget then falls behind
/// later ones, and their messages overtake its.)
async fn join_in_order<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(done) => *output = Some(done),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_messages_keep_their_order_through_a_small_inbox() {
    // Many messages of one sender in flight at once, while a slow consumer
    // keeps a 2-slot inbox full: they wait for room, and arrive in the
    // order they were sent.
    let receiver = Node::builder().inbox_capacity(2).spawn().await.unwrap();
    let sender = Node::builder().spawn().await.unwrap();
    let peer = receiver.addr();
    // The session first: sends waiting for it to open are woken in no
    // particular order (seen under load), so only sends into an open
    // session have an order to keep.
    sender
        .endpoint()
        .session(peer, DEADLINE)
        .await
        .expect("session opens");
    // Polled in order, so the requests go out (and arrive) in order.
    let sends = join_in_order(
        (0..200u32)
            .map(|i| sender.send_message(peer, i.to_le_bytes().to_vec(), DEADLINE))
            .collect(),
    );
    let consume = async {
        let mut inbox = receiver.inbox().unwrap();
        let mut bodies = Vec::new();
        for i in 0..200u32 {
            if i % 16 == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let body = next(&mut inbox).await.body;
            bodies.push(u32::from_le_bytes(body[..].try_into().unwrap()));
        }
        bodies
    };
    let (sent, bodies) = tokio::join!(sends, consume);
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    assert_eq!(bodies, (0..200).collect::<Vec<_>>());
}
