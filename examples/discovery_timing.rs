//! How fast discovery answers, for the numbers in issue notes:
//!
//! - `blob`: the metadata blob's size for a node publishing 1,000 regions
//!   (with ibverbs handles where this host has a device);
//! - `lookup ETCD_URL FERRY_BIN`: lookup by name, warm (the watch-kept
//!   cache) and cold (through etcd), p50/p99 over 20 each;
//! - `expiry ETCD_URL FERRY_BIN`: from `kill -9` of a `ferry serve` to a
//!   peer's cache dropping it, over 20 nodes killed 0.5 s apart (the
//!   default 10 s lease).
//!
//! `scripts/bench-discovery.sh` starts etcd and runs all three.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{Access, EtcdConfig, Node};

const TRIALS: usize = 20;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

fn report(what: &str, samples: &mut [Duration]) {
    println!(
        "{what}: p50 {:.3} ms, p99 {:.3} ms, min {:.3} ms ({} trials)",
        percentile(samples, 0.5).as_secs_f64() * 1e3,
        percentile(samples, 0.99).as_secs_f64() * 1e3,
        samples[0].as_secs_f64() * 1e3,
        samples.len()
    );
}

fn serve(ferry: &str, url: &str, name: &str) -> Child {
    let mut child = Command::new(ferry)
        .args(["serve", "--name", name, "--publish", "kv", "--size", "64K"])
        .args(["--no-ibverbs", "--etcd", url])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ferry serve starts");
    // The handle line: it is up and published.
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    child
}

async fn blob() {
    let node = Node::builder().name("blob-0").spawn().await.unwrap();
    let mut regions = Vec::new();
    for i in 0..1000 {
        let region = node.alloc(4096, Access::ReadWrite).await.unwrap();
        node.publish(format!("kv-cache/layer-{i}"), &region)
            .unwrap();
        regions.push(region);
    }
    let transports: Vec<_> = node.metadata().transports;
    println!(
        "metadata blob, 1,000 regions, transports {transports:?}: {} bytes",
        node.export_metadata(None).len()
    );
    node.shutdown().await;
}

/// A node that finds others through the etcd at `url`.
async fn finder(url: &str) -> Node {
    Node::builder()
        .ibverbs(false)
        .etcd(EtcdConfig::new(url))
        .spawn()
        .await
        .unwrap()
}

async fn lookup(url: &str, ferry: &str) {
    let mut server = serve(ferry, url, "lookup-target");
    let node = finder(url).await;
    let timeout = Duration::from_secs(5);
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..TRIALS {
        node.forget_peer("lookup-target");
        let start = Instant::now();
        node.lookup_region("lookup-target", "kv", timeout)
            .await
            .unwrap();
        cold.push(start.elapsed());
        let start = Instant::now();
        node.lookup_region("lookup-target", "kv", timeout)
            .await
            .unwrap();
        warm.push(start.elapsed());
    }
    report("lookup, cold (etcd)", &mut cold);
    report("lookup, warm (cache)", &mut warm);
    let _ = server.kill();
    let _ = server.wait();
}

async fn expiry(url: &str, ferry: &str) {
    let node = finder(url).await;
    let names: Vec<String> = (0..TRIALS).map(|i| format!("doomed-{i}")).collect();
    let mut servers: Vec<Child> = names.iter().map(|n| serve(ferry, url, n)).collect();
    for name in &names {
        node.lookup(name, Duration::from_secs(5)).await.unwrap();
    }
    let mut killed = Vec::new();
    for server in &mut servers {
        server.kill().unwrap();
        killed.push(Instant::now());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut gone = vec![None; TRIALS];
    let deadline = Instant::now() + Duration::from_secs(30);
    while gone.iter().any(Option::is_none) && Instant::now() < deadline {
        for (i, name) in names.iter().enumerate() {
            if gone[i].is_none() && node.peer_metadata(name).is_none() {
                gone[i] = Some(killed[i].elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for server in &mut servers {
        let _ = server.wait();
    }
    let mut samples: Vec<Duration> = gone
        .into_iter()
        .map(|g| g.expect("gone within 30 s"))
        .collect();
    report(
        "kill -9 to gone from a peer's cache (lease 10 s)",
        &mut samples,
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["blob"] => blob().await,
        ["lookup", url, ferry] => lookup(url, ferry).await,
        ["expiry", url, ferry] => expiry(url, ferry).await,
        _ => {
            eprintln!(
                "usage: discovery_timing blob | lookup ETCD_URL FERRY_BIN | expiry ETCD_URL FERRY_BIN"
            );
            std::process::exit(2);
        }
    }
}
