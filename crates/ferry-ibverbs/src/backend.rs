//! `IbvManagerActor`: owns the device, protection domain, memory regions and
//! queue pairs of this node's RDMA data plane.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Endpoint, EndpointError, NotificationSink, Request, Service, ServiceError};
use ferry_core::{
    BatchProgress, Generation, IbvRemote, NodeAddr, OpError, OpKind, RdmaBackend, RdmaOp,
    RdmaTransportLevel, RegionId, RegisterError, SubmitError,
};
use ferry_core::{RegisterRegion, Submit, TransportInfo, TransportLevel};
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::error::SendError;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tokio::time::Instant;
use tracing::{Instrument, debug, debug_span, info};

pub use crate::connection::FOREIGN_WR_ID_BIT;
use crate::connection::{self, PeerQp, Piece, Pin, QpSession};
use crate::device::{Device, IbvConfig};
use crate::exchange;
use crate::info::{IbvRegionKeys, IbvTransportInfo};
pub use crate::notify::QpNotification;
use crate::notify::{PendingNotification, attach_notification};
use crate::passive::{self, PassiveQps};
use crate::verbs::{MemoryRegion, RdmaOpcode, VerbsError, WorkRequest};

/// How long a submitting task polls for its own completions before it waits
/// for the poller task instead.
const INLINE_POLL: Duration = Duration::from_micros(200);

/// (lkey, rkey) of the regions registered with this device, by region. A
/// B-tree: looked up for every op, and small maps need no hashing.
#[derive(Default)]
struct Registry(Mutex<BTreeMap<(RegionId, Generation), (u32, u32)>>);

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(RegionId, Generation), (u32, u32)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
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
        self.registry.lock().remove(&self.key);
    }
}

/// The queue pair to one peer, once connected, and a lock that makes
/// concurrent first submits share one connection attempt.
#[derive(Default)]
struct PeerSlot {
    connected: Option<Arc<PeerQp>>,
    connecting: Arc<tokio::sync::Mutex<()>>,
}

/// Queue pairs to peers, one per peer, connected on first use. A B-tree:
/// looked up for every submit, and small maps need no hashing.
///
/// A slot whose connection attempt failed goes with its last waiter. A
/// slot holding a queue pair goes once that queue pair is broken (its
/// peer left, or an op failed) and drained, unless a new one replaced it
/// meanwhile: destroying a queue pair whose flush completions are still
/// pending would free memory they may touch (see `connection`).
#[derive(Default)]
struct Peers(Arc<Mutex<BTreeMap<NodeAddr, PeerSlot>>>);

impl Peers {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeAddr, PeerSlot>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The usable QP to `peer`, if there is one.
    fn connected(&self, peer: NodeAddr) -> Option<Arc<PeerQp>> {
        let qp = self.lock().get(&peer)?.connected.clone()?;
        // A broken QP drains on its own; the next op gets a fresh one.
        (!qp.is_broken()).then_some(qp)
    }

    /// The QP to `peer`, connected (by `deadline`) if there is none.
    async fn get(
        &self,
        device: &Arc<Device>,
        endpoint: &Endpoint,
        peer: NodeAddr,
        deadline: Instant,
    ) -> Result<Arc<PeerQp>, OpError> {
        match self.connected(peer) {
            Some(qp) => Ok(qp),
            // Boxed: connecting happens once per peer, and its large state
            // would otherwise be part of (and copied with) every submit's
            // future.
            None => Box::pin(self.connect(device, endpoint, peer, deadline)).await,
        }
    }

    async fn connect(
        &self,
        device: &Arc<Device>,
        endpoint: &Endpoint,
        peer: NodeAddr,
        deadline: Instant,
    ) -> Result<Arc<PeerQp>, OpError> {
        let connecting = self.lock().entry(peer).or_default().connecting.clone();
        let connected = async {
            let _turn = connecting.lock().await;
            // Another submit may have connected while this one waited.
            if let Some(qp) = self.connected(peer) {
                return Ok(qp);
            }
            let qp = exchange::connect(device, endpoint, peer, deadline).await?;
            self.lock().entry(peer).or_default().connected = Some(qp.clone());
            self.release_when_drained(peer, &qp);
            Ok(qp)
        }
        .await;
        // A slot that never got a queue pair (the peer could not be reached)
        // goes with its last waiter: the lock is dropped under the table's
        // lock, so of two waiters leaving at once the second removes it.
        // Slots holding a queue pair stay (see `Peers`).
        let mut peers = self.lock();
        drop(connecting);
        if peers.get(&peer).is_some_and(|slot| {
            slot.connected.is_none() && Arc::strong_count(&slot.connecting) == 1
        }) {
            peers.remove(&peer);
        }
        connected
    }

    /// Empties `peer`'s slot once `qp` is broken and drained, if the slot
    /// still holds it, and removes the slot unless a connection attempt is
    /// under way in it.
    fn release_when_drained(&self, peer: NodeAddr, qp: &Arc<PeerQp>) {
        let table = Arc::downgrade(&self.0);
        let drained = qp.drained().clone();
        let qp = Arc::downgrade(qp);
        tokio::spawn(async move {
            drained.cancelled().await;
            let Some(table) = table.upgrade() else { return };
            let mut peers = table.lock().unwrap_or_else(|e| e.into_inner());
            let Some(slot) = peers.get_mut(&peer) else {
                return;
            };
            if slot
                .connected
                .as_ref()
                .is_some_and(|held| std::ptr::eq(Arc::as_ptr(held), qp.as_ptr()))
            {
                slot.connected = None;
                if Arc::strong_count(&slot.connecting) == 1 {
                    peers.remove(&peer);
                }
            }
        });
    }

    /// Peers with a slot: a queue pair (usable or broken), or a connection
    /// attempt under way.
    fn len(&self) -> usize {
        self.lock().len()
    }

    fn all(&self) -> Vec<Arc<PeerQp>> {
        self.lock()
            .values()
            .filter_map(|slot| slot.connected.clone())
            .collect()
    }
}

struct Shared {
    device: Arc<Device>,
    /// The node's endpoint: queue pairs are set up over its control sessions.
    endpoint: Endpoint,
    peers: Peers,
    registry: Arc<Registry>,
    /// Queue pairs this node keeps for initiators.
    passive: Arc<PassiveQps>,
}

impl Shared {
    /// Runs one batch to completion or deadline, in a tracing span.
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.submit_notified(ops, timeout, None).await.map(|_| ())
    }

    /// As `submit`, with a notification to put behind a single owner's ops.
    async fn submit_notified(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Option<Bytes>,
    ) -> Result<QpNotification, SubmitError> {
        // (Fields are only evaluated when the span is enabled.) A batch
        // usually goes to one peer; name the first.
        let span = debug_span!(
            "submit",
            transport = "ibverbs",
            peer = ?ops.first().map(|op| op.remote.owner().endpoint),
            ops = ops.len(),
            bytes = ops.iter().map(RdmaOp::len).sum::<u64>()
        );
        let result = self
            .run(ops, timeout, notification)
            .instrument(span.clone())
            .await;
        debug!(parent: &span, ?result, "submit finished");
        result
    }

    async fn run(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Option<Bytes>,
    ) -> Result<QpNotification, SubmitError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut groups = self.prepare(&ops)?;
        // Only a single owner can be notified on its QP: it alone cannot
        // know whether another owner's share of the batch failed.
        let notification =
            notification.filter(|_| groups.len() == 1 && !groups[0].pieces.is_empty());
        // A batch that reads notifies once its reads are back, in a SEND of
        // its own (below), not in a SEND fenced behind them: a fence holds
        // every later request on the QP, other batches' included, until the
        // reads return, and soft-RoCE's fence never lifted once a read
        // response was lost (the batch stalled until its deadline). Waiting
        // for the reads' completion costs only the time to post the SEND.
        let reads = ops.iter().any(|op| op.kind == OpKind::Read);
        let (behind, after) = match notification {
            Some(payload) if reads => (None, Some((groups[0].peer, payload))),
            behind => (behind, None),
        };
        let max_msg = u64::from(self.device.max_msg);
        let progress = Arc::new(BatchProgress::with_notifications(
            ops.iter().map(|op| op.len().div_ceil(max_msg) as u32),
            usize::from(behind.is_some()),
        ));
        let notify_index = ops.len();
        if let Some(payload) = behind {
            groups[0].notification = Some(PendingNotification {
                payload,
                index: notify_index,
            });
        }
        drop(ops);
        let outcome = self
            .execute(groups, progress, notify_index, started, deadline, timeout)
            .await;
        let (Some((peer, payload)), Ok(QpNotification::NotSent)) = (after, &outcome) else {
            return outcome;
        };
        let alone = PeerGroup {
            peer,
            pieces: Vec::new(),
            session: None,
            notification: Some(PendingNotification { payload, index: 0 }),
        };
        let progress = Arc::new(BatchProgress::with_notifications([], 1));
        self.execute(vec![alone], progress, 0, Instant::now(), deadline, timeout)
            .await
    }

    /// Posts `groups` (each op's pieces, and a notification behind them if
    /// one is attached; a group may hold only a notification) and waits for
    /// `progress` until `deadline`. `notify_index` is the notification's
    /// index in `progress`; `started` begins the inline polling window.
    async fn execute(
        &self,
        mut groups: Vec<PeerGroup>,
        progress: Arc<BatchProgress>,
        notify_index: usize,
        started: Instant,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<QpNotification, SubmitError> {
        if progress.total_pieces() == 0 {
            return Ok(QpNotification::NotSent);
        }
        // Set once the notification is posted behind the ops.
        let sent = AtomicBool::new(false);
        let finish = |outcome: Result<(), SubmitError>| {
            let sent = sent.load(Ordering::Acquire);
            match outcome {
                Ok(()) if sent => Ok(QpNotification::Accepted),
                Ok(()) => Ok(QpNotification::NotSent),
                Err(SubmitError::Op { index, error }) if sent && index == notify_index => {
                    Ok(QpNotification::Failed(error))
                }
                Err(e) => Err(e),
            }
        };
        // Small transfers finish within microseconds: the submitter polls
        // for them itself rather than sleep until the poller task wakes it,
        // which costs several thread wake-ups. Bounded; then the poller task
        // takes over.
        let spin_until = started + INLINE_POLL;
        // A single-peer batch polls from the start, so its QP's poller task
        // stands aside before the first completion arrives, and it polls
        // while waiting for credits. A batch over several peers starts
        // polling once all is posted: waiting for one QP's credits while
        // keeping another's poller aside could stall other submitters there.
        let single_peer = groups.len() == 1;
        // The common case waits for nothing: one peer, its QP connected,
        // credits free for every piece, done within the inline window. It
        // runs right here; what it leaves, the async work below picks up.
        if single_peer && self.try_now(&mut groups[0], &progress, &sent, spin_until) {
            return finish(progress.outcome());
        }
        let work = async {
            for group in &mut groups {
                // A session try_now began is used as it is. Without
                // pieces (posted already, or only zero-length ops) no QP
                // is needed.
                if group.session.is_none()
                    && (!group.pieces.is_empty() || group.notification.is_some())
                {
                    match self
                        .peers
                        .get(&self.device, &self.endpoint, group.peer, deadline)
                        .await
                    {
                        Ok(qp) => {
                            attach_notification(
                                &mut group.notification,
                                &mut group.pieces,
                                &qp,
                                &progress,
                                &sent,
                            );
                            let session = group.session.insert(QpSession::new(qp));
                            if single_peer {
                                session.start_polling();
                            }
                        }
                        Err(e) => {
                            std::mem::take(&mut group.pieces)
                                .into_iter()
                                .for_each(|p| progress.piece_done(p.op, Err(e.clone())));
                            if let Some(n) = group.notification.take() {
                                progress.piece_done(n.index, Ok(()));
                            }
                            continue;
                        }
                    }
                }
                let pieces = std::mem::take(&mut group.pieces);
                let Some(session) = group.session.as_mut().filter(|_| !pieces.is_empty()) else {
                    continue;
                };
                session
                    .post_all(pieces, &progress, spin_until, deadline)
                    .await;
            }
            if !single_peer {
                groups
                    .iter_mut()
                    .filter_map(|g| g.session.as_mut())
                    .for_each(QpSession::start_polling);
            }
            let poll = || {
                groups
                    .iter()
                    .filter_map(|g| g.session.as_ref())
                    .filter(|s| s.is_polling())
                    .map(|s| s.qp().poll_now())
                    .sum()
            };
            connection::spin_until_done(spin_until, poll, || progress.is_done());
            groups.iter_mut().for_each(|g| g.session = None);
            progress.all_done().await;
        };
        // Pinned so the outcome is decided before the work future is dropped.
        let mut work = std::pin::pin!(work);
        // Most small batches are done within the first poll (they poll
        // inline): only one still running after it needs a timer.
        let first = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
        if first.is_ready() || tokio::time::timeout_at(deadline, work).await.is_ok() {
            return finish(progress.outcome());
        }
        let error = progress.timed_out(timeout);
        // Flush what is still outstanding: the flush completions release the
        // pinned memory; the next op reconnects.
        for qp in self.peers.all() {
            if qp.has_work_of(&progress) {
                qp.break_with(OpError::ConnectionLost {
                    endpoint: qp.peer().endpoint,
                });
            }
        }
        Err(error)
    }

    /// Posts `group` and polls for its completions without waiting for
    /// anything: only if its QP is connected and credits for all its pieces
    /// are free. Returns whether the batch finished; if not, the pieces not
    /// posted are left in the group, and the session (still polling) too.
    fn try_now(
        &self,
        group: &mut PeerGroup,
        progress: &Arc<BatchProgress>,
        sent: &AtomicBool,
        spin_until: Instant,
    ) -> bool {
        let Some(qp) = self.peers.connected(group.peer) else {
            return false;
        };
        attach_notification(
            &mut group.notification,
            &mut group.pieces,
            &qp,
            progress,
            sent,
        );
        let session = group.session.insert(QpSession::new(qp));
        session.start_polling();
        session.post_now(&mut group.pieces, progress)
            && connection::spin_until_done(
                spin_until,
                || session.qp().poll_now(),
                || progress.is_done(),
            )
    }

    /// Checks every op before anything is posted, and turns them into work
    /// requests grouped by peer (in a list: a batch rarely spans more than a
    /// few). Ops larger than the port's message limit become several.
    fn prepare(&self, ops: &[RdmaOp]) -> Result<Vec<PeerGroup>, SubmitError> {
        let max_msg = self.device.max_msg as usize;
        let mut groups: Vec<PeerGroup> = Vec::with_capacity(1);
        let registry = self.registry.lock();
        for (index, op) in ops.iter().enumerate() {
            op.validate()
                .map_err(|error| SubmitError::Op { index, error })?;
            let region = op.local.region();
            let (Some(remote), Some(&(lkey, _))) = (
                op.remote.transports().ibverbs,
                registry.get(&(region.id(), region.generation())),
            ) else {
                return Err(SubmitError::Op {
                    index,
                    error: OpError::NoSharedTransport,
                });
            };
            let peer = op.remote.owner();
            let group = match groups.iter().position(|g| g.peer == peer) {
                Some(i) => i,
                None => {
                    groups.push(PeerGroup {
                        peer,
                        pieces: Vec::with_capacity(ops.len() - index),
                        session: None,
                        notification: None,
                    });
                    groups.len() - 1
                }
            };
            let group = &mut groups[group];
            let opcode = match op.kind {
                OpKind::Read => RdmaOpcode::Read,
                OpKind::Write => RdmaOpcode::Write,
            };
            // An op's length is its local slice's, which fits usize.
            for (at, len) in pieces_of(op.len() as usize, max_msg) {
                group.pieces.push(Piece {
                    op: index,
                    wr: WorkRequest {
                        wr_id: 0,
                        opcode,
                        local_addr: op.local.as_ptr() as u64 + at as u64,
                        len: len as u32,
                        lkey,
                        remote_addr: op.remote.addr() + at as u64,
                        rkey: remote.rkey,
                        signaled: false,
                        fence: false,
                    },
                    pin: Pin::Region(region.clone()),
                });
            }
        }
        Ok(groups)
    }
}

/// The (offset, length) pieces an op of `len` bytes is posted as, each at
/// most `max` bytes: `len.div_ceil(max)` of them.
fn pieces_of(len: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len).step_by(max).map(move |at| (at, max.min(len - at)))
}

/// The part of a batch that goes to one peer.
struct PeerGroup {
    peer: NodeAddr,
    pieces: Vec<Piece>,
    /// The submitter's use of the peer's QP, once connected.
    session: Option<QpSession>,
    /// To post behind `pieces` once the QP is known.
    notification: Option<PendingNotification>,
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
        let mr = MemoryRegion::register(&self.shared.device.pd, msg.memory, msg.access)
            .map_err(|e| RegisterError::Backend(e.to_string()))?;
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
            .filter(|q| !q.is_broken())
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

    /// Runs `ops` as [`RdmaBackend::submit`] does and, if they all go to
    /// one owner, puts `notification` behind them on its queue pair: the
    /// owner receives it only after every op has been executed there (for
    /// reads, after their data has come back), and never if one failed.
    /// It is delivered to the owner's inbox from there; a batch that fails
    /// or times out sends none. See [`QpNotification`] for when it is not
    /// sent, and must go another way.
    pub async fn submit_notified(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Bytes,
    ) -> Result<QpNotification, SubmitError> {
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

#[cfg(test)]
mod tests {
    use super::pieces_of;

    #[test]
    fn ops_split_into_pieces_that_cover_them_exactly() {
        assert_eq!(
            pieces_of(10, 4).collect::<Vec<_>>(),
            [(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(pieces_of(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
        assert_eq!(pieces_of(3, 4).collect::<Vec<_>>(), [(0, 3)]);
        assert_eq!(pieces_of(0, 4).count(), 0);
        for len in [1, 4095, 4096, 4097, (1 << 20) + 3] {
            let pieces: Vec<_> = pieces_of(len, 4096).collect();
            assert_eq!(pieces.len(), len.div_ceil(4096));
            let mut next = 0;
            for (at, piece) in pieces {
                assert_eq!(at, next);
                assert!((1..=4096).contains(&piece));
                next += piece;
            }
            assert_eq!(next, len);
        }
    }
}
