//! Both sides learn how a request ended: a reader tags its request
//! (`Xfer::with_outcome`), and the owner of the memory waits for it by the
//! reader and the tag (`Node::wait_outcome`), getting exactly one answer:
//! completed (after the bytes), failed or cancelled by the reader, or the
//! reader lost, as soon as it is gone and not at the deadline.

use std::time::Duration;

use ferry::prelude::*;
use ferry::{Descs, LocalDescList, Outcome, OutcomeError, RemoteDescList, Xfer};

use crate::common::{PeerProcess, pattern, signal, stop};

const DEADLINE: Duration = Duration::from_secs(30);

async fn tcp_node() -> Node {
    Node::builder()
        .ibverbs(false)
        .memory(false)
        .spawn()
        .await
        .unwrap()
}

/// A request from `reader` over each of `remotes` whole, into a region of
/// its own, of `kind`.
async fn request(reader: &Node, kind: OpKind, remotes: &[RemoteBuffer]) -> Xfer {
    let len: u64 = remotes.iter().map(RemoteBuffer::len).sum();
    let local = reader.alloc(len, Access::ReadWrite).await.unwrap();
    local.write_at(0, &pattern(len as usize, 9)).unwrap();
    let (mut l, mut r) = (Descs::new(), Descs::new());
    let mut at = 0;
    for (i, remote) in remotes.iter().enumerate() {
        l.push(0, at, remote.len());
        r.push(i as u32, 0, remote.len());
        at += remote.len();
    }
    let n = remotes.len();
    let remote = RemoteDescList::new(remotes.to_vec(), r).unwrap();
    let prepared = reader.prepare_remote(remote, DEADLINE).await.unwrap();
    let local = LocalDescList::new(vec![local], l).unwrap();
    reader
        .make_xfer(kind, &local, 0..n, &prepared, 0..n)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_hears_a_completed_read_once() {
    let (owner, reader) = (tcp_node().await, tcp_node().await);
    let blocks = owner.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    blocks.write_at(0, &pattern(1 << 20, 3)).unwrap();
    let waiting = {
        let (owner, reader) = (owner.clone(), reader.addr());
        tokio::spawn(async move { owner.wait_outcome(reader, 7, DEADLINE).await })
    };
    let xfer = request(&reader, OpKind::Read, &[blocks.remote()])
        .await
        .with_outcome(7);
    xfer.post(DEADLINE).unwrap();
    xfer.wait().await.unwrap();
    assert_eq!(waiting.await.unwrap(), Ok(Outcome::Completed));
    // Once: a second wait for the same request hears nothing more.
    let again = owner
        .wait_outcome(reader.addr(), 7, Duration::from_millis(300))
        .await;
    assert!(
        matches!(again, Err(OutcomeError::Timeout { .. })),
        "{again:?}"
    );

    // Told before anyone waited: kept, and given to the first wait.
    let xfer = request(&reader, OpKind::Read, &[blocks.remote()])
        .await
        .with_outcome(8);
    xfer.post(DEADLINE).unwrap();
    xfer.wait().await.unwrap();
    assert_eq!(
        owner.wait_outcome(reader.addr(), 8, DEADLINE).await,
        Ok(Outcome::Completed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_hears_a_failed_request() {
    let (owner, reader) = (tcp_node().await, tcp_node().await);
    let region = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    // A write through a read-only handle: refused by the owner.
    let xfer = request(&reader, OpKind::Write, &[region.remote().read_only()])
        .await
        .with_outcome(1);
    xfer.post(DEADLINE).unwrap();
    assert!(xfer.wait().await.is_err());
    match owner.wait_outcome(reader.addr(), 1, DEADLINE).await {
        Ok(Outcome::Failed { reason }) => assert!(!reason.is_empty()),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_owner_hears_a_cancelled_request() {
    let (owner, reader) = (tcp_node().await, tcp_node().await);
    let here = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    // A second owner, stopped, whose 128 MiB in 16 KiB ops take twice
    // the bytes one window holds (WINDOW_BYTES): the slices past the
    // window cannot start before the cancel, so the request ends
    // cancelled, not done.
    let mut stopped = PeerProcess::spawn().await;
    let len = 2 * ferry::WINDOW_BYTES;
    let there = stopped.alloc(len as usize, Access::ReadWrite, 1).await;
    let ops = len >> 14;
    let pieces: Vec<RemoteBuffer> = std::iter::once(here.remote())
        .chain((0..ops).map(|k| there.handle.slice(k << 14..(k + 1) << 14).unwrap()))
        .collect();
    let xfer = request(&reader, OpKind::Write, &pieces)
        .await
        .with_outcome(5);
    let pid = stopped.pid().unwrap();
    stop(pid).await;
    let waiting = {
        let (owner, reader) = (owner.clone(), reader.addr());
        tokio::spawn(async move { owner.wait_outcome(reader, 5, DEADLINE).await })
    };
    xfer.post(DEADLINE).unwrap();
    xfer.cancel();
    signal(pid, "CONT");
    let ended = xfer.wait().await;
    assert!(
        matches!(ended, Err(ferry::XferError::Cancelled { .. })),
        "{ended:?}"
    );
    assert_eq!(waiting.await.unwrap(), Ok(Outcome::Cancelled));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_dies_is_lost_at_once_not_at_the_deadline() {
    let owner = tcp_node().await;
    let mut reader = PeerProcess::spawn().await;
    let reader_addr = reader.node_addr().await.unwrap();
    let waiting = {
        let owner = owner.clone();
        tokio::spawn(async move { owner.wait_outcome(reader_addr, 11, DEADLINE).await })
    };
    // The owner's session to the reader is open once the reader serves it.
    let opened = std::time::Instant::now();
    while owner.peer_tables().live_sessions == 0 {
        assert!(opened.elapsed() < DEADLINE, "no session to the reader");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reader.kill().await;
    let lost = waiting.await.unwrap();
    assert!(
        matches!(lost, Err(OutcomeError::ReaderLost { .. })),
        "{lost:?}"
    );
    // And a reader that is gone before the wait: lost at once too.
    let again = owner.wait_outcome(reader_addr, 12, DEADLINE).await;
    assert!(
        matches!(again, Err(OutcomeError::ReaderLost { .. })),
        "{again:?}"
    );
}
