//! Transfer requests: how KV-cache connectors drive transfers. A request
//! is made once from two prepared lists and two index sequences, then
//! posted (again and again), polled with [`Xfer::status`] once per
//! scheduler step, awaited, or cancelled.
//!
//! The node drives a posted request, not the caller's polling: a task of
//! the node's runtime posts it in slices of at most [`SLICE_OPS`] ops and
//! [`SLICE_BYTES`] bytes, two and up to [`SLICES_IN_FLIGHT`] at a time
//! (the request's *window*), each through the same routing as [`Node::submit`], and sends
//! the notification behind the last slice once every other one is done:
//! the owner sees it only when every byte is in place, without waiting
//! for the initiator to poll (as NIXL's requests do). The ops are built
//! slice by slice from the lists, so a request of 100,000 descriptors
//! holds its index arrays, not 100,000 handles; a slice whose regions are
//! all same-host is not made into ops at all: the memory transport takes
//! its descriptor pairs and plans each region once
//! ([`MemoryBackend::submit_pairs`](ferry_memory::MemoryBackend::submit_pairs)).
//!
//! Cancelling (or dropping the request) stops posting: what is in flight
//! (at most one window) finishes, and its memory stays held until then,
//! as for a timeout; nothing else moves.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{
    DescError, DescIndices, Indices, LocalDescList, OpKind, RdmaTransportLevel, SubmitError,
};
use kameo::message::{Context, Message};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::IntoBody;
use crate::actor::NodeActor;
use crate::estimate::Estimate;
use crate::messages::NotifyError;
use crate::node::Node;
use crate::prepare::PreparedRemote;
use crate::router::Router;

mod drive;

pub(crate) use drive::Expand;
use drive::{Job, Ops, drive};

/// The most ops in one slice of a request.
pub const SLICE_OPS: usize = 1024;
/// The most bytes in one slice of a request (a slice holds at least one op,
/// however long). 16 MiB rather than 4: same-host requests of 64 KiB and
/// 1 MiB blocks moved 15% more per second with the larger slices (fewer
/// hand-offs to copy threads), TCP and the descriptor-bound rows did not
/// change, and a cancelled request may still move two of them.
pub const SLICE_BYTES: u64 = 16 << 20;
/// The most slices of one request in flight at once: its *window*. A
/// cancelled request moves at most this many slices more. Two slices may
/// always be in flight (a link or the copy threads need two 16 MiB slices
/// to stay busy); more only while the bytes in flight stay within
/// [`WINDOW_BYTES`]. A request of small descriptors waits on each slice's
/// round trip, not its bytes (TCP, 16,384 x 64 B: 108 ns per descriptor
/// with two slices in flight, 75 with eight).
pub const SLICES_IN_FLIGHT: usize = 8;
/// Bytes in flight past which no third or later slice starts: eight
/// slices of 8 KiB descriptors. A slice is done when its last byte is, on
/// whichever connection that comes; a request spread over several peers
/// needs enough slices in flight that the connections done first do not
/// wait for the slowest. A KV hand-off from two prefill ranks over TCP
/// (`kv_handoff_bench`, 1,024 x 8 KiB slices over 8 connections) moved
/// 3.46-3.82 GB/s with 8 MiB in flight (median 3.64, 5 runs), 3.14-4.02
/// with 32 and 3.78-4.57 with 64 (median 4.30): 0.93 of the same pieces
/// sent with `writev`/`readv`. One peer's prepared 4 KiB reads and writes,
/// and same-host requests, moved as many bytes either way, within the
/// runs' noise.
pub const WINDOW_BYTES: u64 = 64 << 20;

/// Where a request stands ([`Xfer::status`]). A post moves it from
/// [`Ready`](Self::Ready), [`Done`](Self::Done) or
/// [`Failed`](Self::Failed) to [`InProgress`](Self::InProgress), and the
/// node moves it on to `Done` or `Failed`, never back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XferStatus {
    /// Made, never posted.
    Ready,
    /// Posted; the node is moving it.
    InProgress,
    /// Every op completed, and the notification (if any) was delivered.
    Done,
    /// It failed, timed out or was cancelled; nothing of it is in flight
    /// any more.
    Failed(XferError),
}

/// Why a request failed. Positions are in the request's index arrays.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum XferError {
    /// The transfer failed: an op (its `index` is the position in the
    /// index arrays), the deadline (unfinished ops counted over the whole
    /// request), or the node.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// Every op completed but the notification was not delivered.
    #[error(transparent)]
    Notify(NotifyError),
    /// [`Xfer::cancel`] (or a drop) stopped it after `completed` of
    /// `total` ops. A cancelled request settles once the slices it had in
    /// flight settle: normally within one window's round trip, but against
    /// an owner that stopped answering only at the post's deadline, and
    /// then `unknown` ops (those slices' unfinished ones) may or may not
    /// have moved. The other `total - completed - unknown` never started.
    #[error("cancelled after {completed} of {total} ops ({unknown} with an unknown outcome)")]
    Cancelled {
        /// Ops that completed.
        completed: usize,
        /// Ops in flight when the post's deadline passed: their
        /// destination bytes may be as they were, new, or partly written.
        unknown: usize,
        /// Ops in the request.
        total: usize,
    },
    /// A pair no longer matches its lists. Lists are checked when made and
    /// when deserialized, so only a bug reaches this; it fails the post
    /// instead of a task of the node.
    #[error(transparent)]
    Desc(#[from] DescError),
    /// Awaited without ever being posted.
    #[error("the request was never posted")]
    NotPosted,
}

/// Why a post was refused; the request is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// It is in progress: post it again once it is done or failed.
    #[error("the request is in progress")]
    InProgress,
}

/// Shared by the request and its driver.
struct State {
    status: watch::Sender<XferStatus>,
    /// The current post's cancellation.
    cancel: Mutex<CancellationToken>,
    /// Ops of the current post that completed.
    completed: AtomicUsize,
}

impl State {
    /// Settles the status at `status`, waking whoever waits for it. Only
    /// when someone subscribed ([`Xfer::wait`]): tokio's watch wakes its
    /// eight waiter lists at each send, a lock each, also when nobody
    /// listens (a request polled with [`Xfer::status`], as through NIXL),
    /// which was a tenth of a small same-host post's own cost. A
    /// subscriber counts itself before it first reads the value, under
    /// the lock this write holds: it reads the new value, or is counted
    /// here and woken.
    fn set_status(&self, status: XferStatus) {
        self.status.send_if_modified(|current| {
            *current = status;
            self.status.receiver_count() > 0
        });
    }
}

/// A transfer request ([`Node::make_xfer`]): see the module docs. Dropping
/// it cancels it.
pub struct Xfer {
    job: Arc<Job>,
    state: Arc<State>,
}

impl std::fmt::Debug for Xfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Without expanding a request from a plan: `None` until posted.
        let ops = self.job.ops_made();
        f.debug_struct("Xfer")
            .field("kind", &self.job.kind)
            .field("ops", &ops.map(|o| o.count))
            .field("bytes", &ops.map(|o| o.bytes))
            .field("status", &self.status())
            .finish()
    }
}

impl Node {
    /// A request of `kind` between local descriptor `local_idx[k]` and
    /// remote descriptor `remote_idx[k]` for every position `k`: index
    /// slices (repeats allowed) or ranges. Every index and every pair's
    /// lengths are checked now: an error names the position, and nothing
    /// moves. Posted with [`Xfer::post`].
    ///
    /// Making one is local work and succeeds on a node that was shut down;
    /// its post then fails with `Submit(ShutDown)`. A request of zero
    /// descriptors is valid and moves nothing; a post of it sends its
    /// notification, if it has one, to each owner of the remote list (none
    /// for a list of no regions), then is done.
    pub fn make_xfer(
        &self,
        kind: OpKind,
        local: &LocalDescList,
        local_idx: impl DescIndices,
        remote: &PreparedRemote,
        remote_idx: impl DescIndices,
    ) -> Result<Xfer, DescError> {
        make_xfer(
            &self.0.router,
            kind,
            local,
            local_idx.to_indices(),
            remote,
            remote_idx.to_indices(),
        )
    }

    /// A request whose ops `expand` makes at its first post, on the node's
    /// runtime (see [`deferred_xfer`]).
    pub(crate) fn deferred_xfer(
        &self,
        kind: OpKind,
        remote: &PreparedRemote,
        expand: Arc<Expand>,
    ) -> Xfer {
        deferred_xfer(&self.0.router, kind, remote, expand)
    }

    /// What `xfer` is expected to take, from the requests to its peer over
    /// its transport that completed, or the configured defaults before any
    /// did ([`crate::EstimateMethod`]).
    ///
    /// Where it holds: for requests like those the model learned from (a
    /// few dozen of similar op counts and sizes to that peer, over that
    /// transport). The model separates a fixed cost, a cost per op and a
    /// cost per byte only from requests that differ in those; one far
    /// smaller than any it saw (16 ops of 4 KiB after requests of 16,384)
    /// is an extrapolation of the fixed cost and may be off by multiples,
    /// and its margin, the mean error of recent estimates, does not show
    /// that. A request of no ops, or over a list of no regions, is
    /// estimated for the path of its first region, or for TCP to this node
    /// when it has none: `Configured` until such requests completed.
    pub fn estimate(&self, xfer: &Xfer) -> Estimate {
        let job = &xfer.job;
        let (peer, level) = job.path();
        let (count, bytes) = (xfer.len(), xfer.bytes());
        self.0.router.estimates.estimate(peer, level, count, bytes)
    }
}

fn make_xfer(
    router: &Arc<Router>,
    kind: OpKind,
    local: &LocalDescList,
    local_idx: Indices,
    remote: &PreparedRemote,
    remote_idx: Indices,
) -> Result<Xfer, DescError> {
    let ops = Ops::new(local.clone(), local_idx, remote.clone(), remote_idx)?;
    Ok(new_xfer(
        router,
        kind,
        remote,
        OnceLock::from(Ok(ops)),
        None,
    ))
}

/// A request whose ops `expand` makes when they are first needed: at its
/// first post, on the node's runtime (or on the caller's thread, if it
/// asks for [`Xfer::len`] or [`Xfer::bytes`] first). `remote` names the
/// regions the ops may use, routed and connected.
pub(crate) fn deferred_xfer(
    router: &Arc<Router>,
    kind: OpKind,
    remote: &PreparedRemote,
    expand: Arc<Expand>,
) -> Xfer {
    new_xfer(router, kind, remote, OnceLock::new(), Some(expand))
}

fn new_xfer(
    router: &Arc<Router>,
    kind: OpKind,
    remote: &PreparedRemote,
    ops: OnceLock<Result<Ops, DescError>>,
    expand: Option<Arc<Expand>>,
) -> Xfer {
    let (status, _) = watch::channel(XferStatus::Ready);
    Xfer {
        job: Arc::new(Job {
            router: router.clone(),
            kind,
            remote: remote.clone(),
            ops: Arc::new(ops),
            expand,
            notification: None,
            outcome: None,
        }),
        state: Arc::new(State {
            status,
            cancel: Mutex::new(CancellationToken::new()),
            completed: AtomicUsize::new(0),
        }),
    }
}

impl Xfer {
    /// Sends `notification` to the owner (every owner) of the remote list
    /// once each post has moved every byte, behind the data where the
    /// transport allows (see [`Node::submit_with_notification`]). Applies
    /// from the next post on.
    pub fn with_notification(mut self, notification: impl IntoBody) -> Self {
        self.set_notification(Some(notification.into_body()));
        self
    }

    /// Sets (or, with `None`, clears) the notification each post sends, as
    /// [`Xfer::with_notification`] does, for a request whose notification
    /// changes from post to post (NIXL's `notif_msg` is per post). Applies
    /// from the next post on.
    pub fn set_notification(&mut self, notification: Option<Bytes>) {
        if self.job.notification != notification {
            Arc::make_mut(&mut self.job).notification = notification;
        }
    }

    /// Tells the owners of the memory the request names how each post
    /// ended (completed, failed, cancelled), under `tag`: an owner waiting
    /// with [`Node::wait_outcome`] for this node and `tag` learns it once,
    /// and learns as promptly that this node is gone if it goes first.
    /// Applies from the next post on.
    pub fn with_outcome(mut self, tag: u64) -> Self {
        self.set_outcome(Some(tag));
        self
    }

    /// Sets (or, with `None`, clears) the tag of [`Xfer::with_outcome`].
    pub fn set_outcome(&mut self, tag: Option<u64>) {
        if self.job.outcome != tag {
            Arc::make_mut(&mut self.job).outcome = tag;
        }
    }

    /// Ops in the request. A request from a plan
    /// ([`TransferPlan::request`](crate::TransferPlan::request)) that was
    /// not posted yet expands its descriptors here, on this thread; one
    /// whose expansion failed has none (its posts fail, saying why).
    pub fn len(&self) -> usize {
        self.job.ops().map_or(0, |ops| ops.count)
    }

    /// Whether it has no ops.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes it moves (expanding as [`Xfer::len`] does).
    pub fn bytes(&self) -> u64 {
        self.job.ops().map_or(0, |ops| ops.bytes)
    }

    /// Posts it, to be done within `timeout`: the node moves it from here
    /// on (a task of the node's runtime; this returns at once, also outside
    /// the runtime, though a small same-host request may already be done
    /// when it does), and the status says when it is done. A request that is
    /// done or failed may be posted again, and moves its bytes again.
    pub fn post(&self, timeout: Duration) -> Result<(), PostError> {
        // Under the cancellation's lock: a `cancel` from another thread
        // reaches either the post before this one or this one, whole.
        let mut current = self.state.cancel.lock().unwrap_or_else(|e| e.into_inner());
        let mut refused = false;
        self.state.status.send_if_modified(|status| {
            refused = *status == XferStatus::InProgress;
            if !refused {
                *status = XferStatus::InProgress;
            }
            // Wakes subscribers only, as `State::set_status`.
            !refused && self.state.status.receiver_count() > 0
        });
        if refused {
            return Err(PostError::InProgress);
        }
        // The last post's token serves again unless it was cancelled: no
        // task holds it any more but one past its last use (the status
        // was settled), and a post done within this call needs none.
        if current.is_cancelled() {
            *current = CancellationToken::new();
        }
        drop(current);
        self.state.completed.store(0, Ordering::Relaxed);
        // A small request to same-host owners already mapped is copied
        // here, whole, without the task and its timer (`post_now`).
        let same_host = (self.job.remote.levels().iter()).all(|l| *l == RdmaTransportLevel::Memory);
        if same_host && drive::post_now(&self.job, &self.state) {
            return Ok(());
        }
        // Taken again under the lock: a `cancel` since the status became
        // `InProgress` cancelled this token, and so this post.
        let cancel = (self.state.cancel.lock())
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let (job, state) = (self.job.clone(), self.state.clone());
        let runtime = &self.job.router.runtime;
        let mut driving = Box::pin(drive(job, state, cancel, timeout));
        // A request to same-host owners is polled once here, on the
        // caller's thread, before the runtime takes it: a small copy
        // through a mapping already held finishes at once (the request is
        // done when this returns), instead of waiting for a worker to wake
        // and start it (25 µs of an 8-byte same-host write through NIXL).
        // The task polls it again with its own waker, so nothing that
        // became ready meanwhile is missed. Not over TCP: there the
        // connection's task is woken either way, and a second wake-up for
        // the spawned driver made an 8-byte write slower. Nor for a
        // request from a plan not expanded yet: the runtime expands it.
        if same_host && self.job.ops_made().is_some() {
            let _context = runtime.enter();
            let mut once = std::task::Context::from_waker(std::task::Waker::noop());
            if driving.as_mut().poll(&mut once).is_ready() {
                return Ok(());
            }
        }
        runtime.spawn(driving);
        Ok(())
    }

    /// Where it stands now; never blocks.
    pub fn status(&self) -> XferStatus {
        self.state.status.borrow().clone()
    }

    /// Ops of the current (or last) post that completed so far.
    pub fn completed(&self) -> usize {
        self.state.completed.load(Ordering::Relaxed)
    }

    /// Waits until it is done or failed. Bounded by the post's timeout:
    /// nothing stays in progress past it. After [`Xfer::cancel`] it
    /// returns once the slices in flight settle: at once when nothing was
    /// in flight, within a round trip normally, and at the post's deadline
    /// when the owner stopped answering (see [`XferError::Cancelled`]).
    pub async fn wait(&self) -> Result<(), XferError> {
        let mut status = self.state.status.subscribe();
        let settled = status
            .wait_for(|s| *s != XferStatus::InProgress)
            .await
            .map(|s| s.clone());
        match settled {
            Ok(XferStatus::Done) => Ok(()),
            Ok(XferStatus::Failed(e)) => Err(e),
            Ok(XferStatus::Ready) => Err(XferError::NotPosted),
            // The sender lives in `self.state`: it cannot have gone.
            Ok(XferStatus::InProgress) | Err(_) => unreachable!("waited for a settled status"),
        }
    }

    /// Stops the current post: nothing more is put on the wire; what is in
    /// flight (at most one window) finishes or reaches the post's deadline,
    /// then the status is [`XferError::Cancelled`] (or `Done`, if it was
    /// the last of it), with the ops whose outcome is unknown counted.
    pub fn cancel(&self) {
        self.state
            .cancel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cancel();
    }
}

impl Drop for Xfer {
    fn drop(&mut self) {
        // Only a post in progress has a task to stop. A settled one's
        // task has nothing left to do, and cancelling its token wakes the
        // token's waiters under a lock: a fifth of what releasing a small
        // request through NIXL costs ferry. A post that settles after this
        // look is cancelled to no effect.
        if *self.state.status.borrow() == XferStatus::InProgress {
            self.cancel();
        }
    }
}

/// Asks a [`NodeActor`] for a request ([`Node::make_xfer`]); the worker
/// posts and polls the [`Xfer`] it gets itself.
#[derive(Clone, Debug)]
pub struct MakeXfer {
    /// Read or write.
    pub kind: OpKind,
    /// The local list.
    pub local: LocalDescList,
    /// Its descriptors to use, in order.
    pub local_idx: Indices,
    /// The remote list, prepared.
    pub remote: PreparedRemote,
    /// Its descriptors to use, in order.
    pub remote_idx: Indices,
    /// Sent to the remote owner once each post is done.
    pub notification: Option<Bytes>,
}

impl Message<MakeXfer> for NodeActor {
    type Reply = Result<Xfer, DescError>;

    async fn handle(&mut self, msg: MakeXfer, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let xfer = make_xfer(
            &self.router,
            msg.kind,
            &msg.local,
            msg.local_idx,
            &msg.remote,
            msg.remote_idx,
        )?;
        Ok(match msg.notification {
            Some(body) => xfer.with_notification(body),
            None => xfer,
        })
    }
}
