//! Which rails a region's ops take, in the two-rail VMs: a region pinned
//! to one rail moves bytes only there, and `Node::path` names the pairs.
//! (The VMs' soft-RoCE devices have no NUMA node, so the NUMA preference
//! itself is covered by `ferry-ibverbs`'s unit tests.)

use ferry::TransportPath;
use ferry::ibverbs::{PinError, RailPair, RailSet};
use ferry::prelude::*;

use super::{STEP_SHORT, posted_bytes, require_two_rails};
use crate::common::{digest, pattern};
use crate::peer::RemotePeer;
use crate::rdma_node;

/// The pairs `path` names, as (local rail, remote rail).
fn pairs(path: Option<TransportPath>) -> Vec<(u8, u8)> {
    match path {
        Some(TransportPath::Nic(pairs)) => pairs
            .as_slice()
            .iter()
            .map(|&RailPair { rail, remote_rail }| (rail, remote_rail))
            .collect(),
        other => panic!("not over ibverbs: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_region_pinned_to_one_rail_moves_its_bytes_only_there() {
    require_two_rails();
    let node = rdma_node().await;
    let mut peer = RemotePeer::start().await;
    let len: u64 = 16 << 20;
    let target = peer.process.alloc(len as usize, Access::ReadWrite, 5).await;
    let src = node.alloc(len, Access::ReadWrite).await.unwrap();
    let write = RdmaOp::write(src.whole(), target.handle.clone());
    assert_eq!(pairs(node.path(&write)), [], "nothing connected yet");
    node.submit(
        vec![RdmaOp::write(
            src.slice(0..4096).unwrap(),
            target.handle.slice(0..4096).unwrap(),
        )],
        STEP_SHORT,
    )
    .await
    .unwrap();
    assert_eq!(
        pairs(node.path(&write)),
        [(0, 0), (1, 1)],
        "no NUMA facts here: every rail preferred"
    );

    // Refusals change nothing.
    assert_eq!(
        node.pin_rails(&src, &[2]),
        Err(PinError::NoSuchRail { rail: 2, rails: 2 })
    );
    assert_eq!(node.pin_rails(&src, &[]), Err(PinError::NoRail));
    assert_eq!(pairs(node.path(&write)), [(0, 0), (1, 1)]);

    node.pin_rails(&src, &[1]).unwrap();
    assert_eq!(pairs(node.path(&write)), [(1, 1)]);
    let info = node.ibverbs().unwrap().transport_info().await.unwrap();
    let keys = info.regions.iter().find(|r| r.id == src.id()).unwrap();
    assert_eq!(
        (keys.allowed, keys.preferred),
        (RailSet::of(&[1]).unwrap(), RailSet::of(&[1]).unwrap())
    );

    let data = pattern(len as usize, 9);
    src.write_at(0, &data).unwrap();
    let before = posted_bytes(&node).await;
    node.submit(vec![write.clone()], STEP_SHORT).await.unwrap();
    let after = posted_bytes(&node).await;
    assert_eq!(
        peer.process.digest(&target).await,
        digest(&data),
        "the write landed"
    );
    let moved: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    eprintln!("16 MiB pinned to rail 1: posted per rail {moved:?} B");
    assert_eq!(moved, [0, len], "all of it on rail 1, none on rail 0");

    // A deregistered region cannot be pinned (the op held it too).
    let (id, generation) = (src.id(), src.generation());
    drop((write, src));
    assert_eq!(
        node.ibverbs().unwrap().pin_rails(id, generation, &[0]),
        Err(PinError::UnknownRegion)
    );
}
