//! The cluster secret: nodes that hold the same one work on every channel
//! (same-host memory, TCP, control), each delivery naming its real sender;
//! a peer without it, with another, replaying a recorded hello, or speaking
//! as another node inside its session is refused with a typed error, and
//! changes nothing; a secret rolls through running nodes without a failed
//! transfer; a flood of bad hellos does not keep a good peer out.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry::control::{Channel, Dialer};
use ferry::prelude::*;
use ferry::{
    ClusterSecret, DeliveryKind, Inbox, MessageError, Node, NodeAddr, NodeId, NotifyError, RpcError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::DEADLINE;

const SECRET: &str = "the test cluster's secret, 32 B";
const OTHER: &str = "another cluster's secret, 32 B!";
const LEN: u64 = 64 << 10;

fn secret(text: &str) -> ClusterSecret {
    ClusterSecret::new(text).unwrap()
}

/// A node with `secret` (or none), over same-host memory or over TCP only.
async fn node(secret: Option<ClusterSecret>, memory: bool) -> Node {
    let mut builder = Node::builder().ibverbs(false).memory(memory);
    if let Some(secret) = secret {
        builder = builder.cluster_secret(secret);
    }
    builder.spawn().await.unwrap()
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

/// A region of `node` filled with `seed`'s pattern.
async fn filled(node: &Node, seed: u8) -> Region {
    let region = node.alloc(LEN, Access::ReadWrite).await.unwrap();
    region.write_at(0, &pattern(LEN, seed)).unwrap();
    region
}

async fn nothing_in(inbox: &mut Inbox) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(inbox.try_recv(), None, "a delivery came through");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_the_same_secret_work_on_every_channel_and_name_the_real_sender() {
    for memory in [true, false] {
        let owner = node(Some(secret(SECRET)), memory).await;
        let peer = node(Some(secret(SECRET)), memory).await;
        let mut inbox = owner.inbox().unwrap();
        let target = filled(&owner, 1).await;
        let src = filled(&peer, 2).await;
        let write = RdmaOp::write(src.whole(), target.remote());
        let expected = if memory {
            RdmaTransportLevel::Memory
        } else {
            RdmaTransportLevel::Tcp
        };
        assert_eq!(peer.route(&write), Some(expected));
        peer.submit_with_notification(vec![write], DEADLINE, &b"written"[..])
            .await
            .unwrap();
        assert_eq!(target.to_vec(), pattern(LEN, 2), "memory {memory}");
        let delivery = tokio::time::timeout(DEADLINE, inbox.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(delivery.kind, DeliveryKind::Notification);
        assert_eq!(
            (delivery.from.id, &delivery.body[..]),
            (peer.addr().id, &b"written"[..])
        );
        let dst = peer.alloc(LEN, Access::ReadWrite).await.unwrap();
        peer.submit(vec![RdmaOp::read(dst.whole(), target.remote())], DEADLINE)
            .await
            .unwrap();
        assert_eq!(dst.to_vec(), pattern(LEN, 2));
        peer.send_message(owner.addr(), &b"hello"[..], DEADLINE)
            .await
            .unwrap();
        let delivery = tokio::time::timeout(DEADLINE, inbox.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (delivery.kind, delivery.from.id),
            (DeliveryKind::Message, peer.addr().id)
        );
        let caller = Arc::new(Mutex::new(None));
        let saw = caller.clone();
        owner
            .serve_rpc("who", move |request: ferry::RpcRequest| {
                *saw.lock().unwrap() = Some(request.from.id);
                async { Ok(Bytes::new()) }
            })
            .unwrap();
        peer.call(owner.addr(), "who", Bytes::new(), DEADLINE)
            .await
            .unwrap();
        assert_eq!(*caller.lock().unwrap(), Some(peer.addr().id));
        assert_eq!(owner.auth_refusals(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_the_secret_or_with_another_are_refused_and_change_nothing() {
    for memory in [true, false] {
        for (name, theirs) in [("none", None), ("another", Some(secret(OTHER)))] {
            let owner = node(Some(secret(SECRET)), memory).await;
            let mut inbox = owner.inbox().unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            let counted = calls.clone();
            owner
                .serve_rpc("count", move |_| {
                    counted.fetch_add(1, Ordering::Relaxed);
                    async { Ok(Bytes::new()) }
                })
                .unwrap();
            let target = filled(&owner, 1).await;
            let peer = node(theirs, memory).await;
            let src = filled(&peer, 2).await;
            let case = format!("memory {memory}, secret {name}");

            let write = RdmaOp::write(src.whole(), target.remote());
            let failed = peer
                .submit_with_notification(vec![write], DEADLINE, &b"forged"[..])
                .await;
            assert!(
                matches!(
                    failed,
                    Err(NotifyError::Submit(SubmitError::Op {
                        error: OpError::AuthFailed { .. },
                        ..
                    }))
                ),
                "{case}: {failed:?}"
            );
            let sent = peer
                .send_message(owner.addr(), &b"forged"[..], DEADLINE)
                .await;
            assert!(
                matches!(sent, Err(MessageError::AuthFailed { .. })),
                "{case}: {sent:?}"
            );
            let notified = peer.notify(owner.addr(), &b"forged"[..], DEADLINE).await;
            assert!(
                matches!(notified, Err(MessageError::AuthFailed { .. })),
                "{case}: {notified:?}"
            );
            let called = peer
                .call(owner.addr(), "count", Bytes::new(), DEADLINE)
                .await;
            assert!(
                matches!(called, Err(RpcError::AuthFailed { .. })),
                "{case}: {called:?}"
            );

            assert_eq!(
                target.to_vec(),
                pattern(LEN, 1),
                "{case}: the region changed"
            );
            assert_eq!(calls.load(Ordering::Relaxed), 0, "{case}: a handler ran");
            nothing_in(&mut inbox).await;
            assert!(owner.auth_refusals() > 0, "{case}: refusals not counted");
        }
    }
    // The other way round: a node with a secret refuses an owner without.
    let open = node(None, false).await;
    let region = filled(&open, 3).await;
    let careful = node(Some(secret(SECRET)), false).await;
    let dst = careful.alloc(LEN, Access::ReadWrite).await.unwrap();
    let read = careful
        .submit(vec![RdmaOp::read(dst.whole(), region.remote())], DEADLINE)
        .await;
    assert!(
        matches!(&read, Err(SubmitError::Op { error: OpError::AuthFailed { reason, .. }, .. }) if reason.contains("peer has none")),
        "{read:?}"
    );
}

/// Forwards one connection to `to`, keeping what the client sent.
async fn recording_proxy(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let keep = recorded.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = TcpStream::connect(to).await.unwrap();
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
        let mut buf = [0; 4096];
        loop {
            match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    keep.lock().unwrap().extend_from_slice(&buf[..n]);
                    if server_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    (addr, recorded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_hello_is_refused() {
    let owner = node(Some(secret(SECRET)), false).await;
    let mut inbox = owner.inbox().unwrap();
    let peer = node(Some(secret(SECRET)), false).await;
    let (proxy, recorded) = recording_proxy(owner.addr().endpoint).await;
    let through_proxy = NodeAddr {
        id: owner.addr().id,
        endpoint: proxy,
    };
    // A real session through the proxy, which records the hello, the proof
    // and a message.
    peer.send_message(through_proxy, &b"once"[..], DEADLINE)
        .await
        .unwrap();
    let first = tokio::time::timeout(DEADLINE, inbox.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&first.body[..], b"once");
    let recorded = recorded.lock().unwrap().clone();
    assert!(
        recorded.len() > 56 + 32,
        "recorded {} bytes",
        recorded.len()
    );

    // The same bytes, replayed on a new connection: the owner answers the
    // hello with a fresh nonce, finds the old proof wrong, and hangs up.
    let mut replay = TcpStream::connect(owner.addr().endpoint).await.unwrap();
    replay.write_all(&recorded).await.unwrap();
    let mut answer = Vec::new();
    match tokio::time::timeout(DEADLINE, replay.read_to_end(&mut answer)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
        Err(_) => panic!("the owner did not hang up on a replayed hello"),
    }
    assert!(
        answer.len() <= 88,
        "the owner said more than its hello reply: {} bytes",
        answer.len()
    );
    nothing_in(&mut inbox).await;
    assert_eq!(owner.auth_refusals(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_proving_the_secret_cannot_speak_as_another_node() {
    use ferry::control::frame::{ControlCodec, Frame};
    use tokio_util::codec::Encoder;

    let owner = node(Some(secret(SECRET)), false).await;
    let mut inbox = owner.inbox().unwrap();
    let victim = NodeId::random();
    let me = Dialer::new(NodeId::random(), Some(secret(SECRET)));

    // A control session whose hello proved `me` but whose Open names the
    // victim: refused (the session never opens), so nothing it sends
    // afterwards can arrive as the victim's.
    // Sealed as a member seals them: the refusal is for the node named,
    // not for a bad tag.
    let greeted = me.connect(owner.addr(), Channel::CONTROL).await.unwrap();
    let (mut stream, auth) = (greeted.stream, greeted.auth.expect("both prove the secret"));
    let open = Frame::Open {
        min_version: 1,
        max_version: u16::MAX,
        node: NodeAddr {
            id: victim,
            endpoint: "127.0.0.1:9".parse().unwrap(),
        },
    };
    let mut wire = bytes::BytesMut::new();
    ControlCodec::sealed(1 << 20, Some(auth.keys.send))
        .encode(open, &mut wire)
        .unwrap();
    stream.write_all(&wire).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest))
        .await
        .expect("the owner hangs up");

    // A data connection proving `me` whose notification names the victim.
    let greeted = me.connect(owner.addr(), Channel::TCP_DATA).await.unwrap();
    let (mut data, auth) = (greeted.stream, greeted.auth.expect("both prove the secret"));
    let mut seal = auth.keys.send;
    let notify = ferry::tcp::frame::Notify {
        id: 1,
        tag: 0,
        len: 6,
        discard: false,
        from: NodeAddr {
            id: victim,
            endpoint: "127.0.0.1:9".parse().unwrap(),
        },
    };
    let header = notify.encode();
    let tag = seal.seal(&[&header, b"forged"]);
    // The owner may hang up as soon as it read the header.
    let _ = data
        .write_all(&[&header[..], b"forged", &tag].concat())
        .await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, data.read_to_end(&mut rest))
        .await
        .expect("the owner hangs up");
    nothing_in(&mut inbox).await;
}

/// Writes from each node into the next one's region, round after round,
/// until `stop`; every write checked. Returns how many went.
async fn ring_of_writes(nodes: Arc<Vec<Node>>, stop: Arc<tokio::sync::Notify>) -> usize {
    let mut regions = Vec::new();
    for node in nodes.iter() {
        regions.push(node.alloc(4096, Access::ReadWrite).await.unwrap());
    }
    let mut done = 0;
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        for (i, node) in nodes.iter().enumerate() {
            let next = &regions[(i + 1) % nodes.len()];
            let src = node.alloc(4096, Access::ReadWrite).await.unwrap();
            let bytes = pattern(4096, done as u8);
            src.write_at(0, &bytes).unwrap();
            node.submit(vec![RdmaOp::write(src.whole(), next.remote())], DEADLINE)
                .await
                .unwrap_or_else(|e| panic!("write {done} failed during the roll: {e}"));
            assert_eq!(next.to_vec(), bytes);
            done += 1;
        }
        tokio::select! {
            _ = &mut stopped => return done,
            _ = tokio::time::sleep(Duration::from_millis(2)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_rolls_node_by_node_with_transfers_running_throughout() {
    let old = || secret(SECRET);
    let new = || secret(OTHER);
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(node(Some(old()), false).await);
    }
    let nodes = Arc::new(nodes);
    let stop = Arc::new(tokio::sync::Notify::new());
    let ring = tokio::spawn(ring_of_writes(nodes.clone(), stop.clone()));
    // Each step, node by node; after each node, a newcomer holding what
    // that step hands out connects to all three (a new connection at every
    // step, not only the ones already open).
    let steps = [
        ("old, also new", old().also_accept(OTHER).unwrap()),
        ("new, also old", new().also_accept(SECRET).unwrap()),
        ("new", new()),
    ];
    for (step, secret_of) in &steps {
        let secret_of = || secret_of.clone();
        for node in nodes.iter() {
            node.set_cluster_secret(Some(secret_of()));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let newcomer = node(Some(secret_of()), false).await;
        for node in nodes.iter() {
            let region = node.alloc(64, Access::ReadWrite).await.unwrap();
            let dst = newcomer.alloc(64, Access::ReadWrite).await.unwrap();
            newcomer
                .submit(vec![RdmaOp::read(dst.whole(), region.remote())], DEADLINE)
                .await
                .unwrap_or_else(|e| panic!("{step}: a newcomer was refused: {e}"));
        }
    }
    stop.notify_one();
    let writes = ring.await.unwrap();
    assert!(writes >= 30, "only {writes} writes ran during the roll");
    // Rolled: a node with only the old secret is refused now.
    let straggler = node(Some(old()), false).await;
    let region = nodes[0].alloc(64, Access::ReadWrite).await.unwrap();
    let dst = straggler.alloc(64, Access::ReadWrite).await.unwrap();
    let refused = straggler
        .submit(vec![RdmaOp::read(dst.whole(), region.remote())], DEADLINE)
        .await;
    assert!(
        matches!(
            refused,
            Err(SubmitError::Op {
                error: OpError::AuthFailed { .. },
                ..
            })
        ),
        "{refused:?}"
    );
    // Nobody was refused during the roll; the straggler was, after it (the
    // owner counts it once it sees the straggler hang up).
    let counted = async {
        while nodes[0].auth_refusals() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(DEADLINE, counted)
        .await
        .expect("the straggler's refusal counted");
    assert_eq!(nodes[1].auth_refusals() + nodes[2].auth_refusals(), 0);
}

/// CPU time this process has used, user and system.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_bad_hellos_leave_a_good_peer_served() {
    let owner = node(Some(secret(SECRET)), false).await;
    let good = node(Some(secret(SECRET)), false).await;
    let target = filled(&owner, 1).await;
    let endpoint = owner.addr();
    let cpu_before = cpu_time();
    let started = std::time::Instant::now();
    let attack = tokio::spawn(async move {
        let wrong = Dialer::new(NodeId::random(), Some(secret(OTHER)));
        let none = Dialer::new(NodeId::random(), None);
        let mut refused = 0;
        for round in 0..1000 {
            let dialer = if round % 2 == 0 { &wrong } else { &none };
            if dialer.connect(endpoint, Channel::CONTROL).await.is_err() {
                refused += 1;
            }
        }
        refused
    });
    let mut good_writes = 0;
    while !attack.is_finished() {
        let src = filled(&good, good_writes as u8).await;
        good.submit(vec![RdmaOp::write(src.whole(), target.remote())], DEADLINE)
            .await
            .unwrap();
        assert_eq!(target.to_vec(), pattern(LEN, good_writes as u8));
        good_writes += 1;
    }
    assert_eq!(attack.await.unwrap(), 1000);
    let cpu = cpu_time() - cpu_before;
    let wall = started.elapsed();
    // Attacker, owner and good peer share this process: the CPU is theirs
    // together, an upper bound on the owner's.
    println!(
        "1,000 bad hellos in {wall:?}: {cpu:?} of CPU in all ({:?} per hello, at most), \
         {good_writes} good writes served meanwhile",
        cpu / 1000
    );
    assert!(good_writes > 0);
    // The owner's side of the last refusals may still be finishing.
    let counted = async {
        while owner.auth_refusals() < 1000 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(DEADLINE, counted)
        .await
        .expect("every refusal counted");
    assert_eq!(owner.auth_refusals(), 1000);
}
