//! ferry: one-sided READ/WRITE transfers between processes, over RDMA where
//! both ends have a NIC and over TCP where they don't.
//!
//! A process spawns one [`Node`] inside its tokio runtime. The node registers
//! memory as [`Region`]s, hands out serializable [`RemoteBuffer`] handles to
//! them, and runs batches of [`RdmaOp`]s, each routed to the fastest transport
//! both ends share.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use ferry::prelude::*;
//! use std::time::Duration;
//!
//! let node = Node::builder().listen("127.0.0.1:0".parse()?).spawn().await?;
//! let local = node.alloc(1 << 20, Access::ReadWrite).await?;
//! # let remote: RemoteBuffer = local.remote();
//! // `remote` came from another node, e.g. serialized with serde.
//! let op = RdmaOp::read(local.slice(0..4096)?, remote.slice(0..4096)?);
//! node.submit(vec![op], Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use ferry_core::{
    Access, Generation, IbvRemote, LocalSlice, MemoryBlock, NodeAddr, NodeId, OpError, OpKind,
    PAGE_SIZE, RdmaBackend, RdmaOp, RdmaTransportLevel, Region, RegionId, RegisterError,
    RemoteBuffer, RemoteTransports, SubmitError,
};
use ferry_core::{RegionIds, RegionParts};
/// The ibverbs backend, for direct use of its actor, messages and raw handles.
pub use ferry_ibverbs as ibverbs;
use ferry_ibverbs::{IbvBackend, IbvConfig, IbvDevice};
/// The TCP fallback backend, for direct use of its actor and messages.
pub use ferry_tcp as tcp;
use ferry_tcp::{TcpBackend, TcpConfig};
use tokio::sync::mpsc;
use tracing::info;

mod meters;
use meters::Meters;

pub mod prelude {
    pub use crate::{
        Access, Node, NodeBuilder, OpError, OpKind, RdmaBackend, RdmaOp, RdmaTransportLevel,
        Region, RemoteBuffer, SubmitError,
    };
    pub use ferry_tcp::{Submit, TcpManagerActor};
}

/// Compiles the README's example as a doc test.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// Regions come only from [`Node::alloc`] and [`Node::register`]: a region
/// assembled by hand would hand out handles that lie. Neither a `Region`
/// constructor nor `RegionParts` is reachable through this crate:
///
/// ```compile_fail
/// let _ = ferry::Region::new;
/// ```
///
/// ```compile_fail
/// let _: Option<ferry::RegionParts> = None;
/// ```
#[cfg(doctest)]
pub struct RegionsOnlyFromNodes;

/// Setting this environment variable to `1` keeps a node off RDMA, as
/// [`NodeBuilder::ibverbs`]`(false)` does.
pub const DISABLE_IBVERBS_ENV: &str = "FERRY_DISABLE_IBVERBS";

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Configures and spawns a [`Node`].
#[derive(Clone, Debug)]
pub struct NodeBuilder {
    listen: SocketAddr,
    tcp: TcpConfig,
    ibverbs: bool,
    ibverbs_config: IbvConfig,
}

impl Default for NodeBuilder {
    fn default() -> Self {
        NodeBuilder {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp: TcpConfig::default(),
            ibverbs: true,
            ibverbs_config: IbvConfig::default(),
        }
    }
}

impl NodeBuilder {
    /// The node's endpoint; port 0 picks a free port. Default `127.0.0.1:0`.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// TCP data connections per peer (default 4).
    pub fn tcp_connections(mut self, n: usize) -> Self {
        self.tcp.connections_per_peer = n.max(1);
        self
    }

    /// Largest request the TCP backend sends as one chunk, in bytes
    /// (default 1 MiB; the backend caps it at its wire format's limit).
    pub fn tcp_chunk_size(mut self, bytes: u64) -> Self {
        // Anything past usize is past the backend's cap as well.
        self.tcp.chunk_size = usize::try_from(bytes).unwrap_or(usize::MAX).max(1);
        self
    }

    pub fn tcp_config(mut self, config: TcpConfig) -> Self {
        self.tcp = config;
        self
    }

    /// Whether to use an RDMA device when this host has one (default true;
    /// `FERRY_DISABLE_IBVERBS=1` overrides it to false).
    pub fn ibverbs(mut self, enabled: bool) -> Self {
        self.ibverbs = enabled;
        self
    }

    /// Which device, port and GID the ibverbs backend uses.
    pub fn ibverbs_config(mut self, config: IbvConfig) -> Self {
        self.ibverbs_config = config;
        self
    }

    /// Binds the endpoint and spawns the backend actors on the current tokio
    /// runtime: TCP always, ibverbs when enabled and a device is usable.
    pub async fn spawn(self) -> Result<Node, NodeError> {
        let id = NodeId::random();
        let disabled_by_env = std::env::var(DISABLE_IBVERBS_ENV).is_ok_and(|v| v == "1");
        let device = match (self.ibverbs, disabled_by_env) {
            (false, _) => Err("disabled by the node builder".to_string()),
            (true, true) => Err(format!("disabled by {DISABLE_IBVERBS_ENV}=1")),
            (true, false) => IbvDevice::open(&self.ibverbs_config).map_err(|e| e.to_string()),
        };
        // Queue-pair exchanges arrive on the node's endpoint; only a node
        // with a device takes them.
        let (control_tx, control_rx) = device.is_ok().then(|| mpsc::channel(64)).unzip();
        let tcp = TcpBackend::start(self.listen, id, self.tcp, control_tx)
            .await
            .map_err(|source| NodeError::Listen {
                addr: self.listen,
                source,
            })?;
        let addr = tcp.local();
        let (ibverbs, ibverbs_unavailable) = match (device, control_rx) {
            (Ok(device), Some(control)) => {
                info!(node = %id, endpoint = %addr.endpoint, "ferry node running on ibverbs ({}) with TCP fallback", device.describe());
                (Some(IbvBackend::start(device, addr, control)), None)
            }
            (device, _) => {
                let reason = device.err().unwrap_or_default();
                info!(node = %id, endpoint = %addr.endpoint, "ferry node running on TCP only: ibverbs unavailable: {reason}");
                (None, Some(reason))
            }
        };
        Ok(Node(Arc::new(NodeInner {
            addr,
            ids: RegionIds::new(),
            tcp,
            ibverbs,
            ibverbs_unavailable,
            tcp_meters: Meters::new("tcp"),
            ibverbs_meters: Meters::new("ibverbs"),
        })))
    }
}

/// One process's ferry endpoint. Cheap to clone; every clone drives the same
/// backends.
#[derive(Clone)]
pub struct Node(Arc<NodeInner>);

struct NodeInner {
    addr: NodeAddr,
    ids: RegionIds,
    tcp: TcpBackend,
    ibverbs: Option<IbvBackend>,
    ibverbs_unavailable: Option<String>,
    tcp_meters: Meters,
    ibverbs_meters: Meters,
}

/// The transports a node runs, and their raw details.
#[derive(Debug)]
pub struct NodeTransportInfo {
    pub tcp: Option<ferry_tcp::TcpTransportInfo>,
    pub ibverbs: Option<ferry_ibverbs::IbvTransportInfo>,
    /// Why the ibverbs backend is not running, when it is not.
    pub ibverbs_unavailable: Option<String>,
}

impl Node {
    pub fn builder() -> NodeBuilder {
        NodeBuilder::default()
    }

    pub fn addr(&self) -> NodeAddr {
        self.0.addr
    }

    /// The TCP backend: its actor accepts `Submit` directly.
    pub fn tcp(&self) -> &TcpBackend {
        &self.0.tcp
    }

    /// The ibverbs backend, when this node runs one.
    pub fn ibverbs(&self) -> Option<&IbvBackend> {
        self.0.ibverbs.as_ref()
    }

    /// Why this node runs without ibverbs (`None` when it runs with it).
    pub fn ibverbs_unavailable(&self) -> Option<&str> {
        self.0.ibverbs_unavailable.as_deref()
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them.
    pub async fn alloc(&self, len: u64, access: Access) -> Result<Region, RegisterError> {
        self.register(MemoryBlock::alloc(len)?, access).await
    }

    /// Registers memory with every running backend; its handles advertise
    /// all of them. `access` is the most any remote handle to it will allow.
    pub async fn register(
        &self,
        memory: MemoryBlock,
        access: Access,
    ) -> Result<Region, RegisterError> {
        let memory = Arc::new(memory);
        let slot = self.0.ids.allocate();
        let (id, generation) = (slot.id(), slot.generation());
        let tcp = self
            .0
            .tcp
            .register(ferry_tcp::RegisterRegion {
                id,
                generation,
                access,
                memory: memory.clone(),
            })
            .await?;
        let mut registrations: Vec<Box<dyn std::any::Any + Send + Sync>> =
            vec![Box::new(tcp.registration)];
        let mut transports = RemoteTransports {
            tcp: Some(tcp.remote),
            ibverbs: None,
        };
        if let Some(ibverbs) = &self.0.ibverbs {
            let ibv = ibverbs
                .register(ferry_ibverbs::RegisterRegion {
                    id,
                    generation,
                    access,
                    memory: memory.clone(),
                })
                .await?;
            registrations.push(Box::new(ibv.registration));
            transports.ibverbs = Some(ibv.remote);
        }
        Ok(RegionParts {
            slot,
            memory,
            access,
            owner: self.0.addr,
            transports,
            registrations,
        }
        .into_region())
    }

    /// Regions currently reachable by peers over TCP, as (id, generation).
    pub async fn registered_regions(&self) -> Vec<(RegionId, Generation)> {
        self.0.tcp.registered().await
    }

    /// Stops the backends; in-flight transfers fail.
    pub async fn shutdown(&self) {
        self.0.tcp.stop().await;
        if let Some(ibverbs) = &self.0.ibverbs {
            ibverbs.stop().await;
        }
    }

    /// The fastest transport this node and the op's remote side share.
    pub fn route(&self, op: &RdmaOp) -> Option<RdmaTransportLevel> {
        let remote = op.remote.transports();
        if self.0.ibverbs.is_some() && remote.ibverbs.is_some() {
            Some(RdmaTransportLevel::Nic)
        } else {
            remote.tcp.map(|_| RdmaTransportLevel::Tcp)
        }
    }

    /// The ibverbs backend's share of a batch; every op routed to it.
    async fn submit_ibverbs(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let Some(ibverbs) = &self.0.ibverbs else {
            return Err(SubmitError::BackendStopped);
        };
        self.0.ibverbs_meters.submit(ibverbs, ops, timeout).await
    }

    /// The TCP backend's share of a batch.
    async fn submit_tcp(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.0.tcp_meters.submit(&self.0.tcp, ops, timeout).await
    }

    /// A batch whose ops take both transports: each share runs as its own
    /// batch, concurrently, and errors are mapped back to batch indices.
    async fn submit_split(
        &self,
        ops: Vec<RdmaOp>,
        on_nic: usize,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        let total = ops.len();
        let (mut nic_ops, mut nic_index) = (Vec::with_capacity(on_nic), Vec::with_capacity(on_nic));
        let (mut tcp_ops, mut tcp_index) = (vec![], vec![]);
        for (index, op) in ops.into_iter().enumerate() {
            if self.route(&op) == Some(RdmaTransportLevel::Nic) {
                nic_index.push(index);
                nic_ops.push(op);
            } else {
                tcp_index.push(index);
                tcp_ops.push(op);
            }
        }
        let (nic_result, tcp_result) = tokio::join!(
            async { remap(self.submit_ibverbs(nic_ops, timeout).await, &nic_index) },
            async { remap(self.submit_tcp(tcp_ops, timeout).await, &tcp_index) },
        );
        merge([nic_result, tcp_result], total)
    }

    /// Runs a batch of ops, each over the fastest transport both ends share;
    /// the same as [`RdmaBackend::submit`], without importing the trait.
    ///
    /// The ops have no order among themselves: they run concurrently (split
    /// over connections, work requests, and transports), so ops of one batch
    /// whose byte ranges overlap leave those bytes unspecified, as on RDMA.
    /// Submit the second after the first completed when order matters.
    ///
    /// A zero-length op is checked locally (lengths, write access, a remote
    /// address range that does not wrap, a shared transport) and then
    /// succeeds at once without contacting the remote side: it does not prove
    /// that the remote region exists.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        RdmaBackend::submit(self, ops, timeout).await
    }
}

/// Maps a backend's answer about its share of a batch back to indices of the
/// whole batch: `index[i]` is the batch index of the backend's op `i`.
fn remap(result: Result<(), SubmitError>, index: &[usize]) -> Result<(), SubmitError> {
    result.map_err(|e| match e {
        SubmitError::Op { index: i, error } => SubmitError::Op {
            index: index[i],
            error,
        },
        other => other,
    })
}

/// Merges the answers of the backends a batch was split over: the lowest
/// failing op first, then a timeout (unfinished ops summed), then a stopped
/// backend.
fn merge(results: [Result<(), SubmitError>; 2], total: usize) -> Result<(), SubmitError> {
    let mut lowest_op: Option<(usize, OpError)> = None;
    let mut timed_out: Option<(Duration, usize)> = None;
    let mut stopped = false;
    for result in results {
        match result {
            Ok(()) => {}
            Err(SubmitError::Op { index, error }) => {
                if lowest_op.as_ref().is_none_or(|(best, _)| index < *best) {
                    lowest_op = Some((index, error));
                }
            }
            Err(SubmitError::Timeout {
                timeout,
                unfinished,
                ..
            }) => {
                let (_, sum) = timed_out.get_or_insert((timeout, 0));
                *sum += unfinished;
            }
            Err(SubmitError::BackendStopped) => stopped = true,
        }
    }
    if let Some((index, error)) = lowest_op {
        return Err(SubmitError::Op { index, error });
    }
    if let Some((timeout, unfinished)) = timed_out {
        return Err(SubmitError::Timeout {
            timeout,
            unfinished,
            total,
        });
    }
    if stopped {
        Err(SubmitError::BackendStopped)
    } else {
        Ok(())
    }
}

impl RdmaBackend for Node {
    type TransportInfo = NodeTransportInfo;

    /// Routes each op to the fastest transport both ends share; the ops of
    /// one transport stay one batch, and the transports run concurrently.
    /// Errors name the op's index in *this* batch.
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let total = ops.len();
        let mut on_nic = 0;
        for (index, op) in ops.iter().enumerate() {
            match self.route(op) {
                Some(RdmaTransportLevel::Nic) => on_nic += 1,
                Some(_) => {}
                None => {
                    return Err(SubmitError::Op {
                        index,
                        error: OpError::NoSharedTransport,
                    });
                }
            }
        }
        // Usually a whole batch takes one transport: it goes on as it is.
        if total == 0 {
            return Ok(());
        } else if on_nic == total {
            return self.submit_ibverbs(ops, timeout).await;
        } else if on_nic == 0 {
            return self.submit_tcp(ops, timeout).await;
        }
        // Boxed: both transports' futures at once are large, and every
        // submit's future would otherwise carry (and copy) them.
        Box::pin(self.submit_split(ops, on_nic, timeout)).await
    }

    fn transport_level(&self) -> RdmaTransportLevel {
        if self.0.ibverbs.is_some() {
            RdmaTransportLevel::Nic
        } else {
            RdmaTransportLevel::Tcp
        }
    }

    async fn transport_info(&self) -> Option<Self::TransportInfo> {
        let ibverbs = match &self.0.ibverbs {
            Some(ibverbs) => ibverbs.transport_info().await,
            None => None,
        };
        Some(NodeTransportInfo {
            tcp: self.0.tcp.transport_info().await,
            ibverbs,
            ibverbs_unavailable: self.0.ibverbs_unavailable.clone(),
        })
    }
}
