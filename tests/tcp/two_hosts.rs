//! Two hosts, emulated as two network namespaces joined by a veth pair: nodes
//! that listen on every interface (`0.0.0.0`) advertise the address they were
//! told to, their handles carry it, and the other host reaches them there.
//! Without an address to advertise such a node does not start.
//!
//! The namespace tests need root and iproute2 (`ip`). Where either is
//! missing they print one line saying so and pass, except under `CI=true`,
//! where they fail: CI must never skip them silently.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry::control::EndpointError;
use ferry::prelude::*;
use ferry::{ADVERTISE_ENV, DISABLE_IBVERBS_ENV, DISABLE_MEMORY_ENV, NodeError};

use crate::common::{LISTEN_ENV, PeerProcess, PeerRegion, digest, pattern};

/// Deadline of each `ip` command.
const IP_DEADLINE: Duration = Duration::from_secs(10);
/// Deadline of an in-process transfer.
const T: Duration = Duration::from_secs(20);

/// Two namespaces joined by a veth pair, `ip_a/24` in `a` and `ip_b/24` in
/// `b`; both are deleted on drop (a test that fails or panics included),
/// which also removes the veth pair.
struct TwoHosts {
    a: String,
    b: String,
    ip_a: Ipv4Addr,
    ip_b: Ipv4Addr,
}

impl TwoHosts {
    /// Sets up the two hosts for the test named `tag`, or says why this
    /// machine cannot: not root, no `ip`, or a namespace or the veth pair
    /// refused.
    fn create(tag: &str) -> Result<TwoHosts, String> {
        let euid = effective_uid()?;
        if euid != 0 {
            return Err(format!("not root (effective uid {euid})"));
        }
        let pid = std::process::id();
        let subnet = (pid % 250) as u8;
        let hosts = TwoHosts {
            a: format!("ferry-a-{pid}-{tag}"),
            b: format!("ferry-b-{pid}-{tag}"),
            ip_a: Ipv4Addr::new(10, 213, subnet, 1),
            ip_b: Ipv4Addr::new(10, 213, subnet, 2),
        };
        // Leftovers of a killed run with this pid: ours by name. Any `?`
        // below drops `hosts`, deleting what was created so far.
        hosts.delete();
        ip(&["netns", "add", &hosts.a])?;
        ip(&["netns", "add", &hosts.b])?;
        // Both ends are created inside the namespaces: nothing appears, even
        // for a moment, among this host's own interfaces.
        let (veth_a, veth_b) = ("veth-a", "veth-b");
        ip(&[
            "link", "add", veth_a, "netns", &hosts.a, "type", "veth", "peer", "name", veth_b,
            "netns", &hosts.b,
        ])?;
        for (ns, dev, addr) in [
            (&hosts.a, veth_a, hosts.ip_a),
            (&hosts.b, veth_b, hosts.ip_b),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(hosts)
    }

    fn delete(&self) {
        for ns in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", ns]);
        }
    }

    /// A peer node in namespace `ns` listening on `listen`, advertising
    /// `advertise` when given; TCP only, whatever devices the host has.
    async fn peer(ns: &str, listen: &str, advertise: Option<&str>) -> PeerProcess {
        Self::peer_with(ns, listen, advertise, &[]).await
    }

    /// `peer`, with extra environment variables.
    async fn peer_with(
        ns: &str,
        listen: &str,
        advertise: Option<&str>,
        extra: &[(&str, &str)],
    ) -> PeerProcess {
        let mut env = vec![(LISTEN_ENV, listen), (DISABLE_IBVERBS_ENV, "1")];
        if let Some(advertise) = advertise {
            env.push((ADVERTISE_ENV, advertise));
        }
        env.extend_from_slice(extra);
        PeerProcess::spawn_in_namespace(ns, &env).await
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        self.delete();
    }
}

/// The two hosts, or `None` after printing why this machine cannot have
/// them. Under `CI=true` a missing capability fails the test instead.
fn two_hosts_or_skip(test: &str) -> Option<TwoHosts> {
    match TwoHosts::create(test) {
        Ok(hosts) => Some(hosts),
        Err(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true, yet two network namespaces cannot be set up here: {why}")
        }
        Err(why) => {
            // Straight to stderr: libtest would swallow `eprintln!`.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED two-host test ({test}): needs root and iproute2 to create network namespaces: {why}"
            );
            None
        }
    }
}

/// Runs `ip args…` under [`IP_DEADLINE`]; `Err` says which command failed
/// and why.
fn ip(args: &[&str]) -> Result<(), String> {
    let shown = format!("`ip {}`", args.join(" "));
    let mut child = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{shown} did not start: {e}"))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < IP_DEADLINE => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{shown} did not finish in {IP_DEADLINE:?}"));
            }
            Err(e) => return Err(format!("{shown}: {e}")),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    Err(format!("{shown} failed ({status}): {}", stderr.trim()))
}

/// This process's effective uid, from `/proc/self/status`.
fn effective_uid() -> Result<u32, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|euid| euid.parse().ok())
        .ok_or_else(|| "no effective uid in /proc/self/status".to_string())
}

/// The handle is the peer's, at `ip` and a real port.
fn assert_owned_at(region: &PeerRegion, ip: Ipv4Addr, what: &str) {
    let endpoint = region.handle.owner().endpoint;
    assert_eq!(endpoint.ip(), IpAddr::V4(ip), "{what}: advertised IP");
    assert_ne!(endpoint.port(), 0, "{what}: advertised port");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_every_interface_reach_each_other_at_their_advertised_addresses() {
    let Some(hosts) = two_hosts_or_skip("advertised") else {
        return;
    };
    let (ip_a, ip_b) = (hosts.ip_a.to_string(), hosts.ip_b.to_string());
    let mut a = TwoHosts::peer(&hosts.a, "0.0.0.0:0", Some(&ip_a)).await;
    let mut b = TwoHosts::peer(&hosts.b, "0.0.0.0:0", Some(&ip_b)).await;
    let addr_a = a.node_addr().await.expect("node in namespace a");
    let addr_b = b.node_addr().await.expect("node in namespace b");
    assert_eq!(addr_a.endpoint.ip(), hosts.ip_a);
    assert_eq!(addr_b.endpoint.ip(), hosts.ip_b);

    for (i, len) in [1usize, (64 << 10) + 3, 8 << 20].into_iter().enumerate() {
        let seed = 10 * i as u8;
        let what = |s: &str| format!("{len} B: {s}");
        let a_out = a.alloc(len, Access::ReadWrite, seed).await;
        let a_in = a.alloc(len, Access::ReadWrite, seed + 1).await;
        let a_back = a.alloc(len, Access::ReadWrite, seed + 2).await;
        let b_out = b.alloc(len, Access::ReadWrite, seed + 3).await;
        let b_in = b.alloc(len, Access::ReadWrite, seed + 4).await;
        for (region, name) in [(&a_out, "a_out"), (&a_in, "a_in"), (&a_back, "a_back")] {
            assert_owned_at(region, hosts.ip_a, &what(name));
            assert_eq!(region.handle.owner(), addr_a, "{}", what(name));
        }
        for (region, name) in [(&b_out, "b_out"), (&b_in, "b_in")] {
            assert_owned_at(region, hosts.ip_b, &what(name));
            assert_eq!(region.handle.owner(), addr_b, "{}", what(name));
        }

        a.write_to(&a_out, &b_in.handle)
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("A writes into B: {e}"))));
        b.write_to(&b_out, &a_in.handle)
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("B writes into A: {e}"))));
        a.read_from(&a_back, &b_in.handle)
            .await
            .unwrap_or_else(|e| panic!("{}", what(&format!("A reads from B: {e}"))));

        let from_a = digest(&pattern(len, seed));
        let from_b = digest(&pattern(len, seed + 3));
        assert_eq!(b.digest(&b_in).await, from_a, "{}", what("A's write in B"));
        assert_eq!(a.digest(&a_in).await, from_b, "{}", what("B's write in A"));
        assert_eq!(a.digest(&a_back).await, from_a, "{}", what("A's read of B"));
        assert_eq!(a.digest(&a_out).await, from_a, "{}", what("A's source"));
        assert_eq!(b.digest(&b_out).await, from_b, "{}", what("B's source"));
        for region in [&a_out, &a_in, &a_back] {
            a.drop_region(region).await;
        }
        for region in [&b_out, &b_in] {
            b.drop_region(region).await;
        }
    }
    // Peers end before their namespaces go.
    a.kill().await;
    b.kill().await;
    drop(hosts);
}

/// Two nodes of one host (same boot id) in different network namespaces
/// cannot reach each other's same-host socket: they are not taken for
/// same-host peers, and their transfers go over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_in_other_network_namespaces_are_not_same_host_peers() {
    let Some(hosts) = two_hosts_or_skip("memory") else {
        return;
    };
    let (ip_a, ip_b) = (hosts.ip_a.to_string(), hosts.ip_b.to_string());
    let sharing = [(DISABLE_MEMORY_ENV, "0")];
    let mut a = TwoHosts::peer_with(&hosts.a, "0.0.0.0:0", Some(&ip_a), &sharing).await;
    let mut b = TwoHosts::peer_with(&hosts.b, "0.0.0.0:0", Some(&ip_b), &sharing).await;
    let len = 1 << 20;
    let a_out = a.alloc(len, Access::ReadWrite, 1).await;
    let b_in = b.alloc(len, Access::ReadWrite, 2).await;
    // B offers the memory transport, on this very boot...
    let offered = b_in.handle.transports().memory.expect("b shares memory");
    assert_eq!(Some(offered.boot_id), ferry::memory::boot_id());
    // ...but its socket is in B's namespace: this node (in the root one)
    // routes to it over TCP, and A's write into it works, over TCP.
    let here = Node::builder().ibverbs(false).spawn().await.unwrap();
    let local = here.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let op = RdmaOp::write(local.whole(), b_in.handle.clone());
    assert_eq!(here.route(&op), Some(RdmaTransportLevel::Tcp));
    a.write_to(&a_out, &b_in.handle)
        .await
        .expect("A writes into B");
    assert_eq!(b.digest(&b_in).await, digest(&pattern(len, 1)));
    a.kill().await;
    b.kill().await;
    drop(hosts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_every_interface_without_an_advertised_address_does_not_start() {
    let Some(hosts) = two_hosts_or_skip("unadvertised") else {
        return;
    };
    let mut a = TwoHosts::peer(&hosts.a, "0.0.0.0:0", None).await;
    let error = match a.node_addr().await {
        Ok(addr) => panic!("node on 0.0.0.0 without an address to advertise started at {addr:?}"),
        Err(error) => error,
    };
    assert!(
        error.contains("0.0.0.0:0") && error.contains("advertise"),
        "spawn failed, but not for want of an advertised address: {error}"
    );

    // A concrete listen address is advertised as it is.
    let listen_b = SocketAddr::new(hosts.ip_b.into(), 0).to_string();
    let mut b = TwoHosts::peer(&hosts.b, &listen_b, None).await;
    let addr_b = b.node_addr().await.expect("node listening on its IP");
    assert_eq!(addr_b.endpoint.ip(), hosts.ip_b);
    assert_ne!(addr_b.endpoint.port(), 0);
    a.kill().await;
    b.kill().await;
    drop(hosts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listening_on_every_interface_needs_an_advertised_address() {
    let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
    assert!(
        std::env::var_os(ADVERTISE_ENV).is_none(),
        "unset {ADVERTISE_ENV} to run this test: the node builder reads it"
    );
    match Node::builder().listen(any).ibverbs(false).spawn().await {
        Ok(node) => panic!(
            "spawned at {} with nothing to advertise",
            node.addr().endpoint
        ),
        Err(NodeError::Endpoint(EndpointError::Unadvertised { listen })) => {
            assert_eq!(listen, any);
        }
        Err(other) => panic!("expected Unadvertised, got {other:?}"),
    }

    let advertised = |port| {
        Node::builder()
            .listen(any)
            .advertise(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port))
            .ibverbs(false)
            .spawn()
    };
    let a = advertised(0).await.unwrap();
    let b = advertised(0).await.unwrap();
    for node in [&a, &b] {
        let endpoint = node.addr().endpoint;
        assert_eq!(endpoint.ip(), Ipv4Addr::LOCALHOST);
        assert_ne!(endpoint.port(), 0, "port 0 advertises the bound port");
    }

    let len = (64 << 10) + 3;
    let data = pattern(len, 42);
    let src = a.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let back = a.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let target = b.alloc(len as u64, Access::ReadWrite).await.unwrap();
    assert_eq!(target.remote().owner(), b.addr());
    src.write_at(0, &data).unwrap();
    a.submit(vec![RdmaOp::write(src.whole(), target.remote())], T)
        .await
        .unwrap();
    assert!(target.to_vec() == data, "write landed at b");
    a.submit(vec![RdmaOp::read(back.whole(), target.remote())], T)
        .await
        .unwrap();
    assert!(back.to_vec() == data, "read back from b");
}
