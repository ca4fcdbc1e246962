//! KV-cache hand-off between a prefill node and a decode node, the way an
//! inference server disaggregates the two: the prefill side writes each
//! request's KV blocks straight into the decode node's memory, with a
//! notification; the decode side, notified, knows the blocks are in place,
//! checks them and answers the prefill side over RPC.
//!
//! ```text
//! cargo run --example kv_handoff
//! ```
//!
//! Both nodes run in this process here; across hosts, the only change is
//! how the decode node's handle reaches the prefill node (any serde format).

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ferry::prelude::*;
use ferry::{Delivery, DeliveryKind, NodeAddr, SubmitWithNotification};
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};

/// Requests, each handing off `BLOCKS` KV blocks of `BLOCK` bytes.
const REQUESTS: u32 = 8;
const BLOCKS: u64 = 4;
const BLOCK: u64 = 256 << 10;
/// Every transfer, notification and call gives up after this long.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The bytes of block `b` of request `r`.
fn kv_block(r: u32, b: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u32 ^ r.wrapping_mul(2654435761) ^ b as u32) as u8)
        .collect()
}

/// Where request `r`'s blocks live in the decode node's KV region.
fn slot(r: u32) -> std::ops::Range<u64> {
    let at = u64::from(r) * BLOCKS * BLOCK;
    at..at + BLOCKS * BLOCK
}

/// The prefill worker: "computes" KV blocks and writes them to the decode
/// node, one batch with a notification per request.
#[derive(Actor)]
struct Prefill {
    node: ActorRef<NodeActor>,
    staging: Region,
    kv: RemoteBuffer,
}

/// Hand off the request with this number.
struct HandOff(u32);

impl Message<HandOff> for Prefill {
    type Reply = Result<(), String>;

    async fn handle(&mut self, msg: HandOff, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let r = msg.0;
        let mut ops = Vec::new();
        for b in 0..BLOCKS {
            let at = b * BLOCK;
            self.staging
                .write_at(at, &kv_block(r, b))
                .map_err(|e| e.to_string())?;
            let remote_at = slot(r).start + at;
            ops.push(RdmaOp::write(
                self.staging
                    .slice(at..at + BLOCK)
                    .map_err(|e| e.to_string())?,
                self.kv
                    .slice(remote_at..remote_at + BLOCK)
                    .map_err(|e| e.to_string())?,
            ));
        }
        // The notification says which request's blocks landed.
        let submit = SubmitWithNotification {
            ops,
            timeout: TIMEOUT,
            notification: Bytes::copy_from_slice(&r.to_le_bytes()),
        };
        self.node.ask(submit).await.map_err(|e| e.to_string())
    }
}

/// The decode worker: subscribed to its node's inbox, it is told every
/// notification, checks the request's blocks, and reports to prefill.
#[derive(Actor)]
struct Decode {
    node: Node,
    kv: Region,
    prefill: NodeAddr,
}

impl Message<Delivery> for Decode {
    type Reply = ();

    async fn handle(&mut self, delivery: Delivery, _: &mut Context<Self, ()>) {
        if delivery.kind != DeliveryKind::Notification {
            return;
        }
        let r = u32::from_le_bytes(delivery.body[..4].try_into().unwrap_or_default());
        // Notified: every block of the request is in `kv` already.
        let expected: Vec<u8> = (0..BLOCKS).flat_map(|b| kv_block(r, b)).collect();
        let mut got = vec![0; expected.len()];
        let ok = self.kv.read_at(slot(r).start, &mut got).is_ok() && got == expected;
        let answer = [&r.to_le_bytes()[..], &[ok as u8]].concat();
        if let Err(e) = self
            .node
            .call(self.prefill, "kv-ready", answer, TIMEOUT)
            .await
        {
            eprintln!("decode: could not answer prefill for request {r}: {e}");
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let prefill = Node::builder().spawn().await.expect("prefill node");
    let decode = Node::builder().spawn().await.expect("decode node");

    // Prefill counts the decode side's answers (an RPC handler).
    let verified = Arc::new(AtomicUsize::new(0));
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    prefill
        .serve_rpc("kv-ready", {
            let verified = verified.clone();
            move |request| {
                let (r, ok) = (request.body[..4].to_vec(), request.body[4] == 1);
                if ok {
                    verified.fetch_add(1, Ordering::SeqCst);
                }
                let _ = done_tx.send((r, ok));
                async { Ok(Bytes::new()) }
            }
        })
        .expect("serve kv-ready");

    // Decode: a KV region, its handle for prefill, and the decode actor.
    let kv = decode
        .alloc(u64::from(REQUESTS) * BLOCKS * BLOCK, Access::ReadWrite)
        .await
        .expect("KV region");
    let handle = serde_json::to_string(&kv.remote()).expect("handle");
    let actor = Decode::spawn(Decode {
        node: decode.clone(),
        kv,
        prefill: prefill.addr(),
    });
    decode.subscribe(actor).expect("the inbox is free");

    // Prefill: one worker hands off every request.
    let worker = Prefill::spawn(Prefill {
        node: prefill.actor().clone(),
        staging: prefill
            .alloc(BLOCKS * BLOCK, Access::ReadWrite)
            .await
            .expect("staging"),
        kv: serde_json::from_str(&handle).expect("handle"),
    });
    for r in 0..REQUESTS {
        if let Err(e) = worker.ask(HandOff(r)).await {
            println!("request {r}: hand-off FAILED: {e}");
            return ExitCode::FAILURE;
        }
    }
    for _ in 0..REQUESTS {
        match tokio::time::timeout(TIMEOUT, done.recv()).await {
            Ok(Some((r, ok))) => {
                let r = u32::from_le_bytes(r.try_into().unwrap_or_default());
                println!(
                    "request {r}: {} KiB of KV in place when decode was notified: {}",
                    (BLOCKS * BLOCK) >> 10,
                    if ok { "verified" } else { "WRONG BYTES" }
                );
            }
            _ => {
                println!("decode did not answer in time");
                return ExitCode::FAILURE;
            }
        }
    }
    let verified = verified.load(Ordering::SeqCst);
    println!("{verified} of {REQUESTS} hand-offs verified by the decode side");
    if verified == REQUESTS as usize {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
