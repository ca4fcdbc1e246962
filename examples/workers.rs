//! Start here: two ferry nodes in one process and four worker actors moving
//! bytes between them through node A's manager actor.
//!
//! ```text
//! cargo run --example workers
//! ```
//!
//! Node B owns a region and hands out a `RemoteBuffer` for it. The handle is
//! plain serializable data (here it goes through JSON, as it would through any
//! control channel between two processes). On node A, each worker writes its
//! own slice of B's region and reads it back, by sending `Submit` messages to
//! A's `NodeActor`, which routes every op over the fastest transport both
//! nodes share (RDMA where both have a NIC, TCP otherwise).

use std::process::ExitCode;
use std::time::Duration;

use ferry::Transports;
use ferry::prelude::*;
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};

const WORKERS: usize = 4;
/// Bytes each worker moves (lengths in ferry are `u64` bytes).
const SLICE: u64 = 1 << 20;
/// Every transfer gives up after this long instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Holds its own handle to the node's manager actor and its own local memory.
#[derive(Actor)]
struct Worker {
    node: ActorRef<NodeActor>,
    src: Region,
    back: Region,
}

/// Write `seed`'s pattern into `remote`, read it back, compare.
struct RoundTrip {
    remote: RemoteBuffer,
    seed: u8,
}

impl Worker {
    async fn submit(&self, op: RdmaOp) -> Result<(), SubmitError> {
        let submit = Submit {
            ops: vec![op],
            timeout: TIMEOUT,
        };
        // `?` turns kameo's error into a `SubmitError`: one error type,
        // whether the transfer failed or the node's actor is gone.
        self.node.ask(submit).await?;
        Ok(())
    }
}

impl Message<RoundTrip> for Worker {
    type Reply = Result<(), String>;

    async fn handle(&mut self, msg: RoundTrip, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let data = pattern(msg.seed);
        self.src.write_at(0, &data).map_err(|e| e.to_string())?;
        self.submit(RdmaOp::write(self.src.whole(), msg.remote.clone()))
            .await
            .map_err(|e| e.to_string())?;
        self.submit(RdmaOp::read(self.back.whole(), msg.remote))
            .await
            .map_err(|e| e.to_string())?;
        match self.back.to_vec() == data {
            true => Ok(()),
            false => Err("read back other bytes than were written".into()),
        }
    }
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..SLICE)
        .map(|i| (i as u8).wrapping_mul(seed | 1) ^ seed)
        .collect()
}

#[tokio::main]
async fn main() -> ExitCode {
    let a = Node::builder().spawn().await.expect("node A");
    let b = Node::builder().spawn().await.expect("node B");
    println!(
        "node A at {}, node B at {}",
        a.addr().endpoint,
        b.addr().endpoint
    );
    // What A's actor can move bytes with, and why not where it cannot.
    for transport in a.actor().ask(Transports).await.expect("node A runs") {
        println!("node A transport {transport}");
    }

    // B: one region for all workers, shared as a serializable handle.
    let target = b
        .alloc(WORKERS as u64 * SLICE, Access::ReadWrite)
        .await
        .unwrap();
    // Any serde format works. The JSON holds the access token: treat it as a secret.
    let json = serde_json::to_string(&target.remote()).unwrap();
    println!(
        "B's handle as JSON, {} bytes: {}... (the rest carries the token)",
        json.len(),
        &json[..60]
    );
    let remote: RemoteBuffer = serde_json::from_str(&json).unwrap();

    // A: workers, each with its own handle to A's actor and local regions.
    let mut tasks = Vec::new();
    for i in 0..WORKERS {
        let worker = Worker::spawn(Worker {
            node: a.actor().clone(),
            src: a.alloc(SLICE, Access::ReadWrite).await.unwrap(),
            back: a.alloc(SLICE, Access::ReadWrite).await.unwrap(),
        });
        let at = i as u64 * SLICE;
        let msg = RoundTrip {
            remote: remote.slice(at..at + SLICE).unwrap(),
            seed: i as u8,
        };
        // Workers run concurrently; ask each and collect the answers.
        tasks.push(tokio::spawn(async move { worker.ask(msg).await }));
    }

    let mut failed = false;
    for (i, task) in tasks.into_iter().enumerate() {
        match task.await.expect("worker task") {
            Ok(()) => println!("worker {i}: wrote and read back {SLICE} bytes, identical"),
            Err(e) => {
                println!("worker {i}: FAILED: {e}");
                failed = true;
            }
        }
    }
    // B's side, checked directly: every slice holds its worker's pattern.
    let expected: Vec<u8> = (0..WORKERS).flat_map(|i| pattern(i as u8)).collect();
    if target.to_vec() == expected {
        println!("node B's region holds all {WORKERS} slices as written");
    } else {
        println!("node B's region does NOT hold what the workers wrote");
        failed = true;
    }
    a.shutdown().await;
    b.shutdown().await;
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
