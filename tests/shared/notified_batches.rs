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
    notified_writes_from(node, &mut PeerProcess::spawn().await, BATCHES).await;
}

/// As [`notified_writes_each_find_their_bytes_in_place`], `batches` of
/// them from `peer`.
pub async fn notified_writes_from(node: &Node, peer: &mut PeerProcess, batches: usize) {
    let target = node
        .alloc((batches * SLOT) as u64, Access::ReadWrite)
        .await
        .unwrap();
    let mut inbox = node.inbox().unwrap();
    let peer_addr = peer.node_addr().await.unwrap();
    let remote = target.remote();
    let writer = peer.notified_batches("write", batches, IN_FLIGHT, &remote);
    let check = async {
        let mut seen = vec![false; batches];
        for _ in 0..batches {
            let i = next_batch(&mut inbox, peer_addr, &mut seen).await;
            let mut landed = vec![0; SLOT];
            target.read_at((i * SLOT) as u64, &mut landed).unwrap();
            assert!(
                landed == slot_bytes(i),
                "batch {i}: notified before all of its bytes landed"
            );
        }
    };
    let (result, ()) = tokio::join!(writer, check);
    assert_eq!(result, Ok(()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(inbox.try_recv(), None, "a notification beyond the batches");
    node.return_inbox(inbox);
}

/// The peer reads `BATCHES` notified batches from `node`'s memory; on
/// each notification `node` overwrites that batch's bytes, and the peer
/// finds none of the overwritten bytes in what it read.
pub async fn notified_reads_are_done_when_the_owner_hears(node: &Node) {
    notified_reads_from(node, &mut PeerProcess::spawn().await, BATCHES).await;
}

/// As [`notified_reads_are_done_when_the_owner_hears`], `batches` of them
/// by `peer`.
pub async fn notified_reads_from(node: &Node, peer: &mut PeerProcess, batches: usize) {
    let source = node
        .alloc((batches * SLOT) as u64, Access::ReadWrite)
        .await
        .unwrap();
    for i in 0..batches {
        source.write_at((i * SLOT) as u64, &slot_bytes(i)).unwrap();
    }
    let mut inbox = node.inbox().unwrap();
    let peer_addr = peer.node_addr().await.unwrap();
    let remote = source.remote();
    let reader = peer.notified_batches("read", batches, IN_FLIGHT, &remote);
    let reuse = async {
        let mut seen = vec![false; batches];
        for _ in 0..batches {
            // Notified: the reads are done, so the owner reuses the slot at
            // once. A read still to come would carry these bytes to the
            // peer, which checks for them.
            let i = next_batch(&mut inbox, peer_addr, &mut seen).await;
            source.write_at((i * SLOT) as u64, &[0xee; SLOT]).unwrap();
        }
    };
    let (result, ()) = tokio::join!(reader, reuse);
    assert_eq!(result, Ok(()));
    node.return_inbox(inbox);
}
