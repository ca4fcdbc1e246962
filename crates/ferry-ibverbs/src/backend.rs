//! `IbvManagerActor`: owns the rails (devices, protection domains, ports),
//! memory regions and queue pairs of this node's RDMA data plane;
//! `IbvBackend`, its handle.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Endpoint, EndpointError, NotificationSink, Request, Service, ServiceError};
use ferry_core::{
    DataPathNotification, Generation, IbvRemote, NodeAddr, OpError, RailKeys, RdmaBackend, RdmaOp,
    RdmaTransportLevel, RegionId, RegisterError, RegisterRegion, Submit, SubmitError,
    TransportInfo, TransportLevel,
};
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::error::SendError;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tracing::info;

use crate::batch::Shared;
pub use crate::connection::FOREIGN_WR_ID_BIT;
use crate::device::{Fabric, IbvConfig};
use crate::info::{IbvRegionKeys, IbvTransportInfo};
use crate::mr_cache::MrCache;
use crate::passive::{self, PassiveQps};
use crate::peers::Peers;
use crate::placement::{PinError, Placement, RailPairs, RailSet, Route, numa_node_of};
use crate::verbs::{MemoryRegion, VerbsError};

/// A registered region's keys on each rail, by rail index, and the rails
/// its ops take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keys {
    pub lkeys: RailKeys,
    pub rkeys: RailKeys,
    /// The NUMA node of the region's memory, when placement asked for it
    /// and the kernel said.
    pub numa_node: Option<u32>,
    pub route: Route,
}

/// The keys of the regions registered on this node's rails, by region. A
/// B-tree: looked up for every op, and small maps need no hashing.
#[derive(Default)]
pub(crate) struct Registry(Mutex<BTreeMap<(RegionId, Generation), Keys>>);

impl Registry {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(RegionId, Generation), Keys>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Dropping this deregisters the region from every device: first from the
/// key registry (no new work can name it), then the MRs themselves. `ibv_dereg_mr`
/// returns only once the NIC can no longer access the memory through the
/// MR (a peer's RDMA write naming its rkey fails with a remote access
/// error), so no ibverbs write lands in the memory once this drop returned;
/// the MR's hold on the block goes right after.
pub struct IbvRegistration {
    registry: Arc<Registry>,
    key: (RegionId, Generation),
    /// Its own MR on each device, or the one of a registered region it lies
    /// in (shared: deregistered with the last region using it).
    _mrs: Vec<Arc<MemoryRegion>>,
}

impl Drop for IbvRegistration {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.key);
    }
}

/// Credits a peer returns for the notification receive buffers it posted
/// for one of our QPs (the `IBVERBS_CREDITS` service). Credits for a QP
/// that is gone, replaced by a newer one, are ignored.
fn take_credits(shared: &Weak<Shared>, request: &Request) -> Result<Bytes, ServiceError> {
    let (qpn, count) = crate::wire::decode_credits(&request.body)
        .ok_or_else(|| ServiceError("malformed credit return".into()))?;
    let owner = request.session.peer();
    let qp = shared.upgrade().and_then(|shared| {
        shared
            .peers
            .all()
            .into_iter()
            .find(|qp| qp.qpn() == qpn && qp.peer().id == owner.id)
    });
    if let Some(lane) = qp.as_ref().and_then(|qp| qp.notify_lane()) {
        lane.return_credits(count);
    }
    Ok(Bytes::new())
}

/// The ibverbs data plane's manager actor. It accepts the shared
/// [`Submit`], [`RegisterRegion`], [`TransportLevel`] and [`TransportInfo`]
/// messages and replies to `Submit` later (delegated), so its mailbox never
/// waits on a transfer. Made by [`IbvBackend::start`].
pub struct IbvManagerActor {
    shared: Arc<Shared>,
}

impl Actor for IbvManagerActor {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(actor: Self, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(actor)
    }
}

impl Message<Submit> for IbvManagerActor {
    type Reply = DelegatedReply<Result<(), SubmitError>>;

    async fn handle(&mut self, msg: Submit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let shared = self.shared.clone();
        ferry_core::inline::answer(
            ctx,
            async move { shared.submit(msg.ops, msg.timeout).await },
        )
    }
}

/// What registering a region with the ibverbs backend gives.
pub struct IbvRegistered {
    /// The credentials remote handles carry.
    pub remote: IbvRemote,
    /// Deregisters the region from the NIC when dropped.
    pub registration: IbvRegistration,
}

impl Message<RegisterRegion> for IbvManagerActor {
    type Reply = Result<IbvRegistered, RegisterError>;

    async fn handle(
        &mut self,
        msg: RegisterRegion,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let key = (msg.id, msg.generation);
        let shared = &self.shared;
        let fabric = &shared.fabric;
        let (addr, len) = (msg.memory.addr(), msg.memory.len());
        let mut mrs = Vec::with_capacity(fabric.nics.len());
        for (nic, device) in fabric.nics.iter().enumerate() {
            let cached = fabric
                .share_registrations
                .then(|| shared.mrs.covering(nic, addr, len, msg.access))
                .flatten();
            let mr = match cached {
                Some(mr) => mr,
                None => {
                    let mr = MemoryRegion::register(&device.pd, msg.memory.clone(), msg.access)
                        .map_err(|e| {
                            RegisterError::Backend(format!("{}: {e}", device.context.name()))
                        })?;
                    let mr = Arc::new(mr);
                    shared.mrs.insert(nic, &mr, msg.access);
                    mr
                }
            };
            mrs.push(mr);
        }
        let per_rail = |key: fn(&MemoryRegion) -> u32| {
            let keys: Vec<u32> = fabric.rails.iter().map(|r| key(&mrs[r.nic])).collect();
            RailKeys::new(&keys).expect("a fabric has at most MAX_RAILS rails")
        };
        // The pages are pinned now (registered), so the kernel can say
        // where they are. One rail has nothing to choose from.
        let numa_node = (fabric.placement == Placement::Numa && fabric.rails.len() > 1)
            .then(|| numa_node_of(addr))
            .flatten();
        let keys = Keys {
            lkeys: per_rail(MemoryRegion::lkey),
            rkeys: per_rail(MemoryRegion::rkey),
            numa_node,
            route: Route::new(&fabric.numa_nodes(), numa_node, None),
        };
        let mut map = self.shared.registry.lock();
        if map.contains_key(&key) {
            return Err(RegisterError::IdInUse(msg.id));
        }
        map.insert(key, keys);
        drop(map);
        Ok(IbvRegistered {
            remote: IbvRemote { rkeys: keys.rkeys },
            registration: IbvRegistration {
                registry: self.shared.registry.clone(),
                key,
                _mrs: mrs,
            },
        })
    }
}

impl Message<TransportLevel> for IbvManagerActor {
    type Reply = Result<RdmaTransportLevel, Infallible>;

    async fn handle(
        &mut self,
        _: TransportLevel,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(RdmaTransportLevel::Nic)
    }
}

impl Message<TransportInfo> for IbvManagerActor {
    type Reply = Result<IbvTransportInfo, Infallible>;

    async fn handle(
        &mut self,
        _: TransportInfo,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let shared = &self.shared;
        let qps = shared
            .peers
            .all()
            .into_iter()
            .filter(|q| q.is_usable())
            .collect();
        let regions = shared
            .registry
            .lock()
            .iter()
            .map(|(&(id, generation), keys)| IbvRegionKeys {
                id,
                generation,
                lkeys: keys.lkeys,
                rkeys: keys.rkeys,
                numa_node: keys.numa_node,
                allowed: keys.route.allowed,
                preferred: keys.route.prefer,
            })
            .collect();
        Ok(IbvTransportInfo::new(
            &shared.fabric,
            qps,
            shared.passive.len(),
            regions,
        ))
    }
}

/// Cloneable handle to a running `IbvManagerActor`. Its `submit` runs the
/// transfer in the caller's task, without a mailbox hop; the actor's
/// `Submit` message does the same work for callers that only hold the actor.
#[derive(Clone)]
pub struct IbvBackend {
    actor: ActorRef<IbvManagerActor>,
    shared: Arc<Shared>,
}

/// This node's opened, usable rails (RDMA device ports), ready to back an
/// [`IbvBackend`].
pub struct IbvDevice(Arc<Fabric>);

impl IbvDevice {
    /// Opens the rails `config` names (every active port of every device
    /// by default). Fails with `VerbsError::NoDevice` on a host without
    /// RDMA hardware.
    pub fn open(config: &IbvConfig) -> Result<Self, VerbsError> {
        Ok(IbvDevice(Arc::new(Fabric::open(config)?)))
    }

    /// e.g. "rxe0:1 (GID index 1, MTU 1024), rxe1:1 (GID index 1, MTU 1024)"
    pub fn describe(&self) -> String {
        let rails: Vec<String> = self
            .0
            .rails
            .iter()
            .map(|r| {
                format!(
                    "{} (GID index {}, MTU {})",
                    r.name(),
                    r.gid_index,
                    128u32 << r.mtu
                )
            })
            .collect();
        rails.join(", ")
    }
}

impl IbvBackend {
    /// Serves queue-pair exchanges on `endpoint`'s control sessions and
    /// spawns the manager on the current tokio runtime. Notifications that
    /// peers send on their queue pairs go to `sink` (the node's inbox).
    pub fn start(
        device: IbvDevice,
        endpoint: &Endpoint,
        sink: NotificationSink,
    ) -> Result<Self, EndpointError> {
        let fabric = device.0;
        let (per_session, total) = fabric.passive_caps;
        let passive = Arc::new(PassiveQps::new(passive::Caps { per_session, total }));
        endpoint.serve(Service::IBVERBS_CONNECT, {
            let (fabric, passive) = (fabric.clone(), passive.clone());
            move |request| passive::accept(fabric.clone(), passive.clone(), sink.clone(), request)
        })?;
        for rail in &fabric.rails {
            info!(
                rail = rail.index,
                device = %rail.context.name(),
                port = rail.port,
                gid_index = rail.gid_index,
                mtu = 128u32 << rail.mtu,
                max_send_wr = rail.max_send_wr,
                notify_slots = rail.notify_slots,
                netdev = rail.netdev.as_deref().unwrap_or("-"),
                "ibverbs rail ready"
            );
        }
        let shared = Arc::new(Shared {
            fabric,
            endpoint: endpoint.clone(),
            peers: Peers::default(),
            registry: Arc::default(),
            mrs: MrCache::default(),
            passive,
            leases: AtomicU32::new(0),
        });
        crate::ports::watch(&shared.fabric, Arc::downgrade(&shared));
        // Weak: the endpoint holds its handlers, and `Shared` the endpoint.
        let weak = Arc::downgrade(&shared);
        endpoint.serve(Service::IBVERBS_CREDITS, move |request| {
            let answer = take_credits(&weak, &request);
            async move { answer }
        })?;
        let actor = IbvManagerActor::spawn(IbvManagerActor {
            shared: shared.clone(),
        });
        Ok(IbvBackend { actor, shared })
    }

    /// Leases queue pairs to `peer` for code that posts RDMA itself (a GPU
    /// kernel, a proxy thread), one per rail pair ferry uses to that peer
    /// (only those from the local rails in `rails`, when given), each with
    /// room for `depth` outstanding requests and a completion queue of its
    /// own that ferry never polls, connected and probed by `timeout`. See
    /// [`IbvLease`](crate::IbvLease) for what ferry does with them until
    /// the lease is dropped. Fails with `PeerUnreachable` when no pair
    /// could be leased.
    pub async fn lease(
        &self,
        peer: NodeAddr,
        rails: Option<&[u8]>,
        depth: u32,
        timeout: Duration,
    ) -> Result<crate::IbvLease, OpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let shared = &self.shared;
        let fabric = &shared.fabric;
        let link = shared
            .peers
            .get(fabric, &shared.endpoint, peer, deadline)
            .await?;
        let candidates: Vec<_> = link
            .usable()
            .iter()
            .filter(|qp| rails.is_none_or(|r| r.contains(&qp.rail().index)))
            .filter_map(|qp| {
                let theirs = link.theirs().iter().find(|t| t.index == qp.remote_rail())?;
                Some((qp.rail().clone(), *theirs))
            })
            .collect();
        let unreachable = |reason: String| OpError::PeerUnreachable {
            endpoint: peer.endpoint,
            reason,
        };
        if candidates.is_empty() {
            return Err(unreachable(format!(
                "no usable rail pair to lease from rails {rails:?}"
            )));
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let session = shared.endpoint.session(peer, left).await?;
        // Slot 0 is ferry's own pairs; leases count from 1, wrapping.
        let slot = (shared.leases.fetch_add(1, Ordering::Relaxed) % u32::from(u16::MAX)) as u16 + 1;
        let depth = depth.max(1);
        let mut tried = Vec::new();
        let connected = crate::exchange::propose(
            fabric,
            &session,
            candidates,
            slot,
            Some(depth),
            deadline,
            &mut tried,
        )
        .await?;
        if connected.is_empty() {
            return Err(unreachable(format!("leasing failed: {}", tried.join("; "))));
        }
        Ok(crate::IbvLease::new(peer, slot, session, connected, depth))
    }

    /// Connects this node's queue pairs to `peer` (the exchange over the
    /// control session, the probes and the moves to RTS) within `timeout`,
    /// as its first transfer there would: the first transfer then pays none
    /// of it.
    pub async fn connect(&self, peer: NodeAddr, timeout: Duration) -> Result<(), OpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let shared = &self.shared;
        shared
            .peers
            .get(&shared.fabric, &shared.endpoint, peer, deadline)
            .await
            .map(drop)
    }

    /// Runs `ops` as [`RdmaBackend::submit`] does and, if they all go to
    /// one owner, puts `notification` behind them on its queue pair: the
    /// owner receives it only after every op has been executed there (for
    /// reads, after their data has come back), and never if one failed.
    /// It is delivered to the owner's inbox from there; a batch that fails
    /// or times out sends none.
    ///
    /// [`NotSent`](DataPathNotification::NotSent) when the batch spans
    /// several owners, or the owner posted no receive buffers for this
    /// node, or none is free (its inbox is full), or the notification is
    /// larger than one: the batch ran without it, notify the owner another
    /// way. [`Accepted`](DataPathNotification::Accepted) once the owner's
    /// NIC acknowledged the SEND. [`Failed`](DataPathNotification::Failed)
    /// when the ops completed but the queue pair broke under the SEND.
    pub async fn submit_notified(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Bytes,
    ) -> Result<DataPathNotification, SubmitError> {
        self.shared
            .submit_notified(ops, timeout, Some(notification))
            .await
    }

    /// Whether ibverbs may reach `peer`: false for a while (30 s) after
    /// connecting found that no pair of rails reaches it, during which a
    /// node routes its transfers over TCP where it may.
    pub fn reaches(&self, peer: NodeAddr) -> bool {
        self.shared.peers.reaches(peer)
    }

    /// Pins the region `id` of `generation` to `rails` (indices, as in
    /// [`IbvTransportInfo::rails`]): its ops take only those rails from
    /// now on, preferring the ones on its memory's NUMA node, and fail
    /// with `NoSharedTransport` where none of them reaches the peer. An op
    /// already posted keeps its rails. Pinning again replaces the pin.
    pub fn pin_rails(
        &self,
        id: RegionId,
        generation: Generation,
        rails: &[u8],
    ) -> Result<(), PinError> {
        let count = self.shared.fabric.rails.len();
        if let Some(&rail) = rails.iter().find(|&&r| usize::from(r) >= count) {
            return Err(PinError::NoSuchRail { rail, rails: count });
        }
        let pin = RailSet::of(rails).expect("checked against the rails");
        if pin.is_empty() {
            return Err(PinError::NoRail);
        }
        let mut registry = self.shared.registry.lock();
        let keys = registry
            .get_mut(&(id, generation))
            .ok_or(PinError::UnknownRegion)?;
        keys.route = Route::new(&self.shared.fabric.numa_nodes(), keys.numa_node, Some(pin));
        Ok(())
    }

    /// The rail pairs `op` would take now (see [`crate::Placement`]):
    /// empty when no pair to its peer is connected yet (they are probed at
    /// the first op) or none may carry it.
    pub fn path(&self, op: &RdmaOp) -> RailPairs {
        self.shared.pairs_for(op)
    }

    /// Whether this node has usable queue pairs to `peer` now.
    pub fn is_connected(&self, peer: NodeAddr) -> bool {
        self.shared.peers.connected(peer).is_some()
    }

    /// The manager actor, for workers that send it messages.
    pub fn actor(&self) -> &ActorRef<IbvManagerActor> {
        &self.actor
    }

    /// Peers this node has a queue-pair slot for (released once the queue
    /// pair is broken and drained), and the queue pairs it keeps for
    /// initiators (released when their control session ends). For leak
    /// checks and `ferry info`.
    pub fn peer_tables(&self) -> (usize, usize) {
        (self.shared.peers.len(), self.shared.passive.len())
    }

    /// The rails' names, in rail order, e.g. `["rxe0:1", "rxe1:1"]`.
    pub fn rails(&self) -> Vec<String> {
        self.shared.fabric.rails.iter().map(|r| r.name()).collect()
    }

    /// Memory regions registered with the devices for this node's regions
    /// now: one per region and device, except regions inside another that
    /// share its ([`IbvConfig::share_registrations`]).
    pub fn memory_regions(&self) -> usize {
        self.shared.mrs.live()
    }

    /// Stops the manager; queue pairs are destroyed once drained.
    pub async fn stop(&self) {
        let _ = self.actor.stop_gracefully().await;
        self.actor.wait_for_shutdown().await;
    }

    /// Registers a region with the NIC (remote write only for
    /// [`Access::ReadWrite`](ferry_core::Access::ReadWrite)); fails with
    /// [`RegisterError::Backend`] when the device refuses the memory.
    pub async fn register(&self, msg: RegisterRegion) -> Result<IbvRegistered, RegisterError> {
        self.actor.ask(msg).await.map_err(|e| match e {
            SendError::HandlerError(e) => e,
            _ => RegisterError::BackendStopped,
        })
    }
}

impl RdmaBackend for IbvBackend {
    type TransportInfo = IbvTransportInfo;

    /// Runs the transfer in the caller's task (see [`IbvBackend`]).
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.shared.submit(ops, timeout).await
    }

    fn transport_level(&self) -> RdmaTransportLevel {
        RdmaTransportLevel::Nic
    }

    async fn transport_info(&self) -> Option<IbvTransportInfo> {
        self.actor.ask(TransportInfo).await.ok()
    }
}
