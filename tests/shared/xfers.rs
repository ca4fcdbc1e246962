//! Transfer requests' life, checked the same way over each transport:
//! status moves forward only, a re-post moves the bytes again, bad input is
//! refused before anything moves, a cancelled request moves at most one
//! window more, a dropped one holds its memory until its last byte landed,
//! and a peer restarted between prepare and post is refused typed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry::prelude::*;
use ferry::{
    DescError, Descs, LocalDescList, MemoryBlock, PostError, PreparedRemote, RemoteDescList,
    SLICE_OPS, SLICES_IN_FLIGHT, WINDOW_BYTES, Xfer, XferError, XferStatus,
};

use crate::common::{LISTEN_ENV, PeerProcess, PeerRegion, digest, pattern, signal, stop, stopped};

const BLOCK: u64 = 4096;
const DEADLINE: Duration = Duration::from_secs(60);

/// A local list of `blocks` blocks over a region filled with
/// `pattern(.., seed)`, and the region.
async fn local_blocks(node: &Node, blocks: u32, seed: u8) -> (Region, LocalDescList, Vec<u8>) {
    let len = BLOCK * u64::from(blocks);
    let region = node.alloc(len, Access::ReadWrite).await.unwrap();
    let data = pattern(len as usize, seed);
    region.write_at(0, &data).unwrap();
    let list = LocalDescList::new(
        vec![region.clone()],
        Descs::strided(0, 0, BLOCK, BLOCK, blocks),
    )
    .unwrap();
    (region, list, data)
}

/// A prepared list of `blocks` blocks over the peer's region `handle`.
async fn remote_blocks(node: &Node, handle: &RemoteBuffer, blocks: u32) -> PreparedRemote {
    let descs = Descs::strided(0, 0, BLOCK, BLOCK, blocks);
    let list = RemoteDescList::new(vec![handle.clone()], descs).unwrap();
    node.prepare_remote(list, DEADLINE).await.unwrap()
}

/// A request writing `blocks` local blocks filled with `pattern(.., seeds.1)`
/// over as many blocks of a new peer region filled with
/// `pattern(.., seeds.0)`: the peer's region, the local region and its
/// bytes, the prepared remote list, and the request (not posted).
#[allow(dead_code)] // tests/ibverbs runs only the first test
async fn block_writes(
    node: &Node,
    peer: &mut PeerProcess,
    blocks: u32,
    seeds: (u8, u8),
) -> (PeerRegion, Region, Vec<u8>, PreparedRemote, Xfer) {
    let len = BLOCK as usize * blocks as usize;
    let target = peer.alloc(len, Access::ReadWrite, seeds.0).await;
    let (local, locals, data) = local_blocks(node, blocks, seeds.1).await;
    let prepared = remote_blocks(node, &target.handle, blocks).await;
    let xfer = node
        .make_xfer(
            OpKind::Write,
            &locals,
            0..blocks as usize,
            &prepared,
            0..blocks as usize,
        )
        .unwrap();
    (target, local, data, prepared, xfer)
}

/// Status moves Ready → InProgress → Done and never back, a post while in
/// progress is refused, a re-post moves new bytes, and bad descriptors and
/// indices are refused with their positions while nothing moves.
pub async fn a_request_lives_posts_again_and_refuses_bad_input(
    node: &Node,
    peer: &mut PeerProcess,
    route: RdmaTransportLevel,
) {
    let blocks = 4096;
    let target = peer
        .alloc((BLOCK * blocks) as usize, Access::ReadWrite, 1)
        .await;
    let (local, locals, data) = local_blocks(node, blocks as u32, 2).await;
    let prepared = remote_blocks(node, &target.handle, blocks as u32).await;
    assert_eq!(prepared.levels(), [route]);

    // Bad input: nothing moves.
    let mut bad = Descs::new();
    bad.push(0, 0, BLOCK);
    bad.push(0, BLOCK * blocks - 1, 2);
    assert_eq!(
        LocalDescList::new(vec![local.clone()], bad).unwrap_err(),
        DescError::Descriptor {
            index: 1,
            error: OpError::OutOfBounds {
                offset: BLOCK * blocks - 1,
                len: 2,
                bound: BLOCK * blocks
            }
        }
    );
    let out_of_range = [0u32, 1, blocks as u32];
    assert_eq!(
        node.make_xfer(OpKind::Write, &locals, 0..3, &prepared, &out_of_range[..])
            .unwrap_err(),
        DescError::IndexOutOfRange {
            position: 2,
            index: blocks,
            len: blocks as usize
        }
    );
    assert_eq!(peer.digest(&target).await, digest(&target.original()));

    let xfer = node
        .make_xfer(
            OpKind::Write,
            &locals,
            0..blocks as usize,
            &prepared,
            0..blocks as usize,
        )
        .unwrap();
    assert_eq!(xfer.status(), XferStatus::Ready);
    assert_eq!(xfer.wait().await, Err(XferError::NotPosted));
    let estimate = node.estimate(&xfer);
    assert_eq!(estimate.method, ferry::EstimateMethod::Configured);
    // Posting again while in progress is refused. On a loaded machine a
    // one-slice same-host request can be done before this thread posts
    // again (and the second post then starts it over): try again, a few
    // times, until the refusal is seen.
    let mut refused = false;
    let mut posts = 0;
    for _ in 0..20 {
        xfer.post(DEADLINE).unwrap();
        posts += 1;
        match xfer.post(DEADLINE) {
            Err(PostError::InProgress) => {
                refused = true;
                break;
            }
            second => second.unwrap(),
        }
        posts += 1;
        xfer.wait().await.unwrap();
    }
    assert!(refused, "a post while in progress was never refused");
    // Polled as a scheduler would: in progress, then done, never back.
    let mut seen = vec![xfer.status()];
    while *seen.last().unwrap() == XferStatus::InProgress {
        tokio::time::sleep(Duration::from_micros(200)).await;
        let now = xfer.status();
        if now != *seen.last().unwrap() {
            seen.push(now);
        }
    }
    // A same-host request of one slice may be done before the first poll
    // (post returns once its first window is on its way, which here is all
    // of it): then the poller sees Done alone, still never going back.
    let sequence = [XferStatus::InProgress, XferStatus::Done];
    assert!(sequence.ends_with(&seen), "{seen:?}");
    assert_eq!(xfer.status(), XferStatus::Done, "stays done");
    assert_eq!(xfer.completed(), blocks as usize);
    assert_eq!(peer.digest(&target).await, digest(&data));

    // A re-post moves the bytes again: new ones.
    let again = pattern(data.len(), 3);
    local.write_at(0, &again).unwrap();
    xfer.post(DEADLINE).unwrap();
    xfer.wait().await.unwrap();
    assert_eq!(peer.digest(&target).await, digest(&again));
    // Completed requests taught the estimate (all but the first, which
    // paid one-time costs).
    for _ in 0..3 {
        xfer.post(DEADLINE).unwrap();
        xfer.wait().await.unwrap();
    }
    let samples = posts + 4 - 1;
    let estimate = node.estimate(&xfer);
    assert_eq!(estimate.method, ferry::EstimateMethod::Measured { samples });
    assert!(
        !estimate.duration.is_zero() && estimate.transport == route,
        "{estimate:?}"
    );
    peer.drop_region(&target).await;
}

/// A request cancelled right after its post moves no more than one window
/// (counted in the owner's memory: the blocks that hold the new bytes),
/// and exactly the ops it reports completed, and moves them all when
/// posted again; one dropped right after its post keeps its memory
/// (`from_raw` here) until its last byte landed, and stops as a cancelled
/// one does.
#[allow(dead_code)] // tests/ibverbs runs only the first
pub async fn a_cancelled_request_moves_at_most_one_window(node: &Node, peer: &mut PeerProcess) {
    let blocks = 32 * 1024u32;
    let len = BLOCK as usize * blocks as usize;
    let (target, _, data, prepared, xfer) = block_writes(node, peer, blocks, (4, 5)).await;
    xfer.post(DEADLINE).unwrap();
    xfer.cancel();
    let at_cancel = xfer.completed();
    let Err(XferError::Cancelled {
        completed, total, ..
    }) = xfer.wait().await
    else {
        panic!("expected a cancelled request, got {:?}", xfer.status());
    };
    assert_eq!(total, blocks as usize);
    // One window: two slices, or more within so many bytes.
    let window = (SLICES_IN_FLIGHT * SLICE_OPS)
        .min((2 * SLICE_OPS).max((WINDOW_BYTES / BLOCK) as usize + SLICE_OPS));
    assert!(
        completed <= at_cancel + window,
        "{completed} ops completed, {at_cancel} at cancel"
    );
    // The owner's memory: every block is either new (moved) or as it was.
    let back = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let read = RdmaOp::read(back.whole(), target.handle.clone());
    node.submit(vec![read], DEADLINE).await.unwrap();
    let moved = blocks_moved(&back.to_vec(), &data, &target.original());
    assert_eq!(moved, completed, "blocks moved against ops reported");
    // Posted again, the cancelled request moves every block.
    xfer.post(DEADLINE).unwrap();
    xfer.wait()
        .await
        .expect("a cancelled request posted again is done");
    assert!(
        peer.contents(&target).await == data,
        "the re-post left blocks unmoved"
    );

    // Dropped in flight: the memory is held until the transfer let go.
    let released = Arc::new(AtomicBool::new(false));
    let mut buffer = vec![0u8; len].into_boxed_slice();
    let ptr = std::ptr::NonNull::new(buffer.as_mut_ptr()).unwrap();
    /// Frees its buffer when dropped, after raising its flag.
    struct Flag(Arc<AtomicBool>, #[allow(dead_code)] Box<[u8]>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    // SAFETY: the buffer lives in the keep-alive, freed only once ferry
    // drops it.
    let memory =
        unsafe { MemoryBlock::from_raw(ptr, len as u64, Box::new(Flag(released.clone(), buffer))) }
            .unwrap();
    let raw = node.register(memory, Access::ReadWrite).await.unwrap();
    let raw_list = LocalDescList::new(
        vec![raw.clone()],
        Descs::strided(0, 0, BLOCK, BLOCK, blocks),
    )
    .unwrap();
    let reading = node
        .make_xfer(
            OpKind::Read,
            &raw_list,
            0..blocks as usize,
            &prepared,
            0..blocks as usize,
        )
        .unwrap();
    reading.post(DEADLINE).unwrap();
    let closing = raw.closing();
    drop((reading, raw_list));
    closing
        .wait(tokio::time::Instant::now() + DEADLINE)
        .await
        .expect("released once the request let go");
    assert!(released.load(Ordering::Acquire));
    peer.drop_region(&target).await;

    // Dropped in flight, a write stops as a cancelled one does: once it
    // let go of its memory, at most a window more than it had completed
    // at the drop moved.
    let (target, local, data, _, writing) = block_writes(node, peer, blocks, (6, 7)).await;
    writing.post(DEADLINE).unwrap();
    let at_drop = writing.completed();
    let closing = local.closing();
    drop(writing);
    closing
        .wait(tokio::time::Instant::now() + DEADLINE)
        .await
        .expect("released once the dropped request let go");
    let moved = blocks_moved(&peer.contents(&target).await, &data, &target.original());
    assert!(
        moved <= at_drop + window,
        "{moved} blocks moved after a drop at {at_drop} of {blocks}"
    );
    peer.drop_region(&target).await;
}

/// A request cancelled while its owner is stopped (`SIGSTOP`) ends
/// `Cancelled`, not `Timeout`: the caller asked to stop, and is told which
/// ops' outcome is unknown (those in flight when the deadline passed). Once
/// the owner runs again, at least `completed` blocks are new and no more
/// than `completed + unknown` changed.
#[allow(dead_code)] // a stopped owner stalls only the TCP path
pub async fn a_request_cancelled_against_a_stopped_owner_ends_cancelled(
    node: &Node,
    peer: &mut PeerProcess,
) {
    let blocks = 1024u32;
    let (target, _, data, _, xfer) = block_writes(node, peer, blocks, (5, 6)).await;
    // One read, so that the connections exist before the stop.
    let scratch = node.alloc(BLOCK, Access::ReadWrite).await.unwrap();
    let first = target.handle.slice(0..BLOCK).unwrap();
    let warm_up = RdmaOp::read(scratch.whole(), first);
    node.submit(vec![warm_up], DEADLINE).await.unwrap();

    let pid = peer.pid().expect("a local peer process");
    stop(pid).await;
    let timeout = Duration::from_secs(2);
    xfer.post(timeout).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    xfer.cancel();
    let settled = xfer.wait().await;
    // If the owner ran meanwhile, the outcome says nothing about ferry.
    let still_stopped = stopped(pid);
    signal(pid, "CONT");
    assert!(
        still_stopped,
        "the owner ran while it should have been stopped"
    );
    let Err(XferError::Cancelled {
        completed,
        unknown,
        total,
    }) = settled
    else {
        panic!("expected Cancelled, got {settled:?}");
    };
    assert_eq!(total, blocks as usize);
    assert!(unknown > 0, "the stopped owner left ops in flight");
    assert!(
        completed + unknown <= total,
        "{completed} + {unknown} > {total}"
    );

    // A completed op's block is new; an unknown one's may be new, as it
    // was, or torn (the owner took part of its payload before the
    // connection closed); every other block is as it was.
    let now = peer.contents(&target).await;
    let original = target.original();
    let (mut moved, mut touched) = (0, 0);
    for i in 0..blocks as usize {
        if block(&now, i) == block(&data, i) {
            moved += 1;
        }
        if block(&now, i) != block(&original, i) {
            touched += 1;
        }
    }
    assert!(
        moved >= completed,
        "{moved} blocks moved, {completed} reported"
    );
    assert!(
        touched <= completed + unknown,
        "{touched} blocks changed, {completed} completed and {unknown} unknown"
    );
}

#[allow(dead_code)] // tests/ibverbs runs only the first
fn block(bytes: &[u8], i: usize) -> &[u8] {
    &bytes[i * BLOCK as usize..(i + 1) * BLOCK as usize]
}

/// How many blocks of the owner's bytes `now` hold the written `data`;
/// every other block must still hold its `original` bytes.
#[allow(dead_code)] // tests/ibverbs runs only the first test
fn blocks_moved(now: &[u8], data: &[u8], original: &[u8]) -> usize {
    (0..now.len() / BLOCK as usize)
        .filter(|&i| {
            assert!(
                block(now, i) == block(data, i) || block(now, i) == block(original, i),
                "block {i}"
            );
            block(now, i) == block(data, i)
        })
        .count()
}

/// A peer restarted (same address, new node id) between prepare and post:
/// the post fails typed, and the new process's memory is untouched. Both
/// incarnations listen on one free port, with `env` besides.
#[allow(dead_code)] // tests/ibverbs runs only the first
pub async fn a_peer_restarted_after_prepare_is_refused_typed(node: &Node, env: &[(&str, &str)]) {
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let env = [env, &[(LISTEN_ENV, listen.as_str())]].concat();
    let env = env.as_slice();
    let mut peer = PeerProcess::spawn_with_env(env).await;
    let len = 64 * BLOCK as usize;
    let old = peer.alloc(len, Access::ReadWrite, 6).await;
    let (_, locals, _) = local_blocks(node, 64, 7).await;
    let prepared = remote_blocks(node, &old.handle, 64).await;
    let xfer = node
        .make_xfer(OpKind::Write, &locals, 0..64, &prepared, 0..64)
        .unwrap();
    peer.kill().await;
    let mut again = PeerProcess::spawn_with_env(env).await;
    let new = again.alloc(len, Access::ReadWrite, 8).await;
    assert_eq!(new.handle.owner().endpoint, old.handle.owner().endpoint);
    for _ in 0..2 {
        xfer.post(DEADLINE).unwrap();
        match xfer.wait().await {
            Err(XferError::Submit(SubmitError::Op {
                error: OpError::UnknownNode { expected, .. },
                ..
            })) => assert_eq!(expected, old.handle.owner().id),
            other => panic!("expected UnknownNode, got {other:?}"),
        }
    }
    assert_eq!(again.digest(&new).await, digest(&new.original()));
}

/// A request of one slice to a same-host region already mapped is done
/// when its post returns (copied on the caller's thread), counts its ops
/// and teaches the estimate like any other; after the owner dropped the
/// region, the same request fails typed, naming its first op, and moves
/// nothing into the region that took the slot.
#[allow(dead_code)] // only the memory transport copies within the post
pub async fn a_small_same_host_request_is_done_when_its_post_returns(
    node: &Node,
    peer: &mut PeerProcess,
) {
    let blocks = 16;
    let (target, _, data, prepared, xfer) = block_writes(node, peer, blocks, (6, 7)).await;
    for post in 1..=3 {
        xfer.post(DEADLINE).unwrap();
        assert_eq!(xfer.status(), XferStatus::Done, "post {post}");
        assert_eq!(xfer.completed(), blocks as usize);
    }
    assert_eq!(peer.digest(&target).await, digest(&data));
    let estimate = node.estimate(&xfer);
    assert_eq!(
        estimate.method,
        ferry::EstimateMethod::Measured { samples: 2 },
        "{estimate:?}"
    );

    // Read back into fresh local blocks: done at once too, same bytes.
    let (back, backs, _) = local_blocks(node, blocks, 8).await;
    let read = node
        .make_xfer(
            OpKind::Read,
            &backs,
            0..blocks as usize,
            &prepared,
            0..blocks as usize,
        )
        .unwrap();
    read.post(DEADLINE).unwrap();
    assert_eq!(read.status(), XferStatus::Done);
    assert_eq!(back.to_vec(), data);

    // The region dropped, and its slot taken by a new one: the request
    // goes the slow way and is refused there.
    peer.drop_region(&target).await;
    let new = peer
        .alloc(BLOCK as usize * blocks as usize, Access::ReadWrite, 9)
        .await;
    xfer.post(DEADLINE).unwrap();
    match xfer.wait().await {
        Err(XferError::Submit(SubmitError::Op { index: 0, error })) => assert!(
            matches!(
                error,
                OpError::StaleGeneration { .. } | OpError::UnknownRegion
            ),
            "{error:?}"
        ),
        other => panic!("a write to a dropped region: {other:?}"),
    }
    assert_eq!(peer.digest(&new).await, digest(&new.original()));
    peer.drop_region(&new).await;
}
