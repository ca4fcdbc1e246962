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
    Access, Generation, LocalSlice, MemoryBlock, NodeAddr, NodeId, OpError, OpKind, PAGE_SIZE,
    RdmaBackend, RdmaOp, RdmaTransportLevel, Region, RegionId, RegisterError, RemoteBuffer,
    RemoteTransports, SubmitError,
};
use ferry_core::{RegionIds, RegionParts};
/// The TCP fallback backend, for direct use of its actor and messages.
pub use ferry_tcp as tcp;
use ferry_tcp::{RegisterRegion, TcpBackend, TcpConfig};
use tracing::info;

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
}

impl Default for NodeBuilder {
    fn default() -> Self {
        NodeBuilder {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp: TcpConfig::default(),
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

    /// Largest request the TCP backend sends as one chunk (default 1 MiB).
    pub fn tcp_chunk_size(mut self, bytes: usize) -> Self {
        self.tcp.chunk_size = bytes.max(1);
        self
    }

    pub fn tcp_config(mut self, config: TcpConfig) -> Self {
        self.tcp = config;
        self
    }

    /// Binds the endpoint and spawns the backend actors on the current tokio
    /// runtime.
    pub async fn spawn(self) -> Result<Node, NodeError> {
        let id = NodeId::random();
        let tcp = TcpBackend::start(self.listen, id, self.tcp, None)
            .await
            .map_err(|source| NodeError::Listen {
                addr: self.listen,
                source,
            })?;
        let addr = tcp.local();
        info!(node = %id, endpoint = %addr.endpoint, transports = "tcp", "ferry node running on TCP: the ibverbs backend is not part of this build");
        Ok(Node(Arc::new(NodeInner {
            addr,
            ids: RegionIds::new(),
            tcp,
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

    /// Allocates `len` zeroed, page-aligned bytes and registers them.
    pub async fn alloc(&self, len: usize, access: Access) -> Result<Region, RegisterError> {
        self.register(MemoryBlock::alloc(len)?, access).await
    }

    /// Registers memory with every running backend. `access` is the most any
    /// remote handle to it will allow.
    pub async fn register(
        &self,
        memory: MemoryBlock,
        access: Access,
    ) -> Result<Region, RegisterError> {
        let memory = Arc::new(memory);
        let slot = self.0.ids.allocate();
        let tcp = self
            .0
            .tcp
            .register(RegisterRegion {
                id: slot.id(),
                generation: slot.generation(),
                access,
                memory: memory.clone(),
            })
            .await?;
        Ok(Region::new(RegionParts {
            slot,
            memory,
            access,
            owner: self.0.addr,
            transports: RemoteTransports {
                tcp: Some(tcp.remote),
            },
            registrations: vec![Box::new(tcp.registration)],
        }))
    }

    /// Regions currently reachable by peers, as (id, generation).
    pub async fn registered_regions(&self) -> Vec<(RegionId, Generation)> {
        self.0.tcp.registered().await
    }

    /// Stops the backends; in-flight transfers fail.
    pub async fn shutdown(&self) {
        self.0.tcp.stop().await;
    }

    /// The fastest transport this node and the op's remote side share.
    fn route(&self, op: &RdmaOp) -> Option<RdmaTransportLevel> {
        op.remote.transports().tcp.map(|_| RdmaTransportLevel::Tcp)
    }
}

impl RdmaBackend for Node {
    type TransportInfo = ferry_tcp::TcpTransportInfo;

    /// Routes each op to a transport both ends share; ops sharing a transport
    /// stay one batch. Errors name the op's index in *this* batch.
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let total = ops.len();
        let mut tcp_ops = Vec::with_capacity(total);
        let mut tcp_index = Vec::with_capacity(total);
        for (index, op) in ops.into_iter().enumerate() {
            match self.route(&op) {
                Some(RdmaTransportLevel::Tcp) => {
                    tcp_index.push(index);
                    tcp_ops.push(op);
                }
                _ => return Err(SubmitError::op(index, OpError::NoSharedTransport)),
            }
        }
        self.0
            .tcp
            .submit(tcp_ops, timeout)
            .await
            .map_err(|e| match e {
                SubmitError::Op { index, error } => SubmitError::Op {
                    index: tcp_index[index],
                    error,
                },
                SubmitError::Timeout {
                    timeout,
                    unfinished,
                    ..
                } => SubmitError::Timeout {
                    timeout,
                    unfinished,
                    total,
                },
                other => other,
            })
    }

    fn transport_level(&self) -> RdmaTransportLevel {
        RdmaTransportLevel::Tcp
    }

    async fn transport_info(&self) -> Option<Self::TransportInfo> {
        self.0.tcp.transport_info().await
    }
}

impl Node {
    /// Same as [`RdmaBackend::submit`], without importing the trait.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        RdmaBackend::submit(self, ops, timeout).await
    }
}
