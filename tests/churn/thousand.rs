//! A thousand peers against one node ("the hub"): each connects, moves
//! bytes both ways (compared), sends a message, calls and is called, is
//! looked up, and vanishes: shut down, dropped, dropped with a transfer in
//! flight, or dropped after resetting connections mid-frame. A few are
//! separate processes killed with SIGKILL mid-transfer. Then every
//! per-peer table of the hub is back to empty and its descriptors back to
//! the baseline.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry::control::Channel;
use ferry::prelude::*;
use ferry::{NodeId, OpError, PeerTables, SubmitError};
use tokio::io::AsyncWriteExt;

use crate::child::Child;
use crate::{DEADLINE, open_fds, pattern, read_and_check, rss_kib, serial, soak, write_and_check};

/// Peers in the suite's run (`FERRY_CHURN_PEERS` overrides it; in a soak,
/// the peers of every block of four waves).
const PEERS: usize = 1000;
/// Peers alive at once.
const LANES: usize = 16;
/// Bytes of the hub's region each lane writes into.
const SLOT: u64 = 16 << 10;
/// Bytes of the region a peer drops while the hub still reads it.
const IN_FLIGHT: u64 = 1 << 20;
/// Killed child processes in the suite's run.
const VICTIMS: usize = 4;
/// How long the hub may take to notice that peers went away: the memory
/// transport's sweep (1 s) and its memory of an unreachable owner (5 s)
/// are the slowest, with margin for a loaded machine.
const SETTLE: Duration = Duration::from_secs(30);

/// What the hub's descriptor count may be above its baseline at the end,
/// and why: none. Every descriptor the runtime creates lazily (its blocking
/// pool has no descriptors; the timer and I/O driver are made with it) was
/// made in the warm-up, before the baseline.
const FD_SLACK: usize = 0;

/// How a peer leaves.
#[derive(Clone, Copy, Debug)]
enum Exit {
    /// `Node::shutdown`, then dropped.
    Shutdown,
    /// Dropped without a word.
    Dropped,
    /// Dropped while the hub reads from it.
    DroppedMidTransfer,
    /// Resets a control and a data connection mid-frame, then is dropped.
    Reset,
}

const EXITS: [Exit; 4] = [
    Exit::Shutdown,
    Exit::Dropped,
    Exit::DroppedMidTransfer,
    Exit::Reset,
];

#[test]
fn a_thousand_peers_come_and_go_and_the_hub_keeps_nothing_of_them() {
    serial(run());
}

struct Hub {
    node: Node,
    area: Region,
    /// Messages the hub's inbox received.
    messages: Arc<AtomicUsize>,
}

async fn run() {
    let node = Node::builder().ibverbs(false).spawn().await.unwrap();
    let area = node
        .alloc(SLOT * LANES as u64, Access::ReadWrite)
        .await
        .unwrap();
    node.serve_rpc("echo", |request| async move { Ok(reversed(&request.body)) })
        .unwrap();
    let messages = Arc::new(AtomicUsize::new(0));
    let mut inbox = node.inbox().unwrap();
    let counted = messages.clone();
    tokio::spawn(async move {
        while let Some(delivery) = inbox.recv().await {
            if delivery.kind == ferry::DeliveryKind::Message {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let hub = Arc::new(Hub {
        node,
        area,
        messages,
    });
    let empty = PeerTables::default();

    // Warm-up: one peer of each kind (memory on and off), and one victim.
    for (i, exit) in EXITS.into_iter().enumerate() {
        peer(&hub, 0, i, exit, i % 2 == 0).await;
    }
    victim(&hub, 0, true).await;
    settle(&hub.node, empty).await;
    let (fds_before, rss_before) = (open_fds(), rss_kib());
    let messages_before = hub.messages.load(Ordering::Relaxed);

    let peers_per_block = std::env::var("FERRY_CHURN_PEERS")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(PEERS)
        .max(4);
    let started = Instant::now();
    let until = soak();
    let mut peers = 0;
    let mut victims = 0;
    let mut next_report = Duration::ZERO;
    loop {
        let wave = peers_per_block / 4;
        churn(&hub, peers, wave).await;
        peers += wave;
        // A killed process per quarter of the peers.
        for _ in 0..VICTIMS / 4 {
            victim(&hub, victims % LANES, victims % 2 == 0).await;
            victims += 1;
        }
        let elapsed = started.elapsed();
        let done = match until {
            Some(until) => elapsed >= until,
            None => peers >= peers_per_block,
        };
        if until.is_some() && (elapsed >= next_report || done) {
            report(&hub.node, elapsed, peers, victims);
            next_report = elapsed + Duration::from_secs(10);
        }
        if done {
            break;
        }
    }
    settle(&hub.node, empty).await;
    let fds_after = settled_fds(fds_before + FD_SLACK).await;
    let rss_after = rss_kib();
    println!(
        "churn: {peers} peers and {victims} killed processes in {:.1?}; fds {fds_before} -> \
         {fds_after}; RSS {rss_before} KiB -> {rss_after} KiB",
        started.elapsed()
    );
    assert_eq!(hub.node.peer_tables(), empty, "per-peer tables after churn");
    assert!(
        fds_after <= fds_before + FD_SLACK,
        "open descriptors: {fds_before} before the churn, {fds_after} after"
    );
    // Every peer's and every victim's message arrived, once.
    assert_eq!(
        hub.messages.load(Ordering::Relaxed) - messages_before,
        peers + victims
    );
}

/// Runs `count` peers, `LANES` at a time, numbered from `first`.
async fn churn(hub: &Arc<Hub>, first: usize, count: usize) {
    let mut lanes = tokio::task::JoinSet::new();
    for lane in 0..LANES {
        let hub = hub.clone();
        lanes.spawn(async move {
            for i in (first + lane..first + count).step_by(LANES) {
                // Memory on for half the peers: the other half, and the hub's
                // transfers to them, go over TCP.
                peer(&hub, lane, i, EXITS[i % EXITS.len()], i % 2 == 0).await;
            }
        });
    }
    while let Some(done) = lanes.join_next().await {
        done.expect("a lane of peers failed");
    }
}

/// One in-process peer's life.
async fn peer(hub: &Hub, lane: usize, i: usize, exit: Exit, memory: bool) {
    let node = Node::builder()
        .ibverbs(false)
        .memory(memory)
        .spawn()
        .await
        .unwrap();
    node.serve_rpc("echo", |request| async move { Ok(reversed(&request.body)) })
        .unwrap();
    let len = if matches!(exit, Exit::DroppedMidTransfer) {
        IN_FLIGHT
    } else {
        SLOT
    };
    let own = node.alloc(len, Access::ReadWrite).await.unwrap();
    let bytes = pattern(len as usize, i as u64);
    own.write_at(0, &bytes).unwrap();

    // The peer writes into the hub and reads it back; the hub reads the
    // peer's region and writes into it, notified.
    let slot = lane_slot(hub, lane);
    write_and_check(&node, &slot, &pattern(SLOT as usize, i as u64 + 1)).await;
    let mut inbox = node.inbox().unwrap();
    let into_peer = own.remote().slice(0..SLOT).unwrap();
    let src = hub.node.alloc(SLOT, Access::ReadWrite).await.unwrap();
    let written = pattern(SLOT as usize, i as u64 + 2);
    src.write_at(0, &written).unwrap();
    hub.node
        .submit_with_notification(
            vec![RdmaOp::write(src.whole(), into_peer.clone())],
            DEADLINE,
            Bytes::from(format!("hub {i}")),
        )
        .await
        .unwrap();
    let delivery = tokio::time::timeout(DEADLINE, inbox.recv())
        .await
        .expect("notification within the deadline")
        .expect("an inbox");
    assert_eq!(&delivery.body[..], format!("hub {i}").as_bytes());
    assert_eq!(&own.to_vec()[..SLOT as usize], &written[..]);

    // Messages, calls both ways, and a lookup.
    node.send_message(hub.node.addr(), format!("peer {i}"), DEADLINE)
        .await
        .unwrap();
    let answer = node
        .call(hub.node.addr(), "echo", format!("to hub {i}"), DEADLINE)
        .await
        .unwrap();
    assert_eq!(answer, reversed(format!("to hub {i}").as_bytes()));
    let answer = hub
        .node
        .call(node.addr(), "echo", format!("to peer {i}"), DEADLINE)
        .await
        .unwrap();
    assert_eq!(answer, reversed(format!("to peer {i}").as_bytes()));
    hub.node
        .fetch_metadata(node.addr().endpoint, DEADLINE)
        .await
        .unwrap();

    match exit {
        Exit::Shutdown => {
            read_and_check(&hub.node, &into_peer, &written).await;
            node.shutdown().await;
        }
        Exit::Dropped => {
            read_and_check(&hub.node, &into_peer, &written).await;
        }
        Exit::DroppedMidTransfer => {
            let dst = hub.node.alloc(len, Access::ReadWrite).await.unwrap();
            let read = {
                let (hub, remote, dst) = (hub.node.clone(), own.remote(), dst.clone());
                tokio::spawn(async move {
                    hub.submit(vec![RdmaOp::read(dst.whole(), remote)], DEADLINE)
                        .await
                })
            };
            tokio::task::yield_now().await;
            drop((node, own, inbox));
            // Either the read won the race (and its bytes are the peer's),
            // or it failed with the peer gone; it never hangs.
            match read.await.unwrap() {
                Ok(()) => {
                    let mut expected = bytes;
                    expected[..SLOT as usize].copy_from_slice(&written);
                    assert!(dst.to_vec() == expected, "bytes of the in-flight read");
                }
                Err(SubmitError::Op { error, .. }) => assert!(
                    matches!(
                        error,
                        OpError::ConnectionLost { .. }
                            | OpError::PeerUnreachable { .. }
                            | OpError::StaleGeneration { .. }
                            | OpError::UnknownRegion
                    ),
                    "in-flight read failed with {error:?}"
                ),
                Err(e) => panic!("in-flight read: {e}"),
            }
            return;
        }
        Exit::Reset => reset_connections(hub).await,
    }
    drop((node, own, inbox));
}

/// A peer that says hello and then resets its connection halfway through
/// a frame, on the control channel and on the TCP data channel.
async fn reset_connections(hub: &Hub) {
    let me = NodeId::random();
    for (channel, half_frame) in [
        (Channel::CONTROL, &[0u8; 5][..]),
        (Channel::TCP_DATA, &[1u8; 9]),
    ] {
        let mut stream = ferry::control::Dialer::new(me, None)
            .connect(hub.node.addr(), channel)
            .await
            .unwrap()
            .stream;
        stream.write_all(half_frame).await.unwrap();
        stream.set_zero_linger().unwrap();
        drop(stream);
    }
}

/// A peer in another process that moves bytes, sends and calls, and is
/// killed (SIGKILL) while the hub reads a large region of it.
async fn victim(hub: &Hub, lane: usize, memory: bool) {
    let slot = lane_slot(hub, lane);
    let mut child = Child::spawn("victim", memory, 0).await;
    let setup = serde_json::json!({ "hub": hub.node.addr(), "slot": slot });
    let ready = child.ask(&format!("victim {setup}")).await;
    let remote: RemoteBuffer = serde_json::from_value(ready["region"].clone()).unwrap();
    let seed = ready["seed"].as_u64().unwrap();
    let expected = pattern(remote.len() as usize, seed);
    read_and_check(
        &hub.node,
        &remote.slice(0..SLOT).unwrap(),
        &expected[..SLOT as usize],
    )
    .await;
    hub.node
        .fetch_metadata(remote.owner().endpoint, DEADLINE)
        .await
        .unwrap();
    let dst = hub
        .node
        .alloc(remote.len(), Access::ReadWrite)
        .await
        .unwrap();
    let read = {
        let (hub, remote, dst) = (hub.node.clone(), remote.clone(), dst.clone());
        tokio::spawn(async move {
            hub.submit(vec![RdmaOp::read(dst.whole(), remote)], DEADLINE)
                .await
        })
    };
    child.kill().await;
    match read.await.unwrap() {
        Ok(()) => assert!(dst.to_vec() == expected, "bytes read from a killed peer"),
        Err(SubmitError::Op { error, .. }) => assert!(
            matches!(
                error,
                OpError::ConnectionLost { .. } | OpError::PeerUnreachable { .. }
            ),
            "read from a killed peer failed with {error:?}"
        ),
        Err(e) => panic!("read from a killed peer: {e}"),
    }
}

/// The hub's slot for `lane`.
fn lane_slot(hub: &Hub, lane: usize) -> RemoteBuffer {
    let at = lane as u64 * SLOT;
    hub.area.remote().slice(at..at + SLOT).unwrap()
}

fn reversed(body: &[u8]) -> Bytes {
    body.iter().rev().copied().collect::<Vec<u8>>().into()
}

/// Waits (up to [`SETTLE`]) for `node`'s tables to read `expected`.
async fn settle(node: &Node, expected: PeerTables) {
    let deadline = Instant::now() + SETTLE;
    while node.peer_tables() != expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The descriptor count once it is at most `bound`, or after [`SETTLE`]:
/// dropped peers' tasks close theirs as the runtime gets to them.
async fn settled_fds(bound: usize) -> usize {
    let deadline = Instant::now() + SETTLE;
    loop {
        let fds = open_fds();
        if fds <= bound || Instant::now() >= deadline {
            return fds;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One line of the soak's log.
fn report(node: &Node, elapsed: Duration, peers: usize, victims: usize) {
    let tables: Vec<String> = node
        .peer_tables()
        .entries()
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name}={n}"))
        .collect();
    println!(
        "soak churn t={:>4}s peers={peers} killed={victims} rss={}KiB fds={} tables: {}",
        elapsed.as_secs(),
        rss_kib(),
        open_fds(),
        if tables.is_empty() {
            "all empty".into()
        } else {
            tables.join(" ")
        }
    );
}
