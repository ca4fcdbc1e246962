//! Two rails between the VMs (`tests/rxe/run.sh --two --rails 2`: rxe0 on
//! `wire`, rxe1 on `wire1`, in each VM): a node uses both, finds which of
//! its rails reach which of the peer's by probing, negotiates each pair's
//! MTU, and stripes large ops over the pairs. Run by
//! `tests/rxe/wire-tests.sh --rails 2`; each test insists on two rails, so
//! a one-rail run cannot pass it by accident.

use ferry::NodeAddr;
use ferry::prelude::*;

use crate::common::{digest, pattern};
use crate::peer::{RemotePeer, both, here, on_peer};
use crate::{ops, rdma_node};

/// The second wire's interface in both VMs (`FERRY_RXE_WIRE1`).
const WIRE1: &str = "wire1";
/// Bytes moved each way by the striping test, as the issue asks.
const BIG: u64 = 256 << 20;

fn require_two_rails() {
    assert_eq!(
        std::env::var("FERRY_RXE_RAILS").as_deref(),
        Ok("2"),
        "needs two rails: run by tests/rxe/wire-tests.sh --rails 2"
    );
}

/// Packets sent by `device` in this VM so far (rxe's own counter).
fn sent_packets(device: &str) -> u64 {
    let path = format!("/sys/class/infiniband/{device}/ports/1/hw_counters/sent_pkts");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// The (local rail, remote rail, MTU) of each queue pair `node` has to
/// `peer`, sorted.
async fn pairs_to(node: &Node, peer: NodeAddr) -> Vec<(u8, u8, u32)> {
    let info = node.ibverbs().unwrap().transport_info().await.unwrap();
    let mut pairs: Vec<_> = info
        .qps
        .iter()
        .filter(|q| q.peer == peer)
        .map(|q| (q.rail, q.remote_rail, q.mtu))
        .collect();
    pairs.sort();
    pairs
}

/// Bytes posted on each of `node`'s rails so far.
async fn posted_bytes(node: &Node) -> Vec<u64> {
    let info = node.ibverbs().unwrap().transport_info().await.unwrap();
    info.rails.iter().map(|r| r.posted_bytes).collect()
}

/// Deadline of each direction of [`write_read_verify`]: 256 MiB under TCG
/// with one vCPU per VM moves at a few MiB/s.
const BIG_STEP: std::time::Duration = std::time::Duration::from_secs(600);

/// Writes `len` bytes in ops of `piece` into a fresh region of `peer`,
/// checks them there, reads them back and compares; prints each
/// direction's rate.
async fn write_read_verify(node: &Node, peer: &mut RemotePeer, len: u64, piece: u64, seed: u8) {
    let target = peer
        .process
        .alloc(len as usize, Access::ReadWrite, seed)
        .await;
    let data = pattern(len as usize, seed.wrapping_add(7));
    let src = node.alloc(len, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    let rate = |started: std::time::Instant| {
        len as f64 / started.elapsed().as_secs_f64() / f64::from(1 << 20)
    };
    let started = std::time::Instant::now();
    node.submit(ops(&src, &target.handle, piece, true), BIG_STEP)
        .await
        .unwrap_or_else(|e| panic!("writes of {piece} B: {e}"));
    eprintln!(
        "{len} B written in ops of {piece} B at {:.1} MiB/s",
        rate(started)
    );
    assert_eq!(
        peer.process.digest(&target).await,
        digest(&data),
        "the writes landed"
    );
    drop(src);
    let back = node.alloc(len, Access::ReadWrite).await.unwrap();
    let started = std::time::Instant::now();
    node.submit(ops(&back, &target.handle, piece, false), BIG_STEP)
        .await
        .unwrap_or_else(|e| panic!("reads of {piece} B: {e}"));
    eprintln!(
        "{len} B read in ops of {piece} B at {:.1} MiB/s",
        rate(started)
    );
    assert!(back.to_vec() == data, "the reads brought other bytes");
    peer.process.drop_region(&target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_256_mib_write_and_read_use_both_rails() {
    require_two_rails();
    let node = rdma_node().await;
    let mut peer = RemotePeer::start().await;
    let addr = peer.process.node_addr().await.unwrap();
    let rails = node.ibverbs().unwrap().rails();
    assert_eq!(rails, ["rxe0:1", "rxe1:1"]);
    let before = (sent_packets("rxe0"), sent_packets("rxe1"));
    let posted_before = posted_bytes(&node).await;
    // One op of 256 MiB each way: striped, half on each pair.
    write_read_verify(&node, &mut peer, BIG, BIG, 1).await;
    let after = (sent_packets("rxe0"), sent_packets("rxe1"));
    let posted: Vec<u64> = posted_bytes(&node)
        .await
        .iter()
        .zip(&posted_before)
        .map(|(a, b)| a - b)
        .collect();
    eprintln!(
        "256 MiB each way: posted per rail {posted:?} B; rxe0 sent {} packets, rxe1 {}",
        after.0 - before.0,
        after.1 - before.1
    );
    assert_eq!(
        posted.iter().sum::<u64>(),
        2 * BIG,
        "every byte posted once"
    );
    for (rail, &bytes) in posted.iter().enumerate() {
        assert!(
            bytes >= BIG / 2,
            "rail {rail} carried only {bytes} B of {}",
            2 * BIG
        );
    }
    // The kernel's own counters agree: both devices sent.
    assert!(after.0 - before.0 > 10_000 && after.1 - before.1 > 10_000);
    assert_eq!(
        pairs_to(&node, addr).await,
        [(0, 0, 1024), (1, 1, 1024)],
        "straight pairs, the wires' MTU"
    );
    // Many small ops spread too: 16 MiB in 64 KiB ops.
    let posted_before = posted_bytes(&node).await;
    write_read_verify(&node, &mut peer, 16 << 20, 64 << 10, 2).await;
    let posted: Vec<u64> = posted_bytes(&node)
        .await
        .iter()
        .zip(&posted_before)
        .map(|(a, b)| a - b)
        .collect();
    eprintln!("16 MiB in 64 KiB ops each way: posted per rail {posted:?} B");
    assert!(posted.iter().all(|&b| b >= 4 << 20), "{posted:?}");
}

/// Drops, in both VMs, RoCE packets that leave a wire for the other
/// wire's subnet: each rail reaches only the same rail of the other VM.
struct RailOnly;

impl RailOnly {
    fn apply() -> RailOnly {
        for (wire, other) in [("wire", "10.88.1.0/24"), (WIRE1, "10.88.0.0/24")] {
            both(&format!(
                "/usr/bin/tc qdisc replace dev {wire} root handle 1: prio && \
                 /usr/bin/tc filter add dev {wire} parent 1: protocol ip prio 1 \
                 u32 match ip dst {other} action drop && \
                 /usr/bin/tc filter add dev {wire} parent 1: protocol ip prio 2 \
                 u32 match ip src {other} action drop"
            ));
        }
        RailOnly
    }
}

impl Drop for RailOnly {
    fn drop(&mut self) {
        for wire in ["wire", WIRE1] {
            let _ = crate::peer::on_peer_status(&format!(
                "/usr/bin/tc qdisc del dev {wire} root 2>/dev/null; true"
            ));
            here(&format!(
                "/usr/bin/tc qdisc del dev {wire} root 2>/dev/null; true"
            ));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn on_a_rail_only_fabric_only_pairs_that_reach_are_used() {
    require_two_rails();
    let _fabric = RailOnly::apply();
    let node = rdma_node().await;
    // The peer lists its rails the other way round, so that its rail 0 is
    // rxe1: the straight pairs by index (rxe0 -> rxe1, rxe1 -> rxe0) cross
    // the wires, which drop that traffic. Probing finds the pairs that
    // reach instead.
    let mut peer = RemotePeer::start_with(&[("FERRY_IBV_RAILS", "rxe1,rxe0".into())]).await;
    let addr = peer.process.node_addr().await.unwrap();
    write_read_verify(&node, &mut peer, 4 << 20, 1 << 20, 3).await;
    assert_eq!(
        pairs_to(&node, addr).await,
        [(0, 1, 1024), (1, 0, 1024)],
        "rxe0 -> the peer's rxe0 (its rail 1), rxe1 -> its rxe1 (rail 0)"
    );
}

/// Sets the MTU of `wire` in VM a, and back to 1500 when dropped.
struct PeerMtu(&'static str);

impl PeerMtu {
    fn set(wire: &'static str, both_ends: u32, peer_end: u32) -> PeerMtu {
        both(&format!("/usr/bin/ip link set {wire} mtu {both_ends}"));
        on_peer(&format!("/usr/bin/ip link set {wire} mtu {peer_end}"));
        PeerMtu(wire)
    }
}

impl Drop for PeerMtu {
    fn drop(&mut self) {
        let cmd = format!("/usr/bin/ip link set {} mtu 1500", self.0);
        let _ = crate::peer::on_peer_status(&cmd);
        here(&cmd);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn each_pair_uses_the_smaller_mtu_of_its_two_ends() {
    require_two_rails();
    // Rail 0: 9000-byte frames at both ends (RoCE MTU 4096). Rail 1: 9000
    // here, 1500 in VM a (4096 against 1024).
    let _wire0 = PeerMtu::set("wire", 9000, 9000);
    let _wire1 = PeerMtu::set(WIRE1, 9000, 1500);
    let node = rdma_node().await;
    let info = node.ibverbs().unwrap().transport_info().await.unwrap();
    let mtus: Vec<u32> = info.rails.iter().map(|r| r.mtu).collect();
    assert_eq!(mtus, [4096, 4096], "this VM's ports");
    let mut peer = RemotePeer::start().await;
    let addr = peer.process.node_addr().await.unwrap();
    write_read_verify(&node, &mut peer, 8 << 20, 8 << 20, 4).await;
    assert_eq!(pairs_to(&node, addr).await, [(0, 0, 4096), (1, 1, 1024)]);
}
