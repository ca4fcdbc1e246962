//! How many same-host sockets the owner answers at once, and for how long
//! one that has proved nothing may hold its place.
//!
//! The owner's socket is an abstract one: the kernel checks no permission
//! on it, so any local process may connect, as often as it likes. Each
//! socket answered costs a task and a descriptor, and there are
//! [`SameHostLimits::max_peers`] places. The bounds mirror the endpoint's
//! for TCP (`ferry_control::limits`):
//!
//! - A socket is *unproven* until it has shown it belongs to a peer: where
//!   the node has a cluster secret, by proving it; where it has none, by
//!   being granted a region (which takes a handle's token). An unproven
//!   socket that sends nothing for [`SameHostLimits::unproven_timeout`]
//!   (its first packet, the secret's proof, its next request) is closed.
//!   Proven sockets wait for their peer's next request as long as it
//!   likes: a peer keeps one per owner, and asks only for new regions.
//! - At the bound, the socket that has waited longest for its client makes
//!   room for the newcomer, an unproven one before any proven one, if it has
//!   waited at least [`ferry_control::EVICTABLE_AFTER`] (a client that just
//!   connected is sending its first packet). Only when none has is the
//!   newcomer refused: its socket is closed at once. A socket busy with a
//!   request (the owner answering it) is never closed.
//!
//! A peer whose socket the owner closed connects afresh at its next op (an
//! owner that stopped refuses the connect, which is how the peer tells the
//! two apart, see `peer::Links`), so closing an idle socket costs it a
//! round trip, never a failed op.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_control::EVICTABLE_AFTER;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Bounds on the same-host sockets a node's memory transport answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SameHostLimits {
    /// Sockets answered at once. Notification lanes, once open, are not
    /// counted: they have a bound of their own.
    pub max_peers: usize,
    /// An unproven socket (see the module docs) that sends nothing for this
    /// long is closed: its first packet, the cluster secret's proof, each
    /// request before its first grant.
    pub unproven_timeout: Duration,
}

/// Upper bound of the default [`SameHostLimits::max_peers`].
const DEFAULT_MAX_PEERS: usize = 1024;

/// Default [`SameHostLimits::unproven_timeout`]: a peer sends its first
/// packet as soon as it connects and proves the secret in one round trip;
/// as long as the endpoint gives a hello.
pub const DEFAULT_UNPROVEN_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for SameHostLimits {
    /// An eighth of the process's descriptor limit (`RLIMIT_NOFILE`), at
    /// least 16 and at most 1024: one descriptor per socket, in a process
    /// whose endpoint takes most of the rest for TCP connections
    /// (`ferry_control::ConnectionLimits`).
    fn default() -> Self {
        let fds = ferry_control::socket::fd_limit().unwrap_or(u64::MAX);
        let max_peers = usize::try_from(fds / 8)
            .unwrap_or(usize::MAX)
            .clamp(16, DEFAULT_MAX_PEERS);
        SameHostLimits {
            max_peers,
            unproven_timeout: DEFAULT_UNPROVEN_TIMEOUT,
        }
    }
}

/// Why the owner closed a socket that waited for its client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Closed {
    /// Unproven, it sent nothing for this long.
    #[error("unproven and silent for {0:?}")]
    TimedOut(Duration),
    /// A newcomer needed its place at the bound.
    #[error("closed to make room for a new socket at the bound")]
    Evicted,
}

/// The places of the sockets answered now.
pub(crate) struct Places {
    limits: SameHostLimits,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    open: HashMap<u64, Entry>,
    next: u64,
    /// Whether the bound was reached (logged once per stretch).
    full: bool,
}

struct Entry {
    proven: bool,
    /// Since when it waits for its client, while it does.
    idle_since: Option<Instant>,
    /// Cancelled when it is evicted.
    evict: CancellationToken,
}

/// One socket's place; dropping it frees it.
pub(crate) struct Place {
    places: Arc<Places>,
    id: u64,
    evict: CancellationToken,
}

impl Places {
    pub fn new(limits: SameHostLimits) -> Arc<Self> {
        Arc::new(Places {
            limits,
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a new socket, unproven and waiting for its first packet;
    /// at the bound, another makes room for it (see the module docs), or
    /// `None`.
    pub fn admit(self: &Arc<Self>) -> Option<Place> {
        let max = self.limits.max_peers;
        let mut state = self.lock();
        if state.open.len() >= max {
            if !state.full {
                state.full = true;
                warn!(
                    "memory transport: {max} same-host sockets answered \
                     (SameHostLimits::max_peers); new ones are refused unless one waiting \
                     for its client makes room, an unproven one first"
                );
            }
            if !Self::evict(&mut state) {
                debug!("memory transport: a same-host socket refused at the bound");
                return None;
            }
        }
        state.next += 1;
        let id = state.next;
        let evict = CancellationToken::new();
        state.open.insert(
            id,
            Entry {
                proven: false,
                idle_since: Some(Instant::now()),
                evict: evict.clone(),
            },
        );
        Some(Place {
            places: self.clone(),
            id,
            evict,
        })
    }

    /// Closes the socket that has waited longest for its client, unproven
    /// ones first, if it has waited [`EVICTABLE_AFTER`]; frees its place at
    /// once. Whether there was one. A scan: it runs only at the bound.
    fn evict(state: &mut State) -> bool {
        let victim = state
            .open
            .iter()
            .filter_map(|(&id, e)| {
                let since = e.idle_since?;
                (since.elapsed() >= EVICTABLE_AFTER).then_some((e.proven, since, id))
            })
            .min();
        let Some((proven, _, id)) = victim else {
            return false;
        };
        if let Some(entry) = state.open.remove(&id) {
            entry.evict.cancel();
        }
        debug!(
            proven,
            "memory transport: closed an idle same-host socket to make room"
        );
        true
    }

    /// Sockets with a place now.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.lock().open.len()
    }
}

impl Place {
    /// Runs `wait`, the socket waiting for its client (a packet, the
    /// secret's proof): evictable meanwhile, and, while unproven, bounded
    /// by [`SameHostLimits::unproven_timeout`]. `Err` when the socket is
    /// to be closed (also when evicted just as `wait` finished).
    pub async fn waiting<F: Future>(&self, wait: F) -> Result<F::Output, Closed> {
        let proven = self.set_idle(true)?;
        // Busy again however this ends, dropped by its caller included.
        let _busy = BusyOnDrop(self);
        let limit = self.places.limits.unproven_timeout;
        let waited = tokio::select! {
            biased;
            _ = self.evict.cancelled() => Err(Closed::Evicted),
            out = wait => Ok(out),
            _ = tokio::time::sleep(limit), if !proven => Err(Closed::TimedOut(limit)),
        };
        if self.evict.is_cancelled() {
            return Err(Closed::Evicted);
        }
        waited
    }

    /// The socket belongs to a peer (see the module docs): no longer
    /// bounded in time, and evicted only when no unproven one can be.
    pub fn prove(&self) {
        if let Some(entry) = self.places.lock().open.get_mut(&self.id) {
            entry.proven = true;
        }
    }

    /// Marks the socket waiting or busy; whether it is proven, or
    /// `Evicted` when its place is gone.
    fn set_idle(&self, idle: bool) -> Result<bool, Closed> {
        let mut state = self.places.lock();
        let entry = state.open.get_mut(&self.id).ok_or(Closed::Evicted)?;
        entry.idle_since = match (entry.idle_since, idle) {
            (since @ Some(_), true) => since,
            (None, true) => Some(Instant::now()),
            (_, false) => None,
        };
        Ok(entry.proven)
    }
}

struct BusyOnDrop<'a>(&'a Place);

impl Drop for BusyOnDrop<'_> {
    fn drop(&mut self) {
        // An evicted socket has no entry left to mark.
        let _ = self.0.set_idle(false);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let max = self.places.limits.max_peers;
        let mut state = self.places.lock();
        state.open.remove(&self.id);
        // With some slack, so that a flood hovering at the bound is not
        // logged per socket.
        if state.full && state.open.len() < max.saturating_sub(max / 8) {
            state.full = false;
            info!(
                "memory transport: accepting new same-host sockets again ({} answered)",
                state.open.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(max_peers: usize) -> Arc<Places> {
        Places::new(SameHostLimits {
            max_peers,
            unproven_timeout: Duration::from_secs(5),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_bound_unproven_sockets_make_room_first_then_idle_proven_ones() {
        let places = places(3);
        let proven = places.admit().unwrap();
        proven.prove();
        tokio::time::advance(Duration::from_millis(10)).await;
        let unproven = places.admit().unwrap();
        let busy = places.admit().unwrap();
        busy.set_idle(false).unwrap();
        // Waiting for less than EVICTABLE_AFTER: nothing makes room.
        assert!(places.admit().is_none());
        tokio::time::advance(EVICTABLE_AFTER).await;
        // The unproven one goes first, though the proven one waited longer.
        let first = places.admit().unwrap();
        assert!(unproven.evict.is_cancelled() && !proven.evict.is_cancelled());
        assert_eq!(places.open(), 3);
        // Then the proven one (the newcomer has not waited long enough),
        // never the busy one.
        let second = places.admit().unwrap();
        assert!(proven.evict.is_cancelled() && !busy.evict.is_cancelled());
        assert!(places.admit().is_none(), "only busy and fresh ones left");
        // An evicted place gives nothing back twice.
        drop((unproven, proven));
        assert_eq!(places.open(), 3);
        drop((first, second, busy));
        assert_eq!(places.open(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unproven_socket_waits_its_timeout_a_proven_one_as_long_as_it_likes() {
        let places = places(2);
        let place = places.admit().unwrap();
        let never = std::future::pending::<()>();
        assert_eq!(
            place.waiting(never).await,
            Err(Closed::TimedOut(Duration::from_secs(5)))
        );
        assert_eq!(place.waiting(async { 7 }).await, Ok(7));
        place.prove();
        let late = async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            8
        };
        assert_eq!(place.waiting(late).await, Ok(8));
        // Evicted while waiting: told so (the other place is busy).
        let other = places.admit().unwrap();
        other.set_idle(false).unwrap();
        let waiting = place.waiting(std::future::pending::<()>());
        let evicting = async {
            tokio::time::sleep(EVICTABLE_AFTER).await;
            places.admit().unwrap()
        };
        let (waited, newcomer) = tokio::join!(waiting, evicting);
        assert_eq!(waited, Err(Closed::Evicted));
        assert_eq!(place.waiting(async {}).await, Err(Closed::Evicted));
        drop((place, other, newcomer));
        assert_eq!(places.open(), 0);
    }
}
