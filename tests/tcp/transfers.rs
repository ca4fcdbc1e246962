//! Data moved between two processes, verified byte for byte on both sides.

use std::time::Duration;

use ferry::prelude::*;
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};

use crate::common::{PeerProcess, digest, pattern};

const DEADLINE: Duration = Duration::from_secs(60);

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

/// A worker that writes its slice of the remote region, reads it back and
/// checks it, all through `Submit` messages to the node's actor.
#[derive(Actor)]
struct Worker {
    node: ActorRef<NodeActor>,
}

struct RoundTrip {
    remote: RemoteBuffer,
    seed: u8,
}

impl Message<RoundTrip> for Worker {
    type Reply = Result<Vec<u8>, SubmitError>;

    async fn handle(&mut self, msg: RoundTrip, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let len = msg.remote.len();
        let alloc = Alloc {
            len,
            access: Access::ReadWrite,
        };
        let src = self.node.ask(alloc).await.unwrap();
        let back = self.node.ask(alloc).await.unwrap();
        src.write_at(0, &pattern(len as usize, msg.seed)).unwrap();
        let submit = |ops| Submit {
            ops,
            timeout: DEADLINE,
        };
        let write = submit(vec![RdmaOp::write(src.whole(), msg.remote.clone())]);
        self.node.ask(write).await?;
        let read = submit(vec![RdmaOp::read(back.whole(), msg.remote)]);
        self.node.ask(read).await?;
        Ok(back.to_vec())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_worker_actors_submit_concurrently_to_the_node_actor() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let slice = (1 << 20) + 77;
    let target = peer.alloc(16 * slice, Access::ReadWrite, 9).await;
    let workers: Vec<_> = (0..16)
        .map(|_| {
            Worker::spawn(Worker {
                node: node.actor().clone(),
            })
        })
        .collect();

    let mut expected = target.original();
    let mut asks = Vec::new();
    for (i, worker) in workers.iter().enumerate() {
        let range = i * slice..(i + 1) * slice;
        let remote = target
            .handle
            .slice(range.start as u64..range.end as u64)
            .unwrap();
        expected[range].copy_from_slice(&pattern(slice, i as u8));
        let worker = worker.clone();
        asks.push(tokio::spawn(async move {
            worker
                .ask(RoundTrip {
                    remote,
                    seed: i as u8,
                })
                .await
        }));
    }
    for (i, ask) in asks.into_iter().enumerate() {
        let back = ask
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("worker {i}: {e}"));
        assert!(
            back == pattern(slice, i as u8),
            "worker {i} read back other bytes"
        );
    }
    assert_eq!(peer.digest(&target).await, digest(&expected));
}
