//! Data moved between two processes, verified byte for byte on both sides.

use ferry::prelude::*;

use std::time::Duration;

use crate::common::{PeerProcess, digest, forge, pattern};

/// Bound on any one batch here; they take milliseconds.
const WAIT: Duration = Duration::from_secs(30);

#[path = "../shared/workers.rs"]
mod workers;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_back_sizes_1_byte_to_256_mib() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let sizes = [
        1usize,
        7,
        4096,
        65_537,
        1 << 20,
        (3 << 20) + 5,
        64 << 20,
        256 << 20,
    ];
    for (i, len) in sizes.into_iter().enumerate() {
        crate::common::write_then_read_back(&node, &mut peer, len, i as u8, None).await;
    }
}

/// Ops of one batch run concurrently, so they target disjoint ranges; even
/// ops write, odd ops read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_1_to_1024_mixed_reads_and_writes() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    for (round, batch) in [1usize, 2, 16, 333, 1024].into_iter().enumerate() {
        // Op sizes cycle through awkward lengths, including ones above the chunk size.
        let sizes: Vec<usize> = (0..batch)
            .map(|i| [1, 100, 4096, 5000, (1 << 20) + 3][i % 5])
            .collect();
        crate::common::mixed_batch_round_trip(&node, &mut peer, &sizes, round as u8).await;
    }
}

/// 16 worker actors, each holding only the node's actor, write and read
/// back their slices of one remote region concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_worker_actors_submit_concurrently_to_the_node_actor() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let slice = (1 << 20) + 77;
    let target = peer.alloc(16 * slice, Access::ReadWrite, 9).await;
    let expected = workers::worker_round_trips(&node, &target.handle, target.original(), 16).await;
    assert_eq!(peer.digest(&target).await, digest(&expected));
}

/// The node's actor answers other messages while it has a transfer running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_actor_answers_while_a_transfer_runs() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let len = 256 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 4).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    // 2 GiB: far longer than one message takes.
    workers::the_actor_answers_while_a_transfer_runs(&node, &src, &target.handle, 8).await;
}

/// A bad op in a batch sent to the node's actor fails the batch with a
/// typed error naming it, and no byte of the batch moves; an empty batch is
/// answered `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_actor_refuses_a_bad_batch_whole() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let writable = peer.alloc(4096, Access::ReadWrite, 3).await;
    let read_only = peer.alloc(4096, Access::ReadOnly, 5).await;
    let src = node.alloc(4096, Access::ReadWrite).await.unwrap();
    src.write_at(0, &[0xEE; 4096]).unwrap();
    let submit = |ops| Submit {
        ops,
        timeout: std::time::Duration::from_secs(10),
    };
    let ops = vec![
        RdmaOp::write(src.whole(), writable.handle.clone()),
        RdmaOp::write(src.whole(), read_only.handle.clone()),
    ];
    let result = node.actor().ask(submit(ops)).await;
    assert_eq!(
        result.map_err(SubmitError::from),
        Err(SubmitError::Op {
            index: 1,
            error: OpError::ReadOnly
        })
    );
    assert_eq!(peer.digest(&writable).await, digest(&writable.original()));
    assert_eq!(node.actor().ask(submit(vec![])).await.ok(), Some(()));
}

#[path = "../shared/descs.rs"]
mod descs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_100_000_descriptors_over_tcp_is_verified_byte_for_byte() {
    let node = Node::builder().ibverbs(false).spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    descs::descriptors_round_trip(&node, &mut peer, RdmaTransportLevel::Tcp, 100_000).await;
}

/// Small ops of one batch travel gathered, many to a request, as long as
/// they share owner region, direction and local region and fit a request's
/// bounds. A batch that crosses every such boundary (two remote and two
/// local regions, a zero-length op, an op too big to gather, runs longer
/// than one request takes) moves every byte where it belongs, both ways;
/// and an op refused inside a gathered run fails the batch with its own
/// index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_ops_gather_across_every_boundary_and_keep_their_indices() {
    const LEN: usize = 4 << 20;
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let remotes = [
        peer.alloc(LEN, Access::ReadWrite, 31).await,
        peer.alloc(LEN, Access::ReadWrite, 32).await,
    ];
    let locals = [
        node.alloc(LEN as u64, Access::ReadWrite).await.unwrap(),
        node.alloc(LEN as u64, Access::ReadWrite).await.unwrap(),
    ];
    let outgoing = [pattern(LEN, 41), pattern(LEN, 42)];
    for (local, bytes) in locals.iter().zip(&outgoing) {
        local.write_at(0, bytes).unwrap();
    }
    // (remote, local, len) per op, each at the next free offset of its
    // remote region; the same offset in its local region.
    let mut shape: Vec<(usize, usize, usize)> = Vec::new();
    shape.extend((0..1500).map(|k| (0, 0, 16 + k % 7)));
    shape.extend((0..40).map(|k| (k % 2, 0, 100)));
    shape.extend((0..40).map(|k| (1, k % 3 / 2, 33)));
    shape.push((1, 1, 0));
    shape.extend((0..300).map(|_| (1, 1, 700)));
    // Larger than a chunk (1 MiB): goes in pieces, gathered with nothing.
    shape.push((0, 1, (1 << 20) + 5));
    // More bytes than one request takes.
    shape.extend((0..300).map(|_| (0, 1, 4096)));
    let mut next = [0usize; 2];
    let mut spans = Vec::new();
    let mut writes = Vec::new();
    let mut expected = [remotes[0].original(), remotes[1].original()];
    for &(r, l, len) in &shape {
        let span = next[r]..next[r] + len;
        next[r] += len;
        let bytes = span.start as u64..span.end as u64;
        let remote = remotes[r].handle.slice(bytes.clone()).unwrap();
        writes.push(RdmaOp::write(locals[l].slice(bytes).unwrap(), remote));
        expected[r][span.clone()].copy_from_slice(&outgoing[l][span.clone()]);
        spans.push((r, l, span));
    }
    assert!(next.iter().all(|&n| n <= LEN), "{next:?}");
    node.submit(writes, WAIT).await.unwrap();
    for (remote, expected) in remotes.iter().zip(&expected) {
        assert_eq!(peer.digest(remote).await, digest(expected));
    }

    // Read every span back into fresh local regions, in reverse order;
    // remote region r's spans land in the r-th half of their local one,
    // so that no two reads share a byte.
    let backs = [
        node.alloc(2 * LEN as u64, Access::ReadWrite).await.unwrap(),
        node.alloc(2 * LEN as u64, Access::ReadWrite).await.unwrap(),
    ];
    let reads = spans.iter().rev().map(|(r, l, span)| {
        let bytes = span.start as u64..span.end as u64;
        let remote = remotes[*r].handle.slice(bytes.clone()).unwrap();
        let at = (r * LEN) as u64;
        let local = backs[*l].slice(at + bytes.start..at + bytes.end).unwrap();
        RdmaOp::read(local, remote)
    });
    node.submit(reads.collect(), WAIT).await.unwrap();
    let got = [backs[0].to_vec(), backs[1].to_vec()];
    for (r, l, span) in &spans {
        let local = r * LEN + span.start..r * LEN + span.end;
        let same = got[*l][local] == expected[*r][span.clone()];
        assert!(same, "span {span:?} of remote {r} read into local {l}");
    }

    // Ops 300..310 go to a region the owner dropped: the batch fails with
    // the first of them, whichever request carried it.
    let gone = peer.alloc(4096, Access::ReadWrite, 33).await;
    peer.drop_region(&gone).await;
    let ops = (0..600u64).map(|k| {
        let local = locals[0].slice(k * 64..k * 64 + 64).unwrap();
        let remote = match k {
            300..310 => gone.handle.slice((k - 300) * 64..(k - 299) * 64),
            _ => remotes[0].handle.slice(k * 64..k * 64 + 64),
        };
        RdmaOp::write(local, remote.unwrap())
    });
    assert_eq!(
        node.submit(ops.collect(), WAIT).await,
        Err(SubmitError::Op {
            index: 300,
            error: OpError::UnknownRegion
        })
    );

    // A handle forged 64 times longer than its 4 KiB region: ops past the
    // region's end pass the initiator's checks and are refused by the
    // owner, from inside a gathered run; the batch names the first.
    let small = peer.alloc(4096, Access::ReadWrite, 34).await;
    let forged = forge(&small.handle, |json| json["len"] = (64 * 4096).into());
    let ops = (0..200u64).map(|k| {
        let local = locals[0].slice(k * 64..k * 64 + 64).unwrap();
        RdmaOp::write(local, forged.slice(k * 64..k * 64 + 64).unwrap())
    });
    let bound = 4096;
    assert_eq!(
        node.submit(ops.collect(), WAIT).await,
        Err(SubmitError::Op {
            index: 64,
            error: OpError::OutOfBounds {
                offset: 4096,
                len: 64,
                bound
            }
        })
    );
}
