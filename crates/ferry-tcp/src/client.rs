//! The initiator side: splits ops into chunks, spreads them over a pool of
//! connections per peer (see [`crate::connection`]), and completes each
//! submit when every chunk is acknowledged, refused, lost, or the deadline
//! passes.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{Answer, BatchProgress, NodeAddr, OpError, OpKind, RdmaOp, SubmitError};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{Instrument, debug, debug_span};

use crate::connection::{Chunk, Conn, Local, connect};
use crate::deadline::Deadlines;
use crate::frame::{ClientFrame, Notify, NotifyOutcome, Request, RequestKind};

/// Initiator tuning; see `TcpConfig` for what each knob trades.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientConfig {
    /// This node, as notifications name their sender.
    pub local: NodeAddr,
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

/// How long a pool that could not open a connection carries on over the
/// ones it has before it tries to grow again: an owner at its connection
/// limit is not asked again for every chunk.
const GROW_BACKOFF: Duration = Duration::from_millis(500);

pub(crate) struct Peer {
    addr: NodeAddr,
    slots: Vec<tokio::sync::Mutex<Option<Conn>>>,
    next: AtomicUsize,
    /// Until when the pool does not try to grow, after a connection it
    /// tried to open failed while it had others.
    no_growth_until: Mutex<Option<Instant>>,
    /// The table it is in, for its connections to release it as they end.
    table: std::sync::Weak<PeerTable>,
}

/// A submit's use of a peer's pool; dropping it releases the pool's entry
/// if nothing else holds it and no connection of it is open.
struct PeerRef(Option<Arc<Peer>>);

impl std::ops::Deref for PeerRef {
    type Target = Peer;

    fn deref(&self) -> &Peer {
        self.0.as_ref().expect("taken only on drop")
    }
}

impl Drop for PeerRef {
    fn drop(&mut self) {
        if let Some(peer) = self.0.take() {
            let addr = peer.addr;
            let table = peer.table.clone();
            // Dropped under the table's lock (see `release`).
            release(&table, addr, Some(peer));
        }
    }
}

/// Removes `addr`'s pool from `table` if no submit holds it (the table's
/// reference is the only one once `holding`, the caller's, is dropped) and
/// none of its connections is open. The caller's reference is dropped under
/// the table's lock, so that of two users leaving at once the second sees
/// the count the first left, and one of them removes the entry.
pub(crate) fn release(
    table: &std::sync::Weak<PeerTable>,
    addr: NodeAddr,
    holding: Option<Arc<Peer>>,
) {
    let Some(table) = table.upgrade() else { return };
    let mut peers = table.lock().unwrap_or_else(|e| e.into_inner());
    drop(holding);
    if peers
        .get(&addr)
        .is_some_and(|p| Arc::strong_count(p) == 1 && p.idle())
    {
        peers.remove(&addr);
    }
}

/// Pools by peer. An entry lives while a connection of its pool is open
/// or a submit is using it: it is released when its last connection closes
/// (the peer went away, or the connection broke) with no submit using it,
/// or when the last submit using it ends with no connection open.
pub(crate) type PeerTable = Mutex<HashMap<NodeAddr, Arc<Peer>>>;

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
            .or_insert_with(|| {
                Arc::new(Peer {
                    addr,
                    slots: (0..self.config.connections.max(1))
                        .map(|_| Default::default())
                        .collect(),
                    next: AtomicUsize::new(0),
                    no_growth_until: Mutex::new(None),
                    table: Arc::downgrade(&self.peers),
                })
            })
            .clone();
        PeerRef(Some(peer))
    }

    /// Opens every data connection of `addr`'s pool that is not open yet,
    /// one after another, by `deadline`: the first transfer then finds its
    /// connections up. The number open after; `Err` only when none is.
    pub async fn connect(&self, addr: NodeAddr, deadline: Instant) -> Result<usize, OpError> {
        let peer = self.peer(addr);
        let mut failed = None;
        for slot in 0..peer.slots.len() {
            let opening = peer.open(slot, self.config);
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
                let lost = Err(OpError::ConnectionLost { endpoint });
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
            // Where each peer's chunks go: per chunk round robin, except
            // that a notified batch keeps each owner's chunks, and its
            // notification, on one connection, whose order the
            // notification relies on. A peer that could not be reached is
            // not retried for every chunk.
            let mut pinned: HashMap<NodeAddr, Result<Conn, OpError>> = HashMap::new();
            let mut unreachable: HashMap<NodeAddr, OpError> = HashMap::new();
            // The connection small chunks go to, and the bytes sent to it
            // since it was picked: a new one is picked once [`RUN_BYTES`]
            // have gone, so a run of small chunks leaves in one `sendmsg`
            // instead of one each across the pool, and large ones still
            // spread over it.
            let mut current: Option<(NodeAddr, Conn, u64)> = None;
            // The pool of the last op's owner: a batch's ops mostly share
            // one, which is then looked up (and released) once, not per op.
            let mut peer: Option<PeerRef> = None;
            for (index, op) in ops.into_iter().enumerate() {
                let owner = op.remote.owner();
                if peer.as_ref().is_none_or(|p| p.addr != owner) {
                    peer = Some(self.peer(owner));
                }
                let peer = peer.as_ref().expect("set above");
                let tcp = op.remote.transports().tcp.expect("checked above");
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
                    if notification.is_some() {
                        if let Entry::Vacant(slot) = pinned.entry(peer.addr) {
                            slot.insert(peer.connection(self.config).await);
                        }
                        match &pinned[&peer.addr] {
                            Ok(conn) => conn.queue(chunk).await,
                            Err(e) => chunk.finish(Err(e.clone())),
                        }
                        continue;
                    }
                    if let Some(e) = unreachable.get(&peer.addr) {
                        chunk.finish(Err(e.clone()));
                        continue;
                    }
                    let reuse = current.as_ref().is_some_and(|(addr, conn, sent)| {
                        *addr == peer.addr && *sent < RUN_BYTES && !conn.closed.is_cancelled()
                    });
                    if !reuse {
                        match peer.connection(self.config).await {
                            Ok(conn) => current = Some((peer.addr, conn, 0)),
                            Err(e) => {
                                chunk.finish(Err(e.clone()));
                                unreachable.insert(peer.addr, e);
                                continue;
                            }
                        }
                    }
                    let (_, conn, sent) = current.as_mut().expect("picked above");
                    *sent += len;
                    conn.queue(chunk).await;
                }
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
                let conn = match pinned.remove(owner) {
                    Some(conn) => conn,
                    // Only zero-length ops for this owner: nothing to follow.
                    None => self.peer(*owner).connection(self.config).await,
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

impl Drop for Peers {
    fn drop(&mut self) {
        self.deadlines.stop();
    }
}

impl Peer {
    /// Whether no connection of the pool is open (or being opened: a slot
    /// locked by a connecting submit, who holds the pool too).
    fn idle(&self) -> bool {
        self.slots.iter().all(|s| {
            s.try_lock()
                .is_ok_and(|c| c.as_ref().is_none_or(|c| c.closed.is_cancelled()))
        })
    }

    fn live_connections(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.try_lock()
                    .is_ok_and(|c| c.as_ref().is_some_and(|c| !c.closed.is_cancelled()))
            })
            .count()
    }

    /// The next connection in turn, connected first if needed. A pool that
    /// cannot grow (the owner at its connection limit, say) carries on over
    /// the connections it has, and tries to grow again after
    /// [`GROW_BACKOFF`]; only a pool with none fails.
    async fn connection(&self, config: ClientConfig) -> Result<Conn, OpError> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let failed = {
            let mut guard = self.slots[slot].lock().await;
            match &*guard {
                Some(conn) if !conn.closed.is_cancelled() => return Ok(conn.clone()),
                _ if self.growth_paused() => None,
                _ => {
                    let release = (self.table.clone(), self.addr);
                    match connect(self.addr, config, release).await {
                        Ok(conn) => return Ok(guard.insert(conn).clone()),
                        Err(e) => Some(e),
                    }
                }
            }
        };
        // Our slot's lock is released first: holding one slot while waiting
        // for another could deadlock with a submit doing the reverse.
        if let Some(conn) = self.other_live(slot).await {
            if let Some(e) = &failed {
                debug!(endpoint = %self.addr.endpoint, error = %e, "pool cannot grow; using the connections it has");
                self.pause_growth();
            }
            return Ok(conn);
        }
        match failed {
            Some(e) => Err(e),
            // None left to carry on over: grow after all.
            None => self.open(slot, config).await,
        }
    }

    /// Slot `slot`'s connection: the live one, or a new one put there.
    async fn open(&self, slot: usize, config: ClientConfig) -> Result<Conn, OpError> {
        let mut guard = self.slots[slot].lock().await;
        if let Some(conn) = guard.as_ref().filter(|c| !c.closed.is_cancelled()) {
            return Ok(conn.clone());
        }
        let release = (self.table.clone(), self.addr);
        Ok(guard
            .insert(connect(self.addr, config, release).await?)
            .clone())
    }

    /// A live connection of the pool in a slot other than `slot`, the next
    /// ones first; each slot locked in turn, one at a time.
    async fn other_live(&self, slot: usize) -> Option<Conn> {
        let n = self.slots.len();
        for k in 1..n {
            let guard = self.slots[(slot + k) % n].lock().await;
            if let Some(conn) = guard.as_ref().filter(|c| !c.closed.is_cancelled()) {
                return Some(conn.clone());
            }
        }
        None
    }

    fn growth_paused(&self) -> bool {
        let until = self
            .no_growth_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        until.is_some_and(|t| Instant::now() < t)
    }

    fn pause_growth(&self) {
        *self
            .no_growth_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + GROW_BACKOFF);
    }
}
