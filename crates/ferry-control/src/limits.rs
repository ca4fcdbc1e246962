//! How many connections the endpoint holds open, in total and per remote
//! address, so that idle or hostile clients cannot take every descriptor of
//! the process and starve the peers it already serves.
//!
//! A connection is *idle* while it waits for its client: before its hello
//! (*unproven*); on a data channel, whenever it has no request in flight
//! (the data plane says so with [`ConnectionPermit::while_idle`]); on a
//! control session, between frames. A control session is never closed for
//! idling (it has its own liveness: keepalive and the peer timeout, and its
//! peer's requests may come at any time), but one that has received
//! nothing for [`ConnectionLimits::session_evictable_after`], with no
//! request in flight either way and nothing of a data plane's tied to it
//! ([`ConnectionPermit::hold`], `Session::hold`), may make room.
//!
//! An idle data connection is closed after [`ConnectionLimits::idle_timeout`].
//! Over a bound, an idle connection the bound counts is closed to make room
//! for the new one: an unproven one first, then an idle data connection,
//! then an idle control session, the least recently used of each kind,
//! if it has been idle for long enough ([`EVICTABLE_AFTER`], one idle only
//! between a peer's requests being in use, and one that just connected
//! saying its hello; a session, [`ConnectionLimits::session_evictable_after`]).
//! Only when none is is the *new* connection refused, at once, before it
//! costs a task or a buffer, and told so in a hello reply
//! ([`crate::HelloStatus::Busy`]). Connections with work under way are
//! untouched. Each stretch at a bound is logged once when it starts and
//! once when it ends.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Bounds on the connections an endpoint accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Accepted connections open at once, over all clients (hello pending
    /// or done). Outbound connections are not counted.
    pub max_connections: usize,
    /// Accepted connections open at once from one IP address. A peer node
    /// uses one control connection plus its TCP data connections (4 by
    /// default), so this leaves room for several nodes per host.
    pub max_per_address: usize,
    /// A client that has not completed its hello by then is disconnected.
    pub hello_timeout: Duration,
    /// A data connection with no request in flight for this long is closed,
    /// so that clients which connect and then wait hold nothing for long; a
    /// peer that needs it again reconnects. Control sessions are not
    /// subject to it (see [`crate::EndpointConfig::peer_timeout`]).
    pub idle_timeout: Duration,
    /// A connection, data or control, whose client began a frame (a
    /// header, a ranges table, a write's payload, a control frame) and
    /// then sent nothing for this long is closed. While it waits for the
    /// rest it counts as idle, so at a bound it is evicted like an idle
    /// connection once silent for [`EVICTABLE_AFTER`]: a peer that stalls
    /// mid-frame holds a place no longer than one that sends nothing.
    /// Counted from the last byte that came, not the frame's first, so a
    /// large payload on a slow link is never cut while it moves.
    pub frame_timeout: Duration,
    /// A control session that has received nothing for this long, with no
    /// request in flight either way and no data plane holding it, may be
    /// closed to make room at a bound (after unproven connections and idle
    /// data connections), so that idle sessions cannot lock a new peer
    /// out. It is never closed for idling otherwise; a peer whose session
    /// was closed opens a new one at its next request.
    pub session_evictable_after: Duration,
}

/// Upper bound of the default total: every accepted data connection costs
/// a read buffer and kernel socket buffers.
const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Default [`ConnectionLimits::idle_timeout`]: long enough that a peer
/// submitting now and then keeps its connections, short enough that idle
/// clients give their descriptors back within a minute.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections one peer node opens to another: its control session and
/// its TCP data connections (4 by default).
const CONNECTIONS_PER_NODE: usize = 5;

/// Peer nodes on one host (one address) the default per-address bound
/// leaves room for, each with [`CONNECTIONS_PER_NODE`] connections: one
/// per GPU of a large host, and then some.
const NODES_PER_ADDRESS: usize = 16;

impl Default for ConnectionLimits {
    /// Derived from the process's descriptor limit (`RLIMIT_NOFILE`): a
    /// quarter of it (at least 32) stays free for everything else the process
    /// opens (listeners, outbound connections, RDMA devices, files); the rest,
    /// at most 4096, is for accepted connections. Any one address gets a
    /// sixteenth of those, but room for 16 peer nodes (80 connections) at
    /// least, and never more than a quarter (nor fewer than 8): one host's
    /// flood holds a small share, and a host of several nodes still fits.
    fn default() -> Self {
        let fds = crate::socket::fd_limit().unwrap_or(u64::MAX);
        let fds = usize::try_from(fds).unwrap_or(usize::MAX);
        let reserve = (fds / 4).max(32);
        let max_connections = fds
            .saturating_sub(reserve)
            .clamp(8, DEFAULT_MAX_CONNECTIONS);
        let max_per_address = (max_connections / 16)
            .max(NODES_PER_ADDRESS * CONNECTIONS_PER_NODE)
            .min(max_connections / 4)
            .max(8);
        ConnectionLimits {
            max_connections,
            max_per_address,
            hello_timeout: Duration::from_secs(10),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            frame_timeout: DEFAULT_FRAME_TIMEOUT,
            session_evictable_after: DEFAULT_SESSION_EVICTABLE_AFTER,
        }
    }
}

/// Default [`ConnectionLimits::session_evictable_after`]: as long as a
/// hello may take, and far longer than the gaps between a working peer's
/// requests; a flood of idle sessions that has just filled a bound locks a
/// new peer out no longer than this.
pub const DEFAULT_SESSION_EVICTABLE_AFTER: Duration = Duration::from_secs(10);

/// Default [`ConnectionLimits::frame_timeout`]: the default peer timeout
/// ([`crate::socket::DEFAULT_PEER_TIMEOUT`]), after which a peer that
/// acknowledges nothing is taken for lost; one that sends nothing in the
/// middle of a frame for as long is lost or hostile.
pub const DEFAULT_FRAME_TIMEOUT: Duration = crate::socket::DEFAULT_PEER_TIMEOUT;

/// How long a connection must have been idle before it may be evicted to
/// make room (or its idle timeout, if shorter): long against the gap
/// between a working peer's requests or a client's connect and its hello,
/// short against how long an idle client holds its place.
pub const EVICTABLE_AFTER: Duration = Duration::from_secs(1);

/// Why the endpoint closed a connection that was waiting for its client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdleClose {
    /// The client sent nothing for this long.
    #[error("idle for {0:?}")]
    TimedOut(Duration),
    /// A new connection needed its place under a bound, and it was the
    /// least recently used idle one.
    #[error("closed to make room for a new connection at the connection limit")]
    Evicted,
    /// The client began a frame and then sent nothing for this long
    /// ([`ConnectionLimits::frame_timeout`]).
    #[error("silent for {0:?} in the middle of a frame")]
    Stalled(Duration),
}

/// Counts of open accepted connections.
pub(crate) struct Admission {
    limits: ConnectionLimits,
    /// The endpoint's own address, for log lines.
    endpoint: SocketAddr,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
    /// Whether the total bound was reached (logged once per stretch).
    full: bool,
    /// Addresses whose bound was reached (each logged once per stretch).
    full_addresses: HashSet<IpAddr>,
    /// Every connection counted above, by id; an evicted one leaves at once.
    open: HashMap<u64, Open>,
    /// The idle ones among them, least recently used first: (the tick it
    /// became idle at, its id).
    idle: BTreeSet<(u64, u64)>,
    /// Gives out ids and ticks, both increasing.
    tick: u64,
}

struct Open {
    address: IpAddr,
    /// While it is idle: what it waits for, and the tick and time it began.
    idle: Option<Idle>,
    /// Holds on it ([`ConnectionPermit::hold`]): never evicted while any.
    holds: usize,
    /// Cancelled when it is evicted.
    evict: CancellationToken,
}

#[derive(Clone, Copy)]
struct Idle {
    waits: Waits,
    tick: u64,
    at: Instant,
}

/// What an idle connection waits for, in the order they make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waits {
    /// Its hello: it has proved nothing.
    Hello,
    /// A data channel's next request, or the rest of a frame.
    Data,
    /// A control session's next frame.
    Session,
}

/// One accepted connection's place under the limits; dropping it frees it.
/// Whoever serves the connection holds it, and says through it when the
/// connection waits for its client ([`ConnectionPermit::while_idle`]).
pub struct ConnectionPermit {
    admission: Arc<Admission>,
    id: u64,
    address: IpAddr,
    evict: CancellationToken,
}

impl std::fmt::Debug for ConnectionPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionPermit")
            .field("id", &self.id)
            .field("address", &self.address)
            .finish()
    }
}

impl Admission {
    pub fn new(limits: ConnectionLimits, endpoint: SocketAddr) -> Arc<Self> {
        Arc::new(Admission {
            limits,
            endpoint,
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A permit for a new connection from `address`, idle until its hello.
    /// At a bound, the least recently used idle connection that bound
    /// counts is evicted to make room; with none idle, `None`. One log line
    /// per stretch at a bound.
    pub fn admit(self: &Arc<Self>, address: IpAddr) -> Option<ConnectionPermit> {
        let limits = self.limits;
        let mut state = self.lock();
        let from_address = state.per_address.get(&address).copied().unwrap_or(0);
        if from_address >= limits.max_per_address {
            if state.full_addresses.insert(address) {
                warn!(
                    endpoint = %self.endpoint,
                    %address,
                    "refusing new connections from {address} unless an idle one makes room: it \
                     has {from_address} open, the per-address limit is {} \
                     (ConnectionLimits::max_per_address); serving those with work under way",
                    limits.max_per_address
                );
            }
            if !self.evict_lru(&mut state, Some(address)) {
                metrics::counter!("ferry_endpoint_refused_total", "bound" => "address")
                    .increment(1);
                return None;
            }
        } else if state.total >= limits.max_connections {
            if !state.full {
                state.full = true;
                warn!(
                    endpoint = %self.endpoint,
                    "refusing new connections unless an idle one makes room: {} are open, the \
                     limit is {} (ConnectionLimits::max_connections); serving those with work \
                     under way",
                    state.total, limits.max_connections
                );
            }
            if !self.evict_lru(&mut state, None) {
                metrics::counter!("ferry_endpoint_refused_total", "bound" => "total").increment(1);
                return None;
            }
        }
        state.tick += 1;
        let id = state.tick;
        let evict = CancellationToken::new();
        state.total += 1;
        *state.per_address.entry(address).or_default() += 1;
        state.open.insert(
            id,
            Open {
                address,
                idle: Some(Idle {
                    waits: Waits::Hello,
                    tick: id,
                    at: Instant::now(),
                }),
                holds: 0,
                evict: evict.clone(),
            },
        );
        state.idle.insert((id, id));
        Some(ConnectionPermit {
            admission: self.clone(),
            id,
            address,
            evict,
        })
    }

    /// Closes an idle connection (from `address`, if given) that has been
    /// idle long enough, and frees its place at once: its task closes the
    /// socket moments later. The least recently used unproven one, else
    /// data connection, else control session (see the module docs); none
    /// that is held. Whether there was one.
    fn evict_lru(&self, state: &mut State, address: Option<IpAddr>) -> bool {
        let limits = &self.limits;
        let victim = [Waits::Hello, Waits::Data, Waits::Session]
            .into_iter()
            .find_map(|waits| {
                let after = match waits {
                    Waits::Hello | Waits::Data => EVICTABLE_AFTER.min(limits.idle_timeout),
                    Waits::Session => limits.session_evictable_after,
                };
                let State { idle, open, .. } = &*state;
                // The first one found is the least recently used of its
                // kind: if it is too fresh, so are the rest.
                idle.iter()
                    .filter_map(|&(tick, id)| Some((tick, id, open.get(&id)?)))
                    .filter(|(_, _, o)| o.holds == 0 && address.is_none_or(|a| o.address == a))
                    .find(|(_, _, o)| o.idle.is_some_and(|i| i.waits == waits))
                    .filter(|(_, _, o)| o.idle.is_some_and(|i| i.at.elapsed() >= after))
                    .map(|(tick, id, _)| (tick, id))
            });
        let Some((tick, id)) = victim else {
            return false;
        };
        state.idle.remove(&(tick, id));
        let Some(open) = state.open.remove(&id) else {
            return false;
        };
        open.evict.cancel();
        uncount(state, open.address);
        let bound = if address.is_some() {
            "address"
        } else {
            "total"
        };
        metrics::counter!("ferry_endpoint_evicted_total", "bound" => bound).increment(1);
        debug!(endpoint = %self.endpoint, address = %open.address, bound, "closed an idle connection to make room");
        true
    }

    /// Marks connection `id` idle, waiting for `waits` (keeping the time it
    /// became so, if it already was), or busy (`None`); `Evicted` if it no
    /// longer has a place.
    fn set_idle(&self, id: u64, waits: Option<Waits>) -> Result<(), IdleClose> {
        let mut state = self.lock();
        let State {
            open,
            idle: idle_set,
            tick,
            ..
        } = &mut *state;
        let Some(entry) = open.get_mut(&id) else {
            return Err(IdleClose::Evicted);
        };
        match (&mut entry.idle, waits) {
            (None, Some(waits)) => {
                *tick += 1;
                entry.idle = Some(Idle {
                    waits,
                    tick: *tick,
                    at: Instant::now(),
                });
                idle_set.insert((*tick, id));
            }
            (Some(idle), Some(waits)) => idle.waits = waits,
            (Some(idle), None) => {
                idle_set.remove(&(idle.tick, id));
                entry.idle = None;
            }
            (None, None) => {}
        }
        Ok(())
    }

    /// Takes a hold on connection `id` (`true`) or lets one go; the last
    /// one let go of an idle connection restarts its idle time: it was in
    /// use until then.
    fn hold(&self, id: u64, take: bool) {
        let mut state = self.lock();
        let State {
            open,
            idle: idle_set,
            tick,
            ..
        } = &mut *state;
        let Some(entry) = open.get_mut(&id) else {
            return;
        };
        if take {
            entry.holds += 1;
            return;
        }
        entry.holds = entry.holds.saturating_sub(1);
        if entry.holds == 0
            && let Some(idle) = &mut entry.idle
        {
            idle_set.remove(&(idle.tick, id));
            *tick += 1;
            idle.tick = *tick;
            idle.at = Instant::now();
            idle_set.insert((*tick, id));
        }
    }

    /// Connections open now, in total.
    pub fn open_total(&self) -> usize {
        self.lock().total
    }

    /// Connections open now: (total, from `address`, idle).
    #[cfg(test)]
    pub fn open(&self, address: IpAddr) -> (usize, usize, usize) {
        let state = self.lock();
        (
            state.total,
            state.per_address.get(&address).copied().unwrap_or(0),
            state.idle.len(),
        )
    }
}

/// Takes one connection from `address` off the counts; what is left from
/// `address`.
fn uncount(state: &mut State, address: IpAddr) -> usize {
    state.total -= 1;
    let left = match state.per_address.get_mut(&address) {
        Some(count) => {
            *count -= 1;
            *count
        }
        None => 0,
    };
    if left == 0 {
        state.per_address.remove(&address);
    }
    left
}

impl ConnectionPermit {
    /// Runs `wait`, the connection waiting for its client's next request,
    /// with the connection idle: `Err` instead when it is to be closed, for
    /// [`ConnectionLimits::idle_timeout`] passing first or for its eviction
    /// (also when evicted just as `wait` finished: its place is gone). A
    /// data plane calls this whenever it has nothing in flight for the
    /// client, and nowhere else; a connection never waited on this way is
    /// neither closed when idle nor evicted.
    pub async fn while_idle<F: Future>(&self, wait: F) -> Result<F::Output, IdleClose> {
        let limit = self.admission.limits.idle_timeout;
        self.wait_idle(Waits::Data, Some(limit), wait).await
    }

    /// Runs `wait`, the connection waiting for more of a frame its client
    /// began (a payload, a table, the rest of a header or control frame):
    /// idle, so evictable at a bound once it has waited [`EVICTABLE_AFTER`],
    /// and `Err(Stalled)` once it has waited
    /// [`ConnectionLimits::frame_timeout`]. Call it around each wait for
    /// the socket, not around a whole payload: each wait ends when bytes
    /// come, so the bound is on silence, never on a transfer's length.
    pub async fn while_mid_frame<F: Future>(&self, wait: F) -> Result<F::Output, IdleClose> {
        let limit = self.admission.limits.frame_timeout;
        let waited = self.wait_idle(Waits::Data, Some(limit), wait).await;
        waited.map_err(|e| match e {
            IdleClose::TimedOut(limit) => IdleClose::Stalled(limit),
            e => e,
        })
    }

    /// Runs `wait`, a control session waiting for its peer's next frame:
    /// never closed for it, but evictable at a bound once it has waited
    /// [`ConnectionLimits::session_evictable_after`] with no hold on it
    /// (`Err(Evicted)`).
    pub(crate) async fn while_session_idle<F: Future>(
        &self,
        wait: F,
    ) -> Result<F::Output, IdleClose> {
        self.wait_idle(Waits::Session, None, wait).await
    }

    /// Keeps the connection from being evicted while the returned hold
    /// lives, idle or not: for what is in flight on it (a request, a
    /// handler) and for state a data plane ties to it (queue pairs), which
    /// its client cannot be seen to use. When the last hold goes, its idle
    /// time starts again. Its timeouts still apply.
    pub fn hold(&self) -> ConnectionHold {
        self.admission.hold(self.id, true);
        ConnectionHold(Some((self.admission.clone(), self.id)))
    }

    /// [`Self::while_idle`] with its own time limit (the hello's).
    pub(crate) async fn idle_within<F: Future>(
        &self,
        limit: Duration,
        wait: F,
    ) -> Result<F::Output, IdleClose> {
        self.wait_idle(Waits::Hello, Some(limit), wait).await
    }

    /// Runs `wait` with the connection idle, waiting for `waits`, for
    /// `limit` at most.
    async fn wait_idle<F: Future>(
        &self,
        waits: Waits,
        limit: Option<Duration>,
        wait: F,
    ) -> Result<F::Output, IdleClose> {
        self.admission.set_idle(self.id, Some(waits))?;
        // Busy again however this ends, dropped by its caller included.
        let busy = BusyOnDrop(self);
        let timeout = async {
            match limit {
                Some(limit) => tokio::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        let waited = tokio::select! {
            biased;
            _ = self.evict.cancelled() => Err(IdleClose::Evicted),
            out = wait => Ok(out),
            _ = timeout => Err(IdleClose::TimedOut(limit.unwrap_or_default())),
        };
        drop(busy);
        // Evicted under the same lock that marks it busy: checked after.
        if self.evict.is_cancelled() {
            return Err(IdleClose::Evicted);
        }
        waited
    }
}

struct BusyOnDrop<'a>(&'a ConnectionPermit);

impl Drop for BusyOnDrop<'_> {
    fn drop(&mut self) {
        // An evicted connection has no entry left to mark.
        _ = self.0.admission.set_idle(self.0.id, None);
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let admission = &self.admission;
        let limits = admission.limits;
        let mut state = admission.lock();
        // An evicted connection's place was freed when it was evicted.
        let Some(open) = state.open.remove(&self.id) else {
            return;
        };
        if let Some(idle) = open.idle {
            state.idle.remove(&(idle.tick, self.id));
        }
        let left = uncount(&mut state, self.address);
        // A stretch at a bound ends once there is room again; with some
        // slack, so a flood hovering at the bound is not logged per accept.
        if state.full
            && state.total
                < limits
                    .max_connections
                    .saturating_sub(limits.max_connections / 8)
        {
            state.full = false;
            info!(endpoint = %admission.endpoint, "accepting new connections again ({} open)", state.total);
        }
        if left
            < limits
                .max_per_address
                .saturating_sub(limits.max_per_address / 8)
            && state.full_addresses.remove(&self.address)
        {
            info!(endpoint = %admission.endpoint, address = %self.address, "accepting new connections from {} again", self.address);
        }
    }
}

mod hold;
#[cfg(test)]
mod tests;

pub use hold::ConnectionHold;
