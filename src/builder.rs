//! Configuring and starting a node: which address it listens on and
//! advertises, which transports it starts (and requires), and their tuning.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ferry_control::inbox::{DEFAULT_INBOX_CAPACITY, DEFAULT_MAX_MESSAGE};
use ferry_control::rpc::DEFAULT_MAX_RPC_PAYLOAD;
use ferry_control::{
    ClusterSecret, ConnectionLimits, Dialer, Endpoint, EndpointConfig, EndpointError, Messages,
    Rpc, SecretError,
};
use ferry_core::{NodeId, RdmaTransportLevel, RegionIds};
use ferry_ibverbs::{IbvBackend, IbvConfig, IbvDevice};
use ferry_memory::MemoryBackend;
use ferry_tcp::{TcpBackend, TcpConfig};
use kameo::actor::Spawn;
use tracing::info;

use crate::actor::NodeActor;
use crate::meters::Meters;
use crate::names::Names;
use crate::node::{Node, NodeInner};
use crate::router::Router;
use crate::transports::{TransportState, TransportStatus};

/// Setting this environment variable to `1` keeps a node off RDMA, as
/// [`NodeBuilder::ibverbs`]`(false)` does.
pub const DISABLE_IBVERBS_ENV: &str = "FERRY_DISABLE_IBVERBS";

/// The address a node advertises to peers when the builder names none:
/// an IP (the bound port is used) or IP:PORT. See [`NodeBuilder::advertise`].
pub const ADVERTISE_ENV: &str = "FERRY_ADVERTISE";
/// Set to `1`, turns the same-host memory transport off whatever the
/// builder says.
pub const DISABLE_MEMORY_ENV: &str = "FERRY_DISABLE_MEMORY";

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The endpoint could not start: the address is taken, or it listens on
    /// every interface with no address to advertise.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// A transport the builder requires ([`NodeBuilder::require`]) cannot
    /// start here.
    #[error("{transport} required but unavailable: {reason}")]
    TransportUnavailable {
        /// The transport required.
        transport: RdmaTransportLevel,
        /// Why it cannot start.
        reason: String,
    },
    /// `FERRY_ADVERTISE` holds something that is not an address.
    #[error("{ADVERTISE_ENV}={value:?} is not an IP address or IP:PORT")]
    BadAdvertiseEnv {
        /// The variable's value.
        value: String,
    },
    /// The cluster secret in the environment (`FERRY_CLUSTER_SECRET`,
    /// `FERRY_CLUSTER_SECRET_FILE`) cannot be used: too short, or its file
    /// unreadable.
    #[error("the cluster secret: {0}")]
    Secret(#[from] SecretError),
    /// etcd discovery could not start: etcd did not answer and the
    /// configuration requires it.
    #[cfg(feature = "etcd")]
    #[error(transparent)]
    Etcd(#[from] ferry_discovery::etcd::EtcdError),
}

/// Configures and spawns a [`Node`].
#[derive(Clone, Debug)]
pub struct NodeBuilder {
    listen: SocketAddr,
    advertise: Option<SocketAddr>,
    endpoint: EndpointConfig,
    tcp: TcpConfig,
    tcp_data: bool,
    ibverbs: bool,
    ibverbs_config: IbvConfig,
    memory: bool,
    memory_limits: ferry_memory::SameHostLimits,
    required: Vec<RdmaTransportLevel>,
    rpc_max_payload: usize,
    message_max_len: usize,
    inbox_capacity: usize,
    name: Option<String>,
    cluster_secret: Option<ClusterSecret>,
    #[cfg(feature = "etcd")]
    etcd: Option<ferry_discovery::etcd::EtcdConfig>,
}

impl Default for NodeBuilder {
    fn default() -> Self {
        NodeBuilder {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            endpoint: EndpointConfig::default(),
            tcp: TcpConfig::default(),
            tcp_data: true,
            ibverbs: true,
            ibverbs_config: IbvConfig::default(),
            memory: true,
            memory_limits: ferry_memory::SameHostLimits::default(),
            required: Vec::new(),
            rpc_max_payload: DEFAULT_MAX_RPC_PAYLOAD,
            message_max_len: DEFAULT_MAX_MESSAGE,
            inbox_capacity: DEFAULT_INBOX_CAPACITY,
            name: None,
            cluster_secret: None,
            #[cfg(feature = "etcd")]
            etcd: None,
        }
    }
}

impl NodeBuilder {
    /// The address the node's endpoint binds; port 0 picks a free port.
    /// Default `127.0.0.1:0`. An unspecified address (`0.0.0.0`, `::`)
    /// listens on every interface and needs [`NodeBuilder::advertise`].
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// The address peers reach this node at, carried by every handle it
    /// hands out; port 0 means the port the endpoint bound. Needed when
    /// listening on every interface; otherwise the listen address is
    /// advertised. Without this call, `FERRY_ADVERTISE` is used if set.
    /// An address that is not one of this host's is accepted (NAT and
    /// proxies make that right) but logged as a warning at spawn: peers on
    /// the same host never dial it, so a wrong one shows only across hosts.
    pub fn advertise(mut self, addr: SocketAddr) -> Self {
        self.advertise = Some(addr);
        self
    }

    /// Bounds on the connections the endpoint accepts (default: derived from
    /// the process's descriptor limit; see [`ConnectionLimits`]).
    pub fn connection_limits(mut self, limits: ConnectionLimits) -> Self {
        self.endpoint.limits = limits;
        self
    }

    /// How long an accepted data connection may have no request in flight
    /// before the endpoint closes it (default
    /// [`ferry_control::DEFAULT_IDLE_TIMEOUT`], 60 s; see
    /// [`ConnectionLimits::idle_timeout`]). Shorter gives idle clients'
    /// descriptors back sooner; peers reconnect when they need it again.
    pub fn idle_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.endpoint.limits.idle_timeout = timeout;
        self
    }

    /// How long a peer may stay silent in the middle of a frame (a
    /// request's header, table or payload, a control frame; or not reading
    /// the responses it asked for) before the endpoint closes its
    /// connection (default [`ferry_control::DEFAULT_FRAME_TIMEOUT`], 20 s;
    /// see [`ConnectionLimits::frame_timeout`]). Counted from the last byte,
    /// so a long payload on a slow link is never cut while it moves; while
    /// it waits the connection is evictable at a bound like an idle one.
    pub fn frame_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.endpoint.limits.frame_timeout = timeout;
        self
    }

    /// How long a peer may acknowledge nothing on its control session
    /// before it is declared lost (default [`crate::DEFAULT_PEER_TIMEOUT`],
    /// 20 s; see docs/operating.md, "Liveness"). Shorter finds dead hosts sooner;
    /// too short fails healthy peers on a congested or lossy path.
    pub fn peer_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.endpoint.peer_timeout = timeout;
        self
    }

    /// How long RDMA transfers under way may go on, while they keep
    /// completing, after their peer's control session went silent (default
    /// [`crate::DEFAULT_SILENT_GRACE`], 60 s; see docs/operating.md, "Liveness").
    /// Give every node the same value: the owner keeps its end of a queue
    /// pair this long.
    pub fn silent_grace(mut self, grace: std::time::Duration) -> Self {
        self.endpoint.silent_grace = grace;
        self
    }

    /// The endpoint's whole configuration (limits, control frame size).
    pub fn endpoint_config(mut self, config: EndpointConfig) -> Self {
        self.endpoint = config;
        self
    }

    /// TCP data connections per peer (default 4).
    pub fn tcp_connections(mut self, n: usize) -> Self {
        self.tcp.connections_per_peer = n.max(1);
        self
    }

    /// How long a TCP data connection waiting for bytes polls its socket
    /// before its task sleeps (default [`ferry_tcp::DEFAULT_BUSY_POLL`],
    /// 100 µs; zero turns it off). An answer that comes within it pays no
    /// thread wake-up; see [`TcpConfig::busy_poll`] for the trade.
    pub fn tcp_busy_poll(mut self, window: std::time::Duration) -> Self {
        self.tcp.busy_poll = window;
        self
    }

    /// Largest request the TCP backend sends as one chunk, in bytes
    /// (default 1 MiB; capped at the protocol's 64 MiB).
    pub fn tcp_chunk_size(mut self, bytes: u64) -> Self {
        self.tcp.chunk_size = usize::try_from(bytes).unwrap_or(usize::MAX).max(1);
        self
    }

    /// Bytes of requests each TCP data connection keeps in flight (default
    /// 8 MiB; at least one chunk always fits): what keeps a link busy, and
    /// all a timed-out submit still moves per connection.
    pub fn tcp_window(mut self, bytes: u32) -> Self {
        self.tcp.window = bytes.max(1);
        self
    }

    /// The TCP backend's whole configuration.
    pub fn tcp_config(mut self, config: TcpConfig) -> Self {
        self.tcp = config;
        self
    }

    /// The node's name in its cluster namespace (e.g. `prefill-0`): peers
    /// that load its metadata know it, and look up its published regions,
    /// by this name. A restarted process takes the same name with a new
    /// node id.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Makes [`Node::lookup`] find peers in etcd, and publishes the node
    /// there under its name, if it has one, with a lease it keeps alive: see
    /// [`ferry_discovery::etcd`]. Starting fails when etcd does not answer,
    /// unless the configuration says it is not required.
    #[cfg(feature = "etcd")]
    pub fn etcd(mut self, config: ferry_discovery::etcd::EtcdConfig) -> Self {
        self.etcd = Some(config);
        self
    }

    /// Whether this node moves region bytes over TCP (default true). With
    /// false, its regions' handles carry no TCP credentials, so no peer
    /// reads or writes them over TCP, and an op of its own that neither
    /// same-host memory nor ibverbs carries fails with
    /// [`OpError::NoSharedTransport`](ferry_core::OpError::NoSharedTransport)
    /// instead of falling back to TCP: for a deployment that must move its
    /// data over RDMA or not at all. Connections, notifications, messages
    /// and RPC still go over the node's endpoint, which is TCP; so does a
    /// submit sent straight to the TCP backend's own actor
    /// ([`Node::tcp`](crate::Node::tcp)), which bypasses the node's
    /// routing. A node with TCP off and no other transport running still
    /// starts (for messages and RPC); `Node::transports` says so.
    pub fn tcp(mut self, enabled: bool) -> Self {
        self.tcp_data = enabled;
        self
    }

    /// Whether to share this node's regions with processes on the same host
    /// and copy to and from theirs directly (default true;
    /// `FERRY_DISABLE_MEMORY=1` overrides it to false). Regions it
    /// allocates are then sealed memfds; see `ferry_memory`.
    pub fn memory(mut self, enabled: bool) -> Self {
        self.memory = enabled;
        self
    }

    /// Bounds on the same-host sockets this node answers (default: derived
    /// from the process's descriptor limit; see
    /// [`SameHostLimits`](ferry_memory::SameHostLimits)). Any local process
    /// can connect to a node's same-host socket: one that proves nothing
    /// holds its place only briefly, and at the bound makes room first.
    pub fn same_host_limits(mut self, limits: ferry_memory::SameHostLimits) -> Self {
        self.memory_limits = limits;
        self
    }

    /// Whether to use an RDMA device when this host has one (default true;
    /// `FERRY_DISABLE_IBVERBS=1` overrides it to false).
    pub fn ibverbs(mut self, enabled: bool) -> Self {
        self.ibverbs = enabled;
        self
    }

    /// Which rails (device ports), GID and queue-pair settings the ibverbs
    /// backend uses.
    pub fn ibverbs_config(mut self, config: IbvConfig) -> Self {
        self.ibverbs_config = config;
        self
    }

    /// Makes [`NodeBuilder::spawn`] fail, naming the reason, unless the
    /// transport of `level` runs (e.g. `require(Nic)` on a host where RDMA
    /// was expected). May be called for several levels.
    pub fn require(mut self, level: RdmaTransportLevel) -> Self {
        if !self.required.contains(&level) {
            self.required.push(level);
        }
        self
    }

    /// The most bytes an RPC argument or answer may hold, in either
    /// direction (default 64 KiB, [`DEFAULT_MAX_RPC_PAYLOAD`]; at most the
    /// endpoint's frame limit less 1 KiB). A call over it is refused before
    /// any byte is sent.
    pub fn rpc_max_payload(mut self, bytes: usize) -> Self {
        self.rpc_max_payload = bytes;
        self
    }

    /// The longest message this node sends or accepts (default 64 KiB,
    /// [`DEFAULT_MAX_MESSAGE`]; at most the endpoint's frame limit less
    /// 1 KiB). A longer one is refused before any byte is sent.
    pub fn message_max_len(mut self, bytes: usize) -> Self {
        self.message_max_len = bytes;
        self
    }

    /// How many deliveries the node's inbox holds before senders wait
    /// (default [`DEFAULT_INBOX_CAPACITY`]).
    pub fn inbox_capacity(mut self, deliveries: usize) -> Self {
        self.inbox_capacity = deliveries;
        self
    }

    /// The cluster secret this node proves and requires: every connection
    /// to its endpoint and from it (control sessions, TCP data, same-host
    /// sockets) is then authenticated both ways, and peers without the
    /// same secret are refused ([`ferry_control::auth`] says how, and
    /// docs/security.md what it protects). Without one,
    /// the secret comes from `FERRY_CLUSTER_SECRET` or the file
    /// `FERRY_CLUSTER_SECRET_FILE` names, if set; with neither, the node
    /// takes any peer that reaches it, as before.
    pub fn cluster_secret(mut self, secret: ClusterSecret) -> Self {
        self.cluster_secret = Some(secret);
        self
    }

    /// The address to advertise: the builder's, else `FERRY_ADVERTISE`'s.
    fn advertised(&self) -> Result<Option<SocketAddr>, NodeError> {
        if self.advertise.is_some() {
            return Ok(self.advertise);
        }
        match std::env::var(ADVERTISE_ENV) {
            Ok(value) if !value.trim().is_empty() => parse_advertise(value.trim())
                .map(Some)
                .ok_or(NodeError::BadAdvertiseEnv { value }),
            _ => Ok(None),
        }
    }

    /// Binds the endpoint and spawns the node's actor and its backends on the
    /// current tokio runtime: TCP always, ibverbs when enabled and a device
    /// is usable, same-host memory when enabled. Fails if a required transport cannot start, or the
    /// endpoint cannot (see [`NodeError`]).
    pub async fn spawn(self) -> Result<Node, NodeError> {
        let id = NodeId::random();
        let secret = match &self.cluster_secret {
            Some(secret) => Some(secret.clone()),
            None => ClusterSecret::from_env()?,
        };
        let authenticated = secret.is_some();
        let dialer = Dialer::new(id, secret);
        let disabled_by_env = std::env::var(DISABLE_IBVERBS_ENV).is_ok_and(|v| v == "1");
        let device = match (self.ibverbs, disabled_by_env) {
            (false, _) => Err("disabled by the node builder".to_string()),
            (true, true) => Err(format!("disabled by {DISABLE_IBVERBS_ENV}=1")),
            (true, false) => IbvDevice::open(&self.ibverbs_config).map_err(|e| e.to_string()),
        };
        let memory_off_by_env = std::env::var(DISABLE_MEMORY_ENV).is_ok_and(|v| v == "1");
        let memory = match (self.memory, memory_off_by_env) {
            (false, _) => Err("disabled by the node builder".to_string()),
            (true, true) => Err(format!("disabled by {DISABLE_MEMORY_ENV}=1")),
            (true, false) => {
                MemoryBackend::start_with_limits(id, dialer.secret_cell(), self.memory_limits)
                    .map_err(|e| e.to_string())
            }
        };
        for &level in &self.required {
            let missing = match level {
                RdmaTransportLevel::Tcp => {
                    (!self.tcp_data).then(|| "disabled by the node builder".to_string())
                }
                RdmaTransportLevel::Nic => device.as_ref().err().cloned(),
                RdmaTransportLevel::Memory => memory.as_ref().err().cloned(),
            };
            if let Some(reason) = missing {
                return Err(NodeError::TransportUnavailable {
                    transport: level,
                    reason,
                });
            }
        }
        // Before anything binds: a node that must publish and cannot fails
        // without side effects.
        #[cfg(feature = "etcd")]
        let etcd = match &self.etcd {
            None => None,
            Some(config) if config.required => {
                Some(ferry_discovery::etcd::Etcd::connect(config.clone()).await?)
            }
            Some(config) => {
                Some(ferry_discovery::etcd::Etcd::connect_lazily(config.clone()).await?)
            }
        };
        let endpoint =
            Endpoint::bind_with_dialer(self.listen, self.advertised()?, self.endpoint, dialer)
                .await?;
        crate::advertise::warn_if_foreign(endpoint.local().endpoint.ip());
        let rpc = Rpc::start(&endpoint, self.rpc_max_payload)?;
        let messages = Messages::start(&endpoint, self.message_max_len, self.inbox_capacity)?;
        let tcp = TcpBackend::start(&endpoint, self.tcp, Arc::downgrade(&messages))?;
        let addr = endpoint.local();
        let (ibverbs, ibverbs_state) = match device {
            Ok(device) => {
                let detail = device.describe();
                let fallback = if self.tcp_data { "with" } else { "without" };
                info!(node = %id, endpoint = %addr.endpoint, "ferry node running on ibverbs ({detail}) {fallback} TCP fallback");
                let backend = IbvBackend::start(device, &endpoint, messages.notification_sink())?;
                (Some(backend), TransportState::Running { detail })
            }
            Err(reason) => {
                info!(node = %id, endpoint = %addr.endpoint, tcp = self.tcp_data, "ferry node without ibverbs: {reason}");
                (None, TransportState::Unavailable { reason })
            }
        };
        let (memory, memory_state) = match memory {
            Ok(backend) => {
                let detail = backend.describe();
                backend.take_notifications(messages.notification_sink());
                (Some(backend), TransportState::Running { detail })
            }
            Err(reason) => (None, TransportState::Unavailable { reason }),
        };
        let transports = vec![
            TransportStatus {
                level: RdmaTransportLevel::Memory,
                state: memory_state,
            },
            TransportStatus {
                level: RdmaTransportLevel::Nic,
                state: ibverbs_state,
            },
            TransportStatus {
                level: RdmaTransportLevel::Tcp,
                state: match self.tcp_data {
                    true => TransportState::Running {
                        detail: format!(
                            "kernel TCP, {} connections per peer",
                            self.tcp.connections_per_peer.max(1)
                        ),
                    },
                    false => TransportState::Unavailable {
                        reason: "disabled by the node builder".to_string(),
                    },
                },
            },
        ];
        let running = transports
            .iter()
            .rev()
            .filter(|t| matches!(t.state, TransportState::Running { .. }))
            .map(|t| t.level)
            .collect();
        let names = Arc::new(Names::new(self.name.clone(), addr, running));
        crate::names::serve(&endpoint, &names)?;
        let outcomes = Arc::new(crate::outcome::Outcomes::default());
        outcomes.serve(&endpoint);
        endpoint.start();
        if authenticated {
            info!(node = %id, "every peer must prove the cluster secret");
        }
        #[cfg(feature = "etcd")]
        if let Some(etcd) = etcd {
            names.start_etcd(etcd);
        }
        let router = Arc::new(Router {
            nic_required: self.required.contains(&RdmaTransportLevel::Nic),
            tcp_data: self.tcp_data,
            endpoint,
            ids: RegionIds::new(),
            tcp,
            ibverbs,
            memory,
            transports,
            tcp_meters: Meters::new("tcp"),
            ibverbs_meters: Meters::new("ibverbs"),
            memory_meters: Meters::new("memory"),
            rpc,
            messages,
            names,
            shut_down: Default::default(),
            runtime: tokio::runtime::Handle::current(),
            estimates: Default::default(),
            outcomes,
        });
        let actor = NodeActor::spawn(NodeActor::new(router.clone()));
        Ok(Node(Arc::new(NodeInner { router, actor })))
    }
}

/// `IP` (port 0: the bound port) or `IP:PORT`.
pub(crate) fn parse_advertise(text: &str) -> Option<SocketAddr> {
    text.parse::<SocketAddr>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, 0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_addresses_parse_with_or_without_a_port() {
        assert_eq!(
            parse_advertise("10.0.0.5"),
            Some("10.0.0.5:0".parse().unwrap())
        );
        assert_eq!(
            parse_advertise("10.0.0.5:7000"),
            Some("10.0.0.5:7000".parse().unwrap())
        );
        assert_eq!(
            parse_advertise("[fd00::1]:7000"),
            Some("[fd00::1]:7000".parse().unwrap())
        );
        assert_eq!(
            parse_advertise("fd00::1"),
            Some("[fd00::1]:0".parse().unwrap())
        );
        assert_eq!(parse_advertise("host.example:7000"), None);
    }
}
