//! Notified batches from a peer in another process, many in flight: each
//! notification is delivered exactly once, and never before its batch is
//! complete on this node. Shared by the TCP suite (the peer's four data
//! connections) and the RDMA suite (in the VM).

#![allow(dead_code)] // each suite runs what its transport supports

use std::time::Duration;

use ferry::prelude::*;
use ferry::{DeliveryKind, Inbox, NodeAddr};

use crate::common::{PeerProcess, SLOT, slot_bytes};

const BATCHES: usize = 10_000;
const IN_FLIGHT: usize = 32;
/// The longest any one notification may take to arrive.
const WAIT: Duration = Duration::from_secs(30);

/// Takes the next notification from `peer` and returns its batch number;
/// a second notification for the same batch fails the test.
async fn next_batch(inbox: &mut Inbox, peer: NodeAddr, seen: &mut [bool]) -> usize {
    let delivery = tokio::time::timeout(WAIT, inbox.recv())
        .await
        .expect("no notification within the deadline")
        .expect("the inbox closed");
    assert_eq!(delivery.kind, DeliveryKind::Notification);
    assert_eq!(delivery.from.id, peer.id);
    let i = u32::from_le_bytes(delivery.body[..].try_into().expect("4-byte body")) as usize;
    assert!(
        !std::mem::replace(&mut seen[i], true),
        "batch {i} notified twice"
    );
    i
}

/// The peer writes `BATCHES` notified batches into `node`'s memory; on
/// each notification, `node` finds that batch's bytes in place.
pub async fn notified_writes_each_find_their_bytes_in_place(node: &Node) {
    let target = node
        .alloc((BATCHES * SLOT) as u64, Access::ReadWrite)
        .await
        .unwrap();
    let mut inbox = node.inbox().unwrap();
    let mut peer = PeerProcess::spawn().await;
    let peer_addr = peer.node_addr().await.unwrap();
    let remote = target.remote();
    let writer = tokio::spawn(async move {
        let result = peer
            .notified_batches("write", BATCHES, IN_FLIGHT, &remote)
            .await;
        (peer, result)
    });
    let mut seen = vec![false; BATCHES];
    for _ in 0..BATCHES {
        let i = next_batch(&mut inbox, peer_addr, &mut seen).await;
        let mut landed = vec![0; SLOT];
        target.read_at((i * SLOT) as u64, &mut landed).unwrap();
        assert!(
            landed == slot_bytes(i),
            "batch {i}: notified before all of its bytes landed"
        );
    }
    let (_peer, result) = writer.await.unwrap();
    assert_eq!(result, Ok(()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(inbox.try_recv(), None, "a notification beyond the batches");
}

/// The peer reads `BATCHES` notified batches from `node`'s memory; on
/// each notification `node` overwrites that batch's bytes, and the peer
/// finds none of the overwritten bytes in what it read.
pub async fn notified_reads_are_done_when_the_owner_hears(node: &Node) {
    let source = node
        .alloc((BATCHES * SLOT) as u64, Access::ReadWrite)
        .await
        .unwrap();
    for i in 0..BATCHES {
        source.write_at((i * SLOT) as u64, &slot_bytes(i)).unwrap();
    }
    let mut inbox = node.inbox().unwrap();
    let mut peer = PeerProcess::spawn().await;
    let peer_addr = peer.node_addr().await.unwrap();
    let remote = source.remote();
    let reader = tokio::spawn(async move {
        let result = peer
            .notified_batches("read", BATCHES, IN_FLIGHT, &remote)
            .await;
        (peer, result)
    });
    let mut seen = vec![false; BATCHES];
    for _ in 0..BATCHES {
        // Notified: the reads are done, so the owner reuses the slot at
        // once. A read still to come would carry these bytes to the peer,
        // which checks for them.
        let i = next_batch(&mut inbox, peer_addr, &mut seen).await;
        source.write_at((i * SLOT) as u64, &[0xee; SLOT]).unwrap();
    }
    let (_peer, result) = reader.await.unwrap();
    assert_eq!(result, Ok(()));
}
