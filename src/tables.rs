//! How much per-peer state a node holds: every table that grows with the
//! peers it talks to, counted, so that a leak (an entry kept after its peer
//! went away) shows, in tests, in `ferry info` and in `/metrics`.

use crate::Node;

/// Sizes of a node's per-peer tables at one moment. Each says when its
/// entries are released; a node whose peers have all gone returns to the
/// counts it had before they came, within those bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerTables {
    /// Peers with an entry in the table of control sessions this node
    /// opened: released when the session closes, or when the last caller
    /// opening it fails.
    pub session_slots: usize,
    /// Control sessions running, in both directions: each ends when its
    /// peer closes it, its connection breaks (keepalive gives up on a
    /// silent peer within about 25 s), or this node shuts down.
    pub live_sessions: usize,
    /// Connections peers opened to this node's endpoint that are open
    /// (control and data): released when each one's task ends.
    pub accepted_connections: usize,
    /// Sessions with a line of messages waiting for the inbox: released
    /// when the session closes.
    pub message_lines: usize,
    /// Peers with a TCP connection pool: released when the pool's last
    /// connection closes with no submit using it.
    pub tcp_pools: usize,
    /// TCP data connections this node opened, open now.
    pub tcp_connections: usize,
    /// Same-host owners linked over the memory transport's socket (or
    /// remembered unreachable): released within a second of the owner's
    /// socket closing, an unreachable verdict after five seconds.
    pub memory_links: usize,
    /// Same-host peers whose requests this node answers: released as
    /// their socket closes.
    pub memory_served: usize,
    /// Notification lanes same-host peers opened into this node (each on
    /// a socket of its own, counted in `memory_served` too): released once
    /// their socket closed and what their ring held is in the inbox.
    pub memory_lanes: usize,
    /// Peers whose metadata this node holds: unnamed ones fetched are
    /// released when this node's control session to them closes; named
    /// ones stay, one per name, until forgotten or replaced by a restart;
    /// those loaded by hand stay until forgotten.
    pub known_peers: usize,
    /// Peers with an ibverbs queue-pair slot (0 without a device): released
    /// once the queue pair is broken (its peer's control session ended, or
    /// an op failed) and its outstanding requests have flushed.
    pub ibverbs_peers: usize,
    /// Queue pairs kept for ibverbs initiators: released when their
    /// control session ends.
    pub ibverbs_passive: usize,
}

impl PeerTables {
    /// The tables as `(name, size)` pairs, e.g. for metrics gauges.
    pub fn entries(&self) -> [(&'static str, usize); 12] {
        [
            ("session_slots", self.session_slots),
            ("live_sessions", self.live_sessions),
            ("accepted_connections", self.accepted_connections),
            ("message_lines", self.message_lines),
            ("tcp_pools", self.tcp_pools),
            ("tcp_connections", self.tcp_connections),
            ("memory_links", self.memory_links),
            ("memory_served", self.memory_served),
            ("memory_lanes", self.memory_lanes),
            ("known_peers", self.known_peers),
            ("ibverbs_peers", self.ibverbs_peers),
            ("ibverbs_passive", self.ibverbs_passive),
        ]
    }
}

impl Node {
    /// The sizes of this node's per-peer tables now (see [`PeerTables`]
    /// for when each entry is released).
    pub fn peer_tables(&self) -> PeerTables {
        let router = &self.0.router;
        let (ibverbs_peers, ibverbs_passive) =
            router.ibverbs.as_ref().map_or((0, 0), |i| i.peer_tables());
        PeerTables {
            session_slots: router.endpoint.session_table_len(),
            live_sessions: router.endpoint.live_sessions(),
            accepted_connections: router.endpoint.accepted_connections(),
            message_lines: router.messages.lines(),
            tcp_pools: router.tcp.peer_pools(),
            tcp_connections: router.tcp.open_connections(),
            memory_links: router.memory.as_ref().map_or(0, |m| m.links()),
            memory_served: router.memory.as_ref().map_or(0, |m| m.served_peers()),
            memory_lanes: router.memory.as_ref().map_or(0, |m| m.served_lanes()),
            known_peers: self.known_peers(),
            ibverbs_peers,
            ibverbs_passive,
        }
    }
}
