//! The [`Node`] handle: what a program that is not an actor holds of its
//! node. Every call goes through the node's [`Router`], as the actor's do.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry_control::Endpoint;
use ferry_core::{
    Access, Generation, MemoryBlock, NodeAddr, RdmaBackend, RdmaOp, RdmaTransportLevel, Region,
    RegionId, RegisterError, SubmitError,
};
use ferry_ibverbs::{IbvBackend, PinError};
use ferry_tcp::TcpBackend;
use kameo::actor::ActorRef;

use crate::NodeBuilder;
use crate::actor::NodeActor;
use crate::router::{NodeTransportInfo, Router, TransportPath};
use crate::transports::TransportStatus;

/// One process's ferry node, as a cheap cloneable handle for code that is
/// not an actor. Every clone, and the node's actor ([`Node::actor`]), drive
/// the same backends through the same routing. The node runs until the last
/// `Node` and the last `ActorRef` to its actor are dropped, or
/// [`Node::shutdown`].
#[derive(Clone)]
pub struct Node(pub(crate) Arc<NodeInner>);

pub(crate) struct NodeInner {
    pub router: Arc<Router>,
    pub actor: ActorRef<NodeActor>,
}

impl Node {
    /// A builder with the defaults: `127.0.0.1:0`, TCP, and ibverbs where a
    /// device exists.
    pub fn builder() -> NodeBuilder {
        NodeBuilder::default()
    }

    /// This node as peers reach it: its id and advertised endpoint.
    pub fn addr(&self) -> NodeAddr {
        self.0.router.addr()
    }

    /// Proves and requires `secret` from now on (`None`: none), on every
    /// channel: connections opened or accepted later. Those already open
    /// stay. To roll a new secret through a running cluster, node by node
    /// (see [`ferry_control::auth`]): every node to the old one also
    /// accepting the new ([`ferry_control::ClusterSecret::also_accept`]),
    /// then every node to the new one also accepting the old, then to the
    /// new one alone. To cut off a leaked secret at once, use
    /// [`Node::revoke_cluster_secret`].
    pub fn set_cluster_secret(&self, secret: Option<ferry_control::ClusterSecret>) {
        self.0.router.endpoint.dialer().set_secret(secret);
    }

    /// [`Node::set_cluster_secret`], and every open connection (control
    /// session, TCP data connection) that proved a secret `secret` does
    /// not accept is closed now: what a holder of a leaked secret opened
    /// ends with it. Transfers in flight on those connections fail; later
    /// ones reconnect under `secret`. Returns how many were closed.
    pub fn revoke_cluster_secret(&self, secret: Option<ferry_control::ClusterSecret>) -> usize {
        self.0.router.endpoint.dialer().revoke_secret(secret)
    }

    /// Authenticated connections this node closed because a frame failed
    /// its tag (altered, injected or replayed on the way: a relay, or
    /// anyone on the path), since it started.
    pub fn forged_connections(&self) -> u64 {
        self.0.router.endpoint.dialer().secret_cell().forged()
    }

    /// Whether this node requires a cluster secret of its peers.
    pub fn has_cluster_secret(&self) -> bool {
        self.0.router.endpoint.dialer().secret().is_some()
    }

    /// Connections refused for the cluster secret since the node started
    /// (its endpoint's and its same-host socket's): peers without it, with
    /// another, or with a wrong or replayed proof.
    pub fn auth_refusals(&self) -> u64 {
        let memory = self
            .0
            .router
            .memory
            .as_ref()
            .map_or(0, |m| m.auth_refusals());
        self.0.router.endpoint.auth_refusals() + memory
    }

    /// The node's manager actor: it accepts [`ferry_core::Submit`] and
    /// routes each op exactly as [`Node::submit`] does. Hand it to worker
    /// actors.
    pub fn actor(&self) -> &ActorRef<NodeActor> {
        &self.0.actor
    }

    /// The TCP backend alone (its actor accepts `Submit`, always over TCP).
    pub fn tcp(&self) -> &TcpBackend {
        &self.0.router.tcp
    }

    /// The ibverbs backend alone, when this node runs one.
    pub fn ibverbs(&self) -> Option<&IbvBackend> {
        self.0.router.ibverbs.as_ref()
    }

    /// Every transport, fastest first: running, or why not.
    pub fn transports(&self) -> &[TransportStatus] {
        &self.0.router.transports
    }

    /// Why the transport of `level` does not run here (`None` when it does).
    pub fn unavailable(&self, level: RdmaTransportLevel) -> Option<&str> {
        self.transports()
            .iter()
            .find(|t| t.level == level)
            .and_then(TransportStatus::unavailable)
    }

    /// The node's endpoint (for its control sessions).
    pub fn endpoint(&self) -> &Endpoint {
        &self.0.router.endpoint
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them. With
    /// the memory transport running they live in a sealed memfd, so that
    /// same-host peers can map them.
    pub async fn alloc(&self, len: u64, access: Access) -> Result<Region, RegisterError> {
        self.register(self.0.router.alloc_memory(len)?, access)
            .await
    }

    /// Registers memory with every running backend (TCP's only when region
    /// bytes may go over TCP); its handles advertise all of them. `access`
    /// is the most any remote handle to it will allow.
    pub async fn register(
        &self,
        memory: MemoryBlock,
        access: Access,
    ) -> Result<Region, RegisterError> {
        self.0.router.register(memory, access).await
    }

    /// Regions currently reachable by peers over TCP, as (id, generation).
    pub async fn registered_regions(&self) -> Vec<(RegionId, Generation)> {
        self.0.router.tcp.registered()
    }

    /// Shuts the node down for good. From the moment it is called, every
    /// call on the node, its clones and its actor (submits, registrations,
    /// messages, RPC) fails with a `ShutDown` error ([`SubmitError::ShutDown`]
    /// and its siblings), whatever transport it would take. Then it
    /// withdraws the node's etcd key (when it publishes there), stops the
    /// endpoint (listener, sessions, served connections), the same-host
    /// transport (its socket, the peers it serves, and every region it
    /// shared: peers' copies into them are refused) and the backends'
    /// actors; transfers in flight fail. The node's actor keeps answering,
    /// with those errors, until its last reference is dropped.
    pub async fn shutdown(&self) {
        let router = &self.0.router;
        router.shut_down.store(true, Ordering::Release);
        // First: peers stop finding a node that is going away.
        router.names.withdraw().await;
        if let Some(memory) = &router.memory {
            memory.shutdown().await;
        }
        router.endpoint.shutdown();
        router.tcp.stop().await;
        if let Some(ibverbs) = &router.ibverbs {
            ibverbs.stop().await;
        }
    }

    /// The fastest transport this node and the op's remote side share:
    /// what [`Node::submit`] will use for it. `None`: none (the submit
    /// fails with `NoSharedTransport`).
    pub fn route(&self, op: &RdmaOp) -> Option<RdmaTransportLevel> {
        self.0.router.route(op)
    }

    /// [`Node::route`] in detail: for the memory transport, whether the op
    /// goes through a mapped memfd or over `process_vm`. A region of memory
    /// ferry did not allocate whose owner the kernel does not let this
    /// process reach (another uid, Yama) is routed to the next transport,
    /// and this says so. The first call for an owner may probe it (one
    /// `process_vm_readv` of a byte).
    pub fn path(&self, op: &RdmaOp) -> Option<TransportPath> {
        self.0.router.path(op)
    }

    /// Pins `region` to this node's rails `rails` (indices into
    /// `transport_info().ibverbs.rails`): its ibverbs ops take only those
    /// from now on (see [`ferry_ibverbs::IbvBackend::pin_rails`]). Without
    /// a pin a region prefers the rails on its memory's NUMA node
    /// ([`ferry_ibverbs::Placement`]).
    pub fn pin_rails(&self, region: &Region, rails: &[u8]) -> Result<(), PinError> {
        let ibverbs = self.0.router.ibverbs.as_ref().ok_or(PinError::NoIbverbs)?;
        ibverbs.pin_rails(region.id(), region.generation(), rails)
    }

    /// Runs a batch: each op over the fastest transport both ends share.
    /// Resolves `Ok` once every op is acknowledged by its remote side;
    /// `Err(Timeout)` when `timeout` passes first (what has not been sent by
    /// then is dropped); `Err(Op { index, .. })` naming the lowest failing op.
    ///
    /// The ops have no order among themselves: they run concurrently, and
    /// two ops whose byte ranges overlap leave those bytes unspecified, as on
    /// RDMA (so does one op whose source and destination overlap, a node
    /// copying within its own region). A zero-length op is only checked locally and succeeds without
    /// contacting its remote side.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.0.router.submit(ops, timeout).await
    }
}

impl RdmaBackend for Node {
    type TransportInfo = NodeTransportInfo;

    /// See [`Node::submit`].
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.0.router.submit(ops, timeout).await
    }

    fn transport_level(&self) -> RdmaTransportLevel {
        self.0.router.transport_level()
    }

    async fn transport_info(&self) -> Option<Self::TransportInfo> {
        Some(self.0.router.transport_info().await)
    }
}
