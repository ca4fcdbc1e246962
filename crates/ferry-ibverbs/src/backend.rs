//! `IbvManagerActor`: owns the device, protection domain, memory regions and
//! queue pairs of this node's RDMA data plane.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{
    BatchProgress, Generation, IbvRemote, NodeAddr, OpError, OpKind, RdmaBackend, RdmaOp,
    RdmaTransportLevel, Region, RegionId, RegisterError, SubmitError,
};
use ferry_core::{RegisterRegion, Submit};
use ferry_tcp::ControlConnection;
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn, WeakActorRef};
use kameo::error::{ActorStopReason, SendError};
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, debug_span, info};

pub use crate::connection::FOREIGN_WR_ID_BIT;
use crate::connection::{self, PeerQp, Piece};
use crate::device::{Device, IbvConfig};
use crate::verbs::{MemoryRegion, RdmaOpcode, VerbsError, WorkRequest};

/// How long a submitting task polls for its own completions before it waits
/// for the poller task instead.
const INLINE_POLL: Duration = Duration::from_micros(200);

/// Local keys of the regions registered with this device, by region.
#[derive(Default)]
struct Registry(Mutex<HashMap<(RegionId, Generation), (u32, u32)>>);

impl Registry {
    fn lkey(&self, region: &Region) -> Option<u32> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(region.id(), region.generation()))
            .map(|(lkey, _)| *lkey)
    }
}

/// Dropping this deregisters the region from the device: first from the key
/// registry (no new work can name it), then the MR itself.
pub struct IbvRegistration {
    registry: Arc<Registry>,
    key: (RegionId, Generation),
    _mr: MemoryRegion,
}

impl Drop for IbvRegistration {
    fn drop(&mut self) {
        self.registry
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

/// The queue pair to one peer, once connected. The async lock makes
/// concurrent first submits share one connection attempt.
type PeerSlot = Arc<tokio::sync::Mutex<Option<Arc<PeerQp>>>>;

/// Queue pairs to peers, one per peer, connected on first use.
#[derive(Default)]
struct Peers(Mutex<HashMap<NodeAddr, PeerSlot>>);

impl Peers {
    async fn get(
        &self,
        device: &Arc<Device>,
        peer: NodeAddr,
        me: NodeAddr,
    ) -> Result<Arc<PeerQp>, OpError> {
        let slot = {
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(peer).or_default().clone()
        };
        let mut slot = slot.lock().await;
        match &*slot {
            Some(qp) if !qp.is_broken() => Ok(qp.clone()),
            // A broken QP drains on its own; the next op gets a fresh one.
            _ => {
                let qp = connection::connect(device, peer, me.id).await?;
                *slot = Some(qp.clone());
                Ok(qp)
            }
        }
    }

    fn all(&self) -> Vec<Arc<PeerQp>> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.values()
            .filter_map(|slot| slot.try_lock().ok().and_then(|s| s.clone()))
            .collect()
    }
}

struct Shared {
    device: Arc<Device>,
    local: NodeAddr,
    peers: Peers,
    registry: Arc<Registry>,
}

impl Shared {
    /// Runs one batch to completion or deadline, in a tracing span.
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let bytes: usize = ops.iter().map(RdmaOp::len).sum();
        // A batch usually goes to one peer; name the first.
        let peer = ops.first().map(|op| op.remote.owner().endpoint);
        let span =
            debug_span!("submit", transport = "ibverbs", peer = ?peer, ops = ops.len(), bytes);
        let result = self.run(ops, timeout).instrument(span.clone()).await;
        debug!(parent: &span, ?result, "submit finished");
        result
    }

    async fn run(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let deadline = Instant::now() + timeout;
        let max_msg = self.device.max_msg as usize;
        let mut counts = Vec::with_capacity(ops.len());
        let mut keys = Vec::with_capacity(ops.len());
        // Every op is checked before anything is posted.
        for (index, op) in ops.iter().enumerate() {
            op.validate().map_err(|e| SubmitError::op(index, e))?;
            let remote = op.remote.transports().ibverbs;
            let lkey = self.registry.lkey(op.local.region());
            let (Some(remote), Some(lkey)) = (remote, lkey) else {
                return Err(SubmitError::op(index, OpError::NoSharedTransport));
            };
            counts.push(op.len().div_ceil(max_msg) as u32);
            keys.push((lkey, remote.rkey));
        }
        let progress = Arc::new(BatchProgress::new(counts));
        if progress.total_pieces() == 0 {
            return Ok(());
        }
        // Ops larger than the port's message limit become several requests.
        let mut groups: HashMap<NodeAddr, Vec<Piece>> = HashMap::new();
        for (index, (op, (lkey, rkey))) in ops.into_iter().zip(keys).enumerate() {
            let opcode = match op.kind {
                OpKind::Read => RdmaOpcode::Read,
                OpKind::Write => RdmaOpcode::Write,
            };
            let pieces = groups.entry(op.remote.owner()).or_default();
            let mut at = 0;
            while at < op.len() {
                let len = max_msg.min(op.len() - at);
                pieces.push(Piece {
                    op: index,
                    wr: WorkRequest {
                        wr_id: 0,
                        opcode,
                        local_addr: op.local.as_ptr() as u64 + at as u64,
                        len: len as u32,
                        lkey,
                        remote_addr: op.remote.addr() + at as u64,
                        rkey,
                        signaled: false,
                    },
                    pin: op.local.region().clone(),
                });
                at += len;
            }
        }
        let used: Mutex<Vec<Arc<PeerQp>>> = Mutex::default();
        let work = async {
            for (peer, pieces) in groups {
                match self.peers.get(&self.device, peer, self.local).await {
                    Ok(qp) => {
                        used.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(qp.clone());
                        qp.post_all(pieces, &progress, deadline).await;
                    }
                    Err(e) => pieces
                        .into_iter()
                        .for_each(|p| progress.piece_done(p.op, Err(e.clone()))),
                }
            }
            // Small transfers finish within microseconds: poll for them here
            // rather than sleep until the poller task wakes us, which costs
            // several thread wake-ups. Bounded; then the poller takes over.
            // The clock is read only every 64 polls: where it is slow to read
            // (an emulated HPET), reading it each time cost more than polling.
            let spin_until = std::time::Instant::now() + INLINE_POLL;
            let qps = used.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let mut wcs = Vec::with_capacity(16);
            let mut polls = 0u32;
            while !progress.is_done()
                && (!polls.is_multiple_of(64) || std::time::Instant::now() < spin_until)
            {
                polls = polls.wrapping_add(1);
                if qps.iter().map(|qp| qp.poll_now(&mut wcs)).sum::<usize>() == 0 {
                    std::hint::spin_loop();
                }
            }
            progress.all_done().await;
        };
        // Pinned so the outcome is decided before the work future is dropped.
        let work = std::pin::pin!(work);
        match tokio::time::timeout_at(deadline, work).await {
            Ok(()) => progress.outcome(),
            Err(_) => {
                let error = progress.timed_out(timeout);
                // Flush what is still outstanding: the flush completions
                // release the pinned memory; the next op reconnects.
                for qp in used.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                    if qp.has_work_of(&progress) {
                        qp.break_with(OpError::ConnectionLost {
                            endpoint: qp.peer().endpoint,
                        });
                    }
                }
                Err(error)
            }
        }
    }
}

pub struct IbvManagerActor {
    shared: Arc<Shared>,
    shutdown: CancellationToken,
}

/// What the actor starts from; made by [`IbvBackend::start`].
pub struct IbvManagerArgs {
    shared: Arc<Shared>,
    /// The node's `Control` connections: queue-pair exchanges from peers.
    control: mpsc::Receiver<ControlConnection>,
}

impl Actor for IbvManagerActor {
    type Args = IbvManagerArgs;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        let IbvManagerArgs {
            shared,
            mut control,
        } = args;
        let shutdown = CancellationToken::new();
        let (acceptor_device, stop) = (shared.device.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    conn = control.recv() => conn,
                    _ = stop.cancelled() => None,
                };
                let Some(conn) = conn else { break };
                tokio::spawn(connection::accept(
                    acceptor_device.clone(),
                    conn.stream,
                    conn.peer,
                ));
            }
        });
        Ok(IbvManagerActor { shared, shutdown })
    }

    async fn on_stop(
        &mut self,
        _: WeakActorRef<Self>,
        _: ActorStopReason,
    ) -> Result<(), Self::Error> {
        self.shutdown.cancel();
        Ok(())
    }
}

impl Message<Submit> for IbvManagerActor {
    type Reply = DelegatedReply<Result<(), SubmitError>>;

    async fn handle(&mut self, msg: Submit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (delegated, reply) = ctx.reply_sender();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let result = shared.submit(msg.ops, msg.timeout).await;
            if let Some(reply) = reply {
                reply.send(result);
            }
        });
        delegated
    }
}

pub struct IbvRegistered {
    pub remote: IbvRemote,
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
        let mr = MemoryRegion::register(&self.shared.device.pd, msg.memory, msg.access)
            .map_err(|e| RegisterError::Backend(e.to_string()))?;
        let mut map = self
            .shared
            .registry
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner());
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

pub struct TransportLevel;

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

/// A queue pair as a GPU kernel (or other code posting its own work) needs it.
#[derive(Clone, Debug)]
pub struct IbvQpHandle {
    pub peer: NodeAddr,
    pub qpn: u32,
    qp: usize,
    cq: usize,
}

impl IbvQpHandle {
    /// The raw `ibv_qp*`. Valid while the `IbvTransportInfo` it came from
    /// lives; do not destroy or modify it.
    pub fn qp(&self) -> *mut rdma_sys::ibv_qp {
        self.qp as *mut _
    }

    /// The raw `ibv_cq*` its send completions go to. Same validity.
    pub fn cq(&self) -> *mut rdma_sys::ibv_cq {
        self.cq as *mut _
    }
}

/// Keys of one registered region on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IbvRegionKeys {
    pub id: RegionId,
    pub generation: Generation,
    pub lkey: u32,
    pub rkey: u32,
}

/// The backend's raw verbs handles, for code that posts RDMA itself.
///
/// Every pointer stays valid for as long as this value lives: it holds
/// references that keep the device context, the protection domain and each
/// listed queue pair (and its completion queue) alive.
///
/// Rules for posting through them: give every work request a `wr_id` with
/// [`FOREIGN_WR_ID_BIT`] set (ferry's poller skips such completions — it also
/// polls the CQ, so do not rely on seeing them yourself; signal nothing, or
/// check the remote result); post only on a QP ferry is idle on, since send
/// queue slots are not coordinated; and keep the memory you post registered
/// (hold its `Region`) until the work has completed.
pub struct IbvTransportInfo {
    pub device: String,
    pub port: u8,
    pub gid: [u8; 16],
    pub gid_index: u32,
    pub lid: u16,
    /// `ibv_mtu` value of the port.
    pub mtu: u32,
    pub qps: Vec<IbvQpHandle>,
    /// Keys of the regions registered when this was taken.
    pub regions: Vec<IbvRegionKeys>,
    device_ref: Arc<Device>,
    _qp_refs: Vec<Arc<PeerQp>>,
}

impl IbvTransportInfo {
    /// The raw `ibv_context*`.
    pub fn context(&self) -> *mut rdma_sys::ibv_context {
        // SAFETY: only reads the pointer; `device_ref` keeps it valid.
        unsafe { self.device_ref.context.raw() }
    }

    /// The raw `ibv_pd*` every ferry memory region is registered with.
    pub fn pd(&self) -> *mut rdma_sys::ibv_pd {
        // SAFETY: as above.
        unsafe { self.device_ref.pd.raw() }
    }
}

// SAFETY: the raw pointers are handles to thread-safe verbs objects, kept
// alive by the Arcs held alongside them.
unsafe impl Send for IbvTransportInfo {}

impl std::fmt::Debug for IbvTransportInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvTransportInfo")
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("mtu", &self.mtu)
            .field("qps", &self.qps)
            .finish()
    }
}

pub struct TransportInfo;

impl Message<TransportInfo> for IbvManagerActor {
    type Reply = Result<IbvTransportInfo, Infallible>;

    async fn handle(
        &mut self,
        _: TransportInfo,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let d = &self.shared.device;
        let qps: Vec<Arc<PeerQp>> = self
            .shared
            .peers
            .all()
            .into_iter()
            .filter(|q| !q.is_broken())
            .collect();
        Ok(IbvTransportInfo {
            device: d.context.name().to_string(),
            port: d.port,
            gid: d.gid,
            gid_index: d.gid_index,
            lid: d.lid,
            mtu: d.mtu,
            qps: qps
                .iter()
                .map(|q| IbvQpHandle {
                    peer: q.peer(),
                    qpn: q.qpn(),
                    // SAFETY: only the pointer values are read; `_qp_refs`
                    // keeps the objects alive.
                    qp: unsafe { q.qp().raw() } as usize,
                    cq: unsafe { q.qp().cq().raw() } as usize,
                })
                .collect(),
            regions: {
                let map = self
                    .shared
                    .registry
                    .0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                map.iter()
                    .map(|(&(id, generation), &(lkey, rkey))| IbvRegionKeys {
                        id,
                        generation,
                        lkey,
                        rkey,
                    })
                    .collect()
            },
            device_ref: d.clone(),
            _qp_refs: qps,
        })
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
    /// Spawns the manager on the current tokio runtime. `control` must carry
    /// the node's `Control` connections.
    pub fn start(
        device: IbvDevice,
        local: NodeAddr,
        control: mpsc::Receiver<ControlConnection>,
    ) -> Self {
        let device = device.0;
        let name = device.context.name().to_string();
        info!(
            device = %name,
            port = device.port,
            gid_index = device.gid_index,
            mtu = 128u32 << device.mtu,
            max_send_wr = device.max_send_wr,
            "ibverbs transport ready"
        );
        let shared = Arc::new(Shared {
            device,
            local,
            peers: Peers::default(),
            registry: Arc::default(),
        });
        let actor = IbvManagerActor::spawn(IbvManagerArgs {
            shared: shared.clone(),
            control,
        });
        IbvBackend {
            actor,
            shared,
            device: name,
        }
    }

    pub fn actor(&self) -> &ActorRef<IbvManagerActor> {
        &self.actor
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    /// Stops the manager; queue pairs are destroyed once drained.
    pub async fn stop(&self) {
        let _ = self.actor.stop_gracefully().await;
        self.actor.wait_for_shutdown().await;
    }

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
