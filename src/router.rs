//! A node's one routing path ([`Router`]), shared by the
//! [`Node`](crate::Node) handle and the [`NodeActor`](crate::NodeActor), so
//! that a submit takes the same transport whichever way it arrives: which
//! transport carries each op, a batch split over several, and the ibverbs
//! share that falls back to TCP.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_control::{Endpoint, Messages, Rpc};
use ferry_core::{
    Access, Answer, MemoryBlock, NodeAddr, OpError, RdmaBackend, RdmaOp, RdmaTransportLevel,
    Region, RegionIds, RegionParts, RegisterError, RegisterRegion, RemoteBuffer, RemoteTransports,
    SubmitError,
};
use ferry_ibverbs::{IbvBackend, IbvTransportInfo, RailPairs};
use ferry_memory::{MemoryBackend, MemoryPath};
use ferry_tcp::{TcpBackend, TcpTransportInfo};

use crate::estimate::Estimator;
use crate::meters::{Meters, Submitted};
use crate::transports::TransportStatus;

/// Everything a node runs, and the routing every submit goes through.
pub(crate) struct Router {
    pub endpoint: Endpoint,
    pub ids: RegionIds,
    pub tcp: TcpBackend,
    pub ibverbs: Option<IbvBackend>,
    /// Whether ibverbs is required (`NodeBuilder::require`): a peer no
    /// rail reaches is then an error, never a fall-back to TCP.
    pub nic_required: bool,
    /// Whether region bytes may move over TCP ([`NodeBuilder::tcp`]):
    /// without it no op routes there, and none falls back there.
    ///
    /// [`NodeBuilder::tcp`]: crate::NodeBuilder::tcp
    pub tcp_data: bool,
    pub memory: Option<MemoryBackend>,
    /// Fastest first.
    pub transports: Vec<TransportStatus>,
    pub tcp_meters: Meters,
    pub ibverbs_meters: Meters,
    pub memory_meters: Meters,
    /// Named handlers this node serves, and its calls of peers' handlers.
    pub rpc: Arc<Rpc>,
    /// Messages this node sends, and its inbox.
    pub messages: Arc<Messages>,
    /// Its name, published regions, and the peers it knows by name.
    pub names: Arc<crate::names::Names>,
    /// Set by [`Node::shutdown`](crate::Node::shutdown), before any
    /// transport stops: every call that starts after it fails with a
    /// `ShutDown` error instead of reaching a transport that may still be
    /// half running.
    pub shut_down: AtomicBool,
    /// The runtime the node was spawned on: transfer requests posted from
    /// any thread are driven there.
    pub runtime: tokio::runtime::Handle,
    /// Per peer and transport, what completed requests took.
    pub estimates: Estimator,
    /// Outcomes of readers' tagged requests over this node's memory.
    pub outcomes: Arc<crate::outcome::Outcomes>,
}

impl Router {
    pub fn addr(&self) -> NodeAddr {
        self.endpoint.local()
    }

    /// Whether [`Node::shutdown`](crate::Node::shutdown) has begun.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }

    /// The fastest transport this node and the op's remote side share.
    pub fn route(&self, op: &RdmaOp) -> Option<RdmaTransportLevel> {
        self.route_remote(&op.remote)
    }

    /// The fastest transport this node and `remote`'s owner share for it.
    pub fn route_remote(&self, remote: &RemoteBuffer) -> Option<RdmaTransportLevel> {
        self.path_remote(remote).map(TransportPath::level)
    }

    /// The fastest transport this node and the op's remote side share, and
    /// how it carries the op: for the memory transport by which path, for
    /// ibverbs over which rail pairs.
    pub fn path(&self, op: &RdmaOp) -> Option<TransportPath> {
        match self.path_remote(&op.remote)? {
            TransportPath::Nic(_) => Some(TransportPath::Nic(
                self.ibverbs
                    .as_ref()
                    .map(|i| i.path(op))
                    .unwrap_or_default(),
            )),
            other => Some(other),
        }
    }

    fn path_remote(&self, remote: &RemoteBuffer) -> Option<TransportPath> {
        let transports = remote.transports();
        let tcp = transports.tcp.as_ref().filter(|_| self.tcp_data);
        if let Some(path) = self.memory.as_ref().and_then(|m| m.path(remote)) {
            Some(TransportPath::Memory(path))
        } else if let Some(ibverbs) = &self.ibverbs
            && transports.ibverbs.is_some()
            // A peer no rail reaches goes over TCP for a while, where it may.
            && (self.nic_required || tcp.is_none() || ibverbs.reaches(remote.owner()))
        {
            Some(TransportPath::Nic(RailPairs::default()))
        } else {
            tcp.map(|_| TransportPath::Tcp)
        }
    }

    /// Routes each op to the fastest transport both ends share; the ops of
    /// one transport stay one batch, and the transports run concurrently.
    /// Errors name the op's index in *this* batch.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        if self.is_shut_down() {
            return Err(SubmitError::ShutDown);
        }
        let mut levels = self.levels(&ops)?;
        // A same-host owner that closed its socket (it stopped, or
        // restarted with a new node id) is forgotten here, once per batch
        // and owner, so that its ops take the next transport, whose answer
        // says what is at the address now (`UnknownNode` for a restarted
        // owner), rather than failing on the dead link.
        if let Some(memory) = &self.memory {
            let on_memory = ops
                .iter()
                .zip(&levels)
                .filter(|(_, level)| **level == RdmaTransportLevel::Memory)
                .map(|(op, _)| op);
            if memory.forget_dead_owners(on_memory) {
                levels = self.levels(&ops)?;
            }
        }
        self.submit_routed(ops, levels, timeout).await
    }

    /// Runs a batch whose ops' transports are known (`levels[i]` is op
    /// `i`'s): the ops of one transport stay one batch, and the transports
    /// run concurrently.
    pub async fn submit_routed(
        &self,
        ops: Vec<RdmaOp>,
        levels: Vec<RdmaTransportLevel>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        if self.is_shut_down() {
            return Err(SubmitError::ShutDown);
        }
        // Usually a whole batch takes one transport: it goes on as it is.
        match levels.first() {
            None => Ok(()),
            Some(&first) if levels.iter().all(|&l| l == first) => {
                self.submit_on(first, ops, timeout).await
            }
            // Boxed: several transports' futures at once are large, and
            // every submit's future would otherwise carry (and copy) them.
            Some(_) => Box::pin(self.submit_split(ops, levels, timeout)).await,
        }
    }

    /// Each op's transport; an error ([`Router::unroutable`]) names the
    /// first op that has none.
    fn levels(&self, ops: &[RdmaOp]) -> Result<Vec<RdmaTransportLevel>, SubmitError> {
        ops.iter()
            .enumerate()
            .map(|(index, op)| {
                self.route(op).ok_or_else(|| SubmitError::Op {
                    index,
                    error: self.unroutable(&op.remote),
                })
            })
            .collect()
    }

    /// Why no transport carries an op to `remote`. Usually nothing is
    /// shared; but a same-host owner the memory transport does not reach
    /// now (it stopped or restarted, or runs in another network namespace),
    /// whose region no other transport this node allows carries (TCP off),
    /// is unreachable: a lost peer, not a configuration that never worked.
    pub fn unroutable(&self, remote: &RemoteBuffer) -> OpError {
        match &self.memory {
            Some(memory) if memory.same_host(remote) => OpError::PeerUnreachable {
                endpoint: remote.owner().endpoint,
                reason: "the same-host owner does not answer on the memory transport (it \
                         stopped, or runs in another network namespace), and no other \
                         transport this node allows carries its region"
                    .to_string(),
            },
            _ => OpError::NoSharedTransport,
        }
    }

    /// One transport's share of a batch.
    async fn submit_on(
        &self,
        level: RdmaTransportLevel,
        ops: Vec<RdmaOp>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        match level {
            RdmaTransportLevel::Memory => self.submit_memory(ops, timeout).await,
            RdmaTransportLevel::Nic => self.submit_ibverbs(ops, timeout).await,
            RdmaTransportLevel::Tcp => self.submit_tcp(ops, timeout).await,
        }
    }

    /// The memory transport's share of a batch; every op routed to it.
    async fn submit_memory(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let Some(memory) = &self.memory else {
            return Err(SubmitError::BackendStopped);
        };
        let submitted = Submitted::new(&ops);
        let result = memory.submit(ops, timeout).await;
        submitted.finish(&self.memory_meters, &result);
        result
    }

    /// A slice of a request's descriptor pairs, every remote region of
    /// which is routed to the memory transport: copied without an op made
    /// per pair ([`MemoryBackend::submit_pairs`](ferry_memory::MemoryBackend::submit_pairs)).
    /// `bytes` is what the pairs move, for the meters.
    pub async fn submit_memory_pairs(
        &self,
        pairs: ferry_memory::Pairs<'_>,
        bytes: u64,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        if self.is_shut_down() {
            return Err(SubmitError::ShutDown);
        }
        let Some(memory) = &self.memory else {
            return Err(SubmitError::BackendStopped);
        };
        let submitted = Submitted::uniform(pairs.kind, pairs.range.len(), bytes);
        let result = memory.submit_pairs(pairs, timeout).await;
        submitted.finish(&self.memory_meters, &result);
        result
    }

    /// The ibverbs backend's share of a batch; every op routed to it. A
    /// share whose first connect finds that no rail pair reaches its peer
    /// runs again over TCP, where the node allows it, with what is left of
    /// its deadline (said once per peer by the backend's warning, and
    /// counted in `ferry_ibverbs_tcp_fallbacks_total`).
    async fn submit_ibverbs(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let Some(ibverbs) = &self.ibverbs else {
            return Err(SubmitError::BackendStopped);
        };
        // Copies are kept only for a share that connects now: only then can
        // it find a peer no rail reaches. Each owner is looked up once per
        // run of ops to it (a batch usually has one).
        let mut last = None;
        let connects = |op: &RdmaOp| {
            let owner = op.remote.owner();
            last != Some(owner) && {
                last = Some(owner);
                !ibverbs.is_connected(owner)
            }
        };
        let retry = (self.may_fall_back(&ops) && ops.iter().any(connects)).then(|| ops.clone());
        let started = std::time::Instant::now();
        let result = self.ibverbs_meters.submit(ibverbs, ops, timeout).await;
        match (retry, &result) {
            (Some(ops), Err(SubmitError::Op { error, .. }))
                if no_rail_reached(ibverbs, ops.iter().map(|op| op.remote.owner()), error) =>
            {
                let left = timeout.saturating_sub(started.elapsed());
                self.submit_tcp(ops, left).await
            }
            _ => result,
        }
    }

    /// Whether a batch of `ops` over ibverbs may run over TCP instead, should
    /// no rail pair reach its owner: the node allows it (ibverbs is not
    /// required, TCP is not off) and every op carries the owner's TCP
    /// credentials. Asked by every path that falls back, so that they
    /// agree.
    pub fn may_fall_back(&self, ops: &[RdmaOp]) -> bool {
        self.tcp_data
            && !self.nic_required
            && ops.iter().all(|op| op.remote.transports().tcp.is_some())
    }

    /// Whether a notified batch to `owner` goes over TCP after all: it would
    /// be the first over ibverbs, it [may fall back](Self::may_fall_back),
    /// and connecting (which the batch would do anyway) finds that no rail
    /// pair reaches the owner. Counted and warned about as
    /// [`Router::submit`]'s fallback is.
    pub async fn no_rail_reaches(
        &self,
        owner: NodeAddr,
        ops: &[RdmaOp],
        timeout: Duration,
    ) -> bool {
        let Some(ibverbs) = &self.ibverbs else {
            return false;
        };
        if ibverbs.is_connected(owner) || !self.may_fall_back(ops) {
            return false;
        }
        match ibverbs.connect(owner, timeout).await {
            Err(error) => no_rail_reached(ibverbs, [owner].into_iter(), &error),
            Ok(_) => false,
        }
    }

    /// A batch whose every op goes over TCP, answered through `answer` from
    /// the thread that finishes it (see [`TcpBackend::submit_with_answer`]);
    /// the future returned only queues it.
    pub fn submit_tcp_with_answer(
        self: &Arc<Self>,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        answer: Answer,
    ) -> impl Future<Output = ()> + Send + use<> {
        let submitted = Submitted::new(&ops);
        let router = self.clone();
        let answer: Answer = {
            let router = router.clone();
            Box::new(move |result| {
                submitted.finish(&router.tcp_meters, &result);
                answer(result)
            })
        };
        async move {
            if router.is_shut_down() {
                return answer(Err(SubmitError::ShutDown));
            }
            router.tcp.submit_with_answer(ops, timeout, answer).await
        }
    }

    /// The TCP backend's share of a batch.
    async fn submit_tcp(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.tcp_meters.submit(&self.tcp, ops, timeout).await
    }

    /// A batch whose ops take both transports: each share runs as its own
    /// batch, concurrently, and errors are mapped back to batch indices.
    /// A batch over several transports: one sub-batch each, concurrently.
    async fn submit_split(
        &self,
        ops: Vec<RdmaOp>,
        levels: Vec<RdmaTransportLevel>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        let total = ops.len();
        let mut groups: Vec<(RdmaTransportLevel, Vec<RdmaOp>, Vec<usize>)> = Vec::new();
        for (index, (op, level)) in ops.into_iter().zip(levels).enumerate() {
            match groups.iter_mut().find(|(l, ..)| *l == level) {
                Some((_, ops, indices)) => {
                    ops.push(op);
                    indices.push(index);
                }
                None => groups.push((level, vec![op], vec![index])),
            }
        }
        let results = futures_util::future::join_all(groups.into_iter().map(
            |(level, ops, indices)| async move {
                remap(self.submit_on(level, ops, timeout).await, &indices)
            },
        ))
        .await;
        merge(results, total)
    }

    /// Registers memory with every running backend (TCP's only when region
    /// bytes may go over TCP); its handles advertise all of them.
    pub async fn register(
        &self,
        memory: MemoryBlock,
        access: Access,
    ) -> Result<Region, RegisterError> {
        if self.is_shut_down() {
            return Err(RegisterError::ShutDown);
        }
        let memory = Arc::new(memory);
        let slot = self.ids.allocate();
        let (id, generation) = (slot.id(), slot.generation());
        let message = || RegisterRegion {
            id,
            generation,
            access,
            memory: memory.clone(),
        };
        let mut registrations: Vec<Box<dyn std::any::Any + Send + Sync>> = Vec::new();
        let mut transports = RemoteTransports {
            tcp: None,
            ibverbs: None,
            memory: None,
        };
        if self.tcp_data {
            let tcp = self.tcp.register(message()).await?;
            registrations.push(Box::new(tcp.registration));
            transports.tcp = Some(tcp.remote);
        }
        if let Some(shared) = self.memory.as_ref().and_then(|m| m.register(&message())) {
            registrations.push(Box::new(shared.registration));
            transports.memory = Some(shared.remote);
        }
        if let Some(ibverbs) = &self.ibverbs {
            let ibv = ibverbs.register(message()).await?;
            registrations.push(Box::new(ibv.registration));
            transports.ibverbs = Some(ibv.remote);
        }
        Ok(RegionParts {
            slot,
            memory,
            access,
            owner: self.addr(),
            transports,
            registrations,
        }
        .into_region())
    }

    /// Memory for a region: shareable with same-host peers when the memory
    /// transport runs.
    pub fn alloc_memory(&self, len: u64) -> Result<MemoryBlock, RegisterError> {
        if self.is_shut_down() {
            return Err(RegisterError::ShutDown);
        }
        match &self.memory {
            Some(_) => ferry_memory::alloc_or_plain(len),
            None => MemoryBlock::alloc(len),
        }
    }

    /// The fastest transport this node runs.
    pub fn transport_level(&self) -> RdmaTransportLevel {
        if self.memory.is_some() {
            RdmaTransportLevel::Memory
        } else if self.ibverbs.is_some() {
            RdmaTransportLevel::Nic
        } else {
            RdmaTransportLevel::Tcp
        }
    }

    pub async fn transport_info(&self) -> NodeTransportInfo {
        let ibverbs = match &self.ibverbs {
            Some(ibverbs) => ibverbs.transport_info().await,
            None => None,
        };
        NodeTransportInfo {
            tcp: self.tcp.transport_info().await,
            ibverbs,
            transports: self.transports.clone(),
        }
    }
}

/// Whether `error`, from a first connect to `owners`, says that no rail pair
/// reaches any of them: the fallback to TCP, counted in
/// `ferry_ibverbs_tcp_fallbacks_total`.
fn no_rail_reached(
    ibverbs: &IbvBackend,
    mut owners: impl Iterator<Item = NodeAddr>,
    error: &OpError,
) -> bool {
    let unreachable =
        matches!(error, OpError::PeerUnreachable { .. }) && owners.all(|o| !ibverbs.reaches(o));
    if unreachable {
        metrics::counter!("ferry_ibverbs_tcp_fallbacks_total").increment(1);
    }
    unreachable
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
fn merge(
    results: impl IntoIterator<Item = Result<(), SubmitError>>,
    total: usize,
) -> Result<(), SubmitError> {
    let mut lowest_op: Option<(usize, OpError)> = None;
    let mut timed_out: Option<(Duration, usize)> = None;
    let mut stopped = false;
    let mut shut_down = false;
    let mut unranked = None;
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
            Err(SubmitError::ShutDown) => shut_down = true,
            // A kind of failure this merge does not rank: kept, not lost.
            Err(other) => unranked = Some(other),
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
    if let Some(error) = unranked {
        return Err(error);
    }
    if shut_down {
        Err(SubmitError::ShutDown)
    } else if stopped {
        Err(SubmitError::BackendStopped)
    } else {
        Ok(())
    }
}

/// How a node carries an op ([`Node::path`](crate::Node::path)): its
/// transport; for the same-host memory transport whether the region is a
/// memfd mapped here or memory reached with
/// `process_vm_readv`/`process_vm_writev` (both are
/// [`RdmaTransportLevel::Memory`]); for ibverbs the rail pairs it may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportPath {
    /// The TCP fallback.
    Tcp,
    /// ibverbs RDMA, over these pairs of this node's and the peer's rails
    /// (indices into `IbvTransportInfo::rails`): those on the local
    /// region's preferred rails (see [`ferry_ibverbs::Placement`]). Empty
    /// until the first op to the peer has connected its pairs.
    Nic(RailPairs),
    /// Same-host memory, by this path.
    Memory(MemoryPath),
}

impl TransportPath {
    /// The transport's level.
    pub fn level(self) -> RdmaTransportLevel {
        match self {
            TransportPath::Tcp => RdmaTransportLevel::Tcp,
            TransportPath::Nic(_) => RdmaTransportLevel::Nic,
            TransportPath::Memory(_) => RdmaTransportLevel::Memory,
        }
    }
}

/// The transports a node runs, and their raw details.
#[derive(Debug)]
#[non_exhaustive]
pub struct NodeTransportInfo {
    /// The TCP backend's details.
    pub tcp: Option<TcpTransportInfo>,
    /// The ibverbs backend's raw handles, when it runs.
    pub ibverbs: Option<IbvTransportInfo>,
    /// Every transport, fastest first: running, or why not.
    pub transports: Vec<TransportStatus>,
}
