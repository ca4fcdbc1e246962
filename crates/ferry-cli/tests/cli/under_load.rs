//! `ferry serve` under pressure, over TCP both here and in the soft-RoCE VM
//! (serve runs with `--no-ibverbs`, the in-test nodes with `.ibverbs(false)`):
//! a flood of idle clients against the endpoint's connection bounds (idle
//! ones making room for new ones once they have idled a moment); and the
//! harness (`Served`) that `timed_out.rs` shares.

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::control::hello::{HELLO_LEN, Hello, HelloReply};
use ferry::control::{Channel, EVICTABLE_AFTER, HelloStatus};
use ferry::prelude::*;
use ferry::{NodeAddr, NodeId, RdmaBackend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::runtime::Runtime;

use super::{ScratchDir, ferry_bin, http_get, metric};

/// A `ferry serve` process, optionally under a soft descriptor limit, with
/// its stderr in a file the test reads while it runs. Dropping it kills the
/// process if the test did not stop it.
pub(crate) struct Served {
    child: Child,
    /// Dropped after the child is killed: removed once serve is gone.
    dir: ScratchDir,
}

impl Served {
    /// Starts serve with `args` and returns it with its region's handle,
    /// once serve has written it (within a deadline).
    pub(crate) fn start(name: &str, nofile: Option<u32>, args: &[&str]) -> (Served, RemoteBuffer) {
        let dir = ScratchDir::new(name);
        let handle = dir.join("handle.json");
        let bin = ferry_bin();
        // `ulimit` in a shell that then becomes serve: no prlimit needed,
        // and busybox's sh (in the VM) has it too.
        let mut command = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let child = command
            .arg("serve")
            .args(args)
            .arg("--stdin")
            // About the network transports: nothing shared through memory.
            .env("FERRY_DISABLE_MEMORY", "1")
            .arg("--handle-file")
            .arg(&handle)
            // Its default filter: warnings and its lifecycle, which the
            // tests read.
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
            .spawn()
            .unwrap();
        let mut served = Served { child, dir };
        let started = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&handle)
                && let Ok(remote) = serde_json::from_str::<RemoteBuffer>(&text)
            {
                return (served, remote);
            }
            assert!(
                served.child.try_wait().unwrap().is_none(),
                "serve exited: {}",
                served.stderr()
            );
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "serve wrote no handle: {}",
                served.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default()
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Closes serve's stdin and expects a clean exit within a deadline.
    pub(crate) fn stop(mut self) {
        drop(self.child.stdin.take());
        let started = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "serve did not exit after its stdin closed"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "serve: {status}\n{}", self.stderr());
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(crate) fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub(crate) fn free_local_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// Deterministic bytes for positions `offset..offset + len` of a pattern
/// that differs per seed and per position (byte, page and MiB).
pub(crate) fn pattern(offset: u64, len: usize, seed: u8) -> Vec<u8> {
    (offset..offset + len as u64)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8 ^ (i >> 20) as u8 ^ seed)
        .collect()
}

/// Fills all of `region` with `pattern(.., seed)`, 1 MiB at a time.
pub(crate) fn fill(region: &Region, seed: u8) {
    let step = 1 << 20;
    let mut offset = 0;
    while offset < region.len() {
        let len = step.min(region.len() - offset) as usize;
        region
            .write_at(offset, &pattern(offset, len, seed))
            .unwrap();
        offset += len as u64;
    }
}

/// Writes a fresh pattern over all of `remote`, reads it back into another
/// region, and checks every byte.
async fn verified_round_trip(node: &Node, remote: &RemoteBuffer, seed: u8) {
    let deadline = Duration::from_secs(30);
    let out = node.alloc(remote.len(), Access::ReadWrite).await.unwrap();
    fill(&out, seed);
    node.submit(vec![RdmaOp::write(out.whole(), remote.clone())], deadline)
        .await
        .unwrap_or_else(|e| panic!("write (seed {seed}): {e}"));
    let back = node.alloc(remote.len(), Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), remote.clone())], deadline)
        .await
        .unwrap_or_else(|e| panic!("read back (seed {seed}): {e}"));
    assert!(back.to_vec() == out.to_vec(), "seed {seed}: bytes differ");
}

/// A TCP-only node on 127.0.0.1.
pub(crate) async fn tcp_node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

pub(crate) async fn shut_down(node: Node) {
    tokio::time::timeout(Duration::from_secs(20), node.shutdown())
        .await
        .expect("node shut down within 20 s");
}

/// Connections a flood opened: those the server took (their hello answered
/// `Ok`, then idle) and how many it hung up on.
#[derive(Default)]
struct Flood {
    held: Vec<(IpAddr, TcpStream)>,
    closed: usize,
}

impl Flood {
    fn held_from(&self, address: IpAddr) -> usize {
        self.held.iter().filter(|(a, _)| *a == address).count()
    }

    /// How many held connections are still open (no EOF, no reset), per
    /// address, then closes them all. Checked on the socket itself, not
    /// through tokio's cached readiness. Those gone were evicted to make
    /// room for newer ones.
    fn still_open_then_close(self) -> Vec<(IpAddr, usize)> {
        let mut open: Vec<(IpAddr, usize)> = Vec::new();
        for (from, stream) in self.held {
            let stream = stream.into_std().unwrap();
            if let Err(e) = stream.peek(&mut [0; 1])
                && e.kind() == ErrorKind::WouldBlock
            {
                match open.iter_mut().find(|(a, _)| *a == from) {
                    Some((_, n)) => *n += 1,
                    None => open.push((from, 1)),
                }
            }
        }
        open
    }
}

/// A refused connection must be hung up on within this; an admitted one
/// answered within it.
const PROMPT: Duration = Duration::from_secs(3);

/// One client from `from` that sends a data-channel hello, reads the reply
/// and then idles: `Some(stream)` if the server took it, `None` if it
/// refused it (`Busy`) or hung up. Panics if the server does neither within
/// `PROMPT`.
async fn hello_only(server: NodeAddr, from: IpAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let mut stream = tokio::time::timeout(PROMPT, socket.connect(server.endpoint))
        .await
        .unwrap_or_else(|_| panic!("connect from {from} did not complete within {PROMPT:?}"))
        .unwrap_or_else(|e| panic!("connect from {from}: {e}"));
    let hello = Hello::new(Channel::TCP_DATA, NodeId::random(), server.id).encode();
    let exchange = async {
        stream.write_all(&hello).await?;
        let mut reply = [0; HELLO_LEN];
        stream.read_exact(&mut reply).await?;
        if HelloReply::decode(&reply).unwrap().status == HelloStatus::Ok {
            let mut tail = [0; HelloReply::LEN - HELLO_LEN];
            stream.read_exact(&mut tail).await?;
        }
        Ok::<_, std::io::Error>(reply)
    };
    let reply = tokio::time::timeout(PROMPT, exchange)
        .await
        .unwrap_or_else(|_| {
            panic!("from {from}: neither answered nor hung up on within {PROMPT:?}")
        });
    match reply {
        Ok(reply) => {
            let reply = HelloReply::decode(&reply).unwrap();
            if reply.status == HelloStatus::Busy {
                return None;
            }
            assert_eq!(reply.status, HelloStatus::Ok, "from {from}");
            Some(stream)
        }
        // EOF, or a reset (the server closed with our hello unread).
        Err(_) => None,
    }
}

/// `per_address` hello-only clients from each of `from`, the addresses
/// concurrently, each address's clients one after another.
async fn flood(server: NodeAddr, from: &[IpAddr], per_address: usize) -> Flood {
    let mut tasks = tokio::task::JoinSet::new();
    for &address in from {
        tasks.spawn(async move {
            let mut flood = Flood::default();
            for _ in 0..per_address {
                match hello_only(server, address).await {
                    Some(stream) => flood.held.push((address, stream)),
                    None => flood.closed += 1,
                }
            }
            flood
        });
    }
    let mut all = Flood::default();
    while let Some(done) = tasks.join_next().await {
        let done = done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        all.held.extend(done.held);
        all.closed += done.closed;
    }
    all
}

fn loopback(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

/// Connections serve's endpoint refused so far, per bound.
fn refused(metrics: &str) -> (u64, u64) {
    counted(metrics, "ferry_endpoint_refused_total")
}

/// Idle connections serve's endpoint closed to make room so far, per bound.
fn evicted(metrics: &str) -> (u64, u64) {
    counted(metrics, "ferry_endpoint_evicted_total")
}

fn counted(metrics: &str, name: &str) -> (u64, u64) {
    let page = http_get(metrics, "/metrics");
    (
        metric(&page, &format!("{name}{{bound=\"total\"}}")),
        metric(&page, &format!("{name}{{bound=\"address\"}}")),
    )
}

/// Under `ulimit -n 128`, serve's endpoint takes at most 96 connections (24
/// per address). A flood of idle clients from several addresses is held at
/// the bound, promptly and with one log line per stretch (clients past it
/// refused, or making room by evicting ones idle for a moment), and a peer
/// is served once the flood has idled a moment; a flood from one address
/// leaves room for a new peer from another.
#[test]
fn endpoint_bounds_hold_under_a_descriptor_limit() {
    const TOTAL: usize = 96;
    const PER_ADDRESS: usize = 24;
    let rt = runtime();
    let metrics = free_local_addr();
    let (mut serve, remote) = Served::start(
        "limits",
        Some(128),
        &["--no-ibverbs", "--size", "4M", "--metrics", &metrics],
    );
    assert!(
        serve
            .stderr()
            .contains("max_connections: 96, max_per_address: 24"),
        "limits derived from 128 descriptors: 96 in all, 24 per address:\n{}",
        serve.stderr()
    );
    let server = remote.owner();
    assert_eq!(server.endpoint.ip(), loopback(1));

    // A well-behaved peer (from 127.0.0.1) is served before the flood.
    let peer = rt.block_on(tcp_node());
    rt.block_on(verified_round_trip(&peer, &remote, 1));
    // Its pool fills up behind that first transfer: all of it is open
    // before the flood comes.
    let pool = rt
        .block_on(peer.tcp().transport_info())
        .unwrap()
        .connections_per_peer;
    let started = Instant::now();
    let peer_connections = loop {
        let open = rt
            .block_on(peer.tcp().transport_info())
            .unwrap()
            .open_connections;
        if open == pool || started.elapsed() > Duration::from_secs(20) {
            break open;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        peer_connections, pool,
        "{peer_connections} data connections"
    );

    // (a) 5 × 40 idle clients from 127.0.0.2-6: per-address room (5 × 24)
    // exceeds the total room, so the total bound is hit: each client past
    // it is refused, or takes the place of one idle for a moment.
    let flooders: Vec<IpAddr> = (2..=6).map(loopback).collect();
    let (refused_before, evicted_before) = (refused(&metrics), evicted(&metrics));
    let first = rt.block_on(flood(server, &flooders, 40));
    let (refused_after, evicted_after) = (refused(&metrics), evicted(&metrics));
    let held = first.held.len();
    let refusals = (refused_after.0 - refused_before.0) + (refused_after.1 - refused_before.1);
    let evictions = (evicted_after.0 - evicted_before.0) + (evicted_after.1 - evicted_before.1);
    eprintln!(
        "flood 1: {held} held, {} refused; per address {:?}; server refused {refusals}, \
         evicted {evictions}",
        first.closed,
        flooders
            .iter()
            .map(|&a| first.held_from(a))
            .collect::<Vec<_>>(),
    );
    assert_eq!(held + first.closed, 5 * 40);
    assert_eq!(
        refusals, first.closed as u64,
        "every refusal was by a bound"
    );
    assert!(
        held + peer_connections <= TOTAL + evictions as usize,
        "past the bound, only evictions made room"
    );
    assert!(
        refusals + evictions >= (5 * 40 + peer_connections - TOTAL) as u64,
        "the total bound was hit"
    );

    // (b) Once the flood has idled a moment, the peer is served: its own
    // connections may have made room for the flood, and the flood's now
    // make room for the peer's.
    std::thread::sleep(EVICTABLE_AFTER + Duration::from_millis(200));
    rt.block_on(verified_round_trip(&peer, &remote, 2));
    let open = first.still_open_then_close();
    let open_total: usize = open.iter().map(|(_, n)| n).sum();
    assert!(open_total < TOTAL, "the bound holds: {open:?}");
    for (a, n) in &open {
        assert!(*n <= PER_ADDRESS, "{a}: over its bound");
    }

    // The first flood is closed: serve says it accepts again once it has
    // seen enough of them go. Then a moment for the rest.
    let started = Instant::now();
    while !serve.stderr().contains("accepting new connections again") {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "serve never said it accepts connections again:\n{}",
            serve.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));

    // (c) One address floods well past the total bound: it gets its own
    // bound and no more, so a new peer from 127.0.0.1 still gets in (with
    // only the total bound, 127.0.0.7 would hold 92 connections and the
    // newcomer would be refused).
    let flooder = loopback(7);
    let (refused_before, evicted_before) = (refused(&metrics), evicted(&metrics));
    let second = rt.block_on(flood(server, &[flooder], 120));
    let (refused_after, evicted_after) = (refused(&metrics), evicted(&metrics));
    let second_evicted = evicted_after.1 - evicted_before.1;
    eprintln!(
        "flood 2: {} held, {} refused; server refused {:?}, evicted {second_evicted} \
         (total, address)",
        second.held.len(),
        second.closed,
        (
            refused_after.0 - refused_before.0,
            refused_after.1 - refused_before.1
        ),
    );
    assert_eq!(second.held.len() + second.closed, 120);
    assert_eq!(
        second.held_from(flooder),
        PER_ADDRESS + second_evicted as usize,
        "{flooder} holds its bound, past it only in place of evicted ones"
    );
    assert_eq!(
        (
            refused_after.0 - refused_before.0,
            refused_after.1 - refused_before.1
        ),
        (0, second.closed as u64),
        "refused by the per-address bound only"
    );
    assert_eq!(
        evicted_after.0, evicted_before.0,
        "nothing made room for the total bound"
    );
    let newcomer = rt.block_on(tcp_node());
    rt.block_on(verified_round_trip(&newcomer, &remote, 3));

    // (d) One warning per stretch at a bound, not one per refusal.
    let log = serve.stderr();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refusing new connections"))
        .collect();
    let total_warnings = warnings
        .iter()
        .filter(|l| l.contains("refusing new connections unless"))
        .count();
    let flooder_warnings = warnings
        .iter()
        .filter(|l| l.contains(&format!("refusing new connections from {flooder} unless")))
        .count();
    eprintln!("{} warnings at a bound", warnings.len());
    assert_eq!(total_warnings, 1, "one stretch at the total bound:\n{log}");
    assert_eq!(flooder_warnings, 1, "one stretch for {flooder}:\n{log}");
    // At most: the total's stretch, one per flooding address.
    assert!(
        warnings.len() <= 1 + flooders.len() + 1,
        "{} warning lines:\n{log}",
        warnings.len()
    );

    // Flood gone: serve is alive and serves both peers.
    let open = second.still_open_then_close();
    assert!(
        open.iter().all(|(_, n)| *n <= PER_ADDRESS),
        "{flooder} stays within its bound: {open:?}"
    );
    assert!(serve.is_running(), "serve died:\n{}", serve.stderr());
    rt.block_on(verified_round_trip(&peer, &remote, 4));
    rt.block_on(verified_round_trip(&newcomer, &remote, 5));
    rt.block_on(async {
        shut_down(newcomer).await;
        shut_down(peer).await;
    });
    serve.stop();
}
