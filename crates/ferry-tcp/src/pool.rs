//! Each peer's pool of data connections: opened on first use, grown up to
//! its size (behind the transfers, once it has one), and released from the
//! node's table once no submit uses it and none of its connections is open.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{NodeAddr, OpError};
use tokio::time::Instant;
use tracing::debug;

use crate::client::ClientConfig;
use crate::connection::{Conn, connect};

/// How long a pool that could not open a connection carries on over the
/// ones it has before it tries to grow again: an owner at its connection
/// limit is not asked again for every chunk.
const GROW_BACKOFF: Duration = Duration::from_millis(500);

/// How long a connection opened behind the transfers (see
/// [`Peer::connection`]) may take before the pool gives up on it and
/// pauses growing; no submit waits for it, so its own deadline is this.
const GROW_DEADLINE: Duration = Duration::from_secs(5);

/// One peer's pool of data connections.
pub(crate) struct Peer {
    pub(crate) addr: NodeAddr,
    slots: Vec<tokio::sync::Mutex<Option<Conn>>>,
    /// Per slot: a task is opening its connection behind the transfers.
    growing: Vec<AtomicBool>,
    next: AtomicUsize,
    /// Until when the pool does not try to grow, after a connection it
    /// tried to open failed while it had others.
    no_growth_until: Mutex<Option<Instant>>,
    /// The table it is in, for its connections to release it as they end.
    table: std::sync::Weak<PeerTable>,
}

/// A submit's use of a peer's pool; dropping it releases the pool's entry
/// if nothing else holds it and no connection of it is open.
pub(crate) struct PeerRef(Option<Arc<Peer>>);

impl PeerRef {
    /// A submit's use of `peer`, from the table.
    pub(crate) fn new(peer: Arc<Peer>) -> Self {
        PeerRef(Some(peer))
    }

    /// The pool's next connection in turn (see [`Peer::connection`]).
    pub(crate) async fn connection(&self, config: ClientConfig) -> Result<Conn, OpError> {
        Peer::connection(self.0.as_ref().expect("taken only on drop"), config).await
    }
}

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

/// Sends `chunks` again, in order, on one connection of `addr`'s pool
/// (made anew in `table` if it went): the chunks a connection's owner
/// closed it without reading (see `connection::run_connection`). A pool
/// that cannot give a connection finishes them with its error.
pub(crate) fn resend(
    table: &std::sync::Weak<PeerTable>,
    addr: NodeAddr,
    config: ClientConfig,
    chunks: Vec<crate::chunk::Chunk>,
) {
    let lost = Err(OpError::connection_lost(addr.endpoint));
    let Some(table) = table.upgrade() else {
        // The client is gone: nobody could send them.
        chunks.into_iter().for_each(|c| c.finish(lost.clone()));
        return;
    };
    let peer = {
        let mut peers = table.lock().unwrap_or_else(|e| e.into_inner());
        let peer = peers
            .entry(addr)
            .or_insert_with(|| Arc::new(Peer::new(addr, config.connections, &table)));
        PeerRef::new(peer.clone())
    };
    tokio::spawn(async move {
        match peer.connection(config).await {
            Ok(conn) => {
                for chunk in chunks {
                    conn.queue(chunk).await;
                }
            }
            Err(e) => chunks.into_iter().for_each(|c| c.finish(Err(e.clone()))),
        }
    });
}

/// Pools by peer. An entry lives while a connection of its pool is open
/// or a submit is using it: it is released when its last connection closes
/// (the peer went away, or the connection broke) with no submit using it,
/// or when the last submit using it ends with no connection open.
pub(crate) type PeerTable = Mutex<HashMap<NodeAddr, Arc<Peer>>>;

impl Peer {
    /// `addr`'s pool of up to `connections` connections, none open yet, in
    /// `table`.
    pub(crate) fn new(addr: NodeAddr, connections: usize, table: &Arc<PeerTable>) -> Self {
        Peer {
            addr,
            slots: (0..connections.max(1))
                .map(|_| Default::default())
                .collect(),
            growing: (0..connections.max(1))
                .map(|_| AtomicBool::new(false))
                .collect(),
            next: AtomicUsize::new(0),
            no_growth_until: Mutex::new(None),
            table: Arc::downgrade(table),
        }
    }

    /// Whether no connection of the pool is open (or being opened: a slot
    /// locked by a connecting submit, who holds the pool too).
    fn idle(&self) -> bool {
        self.slots.iter().all(|s| {
            s.try_lock()
                .is_ok_and(|c| c.as_ref().is_none_or(|c| c.closed.is_cancelled()))
        })
    }

    /// How many connections the pool may hold.
    pub(crate) fn size(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn live_connections(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.try_lock()
                    .is_ok_and(|c| c.as_ref().is_some_and(|c| !c.closed.is_cancelled()))
            })
            .count()
    }

    /// The next connection in turn. A pool with no live connection opens
    /// one here, and the rest of its slots in tasks of their own: after
    /// the first transfer to a peer the pool fills up behind it, as
    /// `Peers::connect` would have, and no later transfer waits for a
    /// connection's set-up (each of the first four requests to a peer used
    /// to pay one). An empty slot found while another connection is live
    /// is likewise filled behind the chunk, which takes the live one. A
    /// pool that cannot grow (the owner at its connection limit, say)
    /// carries on over the connections it has, and tries to grow again
    /// after [`GROW_BACKOFF`], inline from then on (see [`Peer::grow`]);
    /// only a pool with none fails.
    async fn connection(self: &Arc<Self>, config: ClientConfig) -> Result<Conn, OpError> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let failed = {
            // A slot held by a connect under way is passed over for a live
            // one, if there is one, rather than waited for.
            let mut guard = match self.slots[slot].try_lock() {
                Ok(guard) => guard,
                Err(_) => match self.instead_of(slot) {
                    Some(conn) => return Ok(conn),
                    None => self.slots[slot].lock().await,
                },
            };
            match &*guard {
                Some(conn) if !conn.closed.is_cancelled() => return Ok(conn.clone()),
                _ if self.growth_paused() => None,
                _ => {
                    if let Some(conn) = self.instead_of(slot) {
                        drop(guard);
                        self.grow(slot, config.clone());
                        return Ok(conn);
                    }
                    let release = (self.table.clone(), self.addr);
                    match connect(self.addr, config.clone(), release).await {
                        Ok(conn) => {
                            let conn = guard.insert(conn).clone();
                            drop(guard);
                            (0..self.slots.len())
                                .filter(|&other| other != slot)
                                .for_each(|other| self.grow(other, config.clone()));
                            return Ok(conn);
                        }
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

    /// Opens slot `slot`'s connection in a task of its own, unless one is
    /// at it already. The task holds the pool while it runs (at most
    /// [`GROW_DEADLINE`], as a submit holds it until its deadline), and
    /// leaves it as a submit does; a failure pauses growth as an inline one
    /// would.
    ///
    /// Not for a pool the owner ever refused to let grow: there a new
    /// connection may take the place of one of ours that the owner deems
    /// idle, and a chunk that just went on that one would be lost with it;
    /// such a pool grows inline, the chunk riding the new connection.
    fn grow(self: &Arc<Self>, slot: usize, config: ClientConfig) {
        if self.ever_refused_growth() || self.growing[slot].swap(true, Ordering::AcqRel) {
            return;
        }
        let peer = self.clone();
        tokio::spawn(async move {
            let opened = tokio::time::timeout(GROW_DEADLINE, peer.open(slot, config)).await;
            let failure = match opened {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("not open within {GROW_DEADLINE:?}")),
            };
            if let Some(reason) = failure {
                debug!(endpoint = %peer.addr.endpoint, %reason, "pool cannot grow; using the connections it has");
                peer.pause_growth();
            }
            // Cleared after the pause, so no submit starts this again in
            // between.
            peer.growing[slot].store(false, Ordering::Release);
            let (table, addr) = (peer.table.clone(), peer.addr);
            release(&table, addr, Some(peer));
        });
    }

    /// A live connection to take instead of waiting for slot `slot` to
    /// connect: one in another slot that nobody holds locked right now
    /// (never waits), in a pool the owner never refused to let grow (see
    /// [`Peer::grow`]).
    fn instead_of(&self, slot: usize) -> Option<Conn> {
        if self.ever_refused_growth() {
            return None;
        }
        let n = self.slots.len();
        (1..n).find_map(|k| {
            let guard = self.slots[(slot + k) % n].try_lock().ok()?;
            guard.as_ref().filter(|c| !c.closed.is_cancelled()).cloned()
        })
    }

    /// Slot `slot`'s connection: the live one, or a new one put there.
    pub(crate) async fn open(&self, slot: usize, config: ClientConfig) -> Result<Conn, OpError> {
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

    /// Whether a connection this pool tried to open ever failed while it
    /// had others (see [`Peer::grow`]).
    fn ever_refused_growth(&self) -> bool {
        self.no_growth_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn pause_growth(&self) {
        *self
            .no_growth_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + GROW_BACKOFF);
    }
}
