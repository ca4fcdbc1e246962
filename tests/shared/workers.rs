//! Worker actors that move bytes through `Submit` messages to a node's
//! actor, as a user's workers would; shared by the TCP and RDMA suites.

use std::time::Duration;

use ferry::prelude::*;
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};

use crate::common::pattern;

const DEADLINE: Duration = Duration::from_secs(120);

/// Holds only the node's actor: it allocates and transfers through it.
#[derive(Actor)]
pub struct Worker {
    node: ActorRef<NodeActor>,
}

/// Write `pattern(len, seed)` into `remote`, read it back; answers the bytes
/// read back.
pub struct RoundTrip {
    pub remote: RemoteBuffer,
    pub seed: u8,
}

impl Message<RoundTrip> for Worker {
    type Reply = Result<Vec<u8>, SubmitError>;

    async fn handle(&mut self, msg: RoundTrip, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let len = msg.remote.len();
        let alloc = Alloc {
            len,
            access: Access::ReadWrite,
        };
        let src = self.node.ask(alloc).await.expect("alloc through the actor");
        let back = self.node.ask(alloc).await.expect("alloc through the actor");
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

/// `workers` worker actors, each holding `node.actor()`, concurrently write
/// their own slice of `target` and read it back. Panics if any fails or
/// reads back other bytes. Returns what `target` holds afterwards, given
/// its `original` bytes.
pub async fn worker_round_trips(
    node: &Node,
    target: &RemoteBuffer,
    mut original: Vec<u8>,
    workers: usize,
) -> Vec<u8> {
    let slice = target.len() as usize / workers;
    let mut asks = Vec::new();
    for i in 0..workers {
        let worker = Worker::spawn(Worker {
            node: node.actor().clone(),
        });
        let range = i * slice..(i + 1) * slice;
        let remote = target.slice(range.start as u64..range.end as u64).unwrap();
        original[range].copy_from_slice(&pattern(slice, i as u8));
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
    original
}

/// Sends one large batch (`copies` writes of all of `src` into `target`)
/// to the node's actor, then a `Transports` query: the query must be
/// answered while the transfer still runs, since the actor's mailbox never
/// waits on a transfer. Then the transfer completes.
pub async fn the_actor_answers_while_a_transfer_runs(
    node: &Node,
    src: &Region,
    target: &RemoteBuffer,
    copies: usize,
) {
    let ops = (0..copies)
        .map(|_| RdmaOp::write(src.whole(), target.clone()))
        .collect();
    let actor = node.actor().clone();
    let transfer = tokio::spawn(async move {
        actor
            .ask(Submit {
                ops,
                timeout: DEADLINE,
            })
            .await
    });
    // The actor takes the batch first (the task that asks runs at once; the
    // pause only makes sure).
    tokio::time::sleep(Duration::from_millis(50)).await;
    let transports = tokio::time::timeout(DEADLINE, node.actor().ask(ferry::Transports))
        .await
        .expect("answered")
        .unwrap();
    assert!(!transports.is_empty());
    assert!(
        !transfer.is_finished(),
        "the transfer finished before the query was answered: make it longer"
    );
    transfer.await.unwrap().expect("the transfer completes");
}
