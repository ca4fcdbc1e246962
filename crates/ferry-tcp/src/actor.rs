//! `TcpManagerActor`: owns this node's TCP data plane: the data channel of
//! the node's endpoint, which serves registered regions, and the connection
//! pools to peers.

use std::convert::Infallible;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Channel, Endpoint, EndpointError, Messages};
use ferry_core::{
    Answer, Generation, NodeAddr, OpError, RdmaBackend, RdmaOp, RdmaTransportLevel, RegionId,
    RegisterError, SubmitError, TcpRemote, random_u128,
};
use ferry_core::{RegisterRegion, Submit, TransportInfo, TransportLevel};
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn};
use kameo::error::SendError;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tracing::info;

use crate::client::{ClientConfig, Notified, Peers};
#[cfg(doc)]
use crate::frame::NotifyOutcome;
use crate::table::{RegionTable, TcpRegistration};

/// Tuning of the TCP data plane.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// Connections opened to each peer. More connections spread large
    /// transfers over more kernel socket buffers and CPU cores.
    pub connections_per_peer: usize,
    /// Ops are split into requests of at most this many bytes; each travels
    /// on one connection. Smaller chunks spread better, larger ones cost fewer
    /// headers. Capped by the protocol's `MAX_CHUNK`.
    pub chunk_size: usize,
    /// Chunks that may wait in each connection's queue before submitters wait.
    pub queue_depth: usize,
    /// Bytes of requests one connection keeps in flight (sent, not yet
    /// answered); at least one chunk always fits. Enough to keep a fast link
    /// busy, and the bound on what a timed-out submit still moves: its
    /// chunks not yet sent are dropped, so at most this much per connection
    /// is still on the wire.
    pub window: u32,
    /// How long a connection waiting for bytes (an answer, on the
    /// initiator's side; the next request, on the owner's) keeps polling
    /// its socket before its task sleeps. A round trip that comes back
    /// within it pays no thread wake-up, which on a virtual machine costs
    /// more than the round trip itself (64 → 15 µs for an 8-byte write on
    /// loopback here). The price is up to this much CPU after each burst
    /// of traffic; an idle connection polls for it once, then sleeps.
    /// Zero turns polling off.
    ///
    /// Polling suits a runtime with a core for each busy worker. A task
    /// that polls on a multi-worker tokio runtime keeps waking the idle
    /// workers (each time it yields with no other task queued), so on a
    /// machine with fewer cores than busy threads a shorter window, or a
    /// runtime with fewer workers, does better.
    pub busy_poll: Duration,
}

/// The default [`TcpConfig::busy_poll`]: several loopback round trips
/// (15 µs here), so that the next message of a request-answer exchange
/// comes within it even when the other side takes a while to send it.
/// A window barely longer than one round trip is missed now and then; each
/// miss is a sleep and a wake-up, and on a small host the scheduler then
/// tends to wake the sleeper on the waker's core, where the two ends' polls
/// take turns instead of overlapping (8-byte writes on this 2-core VM, one
/// runtime worker per side: p99 58 µs with a 20 µs window, 19 µs with 100).
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(100);

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_peer: 4,
            chunk_size: 1 << 20,
            queue_depth: 256,
            window: 8 << 20,
            busy_poll: DEFAULT_BUSY_POLL,
        }
    }
}

/// What the actor and the [`TcpBackend`] handles share.
struct Shared {
    local: NodeAddr,
    config: TcpConfig,
    table: Arc<RegionTable>,
    peers: Peers,
}

/// The TCP data plane's manager actor. It accepts the shared [`Submit`],
/// [`RegisterRegion`], [`TransportLevel`] and [`TransportInfo`] messages and
/// replies to `Submit` later (delegated), so its mailbox never waits on a
/// transfer. Made by [`TcpBackend::start`].
pub struct TcpManagerActor {
    shared: Arc<Shared>,
}

impl Actor for TcpManagerActor {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(actor: Self, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(actor)
    }
}

impl Message<Submit> for TcpManagerActor {
    type Reply = DelegatedReply<Result<(), SubmitError>>;

    async fn handle(&mut self, msg: Submit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let shared = self.shared.clone();
        // Queued here; answered by the connection that finishes it.
        ferry_core::inline::answer_on_completion(ctx, move |answer| async move {
            shared.peers.start(msg.ops, msg.timeout, answer).await
        })
    }
}

/// What registering a region with the TCP backend gives.
pub struct TcpRegistered {
    /// The credentials remote handles carry.
    pub remote: TcpRemote,
    /// Deregisters the region from the TCP backend when dropped.
    pub registration: TcpRegistration,
}

impl Message<RegisterRegion> for TcpManagerActor {
    type Reply = Result<TcpRegistered, RegisterError>;

    async fn handle(
        &mut self,
        msg: RegisterRegion,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        self.shared.register(msg)
    }
}

impl Shared {
    fn register(&self, msg: RegisterRegion) -> Result<TcpRegistered, RegisterError> {
        let token = random_u128();
        if !self
            .table
            .insert(msg.id, msg.generation, token, msg.access, &msg.memory)
        {
            return Err(RegisterError::IdInUse(msg.id));
        }
        Ok(TcpRegistered {
            remote: TcpRemote { token },
            registration: TcpRegistration {
                table: self.table.clone(),
                id: msg.id,
                generation: msg.generation,
            },
        })
    }
}

/// Stop serving a region now, before its last handle drops. Requests already
/// being served finish; new ones are refused. Replies whether it was registered.
pub struct DeregisterRegion {
    /// The region's slot.
    pub id: RegionId,
    /// Its generation: a newer region in the same slot is left alone.
    pub generation: Generation,
}

impl Message<DeregisterRegion> for TcpManagerActor {
    type Reply = Result<bool, Infallible>;

    async fn handle(
        &mut self,
        msg: DeregisterRegion,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(self.shared.table.remove(msg.id, msg.generation))
    }
}

/// The regions currently served, as (id, generation), sorted.
pub struct RegisteredRegions;

impl Message<RegisteredRegions> for TcpManagerActor {
    type Reply = Result<Vec<(RegionId, Generation)>, Infallible>;

    async fn handle(
        &mut self,
        _: RegisteredRegions,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(self.shared.table.registered())
    }
}

impl Message<TransportLevel> for TcpManagerActor {
    type Reply = Result<RdmaTransportLevel, Infallible>;

    async fn handle(
        &mut self,
        _: TransportLevel,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(RdmaTransportLevel::Tcp)
    }
}

/// What the TCP backend reports about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpTransportInfo {
    /// This node as peers reach it.
    pub local: NodeAddr,
    /// Connections opened to each peer.
    pub connections_per_peer: usize,
    /// Largest request, in bytes.
    pub chunk_size: usize,
    /// Bytes in flight per connection.
    pub window: u32,
    /// Data connections currently open to peers.
    pub open_connections: usize,
}

impl Shared {
    fn info(&self) -> TcpTransportInfo {
        TcpTransportInfo {
            local: self.local,
            connections_per_peer: self.config.connections_per_peer,
            chunk_size: self.config.chunk_size,
            window: self.config.window,
            open_connections: self.peers.connected(),
        }
    }
}

impl Message<TransportInfo> for TcpManagerActor {
    type Reply = Result<TcpTransportInfo, Infallible>;

    async fn handle(
        &mut self,
        _: TransportInfo,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(self.shared.info())
    }
}

/// Cloneable handle to a running `TcpManagerActor`. Its `submit` runs the
/// transfer in the caller's task, without a mailbox hop; the actor's
/// `Submit` message does the same work for callers that only hold the actor.
#[derive(Clone)]
pub struct TcpBackend {
    actor: ActorRef<TcpManagerActor>,
    shared: Arc<Shared>,
}

impl TcpBackend {
    /// Serves the data channel of `endpoint` and spawns the manager actor on
    /// the current tokio runtime. Notifications that peers send behind their
    /// transfers go to `inbox` (weak: the endpoint holds this backend's
    /// handler, and the inbox holds the endpoint); without one (or once it
    /// is gone) they are answered [`NotifyOutcome::NoInbox`].
    pub fn start(
        endpoint: &Endpoint,
        config: TcpConfig,
        inbox: Weak<Messages>,
    ) -> Result<Self, EndpointError> {
        let mut config = config;
        config.chunk_size = config.chunk_size.clamp(1, crate::frame::MAX_CHUNK as usize);
        config.window = config.window.max(1);
        let local = endpoint.local();
        let table = Arc::new(RegionTable::default());
        endpoint.handle(Channel::TCP_DATA, {
            let table = table.clone();
            move |connection| {
                crate::server::serve_connection(
                    connection,
                    table.clone(),
                    inbox.clone(),
                    config.busy_poll,
                )
            }
        })?;
        let peers = Peers::new(ClientConfig {
            local,
            dialer: endpoint.dialer(),
            connections: config.connections_per_peer,
            chunk_size: config.chunk_size,
            queue_depth: config.queue_depth,
            window: config.window,
            busy_poll: config.busy_poll,
        });
        info!(endpoint = %local.endpoint, node = %local.id, ?config, "tcp transport ready");
        let shared = Arc::new(Shared {
            local,
            config,
            table,
            peers,
        });
        let actor = TcpManagerActor::spawn(TcpManagerActor {
            shared: shared.clone(),
        });
        Ok(TcpBackend { actor, shared })
    }

    /// The manager actor, for workers that send it messages.
    pub fn actor(&self) -> &ActorRef<TcpManagerActor> {
        &self.actor
    }

    /// This node as peers reach it.
    pub fn local(&self) -> NodeAddr {
        self.shared.local
    }

    /// Registers a region for remote access over TCP.
    pub async fn register(&self, msg: RegisterRegion) -> Result<TcpRegistered, RegisterError> {
        self.actor.ask(msg).await.map_err(|e| match e {
            SendError::HandlerError(e) => e,
            _ => RegisterError::BackendStopped,
        })
    }

    /// Peers this node keeps a connection pool for: one per peer with a
    /// data connection open or a submit under way. A pool is released when
    /// its last connection closes (the peer went away or the connection
    /// broke) with no submit using it. For leak checks and `ferry info`.
    pub fn peer_pools(&self) -> usize {
        self.shared.peers.len()
    }

    /// Data connections this node has open to peers (those peers accepted
    /// from it are the endpoint's).
    pub fn open_connections(&self) -> usize {
        self.shared.peers.connected()
    }

    /// The regions currently served, as (id, generation), sorted.
    pub fn registered(&self) -> Vec<(RegionId, Generation)> {
        self.shared.table.registered()
    }

    /// Stops the actor; in-flight transfers fail. (The data channel closes
    /// with the endpoint.)
    pub async fn stop(&self) {
        let _ = self.actor.stop_gracefully().await;
        self.actor.wait_for_shutdown().await;
    }
}

impl TcpBackend {
    /// Starts a transfer and hands its outcome to `answer`, from the thread
    /// that finishes it (the last chunk's response, or the deadline), as
    /// [`RdmaBackend::submit`] would return it. The future returned only
    /// queues the transfer: an actor answers its callers this way without
    /// a task per submit waiting for each transfer.
    pub async fn submit_with_answer(&self, ops: Vec<RdmaOp>, timeout: Duration, answer: Answer) {
        self.shared.peers.start(ops, timeout, answer).await
    }

    /// Opens the data connections to `peer` this node would otherwise open
    /// at its first transfer there (the pool's size), within `timeout`: the
    /// number open after, or why none is.
    pub async fn connect(&self, peer: NodeAddr, timeout: Duration) -> Result<usize, OpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        self.shared.peers.connect(peer, deadline).await
    }

    /// Runs a batch and hands `notification` to the owner of its remote
    /// regions right behind its chunks, on the same connection: the owner
    /// delivers it once it has served every chunk, and not at all if it
    /// refused one. `Err` if an op failed or the deadline passed (then no
    /// owner delivers it, unless the deadline passed just after it was
    /// sent); otherwise what each owner did with it: an owner whose inbox
    /// was full answers [`NotifyOutcome::InboxFull`] without waiting, and
    /// the caller may wait for room over the control session. Each owner
    /// judges only its own chunks: in a batch over several owners, one may
    /// deliver while another refused a chunk, so a caller that needs
    /// all-or-nothing sends such batches otherwise (the node facade does).
    pub async fn submit_notified(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Bytes,
    ) -> Result<Notified, SubmitError> {
        self.shared
            .peers
            .submit_notified(ops, timeout, notification)
            .await
    }
}

impl RdmaBackend for TcpBackend {
    type TransportInfo = TcpTransportInfo;

    /// Runs the transfer in the caller's task (see [`TcpBackend`]).
    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        self.shared.peers.submit(ops, timeout).await
    }

    fn transport_level(&self) -> RdmaTransportLevel {
        RdmaTransportLevel::Tcp
    }

    async fn transport_info(&self) -> Option<TcpTransportInfo> {
        Some(self.shared.info())
    }
}
