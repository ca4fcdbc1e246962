//! `TcpManagerActor`: owns this node's TCP data plane — the listener that
//! serves registered regions and the connection pools to peers.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{
    Generation, NodeAddr, NodeId, RdmaBackend, RdmaOp, RdmaTransportLevel, RegionId, RegisterError,
    SubmitError, TcpRemote, random_u128,
};
use ferry_core::{RegisterRegion, Submit};
use kameo::Actor;
use kameo::actor::{ActorRef, Spawn, WeakActorRef};
use kameo::error::{ActorStopReason, SendError};
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::client::{ClientConfig, Peers};
use crate::server::{ControlConnection, accept_loop};
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
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_peer: 4,
            chunk_size: 1 << 20,
            queue_depth: 256,
        }
    }
}

/// Arguments to spawn the actor: a bound listener (so the caller learns the
/// port before anything runs) and this node's identity.
pub struct TcpManagerArgs {
    pub listener: TcpListener,
    pub node: NodeId,
    pub config: TcpConfig,
    /// Where `Control` connections go; without it they are refused.
    pub control: Option<mpsc::Sender<ControlConnection>>,
}

pub struct TcpManagerActor {
    local: NodeAddr,
    config: TcpConfig,
    table: Arc<RegionTable>,
    peers: Arc<Peers>,
    shutdown: CancellationToken,
}

impl Actor for TcpManagerActor {
    type Args = TcpManagerArgs;
    type Error = std::io::Error;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        let endpoint = args.listener.local_addr()?;
        let mut config = args.config;
        config.chunk_size = config.chunk_size.clamp(1, crate::frame::MAX_CHUNK as usize);
        let table = Arc::new(RegionTable::default());
        let shutdown = CancellationToken::new();
        tokio::spawn(accept_loop(
            args.listener,
            args.node,
            table.clone(),
            args.control,
            shutdown.clone(),
        ));
        let peers = Arc::new(Peers::new(ClientConfig {
            node: args.node,
            connections: config.connections_per_peer,
            chunk_size: config.chunk_size,
            queue_depth: config.queue_depth,
        }));
        info!(%endpoint, node = %args.node, ?config, "tcp transport listening");
        Ok(TcpManagerActor {
            local: NodeAddr {
                id: args.node,
                endpoint,
            },
            config,
            table,
            peers,
            shutdown,
        })
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

impl Message<Submit> for TcpManagerActor {
    type Reply = DelegatedReply<Result<(), SubmitError>>;

    async fn handle(&mut self, msg: Submit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (delegated, reply) = ctx.reply_sender();
        let peers = self.peers.clone();
        tokio::spawn(async move {
            let result = peers.submit(msg.ops, msg.timeout).await;
            if let Some(reply) = reply {
                reply.send(result);
            }
        });
        delegated
    }
}

/// The result of asking any manager (TCP or ibverbs) to `Submit`, as one
/// error type: a failed
/// transfer as it is, and a manager that did not take the message (stopped,
/// crashed, mailbox full) as `BackendStopped`.
pub fn submit_outcome(
    result: Result<(), SendError<Submit, SubmitError>>,
) -> Result<(), SubmitError> {
    result.map_err(|e| match e {
        SendError::HandlerError(e) => e,
        _ => SubmitError::BackendStopped,
    })
}

pub struct TcpRegistered {
    pub remote: TcpRemote,
    pub registration: TcpRegistration,
}

impl Message<RegisterRegion> for TcpManagerActor {
    type Reply = Result<TcpRegistered, RegisterError>;

    async fn handle(
        &mut self,
        msg: RegisterRegion,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
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
    pub id: RegionId,
    pub generation: Generation,
}

impl Message<DeregisterRegion> for TcpManagerActor {
    type Reply = Result<bool, Infallible>;

    async fn handle(
        &mut self,
        msg: DeregisterRegion,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(self.table.remove(msg.id, msg.generation))
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
        Ok(self.table.registered())
    }
}

pub struct TransportLevel;

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
    pub local: NodeAddr,
    pub connections_per_peer: usize,
    pub chunk_size: usize,
    /// Data connections currently open to peers.
    pub open_connections: usize,
}

pub struct TransportInfo;

impl Message<TransportInfo> for TcpManagerActor {
    type Reply = Result<TcpTransportInfo, Infallible>;

    async fn handle(
        &mut self,
        _: TransportInfo,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(TcpTransportInfo {
            local: self.local,
            connections_per_peer: self.config.connections_per_peer,
            chunk_size: self.config.chunk_size,
            open_connections: self.peers.connected(),
        })
    }
}

/// Cloneable handle to a running `TcpManagerActor`.
#[derive(Clone)]
pub struct TcpBackend {
    actor: ActorRef<TcpManagerActor>,
    local: NodeAddr,
}

impl TcpBackend {
    /// Binds `listen` and spawns the manager actor on the current tokio
    /// runtime. `control` receives the node's `Control` connections.
    pub async fn start(
        listen: SocketAddr,
        node: NodeId,
        config: TcpConfig,
        control: Option<mpsc::Sender<ControlConnection>>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let endpoint = listener.local_addr()?;
        let actor = TcpManagerActor::spawn(TcpManagerArgs {
            listener,
            node,
            config,
            control,
        });
        Ok(TcpBackend {
            actor,
            local: NodeAddr { id: node, endpoint },
        })
    }

    pub fn actor(&self) -> &ActorRef<TcpManagerActor> {
        &self.actor
    }

    pub fn local(&self) -> NodeAddr {
        self.local
    }

    pub async fn register(&self, msg: RegisterRegion) -> Result<TcpRegistered, RegisterError> {
        self.actor.ask(msg).await.map_err(|e| match e {
            SendError::HandlerError(e) => e,
            _ => RegisterError::BackendStopped,
        })
    }

    pub async fn registered(&self) -> Vec<(RegionId, Generation)> {
        self.actor.ask(RegisteredRegions).await.unwrap_or_default()
    }

    /// Stops the actor and the listener; in-flight transfers fail.
    pub async fn stop(&self) {
        let _ = self.actor.stop_gracefully().await;
        self.actor.wait_for_shutdown().await;
    }
}

impl RdmaBackend for TcpBackend {
    type TransportInfo = TcpTransportInfo;

    async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        submit_outcome(self.actor.ask(Submit { ops, timeout }).await)
    }

    fn transport_level(&self) -> RdmaTransportLevel {
        RdmaTransportLevel::Tcp
    }

    async fn transport_info(&self) -> Option<TcpTransportInfo> {
        self.actor.ask(TransportInfo).await.ok()
    }
}
