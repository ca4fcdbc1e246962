//! A NIXL request, made before the peer it names may be reachable.
//!
//! NIXL's callers make and post requests on the thread that schedules
//! their model (vLLM, SGLang), so no call of the plugin may wait on the
//! network: a request over a peer's memory that is not prepared yet
//! (connected, routed, mapped) is made at once all the same, and waits for
//! its preparation in the background. Posted meanwhile, it is in progress
//! until the preparation ends and its bytes have moved, or failed when the
//! preparation fails or the post's deadline passes first, as UCX's
//! requests stay in progress while their endpoint wires up.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferry::prelude::*;
use ferry::{Bytes, LocalDescList, PreparedRemote, RemoteDescList, Xfer, XferStatus};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::warn;

use crate::engine::{Status, status_of};

/// A preparation's outcome, once it has one: shared by every request over
/// the same memory ([`Preparing`]).
pub(crate) type Prepared = Option<Result<PreparedRemote, Status>>;

/// A preparation of a peer's memory under way or ended, watched by the
/// requests made over it.
pub(crate) type Preparing = watch::Receiver<Prepared>;

/// Starts preparing `list` on `node` in the background, within `deadline`.
pub(crate) fn prepare(
    runtime: &tokio::runtime::Handle,
    node: &Node,
    list: RemoteDescList,
    deadline: Duration,
) -> Preparing {
    let (done, preparing) = watch::channel(None);
    let node = node.clone();
    runtime.spawn(async move {
        let outcome = node.prepare_remote(list, deadline).await.map_err(|e| {
            warn!("FERRY: preparing a peer's memory: {e}");
            match e {
                ferry::PrepareError::Connect { .. } => Status::RemoteDisconnect,
                _ => Status::Backend,
            }
        });
        done.send_replace(Some(outcome));
    });
    preparing
}

/// Whether a preparation ended in failure (a new one is due).
pub(crate) fn failed(preparing: &Preparing) -> bool {
    matches!(*preparing.borrow(), Some(Err(_)))
}

/// A prepared transfer ([`crate::engine::Engine::prep`]).
pub struct Request {
    stage: Arc<Mutex<Stage>>,
    /// Every id its descriptors name: checked again at each post.
    pub(crate) local: Vec<u64>,
    pub(crate) remote: Vec<u64>,
}

/// Where a request stands, in NIXL's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Made, not posted (or released before its preparation ended).
    Ready,
    /// Posted; not done.
    InProgress,
    /// Done.
    Done,
    /// Failed, with NIXL's status.
    Failed(Status),
}

enum Stage {
    /// Waiting for its peer's memory to be prepared.
    Unmade(Box<Unmade>),
    /// Made: a ferry request.
    Made(Xfer),
}

/// A request whose remote memory is still being prepared.
struct Unmade {
    kind: OpKind,
    local: LocalDescList,
    remote: RemoteDescList,
    preparing: Preparing,
    /// Set while posted: the notification and the post's deadline.
    posted: Option<(Option<Bytes>, Instant)>,
    /// How the last post ended, when it ended before the request was made.
    failed: Option<Status>,
    /// Counts posts and releases, so that a waiter of an earlier post
    /// leaves a later one alone.
    generation: u64,
}

impl Request {
    /// A request made now: its remote memory is prepared.
    pub(crate) fn made(xfer: Xfer, local: Vec<u64>, remote: Vec<u64>) -> Request {
        Request {
            stage: Arc::new(Mutex::new(Stage::Made(xfer))),
            local,
            remote,
        }
    }

    /// A request to be made once `preparing` ends.
    pub(crate) fn unmade(
        kind: OpKind,
        local_list: LocalDescList,
        remote_list: RemoteDescList,
        preparing: Preparing,
        local: Vec<u64>,
        remote: Vec<u64>,
    ) -> Request {
        Request {
            stage: Arc::new(Mutex::new(Stage::Unmade(Box::new(Unmade {
                kind,
                local: local_list,
                remote: remote_list,
                preparing,
                posted: None,
                failed: None,
                generation: 0,
            })))),
            local,
            remote,
        }
    }

    fn stage(&self) -> MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where it stands, having moved on to the made request if its
    /// preparation has ended.
    pub(crate) fn standing(&self, node: &Node) -> Standing {
        let mut stage = self.stage();
        advance(&mut stage, node, None);
        match &*stage {
            Stage::Made(xfer) => match xfer.status() {
                XferStatus::Ready => Standing::Ready,
                XferStatus::InProgress => Standing::InProgress,
                XferStatus::Done => Standing::Done,
                XferStatus::Failed(e) => {
                    warn!("FERRY: transfer failed: {e}");
                    Standing::Failed(status_of(&e))
                }
            },
            Stage::Unmade(unmade) => match (&unmade.posted, unmade.failed) {
                (Some(_), _) => Standing::InProgress,
                (None, Some(status)) => Standing::Failed(status),
                (None, None) => Standing::Ready,
            },
        }
    }

    /// Posts it with `notif` within `deadline`. `post` starts a made
    /// request (on the caller's thread when it may drive, see
    /// [`crate::drive`]); one still waiting for its preparation is posted
    /// when that ends, by a task on `runtime`, or fails. `again` starts a
    /// new preparation when the last one failed.
    pub(crate) fn post(
        &self,
        node: &Node,
        runtime: &tokio::runtime::Handle,
        notif: Option<Bytes>,
        deadline: Duration,
        again: impl FnOnce(&RemoteDescList) -> Preparing,
        post: impl FnOnce(&Xfer) -> Result<(), ferry::PostError>,
    ) -> Status {
        let mut stage = self.stage();
        advance(&mut stage, node, None);
        let unmade = match &mut *stage {
            Stage::Made(xfer) => {
                if xfer.status() == XferStatus::InProgress {
                    return Status::RepostActive;
                }
                xfer.set_notification(notif);
                if post(xfer).is_err() {
                    return Status::RepostActive;
                }
                // Done within the post (a small same-host copy): NIXL takes
                // `Success` from postXfer as complete, and skips the checks.
                // A failure is the checks' to report.
                return match xfer.status() {
                    XferStatus::Done => Status::Success,
                    _ => Status::InProgress,
                };
            }
            Stage::Unmade(unmade) => unmade,
        };
        if unmade.posted.is_some() {
            return Status::RepostActive;
        }
        if failed(&unmade.preparing) {
            unmade.preparing = again(&unmade.remote);
        }
        let ends = Instant::now() + deadline;
        unmade.posted = Some((notif, ends));
        unmade.failed = None;
        unmade.generation += 1;
        let (generation, mut preparing) = (unmade.generation, unmade.preparing.clone());
        advance(&mut stage, node, None);
        if let Stage::Unmade(_) = &*stage {
            let (stage, node) = (self.stage.clone(), node.clone());
            runtime.spawn(async move {
                // Ends when the preparation does, or at the post's deadline;
                // either way the request then moves on (or fails).
                let _ = tokio::time::timeout_at(ends, preparing.wait_for(Option::is_some)).await;
                let mut stage = stage.lock().unwrap_or_else(|e| e.into_inner());
                advance(&mut stage, &node, Some(generation));
            });
        }
        Status::InProgress
    }

    /// `releaseReqH`: `Success` when the request may be freed; a made one
    /// still in progress is cancelled and answered `RepostActive` (NIXL
    /// keeps the handle), since its window may still be moving bytes. One
    /// waiting for its preparation has moved nothing: it is released.
    pub(crate) fn release(&self) -> Status {
        let mut stage = self.stage();
        match &mut *stage {
            Stage::Made(xfer) if xfer.status() == XferStatus::InProgress => {
                xfer.cancel();
                Status::RepostActive
            }
            Stage::Made(_) => Status::Success,
            Stage::Unmade(unmade) => {
                unmade.posted = None;
                unmade.generation += 1;
                Status::Success
            }
        }
    }

    /// The made request, for an estimate; `None` while it waits for its
    /// preparation.
    pub(crate) fn with_xfer<T>(&self, f: impl FnOnce(&Xfer) -> T) -> Option<T> {
        match &*self.stage() {
            Stage::Made(xfer) => Some(f(xfer)),
            Stage::Unmade(_) => None,
        }
    }
}

/// Moves an unmade request on once its preparation has ended: made, and
/// posted if it was; or failed, if it was posted and the preparation
/// failed or the post's deadline passed. `waiter`: the post a background
/// waiter was started for; it does nothing for another.
fn advance(stage: &mut Stage, node: &Node, waiter: Option<u64>) {
    let Stage::Unmade(unmade) = stage else {
        return;
    };
    if waiter.is_some_and(|generation| generation != unmade.generation) {
        return;
    }
    let outcome = unmade.preparing.borrow().clone();
    let prepared = match outcome {
        Some(Ok(prepared)) => prepared,
        Some(Err(status)) => {
            if unmade.posted.take().is_some() {
                unmade.failed = Some(status);
            }
            return;
        }
        None => {
            if let Some((_, ends)) = unmade.posted
                && Instant::now() >= ends
            {
                warn!("FERRY: the peer was not reached within the deadline");
                unmade.posted = None;
                unmade.failed = Some(Status::RemoteDisconnect);
            }
            return;
        }
    };
    let n = unmade.local.descs().len();
    let made = prepared
        .with_descs(unmade.remote.descs().clone())
        .and_then(|remote| node.make_xfer(unmade.kind, &unmade.local, 0..n, &remote, 0..n));
    let mut xfer = match made {
        Ok(xfer) => xfer,
        Err(e) => {
            warn!("FERRY: prepXfer: {e}");
            if unmade.posted.take().is_some() {
                unmade.failed = Some(Status::InvalidParam);
            }
            return;
        }
    };
    if let Some((notif, ends)) = unmade.posted.take() {
        xfer.set_notification(notif);
        let left = ends.saturating_duration_since(Instant::now());
        // Made unposted, it cannot be in progress.
        let _ = xfer.post(left.max(Duration::from_millis(1)));
    }
    *stage = Stage::Made(xfer);
}
