//! How many connections the endpoint holds open, in total and per remote
//! address, so that idle or hostile clients cannot take every descriptor of
//! the process and starve the peers it already serves.
//!
//! A connection is *idle* while it waits for its client: before its hello,
//! and, on a data channel, whenever it has no request in flight (the data
//! plane says so with [`ConnectionPermit::while_idle`]). A control session
//! is never idle here: it has its own liveness (keepalive and the peer
//! timeout) and its peer's requests may come at any time.
//!
//! An idle data connection is closed after [`ConnectionLimits::idle_timeout`].
//! Over a bound, the least recently used idle connection the bound counts
//! is closed to make room for the new one, if it has been idle for at least
//! [`EVICTABLE_AFTER`] (one idle only between a peer's requests is in use,
//! and one that just connected is saying its hello); only when none is is the
//! *new* connection refused, at once, before it costs a task or a buffer,
//! and told so in a hello reply ([`crate::HelloStatus::Busy`]). Connections
//! with work under way are untouched. Each stretch at a bound is logged once
//! when it starts and once when it ends.

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
}

/// Upper bound of the default total: every accepted data connection costs
/// a read buffer and kernel socket buffers.
const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Default [`ConnectionLimits::idle_timeout`]: long enough that a peer
/// submitting now and then keeps its connections, short enough that idle
/// clients give their descriptors back within a minute.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for ConnectionLimits {
    /// Derived from the process's descriptor limit (`RLIMIT_NOFILE`): a
    /// quarter of it (at least 32) stays free for everything else the process
    /// opens (listeners, outbound connections, RDMA devices, files); the rest,
    /// at most 4096, is for accepted connections, and a quarter of that (at
    /// least 8) for any one address.
    fn default() -> Self {
        let fds = crate::socket::fd_limit().unwrap_or(u64::MAX);
        let fds = usize::try_from(fds).unwrap_or(usize::MAX);
        let reserve = (fds / 4).max(32);
        let max_connections = fds
            .saturating_sub(reserve)
            .clamp(8, DEFAULT_MAX_CONNECTIONS);
        ConnectionLimits {
            max_connections,
            max_per_address: (max_connections / 4).max(8),
            hello_timeout: Duration::from_secs(10),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            frame_timeout: DEFAULT_FRAME_TIMEOUT,
        }
    }
}

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
    /// The tick and time it became idle at, while it is.
    idle_since: Option<(u64, Instant)>,
    /// Cancelled when it is evicted.
    evict: CancellationToken,
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
                idle_since: Some((id, Instant::now())),
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

    /// Closes the least recently used idle connection (from `address`, if
    /// given), if it has been idle long enough ([`EVICTABLE_AFTER`]), and
    /// frees its place at once: its task closes the socket moments later.
    /// Whether there was one.
    fn evict_lru(&self, state: &mut State, address: Option<IpAddr>) -> bool {
        let after = EVICTABLE_AFTER.min(self.limits.idle_timeout);
        let victim = {
            let State { idle, open, .. } = &*state;
            // The first one found is the least recently used: if it is
            // too fresh, so are the rest.
            idle.iter()
                .filter_map(|&(tick, id)| Some((tick, id, open.get(&id)?)))
                .find(|(_, _, o)| address.is_none_or(|a| o.address == a))
                .filter(|(_, _, o)| o.idle_since.is_some_and(|(_, at)| at.elapsed() >= after))
                .map(|(tick, id, _)| (tick, id))
        };
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

    /// Marks connection `id` idle (keeping the time it became so, if it
    /// already was) or busy; `Evicted` if it no longer has a place.
    fn set_idle(&self, id: u64, idle: bool) -> Result<(), IdleClose> {
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
        match (entry.idle_since, idle) {
            (None, true) => {
                *tick += 1;
                entry.idle_since = Some((*tick, Instant::now()));
                idle_set.insert((*tick, id));
            }
            (Some((since, _)), false) => {
                entry.idle_since = None;
                idle_set.remove(&(since, id));
            }
            _ => {}
        }
        Ok(())
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
        self.idle_within(self.admission.limits.idle_timeout, wait)
            .await
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
        self.idle_within(limit, wait).await.map_err(|e| match e {
            IdleClose::TimedOut(limit) => IdleClose::Stalled(limit),
            e => e,
        })
    }

    /// [`Self::while_idle`] with its own time limit (the hello's).
    pub(crate) async fn idle_within<F: Future>(
        &self,
        limit: Duration,
        wait: F,
    ) -> Result<F::Output, IdleClose> {
        self.admission.set_idle(self.id, true)?;
        // Busy again however this ends, dropped by its caller included.
        let busy = BusyOnDrop(self);
        let waited = tokio::select! {
            biased;
            _ = self.evict.cancelled() => Err(IdleClose::Evicted),
            out = wait => Ok(out),
            _ = tokio::time::sleep(limit) => Err(IdleClose::TimedOut(limit)),
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
        _ = self.0.admission.set_idle(self.0.id, false);
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
        if let Some((since, _)) = open.idle_since {
            state.idle.remove(&(since, self.id));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_address: usize) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: total,
            max_per_address: per_address,
            hello_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
        }
    }

    /// A permit whose connection said its hello and has work under way.
    fn busy(admission: &Arc<Admission>, address: IpAddr) -> Option<ConnectionPermit> {
        let permit = admission.admit(address)?;
        admission.set_idle(permit.id, false).unwrap();
        Some(permit)
    }

    #[test]
    fn bounds_refuse_new_connections_and_free_on_drop() {
        let admission = Admission::new(limits(5, 3), "127.0.0.1:1".parse().unwrap());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let from_a: Vec<_> = (0..3).map(|_| busy(&admission, a).unwrap()).collect();
        assert!(admission.admit(a).is_none(), "per-address bound");
        let from_b: Vec<_> = (0..2).map(|_| busy(&admission, b).unwrap()).collect();
        assert!(admission.admit(b).is_none(), "total bound");
        assert_eq!(admission.open(a), (5, 3, 0));
        drop(from_a);
        assert_eq!(admission.open(a), (2, 0, 0));
        assert!(admission.admit(b).is_some(), "room again");
        drop(from_b);
        assert_eq!(admission.open(b), (0, 0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn at_a_bound_the_least_recently_idle_connection_makes_room() {
        let admission = Admission::new(limits(4, 3), "127.0.0.1:1".parse().unwrap());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        // From a: one busy, then two idle (the first of them idle longest).
        let a_busy = busy(&admission, a).unwrap();
        let a_old = admission.admit(a).unwrap();
        let a_new = admission.admit(a).unwrap();
        // Idle for less than EVICTABLE_AFTER: in use, nothing makes room.
        assert!(admission.admit(a).is_none());
        tokio::time::advance(EVICTABLE_AFTER).await;
        // The per-address bound evicts a's oldest idle one, not its busy one.
        let a_newest = admission.admit(a).unwrap();
        assert!(a_old.evict.is_cancelled());
        assert!(!a_busy.evict.is_cancelled() && !a_new.evict.is_cancelled());
        assert_eq!(admission.open(a), (3, 3, 2));
        // The total bound evicts the oldest idle one of any address.
        let b_first = busy(&admission, b).unwrap();
        assert_eq!(admission.open(b), (4, 1, 2));
        tokio::time::advance(EVICTABLE_AFTER).await;
        let b_second = busy(&admission, b).unwrap();
        assert!(a_new.evict.is_cancelled() && !a_newest.evict.is_cancelled());
        // An evicted permit gives nothing back twice.
        drop((a_old, a_new));
        assert_eq!(admission.open(a), (4, 2, 1));
        // Nothing idle from b and the total full of busy ones: refused.
        admission.set_idle(a_newest.id, false).unwrap();
        assert!(admission.admit(b).is_none());
        drop((a_busy, a_newest, b_first, b_second));
        assert_eq!(admission.open(a), (0, 0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_closed_by_its_timeout_or_its_eviction() {
        let admission = Admission::new(limits(1, 1), "127.0.0.1:1".parse().unwrap());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let permit = busy(&admission, a).unwrap();
        let limit = Duration::from_millis(20);
        let never = std::future::pending::<()>();
        assert_eq!(
            permit.idle_within(limit, never).await,
            Err(IdleClose::TimedOut(limit))
        );
        assert_eq!(permit.idle_within(limit, async { 7 }).await, Ok(7));
        let waiting = permit.while_idle(std::future::pending::<()>());
        let evicting = async {
            tokio::time::sleep(EVICTABLE_AFTER / 2).await;
            assert!(admission.admit(a).is_none(), "idle too briefly");
            tokio::time::sleep(EVICTABLE_AFTER / 2).await;
            admission.admit(a).unwrap()
        };
        let (waited, newcomer) = tokio::join!(waiting, evicting);
        assert_eq!(waited, Err(IdleClose::Evicted));
        assert_eq!(
            permit.idle_within(limit, async { 7 }).await,
            Err(IdleClose::Evicted)
        );
        drop(permit);
        assert_eq!(admission.open(a), (1, 1, 1));
        drop(newcomer);
        assert_eq!(admission.open(a), (0, 0, 0));
    }

    #[test]
    fn defaults_leave_room_for_the_process_and_several_peers() {
        let limits = ConnectionLimits::default();
        assert!(limits.max_connections >= 8);
        assert!(limits.max_per_address >= 8);
        assert!(limits.max_per_address <= limits.max_connections);
        if let Some(fds) = crate::socket::fd_limit() {
            assert!(
                (limits.max_connections as u64) < fds,
                "{limits:?} vs {fds} fds"
            );
        }
    }
}
