//! A session's connection: the handshake that opens it, and the task that
//! runs it (one writer draining the outgoing queue, one reader
//! dispatching what arrives) until either end closes it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::NodeAddr;
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::calls::{Slots, dispatch};
use super::source::FrameSource;
use super::{Inner, OUTGOING_QUEUE, Session};
use crate::ControlError;
use crate::endpoint::Shared;
use crate::frame::{ControlCodec, Frame, SESSION_VERSIONS};
use crate::hello::{Authenticated, Sealing};

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
    auth: Option<Authenticated>,
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
    let Sealing {
        send: send_mac,
        recv: recv_mac,
        revoked,
        tracked,
    } = Authenticated::split(auth);
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
