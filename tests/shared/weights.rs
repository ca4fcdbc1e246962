//! Weight publication between nodes `make` spawns (over the transport they
//! share): a matrix split by rows over two publisher ranks, subscribed by
//! ranks that split it by columns, version after version, every byte
//! checked; the fence held by a reader that checks its buffer
//! continuously; and each failure typed, none blocking the others.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ferry::LocalLayout;
use ferry::layout::RankLayout;
use ferry::prelude::*;
use ferry::weights::{Publisher, Subscriber, WeightsError};

const DEADLINE: Duration = Duration::from_secs(30);

// The matrix, its layouts and its versions' values
// (tests/shared/weights_data.rs, loaded once, by the peer commands).
use crate::common::peer_weights::data::{fill, held, layout, local};
/// Two publisher ranks (rows split), published as `set`, holding version 1.
async fn publishers(
    make: &impl AsyncFn() -> Node,
    set: &str,
) -> Vec<(Node, Publisher, LocalLayout)> {
    let mut out = Vec::new();
    for rank in 0..2 {
        let node = make().await;
        let memory = local(&node, layout(rank, 2, 0)).await;
        // The publisher keeps its own handle to the same memory.
        let publisher = Publisher::start(&node, set, memory.clone()).unwrap();
        let (guard, _) = publisher.write(DEADLINE).await;
        fill(&memory, 1);
        guard.publish(1).unwrap();
        out.push((node, publisher, memory));
    }
    out
}

async fn publish(publishers: &[(Node, Publisher, LocalLayout)], version: u64) {
    for (_, publisher, memory) in publishers {
        let (guard, overrun) = publisher.write(DEADLINE).await;
        assert_eq!(overrun, 0);
        fill(memory, version);
        guard.publish(version).unwrap();
    }
}

fn addrs(publishers: &[(Node, Publisher, LocalLayout)]) -> Vec<std::net::SocketAddr> {
    publishers
        .iter()
        .map(|(n, _, _)| n.addr().endpoint)
        .collect()
}

pub async fn ten_versions_reach_subscribers_of_another_sharding_whole(
    make: &impl AsyncFn() -> Node,
) {
    let publishers = publishers(make, "w10").await;
    let mut subscribers = Vec::new();
    for rank in 0..4 {
        let node = make().await;
        let buffers = vec![
            local(&node, layout(rank, 4, 1)).await,
            local(&node, layout(rank, 4, 1)).await,
        ];
        let sub = Subscriber::new(&node, "w10", &addrs(&publishers), buffers, DEADLINE)
            .await
            .unwrap();
        subscribers.push((node, sub));
    }
    for version in 1..=10 {
        if version > 1 {
            publish(&publishers, version).await;
        }
        for (_, sub) in &mut subscribers {
            let update = sub.update(DEADLINE).await.unwrap();
            assert_eq!((update.version, update.changed), (version, true));
            assert_eq!(held(&sub.buffers()[update.buffer]), Some(version));
            // Already the newest: nothing moves.
            assert!(!sub.update(DEADLINE).await.unwrap().changed);
        }
    }
    // Several versions behind: the newest, not every one between.
    publish(&publishers, 11).await;
    publish(&publishers, 14).await;
    let (_, sub) = &mut subscribers[0];
    assert_eq!(sub.update(DEADLINE).await.unwrap().version, 14);
    // Versions only grow.
    let (guard, _) = publishers[0].1.write(DEADLINE).await;
    assert!(matches!(
        guard.publish(12),
        Err(WeightsError::VersionNotNewer {
            version: 12,
            last: 14
        })
    ));
    // A late joiner gets the current version (rank 0 has none now: the
    // failed publish left it without one; publish again).
    let (guard, _) = publishers[0].1.write(DEADLINE).await;
    fill(&publishers[0].2, 15);
    guard.publish(15).unwrap();
    publish(&publishers[1..], 15).await;
    let node = make().await;
    let late = vec![local(&node, layout(0, 1, 1)).await];
    let mut late = Subscriber::new(&node, "w10", &addrs(&publishers), late, DEADLINE)
        .await
        .unwrap();
    assert_eq!(late.update(DEADLINE).await.unwrap().version, 15);
    assert_eq!(held(&late.buffers()[0]), Some(15));
}

pub async fn a_reader_never_sees_two_versions_mixed(make: &impl AsyncFn() -> Node) {
    for buffers in [1, 2] {
        let set = format!("fence{buffers}");
        let publishers = publishers(make, &set).await;
        let node = make().await;
        let mut memory = Vec::new();
        for _ in 0..buffers {
            memory.push(local(&node, layout(0, 1, 1)).await);
        }
        let mut sub = Subscriber::new(&node, &set, &addrs(&publishers), memory.clone(), DEADLINE)
            .await
            .unwrap();
        sub.update(DEADLINE).await.unwrap();
        let (stop, checks, mixed) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let reader = {
            let (readers, memory) = (sub.readers(), memory.clone());
            let (stop, checks, mixed) = (stop.clone(), checks.clone(), mixed.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let guard = readers.read().await;
                    if held(&memory[guard.buffer()]).is_none() {
                        mixed.fetch_add(1, Ordering::Relaxed);
                    }
                    checks.fetch_add(1, Ordering::Relaxed);
                    drop(guard);
                    tokio::task::yield_now().await;
                }
            })
        };
        for version in 2..=8 {
            publish(&publishers, version).await;
            assert_eq!(sub.update(DEADLINE).await.unwrap().version, version);
        }
        stop.store(true, Ordering::Relaxed);
        reader.await.unwrap();
        assert!(checks.load(Ordering::Relaxed) > 0);
        assert_eq!(mixed.load(Ordering::Relaxed), 0, "{buffers} buffers");
    }
}

pub async fn a_reader_that_vanishes_holds_no_writer_up_and_an_overrun_one_fails_typed(
    make: &impl AsyncFn() -> Node,
) {
    let publishers = publishers(make, "leases").await;
    let (node, publisher, _) = &publishers[0];
    let lease = |version: u64| Bytes::from(format!(r#"{{"Lease":{{"version":{version}}}}}"#));
    // A subscriber that took a lease and was killed (its node shut down).
    let gone = make().await;
    let leased = gone
        .call(node.addr(), "ferry.weights:leases", lease(1), DEADLINE)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&leased).contains("Leased"));
    gone.shutdown().await;
    let (guard, overrun) = publisher.write(DEADLINE).await;
    assert_eq!(
        overrun, 0,
        "the vanished reader's lease ended with its session"
    );
    guard.publish(2).unwrap();
    // A reader that holds its lease past the writer's timeout: overrun,
    // and told so when it releases.
    let slow = make().await;
    let leased = slow
        .call(node.addr(), "ferry.weights:leases", lease(2), DEADLINE)
        .await
        .unwrap();
    let id: u64 = String::from_utf8_lossy(&leased)
        .trim_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap();
    let (guard, overrun) = publisher.write(Duration::from_millis(200)).await;
    assert_eq!(overrun, 1);
    guard.publish(3).unwrap();
    let released = slow
        .call(
            node.addr(),
            "ferry.weights:leases",
            Bytes::from(format!(r#"{{"Release":{{"lease":{id}}}}}"#)),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&released).contains("false"),
        "{released:?}"
    );
}

pub async fn a_lost_publisher_leaves_the_last_version_and_a_restart_is_planned_again(
    make: &impl AsyncFn() -> Node,
) {
    let mut publishers = publishers(make, "restart").await;
    let node = make().await;
    let memory = vec![local(&node, layout(0, 1, 1)).await];
    let mut sub = Subscriber::new(
        &node,
        "restart",
        &addrs(&publishers),
        memory.clone(),
        DEADLINE,
    )
    .await
    .unwrap();
    assert_eq!(sub.update(DEADLINE).await.unwrap().version, 1);
    // Rank 1 is killed.
    let (killed, _, _) = publishers.pop().unwrap();
    killed.shutdown().await;
    let lost = sub.update(DEADLINE).await;
    assert!(
        matches!(lost, Err(WeightsError::PublisherLost { .. })),
        "{lost:?}"
    );
    assert_eq!(sub.version(), Some(1));
    assert_eq!(held(&memory[0]), Some(1));
    // It comes back (another node, the same set): plan again.
    let restarted = make().await;
    let again = local(&restarted, layout(1, 2, 0)).await;
    let publisher = Publisher::start(&restarted, "restart", again.clone()).unwrap();
    let (guard, _) = publisher.write(DEADLINE).await;
    fill(&again, 1);
    guard.publish(1).unwrap();
    publishers.push((restarted, publisher, again));
    let mut sub = Subscriber::new(
        &node,
        "restart",
        &addrs(&publishers),
        memory.clone(),
        DEADLINE,
    )
    .await
    .unwrap();
    assert_eq!(sub.update(DEADLINE).await.unwrap().version, 1);
    assert_eq!(held(&memory[0]), Some(1));
}

/// With one buffer, an update that fails once it began writing (a
/// publisher rank overran its lease) leaves a mix of versions there:
/// readers wait for the next complete version instead of reading it.
pub async fn a_failed_update_in_place_leaves_readers_waiting_not_reading_a_mix(
    make: &impl AsyncFn() -> Node,
) {
    let publishers = publishers(make, "in-place").await;
    let node = make().await;
    let memory = local(&node, layout(0, 1, 1)).await;
    let buffers = vec![memory.clone()];
    let mut sub = Subscriber::new(&node, "in-place", &addrs(&publishers), buffers, DEADLINE)
        .await
        .unwrap();
    sub.update(DEADLINE).await.unwrap();
    publish(&publishers, 2).await;
    let readers = sub.readers();
    let reading = readers.read().await;
    assert_eq!(reading.version(), 1);
    // The update leases version 2 on both ranks, then waits for the reader.
    let update = tokio::spawn(async move {
        let result = sub.update(DEADLINE).await;
        (sub, result)
    });
    let leased = tokio::time::Instant::now() + DEADLINE;
    while publishers.iter().any(|(_, p, _)| p.readers() == 0) {
        assert!(tokio::time::Instant::now() < leased, "no lease taken");
        tokio::task::yield_now().await;
    }
    // Rank 0 writes version 3 without waiting: it overruns the lease, and
    // the update moves rank 0's version 3 beside rank 1's version 2.
    let (_, rank0, memory0) = &publishers[0];
    let (guard, overrun) = rank0.write(Duration::ZERO).await;
    assert_eq!(overrun, 1);
    fill(memory0, 3);
    guard.publish(3).unwrap();
    drop(reading);
    let (mut sub, result) = update.await.unwrap();
    assert_eq!(
        result,
        Err(WeightsError::Overwritten {
            rank: 0,
            version: 2
        })
    );
    assert_eq!(sub.version(), None);
    assert_eq!(held(&memory), None, "the buffer holds a mix");
    let waiting = tokio::spawn({
        let readers = readers.clone();
        async move { readers.read().await.version() }
    });
    let early = tokio::time::timeout(Duration::from_millis(200), readers.read()).await;
    assert!(early.is_err(), "a reader got the mixed buffer");
    // The next complete version releases the waiting reader.
    publish(&publishers[1..], 3).await;
    assert_eq!(sub.update(DEADLINE).await.unwrap().version, 3);
    let version = tokio::time::timeout(DEADLINE, waiting).await.unwrap();
    assert_eq!(version.unwrap(), 3);
    assert_eq!(held(&memory), Some(3));
}

/// A publisher rank dropped and started again on the same node (a trainer
/// that restarts a rank in place) serves the set again, and a subscriber
/// made then gets its versions.
pub async fn a_publisher_started_again_in_place_serves_the_set(make: &impl AsyncFn() -> Node) {
    let mut publishers = publishers(make, "again").await;
    let (node, publisher, memory) = publishers.remove(0);
    // Its layout is taken while it lives.
    let twice = Publisher::start(&node, "again", memory.clone());
    assert!(twice.is_err(), "a second publisher of the set on one node");
    drop(publisher);
    let publisher = Publisher::start(&node, "again", memory.clone()).unwrap();
    publishers.insert(0, (node, publisher, memory));
    publish(&publishers, 2).await;
    let sub_node = make().await;
    let buffer = local(&sub_node, layout(0, 1, 1)).await;
    let mut sub = Subscriber::new(
        &sub_node,
        "again",
        &addrs(&publishers),
        vec![buffer.clone()],
        DEADLINE,
    )
    .await
    .unwrap();
    assert_eq!(sub.update(DEADLINE).await.unwrap().version, 2);
    assert_eq!(held(&buffer), Some(2));
}

/// Relays: subscriber A pulls from the publishers and serves on; B (the
/// same shard) pulls from A and serves on; C (the same shard, in place)
/// pulls from B; D (a quarter of the columns, inside A's half) pulls from
/// A. Every version reaches all four whole, the publishers serving it
/// once, C and D checking checksums. A downstream reader that holds a relay's buffer too long is
/// overrun and told; a relay that goes fails its downstream typed.
pub async fn relays_carry_each_version_down_a_tree_of_subscribers(make: &impl AsyncFn() -> Node) {
    let publishers = publishers(make, "relay").await;
    let subscriber = async |layout: RankLayout, buffers: usize, from: Option<&Node>| {
        let node = make().await;
        let mut memory = Vec::new();
        for _ in 0..buffers {
            memory.push(local(&node, layout.clone()).await);
        }
        let sub = match from {
            None => Subscriber::new(&node, "relay", &addrs(&publishers), memory, DEADLINE).await,
            Some(relay) => {
                Subscriber::from_relay(&node, "relay", relay.addr().endpoint, memory, DEADLINE)
                    .await
            }
        };
        (node, sub.unwrap())
    };
    let (a_node, mut a) = subscriber(layout(0, 2, 1), 2, None).await;
    a.serve_relay().unwrap();
    let (b_node, mut b) = subscriber(layout(0, 2, 1), 2, Some(&a_node)).await;
    b.serve_relay().unwrap();
    let (_c_node, mut c) = subscriber(layout(0, 2, 1), 1, Some(&b_node)).await;
    let (_d_node, mut d) = subscriber(layout(0, 4, 1), 2, Some(&a_node)).await;
    // Checksums through relays too: C's against B's buffers, D's (a
    // sub-shard) against A's.
    c.verify_checksums(true);
    d.verify_checksums(true);
    for version in 1..=5 {
        if version > 1 {
            publish(&publishers, version).await;
        }
        let update = a.update(DEADLINE).await.unwrap();
        assert_eq!(update.version, version);
        for sub in [&mut b, &mut c, &mut d] {
            let update = sub.update_to(version, DEADLINE).await.unwrap();
            assert_eq!((update.version, update.changed), (version, true));
            assert_eq!(held(&sub.buffers()[update.buffer]), Some(version));
        }
    }
    // A downstream reader holding A's current buffer (version 5) while A
    // updates twice: the first update fills the other buffer; the second
    // must write the held one, waits half its time, then overruns it.
    let reader = make().await;
    let ask = |body: String| {
        reader.call(
            a_node.addr(),
            "ferry.weights-relay:relay",
            Bytes::from(body),
            DEADLINE,
        )
    };
    let leased = ask(r#"{"Lease":{"version":5}}"#.into()).await.unwrap();
    let leased: serde_json::Value = serde_json::from_slice(&leased).unwrap();
    let lease = leased["Leased"]["lease"].as_u64().expect("leased");
    for version in [6, 7] {
        publish(&publishers, version).await;
        let update = a.update(Duration::from_millis(600)).await.unwrap();
        assert_eq!(update.version, version);
    }
    let released = ask(format!(r#"{{"Release":{{"lease":{lease}}}}}"#))
        .await
        .unwrap();
    let released: serde_json::Value = serde_json::from_slice(&released).unwrap();
    assert_eq!(released["Released"]["intact"], false, "{released}");
    assert_eq!(b.update_to(7, DEADLINE).await.unwrap().version, 7);
    assert_eq!(held(&b.buffers()[b.active()]), Some(7));
    // The relay goes: its downstream fails typed and keeps version 7.
    drop(a);
    a_node.shutdown().await;
    let lost = d.update(Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(lost, WeightsError::PublisherLost { .. }),
        "{lost:?}"
    );
    assert_eq!(d.version(), Some(5));
}

/// `update_to` called before its version exists waits for it: A for the
/// publishers' next step, B (behind A, a relay) for A's update, each
/// returning only after its source published, with every byte; a
/// version that never comes fails typed at the deadline.
pub async fn update_to_waits_for_a_version_published_after_the_call(make: &impl AsyncFn() -> Node) {
    let publishers = publishers(make, "await").await;
    let a_node = make().await;
    let memory = vec![
        local(&a_node, layout(0, 2, 1)).await,
        local(&a_node, layout(0, 2, 1)).await,
    ];
    let mut a = Subscriber::new(&a_node, "await", &addrs(&publishers), memory, DEADLINE)
        .await
        .unwrap();
    a.serve_relay().unwrap();
    assert_eq!(a.update(DEADLINE).await.unwrap().version, 1);
    let b_node = make().await;
    let memory = vec![local(&b_node, layout(0, 2, 1)).await];
    let mut b = Subscriber::from_relay(&b_node, "await", a_node.addr().endpoint, memory, DEADLINE)
        .await
        .unwrap();
    assert_eq!(b.update_to(1, DEADLINE).await.unwrap().version, 1);
    // The version the publishers hold whole, set before each step starts.
    let published = Arc::new(AtomicU64::new(1));
    let waiting = |mut sub: Subscriber| {
        let published = published.clone();
        tokio::spawn(async move {
            let update = sub.update_to(2, DEADLINE).await;
            let seen = published.load(Ordering::Acquire);
            (update, seen, sub)
        })
    };
    let (a_waits, b_waits) = (waiting(a), waiting(b));
    published.store(2, Ordering::Release);
    publish(&publishers, 2).await;
    let (update, seen, a) = a_waits.await.unwrap();
    assert_eq!((update.unwrap().version, seen), (2, 2));
    assert_eq!(held(&a.buffers()[a.active()]), Some(2));
    let (update, seen, mut b) = b_waits.await.unwrap();
    assert_eq!((update.unwrap().version, seen), (2, 2));
    assert_eq!(held(&b.buffers()[0]), Some(2));
    // A version nobody publishes: typed, at the deadline.
    let started = std::time::Instant::now();
    let never = b
        .update_to(3, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(never, WeightsError::NoCompleteVersion);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(b.version(), Some(2));
    drop(a);
}

/// A stand-in for publisher rank 1 of set `set` on `node`: it publishes
/// the rank's layout over memory that holds version 1, and answers the
/// weights protocol as a rank holding it does, except that it claims the
/// checksums of a zeroed tensor: a source whose bytes arrive other than it
/// holds them, as far as the subscriber can tell.
async fn lying_rank(node: &Node, set: &str) -> LocalLayout {
    let memory = local(node, layout(1, 2, 0)).await;
    fill(&memory, 1);
    node.publish_layout(set, &memory).unwrap();
    node.serve_rpc(&format!("ferry.weights:{set}"), |request| async move {
        let ask: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
        let answer = match &ask {
            serde_json::Value::String(s) if s == "State" => {
                serde_json::json!({"State": {"rank": 1, "version": 1}})
            }
            _ if ask.get("Lease").is_some() => serde_json::json!({"Leased": {"lease": 7}}),
            _ if ask.get("Release").is_some() => serde_json::json!({"Released": {"intact": true}}),
            _ => {
                let boxes = ask["Checksums"]["boxes"].as_array().unwrap().len();
                serde_json::json!({"Checksums": {"sums": vec![0u64; boxes]}})
            }
        };
        Ok(Bytes::from(serde_json::to_vec(&answer).unwrap()))
    })
    .unwrap();
    memory
}

pub async fn checksums_pass_what_each_rank_served_and_catch_a_source_that_differs(
    make: &impl AsyncFn() -> Node,
) {
    // Honest ranks, rows split, into columns: three versions, each checked
    // by the checksums of the boxes each rank shares with the subscriber.
    let publishers = publishers(make, "wsum").await;
    let node = make().await;
    let buffers = vec![local(&node, layout(1, 4, 1)).await];
    let mut sub = Subscriber::new(&node, "wsum", &addrs(&publishers), buffers, DEADLINE)
        .await
        .unwrap();
    sub.verify_checksums(true);
    for version in 1..=3 {
        if version > 1 {
            publish(&publishers, version).await;
        }
        assert_eq!(sub.update(DEADLINE).await.unwrap().version, version);
        assert_eq!(held(&sub.buffers()[0]), Some(version));
    }
    // Rank 1 replaced by one whose checksums differ from its bytes.
    let honest = publishers.into_iter().next().unwrap();
    let liar = make().await;
    let _liar_memory = lying_rank(&liar, "wsum2").await;
    let rank0 = Publisher::start(&honest.0, "wsum2", honest.2.clone()).unwrap();
    let (guard, _) = rank0.write(DEADLINE).await;
    fill(&honest.2, 1);
    guard.publish(1).unwrap();
    let sources = [honest.0.addr().endpoint, liar.addr().endpoint];
    let buffers = vec![local(&node, layout(0, 1, 1)).await];
    let mut sub = Subscriber::new(&node, "wsum2", &sources, buffers, DEADLINE)
        .await
        .unwrap();
    // Unasked, the update takes the bytes: they are version 1's.
    assert_eq!(sub.update(DEADLINE).await.unwrap().version, 1);
    assert_eq!(held(&sub.buffers()[0]), Some(1));
    let buffers = vec![local(&node, layout(0, 1, 1)).await];
    let mut sub = Subscriber::new(&node, "wsum2", &sources, buffers, DEADLINE)
        .await
        .unwrap();
    sub.verify_checksums(true);
    match sub.update(DEADLINE).await {
        Err(WeightsError::ChecksumMismatch {
            tensor,
            rank: 1,
            version: 1,
        }) => assert_eq!(tensor, "w"),
        other => panic!("expected a checksum mismatch from rank 1, got {other:?}"),
    }
    // One buffer, written and not verified: it holds no version, and
    // readers wait rather than read it.
    assert_eq!(sub.version(), None);
    let read = tokio::time::timeout(Duration::from_millis(100), sub.readers().read()).await;
    assert!(
        read.is_err(),
        "a reader got a buffer that failed its checksum"
    );
    // The honest rank's lease was released: it writes without waiting.
    let (_, overrun) = rank0.write(Duration::from_millis(1)).await;
    assert_eq!(overrun, 0);
    assert_eq!(rank0.readers(), 0);
}
