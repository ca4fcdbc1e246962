//! Discovery through a real etcd, with `ferry serve` processes as the
//! published nodes and this process as the node that finds them: lookups
//! by name, leases that outlive a killed node by at most their TTL, the
//! watch that follows restarts, etcd lost and back, and the peer-to-peer
//! fetch with no etcd at all.

mod harness;

use std::time::{Duration, Instant};

use ferry::{Access, DiscoveryError, Node, NodeError, OpError, RdmaOp, RemoteBuffer, SubmitError};
use ferry::{EtcdConfig, EtcdError};
use harness::{EtcdServer, FERRY, Serve, free_port, listed, wait_until};

const LOOKUP: Duration = Duration::from_secs(10);
const SUBMIT: Duration = Duration::from_secs(10);

/// A TCP-only node finding peers in `etcd` (and, named, publishing there).
async fn node(etcd: &EtcdServer, name: Option<&str>) -> Node {
    let mut builder = Node::builder()
        .ibverbs(false)
        .etcd(EtcdConfig::new(etcd.url()).lease_ttl(Duration::from_secs(2)));
    if let Some(name) = name {
        builder = builder.name(name);
    }
    builder.spawn().await.expect("node spawns")
}

/// Writes a pattern into `remote` and reads it back: both verified.
async fn round_trip(node: &Node, remote: &RemoteBuffer, seed: u8) {
    let len = remote.len().min(1 << 20);
    let local = node.alloc(len, Access::ReadWrite).await.unwrap();
    let pattern: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    local.write_at(0, &pattern).unwrap();
    let write = RdmaOp::write(local.whole(), remote.slice(0..len).unwrap());
    node.submit(vec![write], SUBMIT).await.expect("write");
    let back = node.alloc(len, Access::ReadWrite).await.unwrap();
    let read = RdmaOp::read(back.whole(), remote.slice(0..len).unwrap());
    node.submit(vec![read], SUBMIT).await.expect("read");
    assert!(back.to_vec() == pattern, "read back what was written");
}

fn bench(args: &[&str]) -> std::process::Output {
    std::process::Command::new(FERRY)
        .arg("bench")
        .args(args)
        .args([
            "--block",
            "64K",
            "--iters",
            "2",
            "--transport",
            "tcp",
            "--verify",
        ])
        .output()
        .expect("ferry bench runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_find_each_other_by_name_and_move_verified_data() {
    let etcd = EtcdServer::start();
    let url = etcd.url();
    let _decode = Serve::start("decode-0", &["--etcd", &url]);
    let me = node(&etcd, None).await;

    let remote = me.lookup_region("decode-0", "kv", LOOKUP).await.unwrap();
    assert_eq!(
        remote, _decode.handle,
        "etcd holds the handle serve printed"
    );
    round_trip(&me, &remote, 1).await;
    // Unknown names are typed errors at the deadline, not hangs.
    let short = Duration::from_millis(300);
    let missing = me.lookup_region("decode-0", "weights", short).await;
    assert!(
        matches!(missing, Err(DiscoveryError::Lookup(_))),
        "{missing:?}"
    );

    // The CLI finds it the same way.
    let out = bench(&["--peer", "decode-0", "--region", "kv", "--etcd", &url]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench --peer NAME: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("verified"), "{stdout}");

    // `ferry ls` shows it, its transport, region and lease.
    let nodes = harness::ferry_ls(&url).expect("ferry ls --json");
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    let node = &nodes[0];
    assert_eq!(node["name"], "decode-0");
    assert_eq!(node["transports"], serde_json::json!(["tcp", "memory"]));
    assert_eq!(node["regions"][0]["name"], "kv");
    assert_eq!(node["regions"][0]["len"], 4 << 20);
    let lease = node["lease_left_s"].as_u64().expect("a lease");
    assert!(lease <= 10, "default TTL is 10 s, {lease} s left");
    let table = std::process::Command::new(FERRY)
        .args(["ls", "--etcd", &url])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("decode-0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_to_peer_fetch_needs_no_etcd() {
    let solo = Serve::start("solo", &[]);
    let me = Node::builder().ibverbs(false).spawn().await.unwrap();
    let (name, _) = me
        .fetch_metadata(solo.handle.owner().endpoint, LOOKUP)
        .await
        .unwrap();
    assert_eq!(name, "solo");
    let remote = me.remote_region("solo", "kv").unwrap();
    assert_eq!(remote, solo.handle);
    round_trip(&me, &remote, 2).await;

    let addr = solo.handle.owner().endpoint.to_string();
    let out = bench(&["--peer", &addr, "--region", "kv"]);
    assert!(
        out.status.success(),
        "bench --peer HOST:PORT: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A name without etcd cannot be found: said so, not hung.
    let out = bench(&["--peer", "solo", "--region", "kv"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--etcd"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_vanishes_within_its_lease_and_its_restart_is_reached() {
    let etcd = EtcdServer::start();
    let url = etcd.url();
    let ttl = 2;
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let serve_args = ["--etcd", &url, "--lease-ttl", "2", "--listen", &listen];
    let mut first = Serve::start("prefill-0", &serve_args);
    let me = node(&etcd, None).await;
    let old = me.lookup_region("prefill-0", "kv", LOOKUP).await.unwrap();
    round_trip(&me, &old, 3).await;

    first.kill();
    let gone = wait_until(Duration::from_secs(ttl + 5), "key gone", || {
        !listed(&url).contains(&"prefill-0".to_string())
    });
    // The watch dropped it from this node's cache too.
    wait_until(Duration::from_secs(2), "cache dropped", || {
        me.peer_metadata("prefill-0").is_none()
    });
    assert!(
        gone <= Duration::from_secs(ttl + 1),
        "key gone {gone:?} after kill -9, TTL {ttl} s"
    );
    // The dead node's handle fails with a typed error, without hanging.
    let local = me.alloc(4096, Access::ReadWrite).await.unwrap();
    let op = || RdmaOp::write(local.whole(), old.slice(0..4096).unwrap());
    let started = Instant::now();
    let dead = me.submit(vec![op()], SUBMIT).await;
    assert!(
        matches!(
            &dead,
            Err(SubmitError::Op {
                error: OpError::PeerUnreachable { .. } | OpError::ConnectionLost { .. },
                ..
            })
        ),
        "{dead:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3), "failed fast");

    // A new incarnation under the same name and port.
    let second = Serve::start("prefill-0", &serve_args);
    let new = me.lookup_region("prefill-0", "kv", LOOKUP).await.unwrap();
    assert_eq!(new, second.handle);
    assert_ne!(new.owner().id, old.owner().id, "a restart is a new node id");
    round_trip(&me, &new, 4).await;
    // The old incarnation's handle reaches the new process and is refused.
    let stale = me.submit(vec![op()], SUBMIT).await;
    assert!(
        matches!(
            &stale,
            Err(SubmitError::Op {
                error: OpError::UnknownNode { .. },
                ..
            })
        ),
        "{stale:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_go_on_without_etcd_and_nodes_republish_when_it_returns() {
    let mut etcd = EtcdServer::start();
    let url = etcd.url();
    let a = Serve::start("node-a", &["--etcd", &url, "--lease-ttl", "2"]);
    let _b = Serve::start("node-b", &["--etcd", &url, "--lease-ttl", "2"]);
    let me = node(&etcd, Some("watcher")).await;
    let remote = me.lookup_region("node-a", "kv", LOOKUP).await.unwrap();
    assert_eq!(remote, a.handle);

    etcd.kill();
    for seed in 0..5 {
        round_trip(&me, &remote, seed).await;
    }
    // Still known without etcd: the cache answers.
    let cached = me
        .lookup_region("node-a", "kv", Duration::from_millis(100))
        .await;
    assert_eq!(cached.as_ref(), Ok(&remote));

    // An etcd that lost everything: every node puts its key back.
    etcd.restart();
    let back = wait_until(Duration::from_secs(20), "nodes republished", || {
        let names = listed(&url);
        ["node-a", "node-b", "watcher"]
            .iter()
            .all(|n| names.contains(&n.to_string()))
    });
    eprintln!("republished {back:?} after etcd returned");
    round_trip(&me, &remote, 9).await;
    me.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_fails_a_node_that_requires_it() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let config = EtcdConfig::new(&url).request_timeout(Duration::from_secs(1));
    let refused = Node::builder()
        .ibverbs(false)
        .name("early")
        .etcd(config.clone())
        .spawn()
        .await;
    assert!(
        matches!(refused, Err(NodeError::Etcd(EtcdError::Unreachable { .. }))),
        "{:?}",
        refused.err()
    );
    let out = std::process::Command::new(FERRY)
        .args(["serve", "--name", "early", "--no-ibverbs", "--etcd", &url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));

    // Not required: it starts, and publishes once etcd is there.
    let early = Node::builder()
        .ibverbs(false)
        .name("early")
        .etcd(config.required(false))
        .spawn()
        .await
        .expect("starts without etcd");
    assert_eq!(early.published_in_etcd(Duration::ZERO).await, Some(false));
    let etcd = EtcdServer::start_on(port);
    assert_eq!(
        early.published_in_etcd(Duration::from_secs(15)).await,
        Some(true)
    );
    assert!(listed(&etcd.url()).contains(&"early".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_wait_for_a_late_node_and_follow_its_changes() {
    let etcd = EtcdServer::start();
    let me = node(&etcd, None).await;
    // Nobody by that name: a typed error at the deadline.
    let started = Instant::now();
    let none = me.lookup("nobody", Duration::from_millis(300)).await;
    assert!(
        matches!(none, Err(DiscoveryError::Etcd(EtcdError::NotFound { .. }))),
        "{none:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));

    // A lookup waits for a node published after it began.
    let waiting = {
        let me = me.clone();
        tokio::spawn(async move { me.lookup("late", LOOKUP).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let late = node(&etcd, Some("late")).await;
    let found = waiting.await.unwrap().expect("found once published");
    assert_eq!(found.node, late.addr());

    // Its regions change: the watch refreshes the cache.
    let region = late.alloc(8192, Access::ReadOnly).await.unwrap();
    late.publish("weights/layer-3", &region).unwrap();
    wait_until(Duration::from_secs(5), "cache refreshed", || {
        me.peer_metadata("late")
            .is_some_and(|m| m.regions.contains_key("weights/layer-3"))
    });
    let remote = me
        .lookup_region("late", "weights/layer-3", LOOKUP)
        .await
        .unwrap();
    assert_eq!(remote, region.remote());

    // A clean shutdown deletes its key at once (no lease wait).
    late.shutdown().await;
    let gone = wait_until(Duration::from_secs(1), "key withdrawn", || {
        me.peer_metadata("late").is_none()
    });
    eprintln!("withdrawn key seen gone after {gone:?}");
}

#[test]
fn sigterm_withdraws_a_served_node() {
    let etcd = EtcdServer::start();
    let url = etcd.url();
    let mut serve = Serve::start("leaving", &["--etcd", &url]);
    wait_until(Duration::from_secs(5), "listed", || {
        listed(&url).contains(&"leaving".to_string())
    });
    assert!(serve.terminate().success(), "clean exit on SIGTERM");
    // Default TTL is 10 s: gone well before, so the key was withdrawn.
    wait_until(Duration::from_secs(2), "withdrawn", || {
        listed(&url).is_empty()
    });
}

/// The weight publication tests' matrix (the workspace's tests share it).
#[path = "../../../../tests/shared/weights_data.rs"]
mod weights_data;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_finds_the_publisher_ranks_by_name() {
    use ferry::weights::{Publisher, Subscriber, WeightsError};
    use weights_data::{fill, held, layout, local};

    let etcd = EtcdServer::start();
    // Two publisher ranks (rows split), each a node named in etcd.
    let mut ranks = Vec::new();
    for rank in 0..2 {
        let node = node(&etcd, Some(&format!("trainer-{rank}"))).await;
        let memory = local(&node, layout(rank, 2, 0)).await;
        let publisher = Publisher::start(&node, "policy", memory.clone()).unwrap();
        let (guard, _) = publisher.write(LOOKUP).await;
        fill(&memory, 1);
        guard.publish(1).unwrap();
        ranks.push((node, publisher));
    }
    let me = node(&etcd, None).await;
    let buffer = vec![local(&me, layout(1, 2, 1)).await];
    let names = ["trainer-0", "trainer-1"];
    let mut sub = Subscriber::by_names(&me, "policy", &names, buffer, LOOKUP)
        .await
        .unwrap();
    assert_eq!(sub.update(LOOKUP).await.unwrap().version, 1);
    assert_eq!(held(&sub.buffers()[0]), Some(1));
    // A rank nobody published: typed, at the deadline, naming it.
    let buffer = vec![local(&me, layout(0, 1, 1)).await];
    let names = ["trainer-0", "trainer-9"];
    let missing = Subscriber::by_names(&me, "policy", &names, buffer, Duration::from_millis(300));
    match missing.await {
        Err(WeightsError::PublisherLost { reason, .. }) => assert!(reason.contains("trainer-9")),
        Err(other) => panic!("expected PublisherLost naming trainer-9, got {other:?}"),
        Ok(_) => panic!("a subscriber of a rank nobody published"),
    }
}
