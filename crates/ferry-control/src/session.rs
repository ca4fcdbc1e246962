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
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::endpoint::Shared;
use crate::frame::{
    CANCEL_VERSION, ControlCodec, Frame, SESSION_VERSIONS, Service, Status, TELL_VERSION,
};
use crate::{ControlError, ServiceError};
use calls::{Slots, dispatch};
use source::FrameSource;

mod calls;
mod source;

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

/// Which end of a session this node is.
pub(crate) enum Side {
    /// It opened the session, to this peer (whose id the hello checked).
    Opened(NodeAddr),
    /// The peer opened it, as node `hello` (the id its hello named, and
    /// proved where the nodes hold a cluster secret), on an accepted
    /// connection that holds `permit` (evictable at a bound while idle
    /// enough, see [`crate::limits`]).
    Accepted {
        hello: ferry_core::NodeId,
        permit: Arc<crate::ConnectionPermit>,
    },
}

/// Sends our `Open`, reads the peer's, and agrees on a version. The opener
/// speaks first; `expected` (ours to open) is the node the hello proved.
/// The node the peer's `Open` names must be the one its hello named
/// (`hello`, for a session the peer opened): the session, its deliveries
/// and its calls carry that id, so a peer proving the cluster secret as
/// one node cannot speak as another.
async fn handshake(
    read: &mut FramedRead<OwnedReadHalf, ControlCodec>,
    write: &mut FramedWrite<OwnedWriteHalf, ControlCodec>,
    me: NodeAddr,
    remote: std::net::SocketAddr,
    expected: Option<NodeAddr>,
    hello: Option<ferry_core::NodeId>,
) -> Result<(NodeAddr, u16), ControlError> {
    let protocol = |reason: String| ControlError::Protocol {
        endpoint: remote,
        reason,
    };
    let lost = |e: std::io::Error| ControlError::Unreachable {
        endpoint: remote,
        reason: e.to_string(),
    };
    let open = Frame::Open {
        min_version: SESSION_VERSIONS.0,
        max_version: SESSION_VERSIONS.1,
        node: me,
    };
    if expected.is_some() {
        write
            .send(open.clone())
            .await
            .map_err(|e| protocol(e.to_string()))?;
    }
    let theirs = match read.next().await {
        Some(Ok(frame)) => frame,
        Some(Err(e)) => return Err(protocol(e.to_string())),
        None => return Err(lost(std::io::ErrorKind::UnexpectedEof.into())),
    };
    if expected.is_none() {
        // Answered even when the versions will not match, so that the opener
        // can say why.
        write
            .send(open)
            .await
            .map_err(|e| protocol(e.to_string()))?;
    }
    let Frame::Open {
        min_version,
        max_version,
        node,
    } = theirs
    else {
        return Err(protocol(format!("expected an Open frame, got {theirs:?}")));
    };
    if let Some(expected) = expected
        && node.id != expected.id
    {
        return Err(protocol(format!(
            "the session opened as node {} but the hello was answered by {}",
            node.id, expected.id
        )));
    }
    if let Some(hello) = hello
        && node.id != hello
    {
        return Err(protocol(format!(
            "the session opened as node {} but its hello named node {hello}",
            node.id
        )));
    }
    let version = SESSION_VERSIONS.1.min(max_version);
    if version < SESSION_VERSIONS.0.max(min_version) {
        return Err(protocol(format!(
            "no common session version: this node speaks {}..={}, the peer {min_version}..={max_version}",
            SESSION_VERSIONS.0, SESSION_VERSIONS.1
        )));
    }
    Ok((node, version))
}

/// Opens a session on `stream` (after a successful control hello) and runs
/// it in a task of its own, as this node's `side` of it. Returns the
/// session and the task.
pub(crate) async fn start(
    shared: &Arc<Shared>,
    stream: TcpStream,
    auth: Option<crate::hello::Authenticated>,
    side: Side,
) -> Result<(Session, tokio::task::JoinHandle<()>), ControlError> {
    let (expected, hello, permit) = match side {
        Side::Opened(peer) => (Some(peer), None, None),
        Side::Accepted { hello, permit } => (None, Some(hello), Some(permit)),
    };
    let remote = stream
        .peer_addr()
        .unwrap_or_else(|_| expected.map_or(shared.local.endpoint, |p| p.endpoint));
    if let Err(e) = crate::socket::set_liveness(&stream, shared.config.peer_timeout) {
        debug!(%remote, error = %e, "cannot set a control connection's keepalive");
    }
    let (read, write) = stream.into_split();
    let max_frame = shared.config.max_frame;
    // Sealed where the hello proved a secret: from the `Open` frames on,
    // every frame carries its tag, and one that fails ends the session.
    let (send_mac, recv_mac, revoked, tracked) = match auth {
        Some(auth) => (
            Some(auth.keys.send),
            Some(auth.keys.recv),
            Some(auth.revoked),
            Some(auth.tracked),
        ),
        None => (None, None, None, None),
    };
    let mut read = FramedRead::new(read, ControlCodec::sealed(max_frame, recv_mac));
    let mut write = FramedWrite::new(write, ControlCodec::sealed(max_frame, send_mac));
    let (peer, version) =
        handshake(&mut read, &mut write, shared.local, remote, expected, hello).await?;
    let (outgoing, queue) = mpsc::channel(OUTGOING_QUEUE);
    let inner = Arc::new(Inner {
        id: shared.next_session_id(),
        peer,
        version,
        outgoing,
        pending: Mutex::default(),
        our_turns: Semaphore::new(shared.config.max_requests_in_flight.max(1)),
        handling: Mutex::default(),
        next_request: AtomicU64::new(1),
        closed: shared.shutdown.child_token(),
        went_silent: AtomicBool::new(false),
        lost_tells: AtomicU64::new(0),
        peer_timeout: shared.config.peer_timeout,
        silent_grace: shared.config.silent_grace,
        tracked,
        permit: permit.as_ref().map(Arc::downgrade),
    });
    let session = Session(inner.clone());
    debug!(peer = %peer.endpoint, node = %peer.id, id = inner.id, version, "control session open");
    let read = FrameSource::new(read, permit, shared.config.limits.frame_timeout);
    // A revoked secret ends the session as a close does.
    if let Some(revoked) = revoked {
        let closed = inner.closed.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = revoked.cancelled() => {
                    debug!("control session closed: the cluster secret it proved was revoked");
                    closed.cancel();
                }
                _ = closed.cancelled() => {}
            }
        });
    }
    let task = tokio::spawn(run(shared.clone(), inner, read, write, queue));
    Ok((session, task))
}

/// Drives the session until it closes: a writer draining the outgoing queue
/// and a reader dispatching what arrives.
async fn run(
    shared: Arc<Shared>,
    inner: Arc<Inner>,
    read: FrameSource,
    write: FramedWrite<OwnedWriteHalf, ControlCodec>,
    queue: mpsc::Receiver<Frame>,
) {
    // Counted for as long as this task runs, however it ends.
    struct Live<'a>(&'a Shared);
    impl Drop for Live<'_> {
        fn drop(&mut self) {
            self.0.session_ended();
        }
    }
    shared.session_started();
    let _live = Live(&shared);
    let closed = inner.closed.clone();
    let writing = async {
        if let Err(e) = write_loop(write, queue, &closed).await {
            if let crate::frame::FrameError::Io(e) = &e {
                inner.note_failure(e);
            }
            debug!(peer = %inner.peer.endpoint, error = %e, "control session: write failed");
        }
        closed.cancel();
    };
    let reading = async {
        if let Err(reason) = read_loop(&shared, &inner, read).await {
            warn!(peer = %inner.peer.endpoint, node = %inner.peer.id, "control session closed: {reason}");
        }
        closed.cancel();
    };
    tokio::join!(writing, reading);
    // Fail what still waits for an answer: dropping a sender wakes its
    // request with `SessionClosed`.
    let waiting: Vec<_> = inner.lock_pending().drain().collect();
    drop(waiting);
    shared.forget_session(&Session(inner.clone()));
    debug!(peer = %inner.peer.endpoint, id = inner.id, "control session closed");
}

async fn write_loop(
    mut write: FramedWrite<OwnedWriteHalf, ControlCodec>,
    mut queue: mpsc::Receiver<Frame>,
    closed: &CancellationToken,
) -> Result<(), crate::frame::FrameError> {
    loop {
        let frame = tokio::select! {
            biased;
            _ = closed.cancelled() => return Ok(()),
            frame = queue.recv() => match frame {
                Some(frame) => frame,
                None => return Ok(()),
            },
        };
        // Everything queued goes out with one flush.
        write.feed(frame).await?;
        while let Ok(frame) = queue.try_recv() {
            write.feed(frame).await?;
        }
        tokio::select! {
            biased;
            _ = closed.cancelled() => return Ok(()),
            flushed = write.flush() => flushed?,
        }
    }
}

/// Reads frames until the session ends. An error return is a protocol
/// violation or a broken connection, described for the log.
async fn read_loop(
    shared: &Arc<Shared>,
    inner: &Arc<Inner>,
    mut read: FrameSource,
) -> Result<(), String> {
    let slots = Slots {
        running: Arc::new(Semaphore::new(shared.config.max_requests_in_flight)),
        tells_waiting: Arc::new(Semaphore::new(shared.config.max_requests_in_flight)),
    };
    loop {
        let frame = tokio::select! {
            biased;
            _ = inner.closed.cancelled() => return Ok(()),
            frame = read.next() => frame,
        };
        let frame = match frame {
            None => return Ok(()),
            Some(Ok(frame)) => frame,
            Some(Err(crate::frame::FrameError::Io(e)))
                if e.kind() != std::io::ErrorKind::InvalidData =>
            {
                inner.note_failure(&e);
                debug!(peer = %inner.peer.endpoint, error = %e, "control session: connection lost");
                return Ok(());
            }
            Some(Err(crate::frame::FrameError::Forged)) => {
                if let Some(tracked) = &inner.tracked {
                    tracked.forged("control", &inner.peer.endpoint);
                }
                return Err(format!(
                    "protocol error: {}",
                    crate::frame::FrameError::Forged
                ));
            }
            Some(Err(e)) => return Err(format!("protocol error: {e}")),
        };
        match frame {
            // Ids are issued in order: one not issued yet was never sent.
            Frame::Response { id, .. } if id >= inner.next_request.load(Ordering::Relaxed) => {
                return Err(format!(
                    "protocol error: a response to request {id}, never sent"
                ));
            }
            Frame::Response { id, status, body } => match inner.lock_pending().remove(&id) {
                // The requester may have given up meanwhile; then nobody waits.
                Some(waiter) => drop(waiter.send((status, body))),
                None => {
                    debug!(peer = %inner.peer.endpoint, id, "late response to a request that timed out")
                }
            },
            Frame::Request {
                id,
                service,
                deadline,
                body,
            } => dispatch(shared, inner, &slots, Some(id), service, deadline, body).await,
            Frame::Tell {
                service,
                deadline,
                body,
            } => dispatch(shared, inner, &slots, None, service, deadline, body).await,
            Frame::Cancel { id } => {
                // Gone already if the handler finished first.
                if let Some(handler) = inner.lock_handling().remove(&id) {
                    debug!(peer = %inner.peer.endpoint, id, "request cancelled by its caller");
                    handler.abort();
                }
            }
            Frame::Open { .. } => return Err("protocol error: a second Open frame".into()),
        }
    }
}
