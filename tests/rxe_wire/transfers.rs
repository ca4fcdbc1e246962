//! Verified transfers across the wire, clean and at 2 % loss each way:
//! writes and reads in 64 KiB and 1 MiB ops, and notified batches.

use ferry::prelude::*;

use crate::common::{digest, pattern};
use crate::notified_batches::{notified_reads_from, notified_writes_from};
use crate::peer::{RemotePeer, Wire};
use crate::{STEP, ops, rdma_node};

/// Bytes moved each way per op size: small, since under TCG and loss the
/// wire carries a few MiB/s at best.
const REGION: u64 = 2 << 20;
/// Notified batches (4 KiB each) each way.
const BATCHES: usize = 100;

/// Writes `REGION` bytes into a fresh region of the peer in ops of
/// `piece` bytes, checks what landed there, reads it back in the same ops,
/// and compares.
async fn write_read_verify(node: &Node, peer: &mut RemotePeer, piece: u64, seed: u8) {
    let target = peer
        .process
        .alloc(REGION as usize, Access::ReadWrite, seed)
        .await;
    let data = pattern(REGION as usize, seed.wrapping_add(50));
    let src = node.alloc(REGION, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    node.submit(ops(&src, &target.handle, piece, true), STEP)
        .await
        .unwrap_or_else(|e| panic!("writes of {piece} B: {e}"));
    assert_eq!(
        peer.process.digest(&target).await,
        digest(&data),
        "writes of {piece} B landed"
    );
    let back = node.alloc(REGION, Access::ReadWrite).await.unwrap();
    node.submit(ops(&back, &target.handle, piece, false), STEP)
        .await
        .unwrap_or_else(|e| panic!("reads of {piece} B: {e}"));
    assert!(
        back.to_vec() == data,
        "reads of {piece} B brought other bytes"
    );
    peer.process.drop_region(&target).await;
}

/// Everything this suite moves, on whatever the wire is now.
async fn all_transfers(wire_state: &str) {
    let node = rdma_node().await;
    let mut peer = RemotePeer::start().await;
    for (i, piece) in [64 << 10, 1 << 20].into_iter().enumerate() {
        write_read_verify(&node, &mut peer, piece, i as u8).await;
    }
    eprintln!("{wire_state}: writes and reads verified");
    notified_writes_from(&node, &mut peer.process, BATCHES).await;
    notified_reads_from(&node, &mut peer.process, BATCHES).await;
    eprintln!("{wire_state}: notified batches verified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn verified_transfers_over_a_clean_wire() {
    let _wire = Wire::clean();
    all_transfers("clean wire").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn verified_transfers_at_2_percent_loss_each_way() {
    let wire = Wire::clean();
    wire.loss(2.0);
    // Notified reads included: their SEND once waited behind a fence,
    // which soft-RoCE never lifted after a lost read response.
    all_transfers("2 % loss").await;
}
