//! The initiator side: splits ops into chunks, spreads them over a pool of
//! connections per peer (see [`crate::connection`]), and completes each
//! submit when every chunk is acknowledged, refused, lost, or the deadline
//! passes.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{Answer, BatchProgress, NodeAddr, OpError, OpKind, RdmaOp, SubmitError};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{Instrument, debug, debug_span};

use crate::chunk::{Chunk, Local};
use crate::connection::Conn;
use crate::deadline::Deadlines;
use crate::frame::{ClientFrame, Notify, NotifyOutcome, Request, RequestKind};
use crate::gather::Gather;
use crate::pool::{Peer, PeerRef, PeerTable};

/// Initiator tuning; see `TcpConfig` for what each knob trades.
#[derive(Clone, Debug)]
pub(crate) struct ClientConfig {
    /// This node, as notifications name their sender.
    pub local: NodeAddr,
    /// How connections say hello (with the cluster secret, if any).
    pub dialer: ferry_control::Dialer,
    pub connections: usize,
    pub chunk_size: usize,
    pub queue_depth: usize,
    /// Bytes one connection may have requested and not yet had answered.
    pub window: u32,
    /// How long each connection polls for answers before it sleeps.
    pub busy_poll: Duration,
}

/// What one owner did with a batch's notification, or why it was not asked.
pub type NotificationResult = Result<NotifyOutcome, OpError>;

/// A notified batch's outcome per owner, in the order the batch first
/// names them.
pub type Notified = Vec<(NodeAddr, NotificationResult)>;

/// The notification a batch carries, and where each owner's answer goes.
struct Notification {
    body: Bytes,
    tag: u64,
    owners: Vec<NodeAddr>,
    outcomes: Vec<Arc<OnceLock<NotificationResult>>>,
}

/// Bytes of consecutive chunks one connection takes before the next chunk
/// goes to the next connection of the pool (see `Peers::run`).
const RUN_BYTES: u64 = 64 << 10;

/// Connection pools to the peers this node talks to.
pub(crate) struct Peers {
    config: ClientConfig,
    peers: Arc<PeerTable>,
    deadlines: Arc<Deadlines>,
    /// The last tag given to a notified batch.
    tags: AtomicU64,
}

impl Peers {
    /// Starts the deadline keeper on the current tokio runtime.
    pub fn new(config: ClientConfig) -> Self {
        Peers {
            config,
            peers: Arc::default(),
            deadlines: Deadlines::start(),
            tags: AtomicU64::new(0),
        }
    }

    pub fn connected(&self) -> usize {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.values().map(|p| p.live_connections()).sum()
    }

    /// Peers with a pool entry now (see [`PeerTable`] for when one goes).
    pub fn len(&self) -> usize {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn peer(&self, addr: NodeAddr) -> PeerRef {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let peer = peers
            .entry(addr)
            .or_insert_with(|| Arc::new(Peer::new(addr, self.config.connections, &self.peers)))
            .clone();
        PeerRef::new(peer)
    }

    /// Opens every data connection of `addr`'s pool that is not open yet,
    /// one after another, by `deadline`: the first transfer then finds its
    /// connections up. The number open after; `Err` only when none is.
    pub async fn connect(&self, addr: NodeAddr, deadline: Instant) -> Result<usize, OpError> {
        let peer = self.peer(addr);
        let mut failed = None;
        for slot in 0..peer.size() {
            let opening = peer.open(slot, self.config.clone());
            match tokio::time::timeout_at(deadline, opening).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failed = Some(e),
                Err(_) => {
                    failed = Some(OpError::PeerUnreachable {
                        endpoint: addr.endpoint,
                        reason: "its data connections did not open in time".into(),
                    });
                    break;
                }
            }
        }
        match (peer.live_connections(), failed) {
            (0, Some(e)) => Err(e),
            (open, _) => Ok(open),
        }
    }

    /// Runs one batch to completion or deadline.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let (tx, rx) = oneshot::channel();
        self.start(ops, timeout, Box::new(move |result| _ = tx.send(result)))
            .await;
        // Every path through `start` answers exactly once (a batch's last
        // piece, or its deadline); a dropped answer would be a bug there.
        rx.await.unwrap_or(Err(SubmitError::BackendStopped))
    }

    /// Starts one batch and hands its outcome to `answer`, from the thread
    /// that finishes it: the last chunk's response, or the deadline. The
    /// future returned queues the chunks on their connections (connecting
    /// first if needed) and ends once they are queued or the deadline has
    /// passed; the answer may come before or after. A caller that is an
    /// actor answers its own caller this way without a task per submit.
    pub async fn start(&self, ops: Vec<RdmaOp>, timeout: Duration, answer: Answer) {
        self.run(ops, timeout, None, answer).await
    }

    /// Runs one batch and sends `body` to the owner of its remote regions,
    /// each on the connection that carried its chunks, right behind them:
    /// the owner delivers it once it has served them all, and not at all if
    /// it refused one. `Err` if an op failed or the deadline passed (then
    /// no owner delivers it, unless the deadline passed after it was sent);
    /// otherwise what each owner did with it.
    pub async fn submit_notified(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        body: Bytes,
    ) -> Result<Notified, SubmitError> {
        let mut owners: Vec<NodeAddr> = Vec::with_capacity(1);
        for op in &ops {
            let owner = op.remote.owner();
            if !owners.contains(&owner) {
                owners.push(owner);
            }
        }
        let ops_len = ops.len();
        let outcomes: Vec<_> = owners.iter().map(|_| Arc::default()).collect();
        let notification = Notification {
            body,
            tag: self.tags.fetch_add(1, Ordering::Relaxed) + 1,
            owners: owners.clone(),
            outcomes: outcomes.clone(),
        };
        let (tx, rx) = oneshot::channel();
        let answer = Box::new(move |result| _ = tx.send(result));
        self.run(ops, timeout, Some(notification), answer).await;
        match rx.await.unwrap_or(Err(SubmitError::BackendStopped)) {
            Ok(()) => {}
            // Every op completed, but a notification failed: said per owner.
            Err(SubmitError::Op { index, .. }) if index >= ops_len => {}
            Err(e) => return Err(e),
        }
        Ok(owners
            .into_iter()
            .zip(outcomes)
            .map(|(owner, outcome)| {
                let endpoint = owner.endpoint;
                let lost = Err(OpError::connection_lost(endpoint));
                (owner, outcome.get().cloned().unwrap_or(lost))
            })
            .collect())
    }

    async fn run(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Option<Notification>,
        answer: Answer,
    ) {
        let deadline = Instant::now() + timeout;
        let bytes: u64 = ops.iter().map(RdmaOp::len).sum();
        // A batch usually goes to one peer; name the first.
        let peer = ops.first().map(|op| op.remote.owner().endpoint);
        let span = debug_span!(
            "submit",
            transport = "tcp",
            peer = ?peer,
            ops = ops.len(),
            bytes,
            notified = notification.is_some(),
            outcome = tracing::field::Empty
        );
        let answer: Answer = {
            let span = span.clone();
            Box::new(move |result| {
                span.record("outcome", tracing::field::debug(&result));
                debug!(parent: &span, ?result, "submit finished");
                answer(result)
            })
        };
        // Every op is checked before any byte moves: a bad op fails the whole
        // batch untouched.
        for (index, op) in ops.iter().enumerate() {
            let error = match op.validate() {
                Err(error) => error,
                Ok(()) if op.remote.transports().tcp.is_none() => OpError::NoSharedTransport,
                Ok(()) => continue,
            };
            return answer(Err(SubmitError::Op { index, error }));
        }
        let chunk_size = self.config.chunk_size.max(1) as u64;
        let state = Arc::new(BatchProgress::with_notifications(
            ops.iter().map(|op| op.len().div_ceil(chunk_size) as u32),
            notification.as_ref().map_or(0, |n| n.owners.len()),
        ));
        if state.total_pieces() == 0 {
            return answer(Ok(()));
        }
        let key = self.deadlines.insert(deadline, state.clone(), timeout);
        let deadlines = self.deadlines.clone();
        state.answer_when_done(Box::new(move |result| {
            deadlines.remove(key);
            answer(result)
        }));

        let enqueue = async {
            let ops_len = ops.len();
            let tag = notification.as_ref().map_or(0, |n| n.tag);
            let mut route = Route::new(self.config.clone(), notification.is_some());
            // Consecutive small ops of one region, to go as one request.
            let mut gather: Option<Gather> = None;
            // As many bytes as one chunk: a run of 4 or 64 KiB ops then
            // travels like one 1 MiB op (64 KiB runs moved 20% fewer GB/s,
            // and reads half as many).
            let gather_bytes = chunk_size;
            // The pool of the last op's owner: a batch's ops mostly share
            // one, which is then looked up (and released) once, not per op.
            let mut peer: Option<PeerRef> = None;
            for (index, op) in ops.into_iter().enumerate() {
                let owner = op.remote.owner();
                let tcp = op.remote.transports().tcp.expect("checked above");
                let small = (1..=gather_bytes).contains(&op.len());
                let joins = |g: &Gather| small && g.takes(index, &op, tcp.token, gather_bytes);
                if let Some(g) = gather.as_mut().filter(|g| joins(g)) {
                    g.push(&op);
                    continue;
                }
                if let Some(g) = gather.take() {
                    // The gather's owner is the last op's: `peer`'s.
                    let peer = peer.as_ref().expect("set for the gather's ops");
                    let (chunk, len) = g.into_chunk(tag, &state, peer.addr.endpoint);
                    route.send(peer, chunk, len).await;
                }
                if peer.as_ref().is_none_or(|p| p.addr != owner) {
                    peer = Some(self.peer(owner));
                }
                let peer = peer.as_ref().expect("set above");
                if small {
                    gather = Some(Gather::start(index, &op, tcp.token));
                    continue;
                }
                let kind = match op.kind {
                    OpKind::Read => RequestKind::Read,
                    OpKind::Write => RequestKind::Write,
                };
                let mut queued = 0;
                while queued < op.len() {
                    let len = chunk_size.min(op.len() - queued);
                    let request = Request {
                        kind,
                        id: 0,
                        region: op.remote.region(),
                        generation: op.remote.generation(),
                        addr: op.remote.addr() + queued,
                        len,
                        token: tcp.token,
                        scopes: *op.remote.scopes(),
                        tag,
                    };
                    let local = Local::Region {
                        region: op.local.region().clone(),
                        // Inside the local slice, so below the region's
                        // length, which fits usize.
                        offset: (op.local.offset() + queued) as usize,
                    };
                    let chunk = Chunk::new(
                        index,
                        ClientFrame::Op(request),
                        local,
                        &state,
                        peer.addr.endpoint,
                    );
                    queued += len;
                    route.send(peer, chunk, len).await;
                }
            }
            if let (Some(g), Some(peer)) = (gather, &peer) {
                let (chunk, len) = g.into_chunk(tag, &state, peer.addr.endpoint);
                route.send(peer, chunk, len).await;
            }
            let Some(notification) = &notification else {
                return;
            };
            for (k, (owner, outcome)) in notification
                .owners
                .iter()
                .zip(&notification.outcomes)
                .enumerate()
            {
                let notify = Notify {
                    id: 0,
                    tag,
                    len: notification.body.len() as u64,
                    discard: false,
                    from: self.config.local,
                };
                let local = Local::Notification {
                    body: notification.body.clone(),
                    outcome: outcome.clone(),
                };
                let chunk = Chunk::new(
                    ops_len + k,
                    ClientFrame::Notify(notify),
                    local,
                    &state,
                    owner.endpoint,
                );
                let conn = match route.pinned.remove(owner) {
                    Some(conn) => conn,
                    // Only zero-length ops for this owner: nothing to follow.
                    None => self.peer(*owner).connection(self.config.clone()).await,
                };
                match conn {
                    Ok(conn) => conn.queue(chunk).await,
                    Err(e) => chunk.finish(Err(e)),
                }
            }
        };

        // Pinned here rather than moved into `timeout_at`, so that at the
        // deadline the batch is answered while the queueing still exists:
        // dropping it drops the chunks it was still queueing, which count as
        // lost and must not turn a timeout into a connection error.
        let work = std::pin::pin!(enqueue.instrument(span));
        if tokio::time::timeout_at(deadline, work).await.is_err() {
            state.expire(timeout);
        }
    }
}

/// Where a batch's chunks go: per chunk round robin over the owner's pool,
/// except that a notified batch keeps each owner's chunks, and its
/// notification, on one connection, whose order the notification relies
/// on. A peer that could not be reached is not retried for every chunk.
struct Route {
    config: ClientConfig,
    notified: bool,
    /// A notified batch's connection per owner.
    pinned: HashMap<NodeAddr, Result<Conn, OpError>>,
    unreachable: HashMap<NodeAddr, OpError>,
    /// The connection small chunks go to, and the bytes sent to it since
    /// it was picked: a new one is picked once [`RUN_BYTES`] have gone, so
    /// a run of small chunks leaves in one `sendmsg` instead of one each
    /// across the pool, and large ones still spread over it.
    current: Option<(NodeAddr, Conn, u64)>,
}

impl Route {
    fn new(config: ClientConfig, notified: bool) -> Self {
        Route {
            config,
            notified,
            pinned: HashMap::new(),
            unreachable: HashMap::new(),
            current: None,
        }
    }

    /// Queues `chunk`, of `len` bytes, on a connection of `peer`'s pool, or
    /// finishes it with the error that keeps it from going.
    async fn send(&mut self, peer: &PeerRef, chunk: Chunk, len: u64) {
        if self.notified {
            if let Entry::Vacant(slot) = self.pinned.entry(peer.addr) {
                slot.insert(peer.connection(self.config.clone()).await);
            }
            match &self.pinned[&peer.addr] {
                Ok(conn) => conn.queue(chunk).await,
                Err(e) => chunk.finish(Err(e.clone())),
            }
            return;
        }
        if let Some(e) = self.unreachable.get(&peer.addr) {
            return chunk.finish(Err(e.clone()));
        }
        let reuse = self.current.as_ref().is_some_and(|(addr, conn, sent)| {
            *addr == peer.addr && *sent < RUN_BYTES && !conn.closed.is_cancelled()
        });
        if !reuse {
            match peer.connection(self.config.clone()).await {
                Ok(conn) => self.current = Some((peer.addr, conn, 0)),
                Err(e) => {
                    chunk.finish(Err(e.clone()));
                    self.unreachable.insert(peer.addr, e);
                    return;
                }
            }
        }
        let (_, conn, sent) = self.current.as_mut().expect("picked above");
        *sent += len;
        conn.queue(chunk).await;
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        self.deadlines.stop();
    }
}
