//! `IbvManagerActor`: owns the device, protection domain, memory regions and
//! queue pairs of this node's RDMA data plane; `IbvBackend`, its handle.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Endpoint, EndpointError, NotificationSink, Request, Service, ServiceError};
use ferry_core::{
    DataPathNotification, Generation, IbvRemote, NodeAddr, OpError, RdmaBackend, RdmaOp,
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
use crate::device::{Device, IbvConfig};
use crate::info::{IbvRegionKeys, IbvTransportInfo};
use crate::mr_cache::MrCache;
use crate::passive::{self, PassiveQps};
use crate::peers::Peers;
use crate::verbs::{MemoryRegion, VerbsError};

/// (lkey, rkey) of the regions registered with this device, by region. A
/// B-tree: looked up for every op, and small maps need no hashing.
#[derive(Default)]
pub(crate) struct Registry(Mutex<BTreeMap<(RegionId, Generation), (u32, u32)>>);

impl Registry {
    pub(crate) fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<(RegionId, Generation), (u32, u32)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Dropping this deregisters the region from the device: first from the key
/// registry (no new work can name it), then the MR itself. `ibv_dereg_mr`
/// returns only once the NIC can no longer access the memory through the
/// MR (a peer's RDMA write naming its rkey fails with a remote access
/// error), so no ibverbs write lands in the memory once this drop returned;
/// the MR's hold on the block goes right after.
pub struct IbvRegistration {
    registry: Arc<Registry>,
    key: (RegionId, Generation),
    /// Its own MR, or the one of a registered region it lies in (shared:
    /// deregistered with the last region using it).
    _mr: Arc<MemoryRegion>,
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
        let (addr, len) = (msg.memory.addr(), msg.memory.len());
        let mr = match shared
            .device
            .share_registrations
            .then(|| shared.mrs.covering(addr, len, msg.access))
            .flatten()
        {
            Some(mr) => mr,
            None => {
                let mr = MemoryRegion::register(&shared.device.pd, msg.memory, msg.access)
                    .map_err(|e| RegisterError::Backend(e.to_string()))?;
                let mr = Arc::new(mr);
                shared.mrs.insert(&mr, msg.access);
                mr
            }
        };
        let mut map = self.shared.registry.lock();
        if map.contains_key(&key) {
            return Err(RegisterError::IdInUse(msg.id));
        }
        map.insert(key, (mr.lkey(), mr.rkey()));
        drop(map);
        Ok(IbvRegistered {
            remote: IbvRemote {
                rkey: mr.rkey(),
                gid: self.shared.device.gid,
            },
            registration: IbvRegistration {
                registry: self.shared.registry.clone(),
                key,
                _mr: mr,
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
            .map(|(&(id, generation), &(lkey, rkey))| IbvRegionKeys {
                id,
                generation,
                lkey,
                rkey,
            })
            .collect();
        Ok(IbvTransportInfo::new(
            &shared.device,
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
    device: String,
}

/// An opened, usable RDMA device, ready to back an [`IbvBackend`].
pub struct IbvDevice(Arc<Device>);

impl IbvDevice {
    /// Fails with `VerbsError::NoDevice` on a host without RDMA hardware.
    pub fn open(config: &IbvConfig) -> Result<Self, VerbsError> {
        Ok(IbvDevice(Arc::new(Device::open(config)?)))
    }

    /// e.g. "rxe0 port 1, GID index 1, MTU 1024"
    pub fn describe(&self) -> String {
        let d = &self.0;
        format!(
            "{} port {}, GID index {}, MTU {}",
            d.context.name(),
            d.port,
            d.gid_index,
            128u32 << d.mtu
        )
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
        let device = device.0;
        let name = device.context.name().to_string();
        let passive = Arc::new(PassiveQps::default());
        endpoint.serve(Service::IBVERBS_CONNECT, {
            let (device, passive) = (device.clone(), passive.clone());
            move |request| passive::accept(device.clone(), passive.clone(), sink.clone(), request)
        })?;
        info!(
            device = %name,
            port = device.port,
            gid_index = device.gid_index,
            mtu = 128u32 << device.mtu,
            max_send_wr = device.max_send_wr,
            notify_slots = device.notify_slots,
            "ibverbs transport ready"
        );
        let shared = Arc::new(Shared {
            device,
            endpoint: endpoint.clone(),
            peers: Peers::default(),
            registry: Arc::default(),
            mrs: MrCache::default(),
            passive,
        });
        // Weak: the endpoint holds its handlers, and `Shared` the endpoint.
        let weak = Arc::downgrade(&shared);
        endpoint.serve(Service::IBVERBS_CREDITS, move |request| {
            let answer = take_credits(&weak, &request);
            async move { answer }
        })?;
        let actor = IbvManagerActor::spawn(IbvManagerActor {
            shared: shared.clone(),
        });
        Ok(IbvBackend {
            actor,
            shared,
            device: name,
        })
    }

    /// Connects this node's queue pair to `peer` (the exchange over the
    /// control session and the moves to RTS) within `timeout`, as its
    /// first transfer there would: the first transfer then pays none of it.
    pub async fn connect(&self, peer: NodeAddr, timeout: Duration) -> Result<(), OpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let shared = &self.shared;
        shared
            .peers
            .get(&shared.device, &shared.endpoint, peer, deadline)
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

    /// The device's name, e.g. `rxe0`.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Memory regions registered with the device for this node's regions
    /// now: one per region, except regions inside another that share its
    /// ([`IbvConfig::share_registrations`]).
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
