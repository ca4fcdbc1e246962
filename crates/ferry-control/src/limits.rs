//! How many connections the endpoint holds open, in total and per remote
//! address, so that idle or hostile clients cannot take every descriptor of
//! the process and starve the peers it already serves.
//!
//! Over a bound, a *new* connection is closed at once, before it costs a
//! task or a buffer; the connections already open are untouched. Each
//! stretch of refusals is logged once when it starts and once when it ends.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{info, warn};

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
}

/// Upper bound of the default total: every accepted data connection costs
/// a read buffer and kernel socket buffers.
const DEFAULT_MAX_CONNECTIONS: usize = 4096;

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
        }
    }
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
    /// Whether the total bound is refusing connections (logged once).
    full: bool,
    /// Addresses whose bound is refusing connections (each logged once).
    full_addresses: HashSet<IpAddr>,
}

/// One accepted connection's place under the limits; dropping it frees it.
pub struct ConnectionPermit {
    admission: Arc<Admission>,
    address: IpAddr,
}

impl std::fmt::Debug for ConnectionPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionPermit")
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

    /// A permit for a new connection from `address`, or `None` (and one log
    /// line per stretch of refusals) when a bound is reached.
    pub fn admit(self: &Arc<Self>, address: IpAddr) -> Option<ConnectionPermit> {
        let limits = self.limits;
        let mut state = self.lock();
        let from_address = state.per_address.get(&address).copied().unwrap_or(0);
        if state.total >= limits.max_connections {
            if !state.full {
                state.full = true;
                warn!(
                    endpoint = %self.endpoint,
                    "refusing new connections: {} are open, the limit is {} \
                     (ConnectionLimits::max_connections); serving those already open",
                    state.total, limits.max_connections
                );
            }
            metrics::counter!("ferry_endpoint_refused_total", "bound" => "total").increment(1);
            return None;
        }
        if from_address >= limits.max_per_address {
            if state.full_addresses.insert(address) {
                warn!(
                    endpoint = %self.endpoint,
                    %address,
                    "refusing new connections from {address}: it has {from_address} open, the \
                     per-address limit is {} (ConnectionLimits::max_per_address)",
                    limits.max_per_address
                );
            }
            metrics::counter!("ferry_endpoint_refused_total", "bound" => "address").increment(1);
            return None;
        }
        state.total += 1;
        *state.per_address.entry(address).or_default() += 1;
        Some(ConnectionPermit {
            admission: self.clone(),
            address,
        })
    }

    /// Connections open now, in total.
    pub fn open_total(&self) -> usize {
        self.lock().total
    }

    /// Connections open now: (total, from `address`).
    #[cfg(test)]
    pub fn open(&self, address: IpAddr) -> (usize, usize) {
        let state = self.lock();
        (
            state.total,
            state.per_address.get(&address).copied().unwrap_or(0),
        )
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let admission = &self.admission;
        let limits = admission.limits;
        let mut state = admission.lock();
        state.total -= 1;
        let left = match state.per_address.get_mut(&self.address) {
            Some(count) => {
                *count -= 1;
                *count
            }
            None => 0,
        };
        if left == 0 {
            state.per_address.remove(&self.address);
        }
        // A stretch of refusals ends once there is room again; with some
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
        }
    }

    #[test]
    fn bounds_refuse_new_connections_and_free_on_drop() {
        let admission = Admission::new(limits(5, 3), "127.0.0.1:1".parse().unwrap());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let from_a: Vec<_> = (0..3).map(|_| admission.admit(a).unwrap()).collect();
        assert!(admission.admit(a).is_none(), "per-address bound");
        let from_b: Vec<_> = (0..2).map(|_| admission.admit(b).unwrap()).collect();
        assert!(admission.admit(b).is_none(), "total bound");
        assert_eq!(admission.open(a), (5, 3));
        drop(from_a);
        assert_eq!(admission.open(a), (2, 0));
        assert!(admission.admit(b).is_some(), "room again");
        drop(from_b);
        assert_eq!(admission.open(b), (0, 0));
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
