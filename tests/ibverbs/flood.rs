//! Issue 55: queue pairs a peer asks for over its control session. Each
//! costs the owner a queue pair, a completion queue and a descriptor (and
//! ferry's own a registered ring), and any peer with a session may ask: so
//! the owner keeps so many per session and in all, and refuses more with
//! `PeerBusy`, while a good peer's own keep serving it.

use std::time::{Duration, Instant};

use ferry::prelude::*;
use ferry::{OpError, RdmaTransportLevel, ibverbs};

use crate::common::pattern;
use crate::{DEADLINE, rdma_node, rdma_node_with};

/// Writes fresh bytes from `peer` into `target` over RDMA and reads them
/// back; the bytes must match.
async fn served(peer: &Node, target: &Region, seed: u8) {
    let len = target.len() as usize;
    let data = pattern(len, seed);
    let src = peer.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    let write = RdmaOp::write(src.whole(), target.remote());
    assert_eq!(peer.route(&write), Some(RdmaTransportLevel::Nic));
    peer.submit(vec![write], DEADLINE).await.unwrap();
    let back = peer.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let read = RdmaOp::read(back.whole(), target.remote());
    peer.submit(vec![read], DEADLINE).await.unwrap();
    assert!(back.to_vec() == data, "seed {seed}: the bytes came back");
}

/// Leases queue pairs from `node` to `owner` until one is refused (64 at
/// most): the leases, and the refusal.
async fn lease_until_refused(node: &Node, owner: &Node) -> (Vec<ibverbs::IbvLease>, OpError) {
    let ibverbs = node.ibverbs().unwrap();
    let mut leases = Vec::new();
    loop {
        match ibverbs.lease(owner.addr(), None, 4, DEADLINE).await {
            Ok(lease) => leases.push(lease),
            Err(refused) => return (leases, refused),
        }
        assert!(leases.len() < 64, "64 leases, none refused");
    }
}

/// Waits (within `DEADLINE`) until `owner` keeps `count` queue pairs for
/// initiators.
async fn wait_passive(owner: &Node, count: usize) {
    let started = Instant::now();
    while owner.peer_tables().ibverbs_passive != count {
        assert!(
            started.elapsed() < DEADLINE,
            "{} passive queue pairs, not {count}",
            owner.peer_tables().ibverbs_passive
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn queue_pairs_asked_for_are_capped_per_session_and_in_all_and_a_good_peer_is_served() {
    let owner = rdma_node_with(ibverbs::IbvConfig {
        max_passive_qps_per_session: 6,
        max_passive_qps: 12,
        ..Default::default()
    })
    .await;
    let target = owner.alloc(256 << 10, Access::ReadWrite).await.unwrap();
    let good = rdma_node().await;
    served(&good, &target, 1).await;
    let good_qps = owner.peer_tables().ibverbs_passive;
    assert!(good_qps >= 1);

    // A flooder leases queue pairs on its session until refused: its own
    // pairs and its leases', 6 in all.
    let flooder = rdma_node().await;
    let (leases, refused) = lease_until_refused(&flooder, &owner).await;
    let held = owner.peer_tables().ibverbs_passive;
    eprintln!(
        "{good_qps} queue pairs for the good peer; the flooder got {} leases, then {refused}; \
         {held} kept",
        leases.len()
    );
    assert!(
        matches!(&refused, OpError::PeerBusy { endpoint, .. } if *endpoint == owner.addr().endpoint),
        "{refused:?}"
    );
    assert_eq!(held, good_qps + 6, "the session's cap");
    served(&good, &target, 2).await;

    // A second one fills the node's total, and a newcomer is refused.
    let second = rdma_node().await;
    let (more, refused) = lease_until_refused(&second, &owner).await;
    assert!(matches!(refused, OpError::PeerBusy { .. }), "{refused:?}");
    assert_eq!(owner.peer_tables().ibverbs_passive, 12, "the node's cap");
    let late = rdma_node().await;
    let connected = late
        .ibverbs()
        .unwrap()
        .connect(owner.addr(), DEADLINE)
        .await;
    eprintln!(
        "the second flooder got {} leases; a newcomer: {connected:?}",
        more.len()
    );
    assert!(
        matches!(connected, Err(OpError::PeerBusy { .. })),
        "{connected:?}"
    );
    served(&good, &target, 3).await;

    // The floods end: their queue pairs go, and the newcomer gets its own.
    drop((leases, more));
    flooder.shutdown().await;
    second.shutdown().await;
    wait_passive(&owner, good_qps).await;
    served(&late, &target, 4).await;
    served(&good, &target, 5).await;
}
