//! Running the peer's calls on a session: its requests, answered, and its
//! tells, not; how many run at once, and what becomes of those that cannot.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{Inner, Request, ServiceHandler, Session};
use crate::endpoint::Shared;
use crate::frame::{Frame, Service, Status};

/// Where the peer's calls run here.
pub(super) struct Slots {
    /// Bounds the peer's handlers running at once.
    pub(super) running: Arc<Semaphore>,
    /// Bounds the peer's tells waiting for a turn in `running`.
    pub(super) tells_waiting: Arc<Semaphore>,
}

/// Runs the handler for one request (`reply`: its id) or tell (`None`) and
/// sends a request's answer. A request that finds no handler, or every
/// slot taken, is answered so at once (`Busy`: its caller may retry). A
/// tell, which nothing answers, waits for a slot instead, in a task of its
/// own and within its deadline, so tells keep their order only while slots
/// are free. One that finds no handler, too many tells waiting already, or
/// no slot before its deadline, and one whose handler fails, is lost, and
/// logged (see [`tell_lost`]). Reading never waits for a handler.
pub(super) async fn dispatch(
    shared: &Arc<Shared>,
    inner: &Arc<Inner>,
    slots: &Slots,
    reply: Option<u64>,
    service: Service,
    deadline: Duration,
    body: Bytes,
) {
    let refuse = |id, status| Frame::Response {
        id,
        status,
        body: Bytes::new(),
    };
    let Some(handler) = shared.service(service) else {
        match reply {
            Some(id) => {
                debug!(peer = %inner.peer.endpoint, %service, "request for a service with no handler");
                let _ = inner.outgoing.send(refuse(id, Status::NoSuchService)).await;
            }
            None => tell_lost(inner, service, "no handler for its service"),
        }
        return;
    };
    let request = Request {
        session: Session(inner.clone()),
        body,
        deadline: Instant::now() + deadline,
    };
    if let Ok(permit) = slots.running.clone().try_acquire_owned() {
        return start_handler(inner, &handler, request, permit, reply, service);
    }
    if let Some(id) = reply {
        let _ = inner.outgoing.send(refuse(id, Status::Busy)).await;
        return;
    }
    let Ok(waiting) = slots.tells_waiting.clone().try_acquire_owned() else {
        return tell_lost(
            inner,
            service,
            "too many tells wait for a handler slot already",
        );
    };
    let (inner, running) = (inner.clone(), slots.running.clone());
    let held = inner.hold();
    tokio::spawn(async move {
        let _waiting = (waiting, held);
        let turn = tokio::time::timeout_at(request.deadline, running.acquire_owned());
        tokio::select! {
            biased;
            // Nobody is left to serve (handlers free their slots on close,
            // so a turn may come at the same moment).
            _ = inner.closed.cancelled() => {}
            turn = turn => match turn {
                Ok(Ok(_)) if inner.closed.is_cancelled() => {}
                Ok(Ok(permit)) => start_handler(&inner, &handler, request, permit, None, service),
                _ => tell_lost(&inner, service, "no handler slot free before its deadline"),
            },
        }
    });
}

/// Calls `handler` with `request` and runs its future in a task of its own
/// that holds `permit`, until it ends, its deadline passes or the session
/// closes, then answers request `reply` (a tell's failure is logged
/// instead). The handler is called here, so calls that found a slot free
/// are handled in the order they arrived: a service that must keep its
/// requests in order (messages) takes each one's place in line before the
/// handler returns.
fn start_handler(
    inner: &Arc<Inner>,
    handler: &ServiceHandler,
    request: Request,
    permit: tokio::sync::OwnedSemaphorePermit,
    reply: Option<u64>,
    service: Service,
) {
    let peer = inner.peer.endpoint;
    let deadline = request.deadline;
    let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(request)));
    let task_inner = inner.clone();
    // In flight: the session is not idle until it ends.
    let held = inner.hold();
    // Registered under the lock the task takes to deregister itself, so a
    // handler that finishes at once cannot leave a stale entry behind.
    let mut handling = inner.lock_handling();
    let task = tokio::spawn(async move {
        let inner = task_inner;
        let _held = held;
        // A panicking handler fails its request; the session and the node
        // go on.
        let answer = async move {
            match started {
                Ok(future) => std::panic::AssertUnwindSafe(future).catch_unwind().await,
                Err(panic) => Err(panic),
            }
        };
        let (status, body) = tokio::select! {
            answer = answer => match answer {
                Ok(Ok(body)) => (Status::Ok, body),
                Ok(Err(e)) => (Status::Failed, Bytes::from(e.0)),
                Err(panic) => {
                    let message = panic_message(panic.as_ref());
                    // A tell's is logged as it is lost, below.
                    if reply.is_some() {
                        warn!(%peer, %service, "request handler panicked: {message}");
                    }
                    (Status::Failed, Bytes::from(format!("handler panicked: {message}")))
                }
            },
            _ = tokio::time::sleep_until(deadline) => (Status::DeadlineExceeded, Bytes::new()),
            // Nobody is left to answer.
            _ = inner.closed.cancelled() => {
                if let Some(id) = reply {
                    inner.lock_handling().remove(&id);
                }
                return;
            }
        };
        let Some(id) = reply else {
            drop(permit);
            if status != Status::Ok {
                let why = String::from_utf8_lossy(&body);
                tell_lost(
                    &inner,
                    service,
                    &format!("its handler ended {status:?}: {why}"),
                );
            }
            return;
        };
        inner.lock_handling().remove(&id);
        drop(permit);
        let _ = inner
            .outgoing
            .send(Frame::Response { id, status, body })
            .await;
    });
    // A tell has no id to cancel it by: it runs to its end or deadline.
    if let Some(id) = reply {
        handling.insert(id, task.abort_handle());
    }
}

/// Logs a tell of the peer's that came to nothing, which nobody else will
/// hear of: the first on a session as a warning, later ones at debug
/// level, so that a peer sending many cannot flood the log.
fn tell_lost(inner: &Inner, service: Service, why: &str) {
    let peer = inner.peer.endpoint;
    if inner.lost_tells.fetch_add(1, Ordering::Relaxed) == 0 {
        warn!(%peer, %service, "a tell came to nothing: {why} (later ones on this session are logged at debug level)");
    } else {
        debug!(%peer, %service, "a tell came to nothing: {why}");
    }
}

/// What a panic said, if it said it as text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
