//! Faults of the wire and of the owner: a 3 s flap during a long read, a
//! long outage, TCP alone blocked under a long read, and `kill -9` of the
//! owner. Each ends in completed, verified transfers or in a typed error
//! within a stated bound, and the next transfer works.

use std::time::{Duration, Instant};

use ferry::prelude::*;

use crate::common::{PEER_TIMEOUT_ENV, PeerRegion, SILENT_GRACE_ENV};
use crate::peer::{RemotePeer, Wire};
use crate::{STEP, is_peer_lost, is_unfinished, ops, rdma_node, rdma_node_with};

/// The owner's region the faults hit.
const REGION: u64 = 1 << 20;
/// Op size of the reads.
const PIECE: u64 = 64 << 10;
/// Deadline of each read while a fault is on.
const READ_DEADLINE: Duration = Duration::from_secs(30);
/// How late past its deadline a failed submit may report.
const REPORT_SLACK: Duration = Duration::from_secs(2);
/// How long a node takes at most to declare an unreachable peer lost:
/// its liveness bound (`ferry::DEFAULT_PEER_TIMEOUT`, plus one keepalive
/// probe interval) and some slack for TCG.
const DEAD_PEER_BOUND: Duration = Duration::from_secs(30);
/// How long a node takes at most to report the death of a peer whose host
/// stays up (its kernel closes the connections at once).
const KILLED_PEER_BOUND: Duration = Duration::from_secs(2);

/// Reads the owner's whole region into `back` and checks it.
async fn read_and_check(
    node: &Node,
    back: &Region,
    owner: &PeerRegion,
    deadline: Duration,
) -> Result<(), SubmitError> {
    node.submit(ops(back, &owner.handle, PIECE, false), deadline)
        .await?;
    assert!(
        back.to_vec() == owner.original(),
        "the read brought other bytes"
    );
    Ok(())
}

/// A node here, an owner in VM a with a region filled by `seed`, and a
/// local region it has been read into once (so the QP is connected).
async fn connected_owner(seed: u8) -> (Node, RemotePeer, PeerRegion, Region) {
    let node = rdma_node().await;
    let mut owner = RemotePeer::start().await;
    let region = owner
        .process
        .alloc(REGION as usize, Access::ReadWrite, seed)
        .await;
    let back = node.alloc(REGION, Access::ReadWrite).await.unwrap();
    read_and_check(&node, &back, &region, STEP).await.unwrap();
    (node, owner, region, back)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn a_3_second_flap_during_long_reads_completes_or_fails_typed() {
    let wire = Wire::clean();
    let (node, _owner, region, back) = connected_owner(3).await;
    // The owner's end goes down 1 s into the reads, for 3 s.
    let flap = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_secs(1));
        wire.flap(Duration::from_secs(3));
        wire
    });
    let started = Instant::now();
    let (mut completed, mut failed) = (0, 0);
    while started.elapsed() < Duration::from_secs(8) {
        let submitted = Instant::now();
        match read_and_check(&node, &back, &region, READ_DEADLINE).await {
            Ok(()) => completed += 1,
            Err(e) => {
                assert!(
                    is_unfinished(&e),
                    "a typed error of an unfinished read: {e}"
                );
                assert!(
                    submitted.elapsed() <= READ_DEADLINE + REPORT_SLACK,
                    "{e} after {:?}",
                    submitted.elapsed()
                );
                failed += 1;
            }
        }
    }
    let _wire = flap.await.unwrap();
    eprintln!("flap: {completed} reads completed, {failed} failed typed");
    // Healed: the next read works.
    read_and_check(&node, &back, &region, STEP).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn a_long_outage_is_a_typed_error_then_the_same_and_a_fresh_owner_work() {
    let wire = Wire::clean();
    let (node, owner, region, back) = connected_owner(4).await;

    wire.cut();
    let cut = Instant::now();
    let error = read_and_check(&node, &back, &region, STEP)
        .await
        .expect_err("a read across a cut wire");
    let took = cut.elapsed();
    eprintln!("outage: {error} after {took:?}");
    assert!(
        is_peer_lost(&error),
        "the peer is reported lost, not just late: {error}"
    );
    assert!(took <= DEAD_PEER_BOUND, "{error} after {took:?}");

    wire.heal();
    // The same owner, reached again.
    read_and_check(&node, &back, &region, STEP)
        .await
        .unwrap_or_else(|e| panic!("the same owner after the outage: {e}"));
    // A fresh owner.
    owner.kill_9();
    let mut fresh = RemotePeer::start().await;
    let region = fresh
        .process
        .alloc(REGION as usize, Access::ReadWrite, 5)
        .await;
    read_and_check(&node, &back, &region, STEP)
        .await
        .unwrap_or_else(|e| panic!("a fresh owner after the outage: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn kill_9_of_the_owner_is_a_typed_error_within_2_seconds() {
    let _wire = Wire::clean();
    let (node, owner, region, back) = connected_owner(6).await;
    // Reads in a loop; the owner dies under them.
    let reads = async {
        loop {
            if let Err(e) = read_and_check(&node, &back, &region, STEP).await {
                return (e, Instant::now());
            }
        }
    };
    let kill = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        tokio::task::block_in_place(|| owner.kill_9());
        Instant::now()
    };
    let ((error, failed), killed) = tokio::join!(reads, kill);
    let took = failed.saturating_duration_since(killed);
    eprintln!("kill -9: {error} {took:?} after the kill");
    assert!(is_peer_lost(&error), "the owner is reported lost: {error}");
    assert!(took <= KILLED_PEER_BOUND, "{error} {took:?} after the kill");
}

/// Both nodes' peer timeout in the silent-session test: short, so that
/// their sessions go silent early in the long batch.
const SHORT_PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Both nodes' silent grace there: longer than the batch, whatever TCG's
/// speed today.
const LONG_SILENT_GRACE: Duration = Duration::from_secs(40);
/// How long the long batch should take, at the rate measured before it.
const LONG_BATCH: Duration = Duration::from_secs(12);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn reads_still_completing_outlive_a_silent_control_session() {
    let wire = Wire::clean();
    let node = rdma_node_with(|builder| {
        builder
            .peer_timeout(SHORT_PEER_TIMEOUT)
            .silent_grace(LONG_SILENT_GRACE)
    })
    .await;
    let mut owner = RemotePeer::start_with(&[
        (PEER_TIMEOUT_ENV, SHORT_PEER_TIMEOUT.as_millis().to_string()),
        (SILENT_GRACE_ENV, LONG_SILENT_GRACE.as_millis().to_string()),
    ])
    .await;
    let region = owner
        .process
        .alloc(REGION as usize, Access::ReadWrite, 8)
        .await;
    let back = node.alloc(REGION, Access::ReadWrite).await.unwrap();
    // Connects, then times reads of the region to size the long batch:
    // eight rounds in one batch, as the long batch goes. Rounds timed one
    // by one, each checked, ran twice as long as in the batch, which then
    // ended too soon after the session went silent.
    read_and_check(&node, &back, &region, STEP).await.unwrap();
    let timed = Instant::now();
    let probe: Vec<RdmaOp> = (0..8)
        .flat_map(|_| ops(&back, &region.handle, PIECE, false))
        .collect();
    node.submit(probe, STEP).await.unwrap();
    let per_round = timed.elapsed() / 8;
    let rounds = (LONG_BATCH.as_secs_f64() / per_round.as_secs_f64()).ceil() as usize;
    let batch: Vec<RdmaOp> = (0..rounds)
        .flat_map(|_| ops(&back, &region.handle, PIECE, false))
        .collect();
    // The session the queue pair was set up over: it goes silent under
    // the batch.
    let session = node
        .endpoint()
        .session(region.handle.owner(), STEP)
        .await
        .unwrap();
    let ended = tokio::spawn(async move {
        session.closed().await;
        (Instant::now(), session.went_silent())
    });

    // TCP, and so both control sessions, blocked 1 s into the batch; RoCE
    // (UDP) goes on.
    let started = Instant::now();
    let block = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tokio::task::block_in_place(|| wire.block_tcp());
    };
    let (result, ()) = tokio::join!(node.submit(batch, STEP), block);
    let finished = Instant::now();
    result.unwrap_or_else(|e| {
        panic!(
            "{rounds} reads of the region, TCP blocked: {e} after {:?}",
            started.elapsed()
        )
    });
    assert!(
        back.to_vec() == region.original(),
        "the reads brought other bytes"
    );
    assert!(
        ended.is_finished(),
        "the control session was still open when the batch ended, {:?} in: \
         too soon to show anything (raise LONG_BATCH)",
        started.elapsed()
    );
    let (silent_at, went_silent) = ended.await.unwrap();
    assert!(went_silent, "the session was closed, not silent");
    let outlived = finished.saturating_duration_since(silent_at);
    eprintln!(
        "silent session: {rounds} rounds of {per_round:?}, session silent {:?} in, \
         batch done {outlived:?} later",
        silent_at - started
    );
    // Past a peer timeout without progress the initiator would have failed
    // its queue pair: had the owner destroyed its end when its own session
    // went silent, the batch could not have finished this late.
    assert!(
        outlived >= SHORT_PEER_TIMEOUT + Duration::from_secs(1),
        "the batch ended only {outlived:?} after the session went silent: too soon to \
         show that it outlives it (raise LONG_BATCH)"
    );

    // New work needs a new session, which the block prevents.
    let deadline = Duration::from_secs(5);
    let tried = Instant::now();
    let error = read_and_check(&node, &back, &region, deadline)
        .await
        .expect_err("a read needing a new session while TCP is blocked");
    assert!(is_unfinished(&error), "a typed error: {error}");
    assert!(
        tried.elapsed() <= deadline + REPORT_SLACK,
        "{error} after {:?}",
        tried.elapsed()
    );
    wire.heal();
    read_and_check(&node, &back, &region, STEP)
        .await
        .unwrap_or_else(|e| panic!("the same owner once TCP flows again: {e}"));
}
