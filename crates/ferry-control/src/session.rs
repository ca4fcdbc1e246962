//! A control session: one framed connection between two nodes, carrying
//! requests to named services and their responses, multiplexed by request id.
//!
//! Each node opens its own session to a peer the first time it needs one
//! (see [`crate::Endpoint::session`]) and sends its requests on it; it serves
//! the requests that arrive on any session, its own or one the peer opened.
//! Every request has a deadline: the caller stops waiting at it, and the
//! peer's handler is given the same budget. A tell ([`Session::tell`]) is a
//! request that nothing answers.
//!
//! A frame that does not parse, or one that breaks the protocol, ends the
//! session with one logged protocol error. Requests waiting on it fail with
//! `SessionClosed`; nothing else of the node is affected.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::NodeAddr;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::frame::{CANCEL_VERSION, Frame, Service, Status, TELL_VERSION};
use crate::{ControlError, ServiceError};

mod calls;
mod connection;
mod source;

pub(crate) use connection::{Side, start};

/// Frames waiting for the session's writer; senders wait (within their
/// deadline) when it is full.
const OUTGOING_QUEUE: usize = 256;

/// What a service handler returns.
pub type ServiceFuture = Pin<Box<dyn Future<Output = Result<Bytes, ServiceError>> + Send>>;
/// A registered service handler.
pub(crate) type ServiceHandler = Arc<dyn Fn(Request) -> ServiceFuture + Send + Sync>;

/// A request as its service handler receives it.
pub struct Request {
    /// The session it arrived on: the handler may tie state to it (and watch
    /// [`Session::closed`] to drop that state).
    pub session: Session,
    /// The caller's input.
    pub body: Bytes,
    /// When the caller stops waiting (for a tell: when it stops mattering);
    /// the handler is cancelled then.
    pub deadline: Instant,
}

/// One end of a control session. Cheap to clone.
#[derive(Clone)]
pub struct Session(Arc<Inner>);

struct Inner {
    /// Unique in this process.
    id: u64,
    /// The peer as its `Open` frame describes it, whose id must be the one
    /// its hello named (see `handshake`): proved where both ends hold a
    /// cluster secret, the peer's claim otherwise. The endpoint is the
    /// address it advertises, as it says.
    peer: NodeAddr,
    version: u16,
    outgoing: mpsc::Sender<Frame>,
    /// Requests of ours awaiting their response, by id.
    pending: Mutex<HashMap<u64, oneshot::Sender<(Status, Bytes)>>>,
    /// Bounds our requests in flight to what the peer runs at once (both
    /// use the same setting), so that a burst waits here for its turn,
    /// within each request's deadline, instead of being refused `Busy`.
    our_turns: Semaphore,
    /// The peer's requests whose handlers run here, by the peer's id, so
    /// that its `Cancel` can stop them.
    handling: Mutex<HashMap<u64, tokio::task::AbortHandle>>,
    next_request: AtomicU64,
    closed: CancellationToken,
    /// The connection failed because the peer acknowledged nothing for the
    /// peer timeout (ETIMEDOUT), rather than being closed or reset.
    went_silent: AtomicBool,
    /// The peer's tells that came to nothing here (counted and logged in `calls`).
    lost_tells: AtomicU64,
    peer_timeout: Duration,
    silent_grace: Duration,
    /// The session's place among its secret's live connections, where the
    /// hello proved one: for revocation, and to count a forged frame.
    tracked: Option<crate::hello::Tracked>,
    /// An accepted session's place under the endpoint's bounds, which what
    /// is in flight on it holds (see [`Session::hold`]). Weak: a clone of
    /// a session that ended must not keep its place counted.
    permit: Option<std::sync::Weak<crate::ConnectionPermit>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.0.id)
            .field("peer", &self.0.peer)
            .field("version", &self.0.version)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Session {
    /// Unique among this process's sessions.
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The node at the other end (see [`Request::session`] on trust).
    pub fn peer(&self) -> NodeAddr {
        self.0.peer
    }

    /// The session protocol version both ends agreed on.
    pub fn version(&self) -> u16 {
        self.0.version
    }

    /// Whether the session has ended.
    pub fn is_closed(&self) -> bool {
        self.0.closed.is_cancelled()
    }

    /// Resolves when the session has ended, for whatever reason.
    pub async fn closed(&self) {
        self.0.closed.cancelled().await
    }

    /// Whether the session ended because the peer acknowledged nothing for
    /// its peer timeout: its host or the path to it is down, or the path is
    /// lossy enough to lose every keepalive probe of that time. A data
    /// plane that still sees its own transfers with this peer complete may
    /// let them finish (the path works for them); a session closed or reset
    /// by the peer (its process died) is not this.
    pub fn went_silent(&self) -> bool {
        self.0.went_silent.load(Ordering::Acquire)
    }

    /// How long this session's peer may acknowledge nothing before it is
    /// declared lost ([`crate::EndpointConfig::peer_timeout`]).
    pub fn peer_timeout(&self) -> Duration {
        self.0.peer_timeout
    }

    /// How long after this session [went silent](Self::went_silent) a data
    /// path set up over it may go on with the work it had under way
    /// ([`crate::EndpointConfig::silent_grace`]).
    pub fn silent_grace(&self) -> Duration {
        self.0.silent_grace
    }

    /// Keeps the session from being closed to make room at the endpoint's
    /// connection bound while the hold lives (see
    /// [`crate::ConnectionLimits::session_evictable_after`]): for state a
    /// data plane ties to the session and its peer uses without a word on
    /// it (queue pairs). Requests and handlers in flight hold it already.
    /// A session this node opened is under no bound: its hold is a no-op.
    pub fn hold(&self) -> crate::ConnectionHold {
        self.0.hold()
    }

    /// Ends the session now; requests in flight fail with `SessionClosed`.
    pub fn close(&self) {
        self.0.closed.cancel();
    }

    /// Calls the peer's handler for `service` with `body` and returns its
    /// answer, or fails once `timeout` has passed (the peer's handler is
    /// given the same budget). If the call ends unanswered (its deadline
    /// passed, or the caller dropped it), the peer is told to stop the
    /// handler.
    pub async fn request(
        &self,
        service: Service,
        body: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<Bytes, ControlError> {
        let inner = &self.0;
        let endpoint = inner.peer.endpoint;
        let deadline = Instant::now() + timeout;
        let timed_out = ControlError::Timeout {
            endpoint,
            service,
            after: timeout,
        };
        let closed = ControlError::SessionClosed { endpoint };
        let _held = inner.hold();
        let _turn = match tokio::time::timeout_at(deadline, inner.our_turns.acquire()).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(_)) => return Err(closed),
            Err(_) => return Err(timed_out),
        };
        let id = inner.next_request.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        inner.lock_pending().insert(id, tx);
        // Removes the entry however this call ends (answered, timed out, or
        // dropped by its caller), so the map never keeps dead requests.
        let _pending = PendingGuard { inner, id };
        // Checked after inserting: the reader drains the map only after it
        // marks the session closed, so no request can be left behind.
        if self.is_closed() {
            return Err(closed);
        }
        let frame = Frame::Request {
            id,
            service,
            deadline: timeout,
            body: body.into(),
        };
        match tokio::time::timeout_at(deadline, inner.outgoing.send(frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(closed),
            Err(_) => return Err(timed_out),
        }
        let (status, body) = match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => return Err(closed),
            Err(_) => return Err(timed_out),
        };
        match status {
            Status::Ok => Ok(body),
            Status::NoSuchService => Err(ControlError::NoSuchService { endpoint, service }),
            Status::Busy => Err(ControlError::Busy { endpoint, service }),
            Status::DeadlineExceeded => Err(timed_out),
            Status::Failed => Err(ControlError::Failed {
                endpoint,
                service,
                message: String::from_utf8_lossy(&body).into_owned(),
            }),
        }
    }

    /// Calls the peer's handler for `service` with `body` and does not wait
    /// for it: returns once the call is queued for the wire, or fails if the
    /// session ended or the queue had no room within `timeout`. The peer
    /// runs the handler within `timeout` (from the tell's arrival, a wait
    /// for a free handler slot included) and sends nothing back; its
    /// failures are logged there. For calls whose answer nobody needs: it
    /// costs neither end the response's packet nor a wake-up to read it.
    ///
    /// A peer that predates tells (session version below 3) is sent a
    /// request instead, and this waits for its answer, failing as
    /// [`Session::request`] does.
    pub async fn tell(
        &self,
        service: Service,
        body: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<(), ControlError> {
        if self.0.version < TELL_VERSION {
            return self.request(service, body, timeout).await.map(drop);
        }
        let endpoint = self.0.peer.endpoint;
        if self.is_closed() {
            return Err(ControlError::SessionClosed { endpoint });
        }
        let frame = Frame::Tell {
            service,
            deadline: timeout,
            body: body.into(),
        };
        match tokio::time::timeout(timeout, self.0.outgoing.send(frame)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(ControlError::SessionClosed { endpoint }),
            Err(_) => Err(ControlError::Timeout {
                endpoint,
                service,
                after: timeout,
            }),
        }
    }
}

struct PendingGuard<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        let unanswered = self.inner.lock_pending().remove(&self.id).is_some();
        // The reader takes the entry out when the answer arrives: one still
        // here was never answered. Best effort (a full queue skips it): the
        // peer's own deadline stops the handler anyway.
        if unanswered && self.inner.version >= CANCEL_VERSION && !self.inner.closed.is_cancelled() {
            let _ = self.inner.outgoing.try_send(Frame::Cancel { id: self.id });
        }
    }
}

impl Inner {
    /// See [`Session::hold`].
    fn hold(&self) -> crate::ConnectionHold {
        match self.permit.as_ref().and_then(std::sync::Weak::upgrade) {
            Some(permit) => permit.hold(),
            None => crate::ConnectionHold::none(),
        }
    }

    /// Records why the connection failed, if the peer went silent.
    fn note_failure(&self, error: &std::io::Error) {
        if error.kind() == std::io::ErrorKind::TimedOut {
            self.went_silent.store(true, Ordering::Release);
        }
    }

    fn lock_handling(&self) -> std::sync::MutexGuard<'_, HashMap<u64, tokio::task::AbortHandle>> {
        self.handling.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_pending(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<(Status, Bytes)>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}
