//! Two rails between the VMs (`tests/rxe/run.sh --two --rails 2`: rxe0 on
//! `wire`, rxe1 on `wire1`, in each VM): a node uses both, finds which of
//! its rails reach which of the peer's by probing, negotiates each pair's
//! MTU, stripes large ops over the pairs, moves a failed rail's work to
//! the others, and leases queue pairs (`lease`). Run by
//! `tests/rxe/wire-tests.sh --rails 2`; each test insists on two rails, so
//! a one-rail run cannot pass it by accident.

use std::time::{Duration, Instant};

use ferry::NodeAddr;
use ferry::prelude::*;

use crate::common::{digest, pattern, submit_until_it_fails, writes_arrive};
use crate::notified_batches::notified_writes_from;
use crate::peer::{RemotePeer, both, here, on_peer};
use crate::{is_unfinished, ops, rdma_node, rdma_node_with};

mod lease;
mod placement;

/// The second wire's interface in both VMs (`FERRY_RXE_WIRE1`).
const WIRE1: &str = "wire1";
/// Bytes moved each way by the striping test, as the issue asks.
const BIG: u64 = 256 << 20;

pub(crate) fn require_two_rails() {
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

/// Whether `node`'s rail `index` is marked down by a port event.
async fn rail_down(node: &Node, index: usize) -> bool {
    let info = node.ibverbs().unwrap().transport_info().await.unwrap();
    info.rails[index].down
}

/// Bytes posted on each of `node`'s rails so far.
pub(crate) async fn posted_bytes(node: &Node) -> Vec<u64> {
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
    // Every byte posted, half on each rail; more only where a pair was
    // taken for stalled and its work posted again (soft-RoCE under TCG can
    // starve one pair's queue for seconds).
    assert!(posted.iter().sum::<u64>() >= 2 * BIG, "{posted:?}");
    for (rail, &bytes) in posted.iter().enumerate() {
        assert!(
            bytes >= BIG / 4,
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

/// A node whose control sessions (and so notifications and messages) go
/// over the management wire, which no test faults, while its RDMA traffic
/// takes the two rails: a cluster's front-end network beside its RDMA
/// fabric. The peer's counterpart is [`mgmt_peer`].
///
/// The rails' keeper logs to stderr from the first such node on (pairs
/// connected, failed, repaired, and why a repair failed), so that a test
/// that finds a rail unused says what the keeper did.
pub(crate) async fn mgmt_node() -> Node {
    static LOGS: std::sync::Once = std::sync::Once::new();
    LOGS.call_once(|| {
        let filter = "ferry_ibverbs=info,ferry_ibverbs::peers=debug";
        // Another subscriber set first keeps its place.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    });
    rdma_node_with(|builder| builder.listen("10.99.0.2:0".parse().unwrap())).await
}

/// A peer in VM a listening on the management wire.
pub(crate) async fn mgmt_peer() -> RemotePeer {
    RemotePeer::start_with(&[("FERRY_TEST_LISTEN", "10.99.0.1:0".into())]).await
}

/// How a test breaks the second wire.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// Every packet dropped both ways; the links stay up.
    Loss,
    /// Both ends' link down.
    Down,
}

impl Cut {
    fn apply(self, wire: &str) {
        let cmd = match self {
            Cut::Loss => format!("/usr/bin/tc qdisc replace dev {wire} root netem loss 100%"),
            Cut::Down => format!("/usr/bin/ip link set {wire} down"),
        };
        both(&cmd);
    }
}

/// Heals both rails' wires (no qdisc, links up) when dropped, and on
/// [`Heal::now`].
struct Heal;

impl Heal {
    fn now(&self) {
        for wire in ["wire", WIRE1] {
            let cmd = format!(
                "/usr/bin/tc qdisc del dev {wire} root 2>/dev/null; /usr/bin/ip link set {wire} up"
            );
            let _ = crate::peer::on_peer_status(&cmd);
            let _ = std::process::Command::new("sh").args(["-c", &cmd]).status();
        }
    }
}

impl Drop for Heal {
    fn drop(&mut self) {
        self.now();
    }
}

/// Runs `cut` on `wires` after `after`, off the async threads (the agent
/// calls block); returns when it is done.
async fn cut_after(after: Duration, cut: Cut, wires: &'static [&'static str]) -> Instant {
    tokio::time::sleep(after).await;
    tokio::task::spawn_blocking(move || {
        for wire in wires {
            cut.apply(wire);
        }
        Instant::now()
    })
    .await
    .unwrap()
}

/// Waits (up to 20 s) until `node` has two usable pairs to `peer` and a
/// striped write moves bytes on both rails: the healed rail is used again.
async fn both_rails_used_again(node: &Node, peer: &mut RemotePeer, addr: NodeAddr) -> Duration {
    let healed = Instant::now();
    let target = peer.process.alloc(1 << 20, Access::ReadWrite, 9).await;
    let src = node.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    loop {
        let before = posted_bytes(node).await;
        node.submit(
            vec![RdmaOp::write(src.whole(), target.handle.clone())],
            STEP_SHORT,
        )
        .await
        .unwrap();
        let after = posted_bytes(node).await;
        let moved = after.iter().zip(&before).filter(|(a, b)| a > b).count();
        if moved == 2 && pairs_to(node, addr).await.len() == 2 {
            return healed.elapsed();
        }
        assert!(
            healed.elapsed() < Duration::from_secs(20),
            "the healed rail is not used again: pairs {:?}",
            pairs_to(node, addr).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Deadline of a short step under TCG.
pub(crate) const STEP_SHORT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_rail_cut_under_a_256_mib_write_moves_its_work_to_the_other_rail() {
    require_two_rails();
    let heal = Heal;
    let node = mgmt_node().await;
    let mut peer = mgmt_peer().await;
    let addr = peer.process.node_addr().await.unwrap();
    for cut in [Cut::Loss, Cut::Down] {
        let target = peer.process.alloc(BIG as usize, Access::ReadWrite, 5).await;
        let data = pattern(BIG as usize, 11);
        let src = node.alloc(BIG, Access::ReadWrite).await.unwrap();
        src.write_at(0, &data).unwrap();
        let started = Instant::now();
        let write = node.submit(ops(&src, &target.handle, 1 << 20, true), BIG_STEP);
        let (result, (cut_at, failed_over, saw_down)) = tokio::join!(write, async {
            let cut_at = cut_after(Duration::from_secs(5), cut, &[WIRE1]).await;
            // Rail 1's pair leaves the usable ones: its work moves to
            // rail 0 from then on.
            while pairs_to(&node, addr).await.iter().any(|p| p.0 == 1)
                && cut_at.elapsed() < Duration::from_secs(60)
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (cut_at, cut_at.elapsed(), rail_down(&node, 1).await)
        });
        result.unwrap_or_else(|e| panic!("{cut:?}: the write failed: {e}"));
        eprintln!(
            "{cut:?}: 256 MiB written in {:.1} s, rail 1 cut {:.1} s in, its pair failed {:.2} s after the cut",
            started.elapsed().as_secs_f64(),
            (cut_at - started).as_secs_f64(),
            failed_over.as_secs_f64()
        );
        // A link taken down is reported by the port (its event marks the
        // rail down); a lossy link with its carrier up is not, and is
        // found by stall detection alone.
        assert_eq!(
            saw_down,
            matches!(cut, Cut::Down),
            "{cut:?}: rail 1 marked down"
        );
        assert_eq!(peer.process.digest(&target).await, digest(&data), "{cut:?}");
        eprintln!(
            "{cut:?}: pairs in use after the write: {:?}; bytes posted per rail so far: {:?}",
            pairs_to(&node, addr).await,
            posted_bytes(&node).await
        );
        heal.now();
        let back = both_rails_used_again(&node, &mut peer, addr).await;
        assert!(!rail_down(&node, 1).await, "{cut:?}: the port is up again");
        eprintln!(
            "{cut:?}: both rails in use again {:.1} s after the heal",
            back.as_secs_f64()
        );
        peer.process.drop_region(&target).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_rail_cut_under_1000_notified_batches_loses_and_repeats_nothing() {
    require_two_rails();
    let _heal = Heal;
    let node = mgmt_node().await;
    let mut peer = mgmt_peer().await;
    // The peer writes into this node, notifying each batch; rail 1 is cut
    // a second in. Every batch's bytes are in place when its notification
    // comes, and each comes once (checked by the helper).
    let stream = notified_writes_from(&node, &mut peer.process, 1000);
    let ((), _) = tokio::join!(
        stream,
        cut_after(Duration::from_secs(1), Cut::Loss, &[WIRE1])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn both_rails_cut_fail_within_the_deadline_and_work_again_once_healed() {
    require_two_rails();
    let heal = Heal;
    let node = mgmt_node().await;
    let mut peer = mgmt_peer().await;
    let addr = peer.process.node_addr().await.unwrap();
    let len = 64u64 << 20;
    let target = peer.process.alloc(len as usize, Access::ReadWrite, 6).await;
    let src = node.alloc(len, Access::ReadWrite).await.unwrap();
    let deadline = Duration::from_secs(20);
    // Writes go on, batch after batch, until one fails: a fast host may
    // finish a batch before the cut, and the assertion is about the
    // batch the cut fell on (bounded: each batch by its deadline, the
    // writes in all by three).
    let batch = ops(&src, &target.handle, 1 << 20, true);
    let writes = submit_until_it_fails(&node, &batch, deadline, Instant::now() + 3 * deadline);
    let ((result, started), _) = tokio::join!(
        writes,
        cut_after(Duration::from_secs(2), Cut::Loss, &["wire", WIRE1])
    );
    let error = result.expect_err("nothing can move with both rails cut");
    assert!(is_unfinished(&error), "{error}");
    assert!(
        started.elapsed() < deadline + Duration::from_secs(3),
        "reported {:.1} s after its batch started, deadline {deadline:?}",
        started.elapsed().as_secs_f64()
    );
    heal.now();
    let back = both_rails_used_again(&node, &mut peer, addr).await;
    eprintln!(
        "both rails in use again {:.1} s after the heal",
        back.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_rail_cut_when_the_peer_is_first_reached_joins_the_link_once_healed() {
    require_two_rails();
    let heal = Heal;
    for cut in [Cut::Loss, Cut::Down] {
        // Both ends start with two rails; rail 1 is cut before the first
        // submit to the peer.
        let node = mgmt_node().await;
        let mut peer = mgmt_peer().await;
        let addr = peer.process.node_addr().await.unwrap();
        let len = 1usize << 20;
        let target = peer.process.alloc(len, Access::ReadWrite, 4).await;
        let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
        src.write_at(0, &pattern(len, 21)).unwrap();
        cut.apply(WIRE1);
        if let Cut::Down = cut {
            let noticed = Instant::now();
            while !rail_down(&node, 1).await {
                assert!(
                    noticed.elapsed() < Duration::from_secs(10),
                    "rail 1's port never reported down"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // Rail 1's pair fails at connect: the link starts with rail 0 alone.
        writes_arrive(&node, &mut peer.process, &src, &target, STEP_SHORT).await;
        assert_eq!(pairs_to(&node, addr).await, [(0, 0, 1024)], "{cut:?}");
        // While the cut lasts the keeper's tries (or, with the port down,
        // none) add nothing.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(pairs_to(&node, addr).await, [(0, 0, 1024)], "{cut:?}");
        heal.now();
        let back = both_rails_used_again(&node, &mut peer, addr).await;
        eprintln!(
            "{cut:?}: the rail cut at connect in use {:.1} s after the heal",
            back.as_secs_f64()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_peer_no_rail_reaches_falls_back_to_tcp_unless_ibverbs_is_required() {
    require_two_rails();
    let heal = Heal;
    for wire in ["wire", WIRE1] {
        Cut::Loss.apply(wire);
    }
    let node = mgmt_node().await;
    let mut peer = mgmt_peer().await;
    let len = 1usize << 20;
    let target = peer.process.alloc(len, Access::ReadWrite, 3).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 33)).unwrap();
    // Every pair's probe fails; the write goes over TCP (on the management
    // wire) instead, and so does the next.
    writes_arrive(&node, &mut peer.process, &src, &target, STEP_SHORT).await;
    let next = RdmaOp::write(src.whole(), target.handle.clone());
    assert_eq!(node.route(&next), Some(RdmaTransportLevel::Tcp));
    // A peer whose first batches to this node carry notifications falls
    // back the same way: each notification arrives once, after its bytes.
    let mut notifier = mgmt_peer().await;
    notified_writes_from(&node, &mut notifier.process, 20).await;
    // A node that requires ibverbs gets an error naming the pairs tried.
    let strict = rdma_node_with(|builder| {
        builder
            .listen("10.99.0.2:0".parse().unwrap())
            .require(RdmaTransportLevel::Nic)
    })
    .await;
    let local = strict.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let error = strict
        .submit(
            vec![RdmaOp::write(local.whole(), target.handle.clone())],
            STEP_SHORT,
        )
        .await
        .expect_err("no rail reaches the peer");
    let text = error.to_string();
    assert!(
        matches!(
            error,
            SubmitError::Op {
                error: OpError::PeerUnreachable { .. },
                ..
            }
        ) && text.contains("rxe0:1 -> rail 0")
            && text.contains("rxe1:1 -> rail 1"),
        "{text}"
    );
    heal.now();
}
