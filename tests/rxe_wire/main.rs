//! Two ferry nodes on two machines joined by a wire that the tests make
//! lossy, cut, and flap, and whose owner they kill.
//!
//! The machines are the two soft-RoCE VMs of `tests/rxe/run.sh --two`
//! (`tests/rxe/wire-tests.sh` builds and runs this suite there): this
//! process runs in VM b, and its peers (this same binary, as
//! `ferry_peer`) run in VM a, started through VM a's agent on the
//! management wire, which no test faults. Every fault is applied with
//! `tc netem` or `ip link` on the wire's interfaces, in both VMs, and
//! undone by [`Wire`]'s guard even when a test fails.
//!
//! On any other host these tests are `#[ignore]`d with that reason.

#[path = "../tcp/common.rs"]
mod common;
mod faults;
#[path = "../shared/notified_batches.rs"]
mod notified_batches;
mod peer;
mod rails;
mod transfers;
mod weights;

use std::time::Duration;

use ferry::prelude::*;

const NEEDS_TWO_VMS: &str = "needs two VMs: run by tests/rxe/wire-tests.sh";

/// Entry point of the peer process (in VM a); does nothing in a normal
/// test run.
#[test]
fn ferry_peer() {
    if std::env::var_os(common::PEER_ENV).is_some() {
        common::peer_main();
    }
}

/// This VM's node, RDMA only (the suite is about the wire), listening on
/// the wire's address so that the peer can reach it too (notifications).
async fn rdma_node() -> Node {
    rdma_node_with(|builder| builder).await
}

/// [`rdma_node`], its builder adjusted by `configure` first.
async fn rdma_node_with(configure: impl FnOnce(NodeBuilder) -> NodeBuilder) -> Node {
    let ip = std::env::var("FERRY_RXE_IP").unwrap_or_else(|_| "127.0.0.1".into());
    let listen = format!("{ip}:0")
        .parse()
        .expect("FERRY_RXE_IP is an IP address");
    let node = configure(Node::builder().memory(false).listen(listen))
        .spawn()
        .await
        .unwrap();
    assert!(
        node.ibverbs().is_some(),
        "{NEEDS_TWO_VMS}; here: {}",
        node.unavailable(RdmaTransportLevel::Nic).unwrap_or("?")
    );
    node
}

/// Ops of `piece` bytes covering `local` and `remote` back to back, all
/// writes or all reads.
fn ops(local: &Region, remote: &RemoteBuffer, piece: u64, write: bool) -> Vec<RdmaOp> {
    (0..local.len())
        .step_by(piece as usize)
        .map(|at| {
            let end = (at + piece).min(local.len());
            let (l, r) = (
                local.slice(at..end).unwrap(),
                remote.slice(at..end).unwrap(),
            );
            if write {
                RdmaOp::write(l, r)
            } else {
                RdmaOp::read(l, r)
            }
        })
        .collect()
}

/// Whether `error` reports the peer lost: its connection declared dead, or
/// a new one refused.
fn is_peer_lost(error: &SubmitError) -> bool {
    matches!(
        error,
        SubmitError::Op {
            error: OpError::ConnectionLost { .. } | OpError::PeerUnreachable { .. },
            ..
        }
    )
}

/// Whether `error` is one of the ways a transfer that could not finish is
/// reported: its deadline passed, or its peer was reported lost.
fn is_unfinished(error: &SubmitError) -> bool {
    matches!(error, SubmitError::Timeout { .. }) || is_peer_lost(error)
}

/// Generous bound for one step of a test under TCG: only a hang fails it.
const STEP: Duration = Duration::from_secs(120);
