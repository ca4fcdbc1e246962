//! `NodeActor`: the node's manager actor, the one worker actors talk to.
//!
//! It accepts the same [`Submit`] every backend manager does and routes each
//! op exactly as [`crate::Node::submit`] does (the same code: the node's
//! router). It answers transfers and registrations later (delegated
//! replies), so one actor keeps any number of submits in flight and its
//! mailbox never waits on a transfer, and without a task per submit where
//! it can (see [`ferry_core::inline`]): a TCP submit is queued in the
//! handler and answered by the connection that finishes it; an RDMA submit
//! is posted and polled in the handler (while no other message waits) and
//! answered at once if that completes it, else from a task of its own.

use std::convert::Infallible;
use std::sync::Arc;

use ferry_core::{
    Access, MemoryBlock, RdmaTransportLevel, Region, RegisterError, Submit, SubmitError,
    TransportInfo, TransportLevel,
};
use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;

use crate::router::{NodeTransportInfo, Router};
use crate::transports::TransportStatus;

/// The node's manager actor; see the module docs. Spawned by
/// [`crate::NodeBuilder::spawn`], reached through [`crate::Node::actor`].
pub struct NodeActor {
    pub(crate) router: Arc<Router>,
}

impl NodeActor {
    pub(crate) fn new(router: Arc<Router>) -> Self {
        NodeActor { router }
    }
}

impl Actor for NodeActor {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(actor: Self, _: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(actor)
    }
}

impl Message<Submit> for NodeActor {
    type Reply = DelegatedReply<Result<(), SubmitError>>;

    async fn handle(&mut self, msg: Submit, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let router = self.router.clone();
        let first = msg.ops.first().and_then(|op| router.route(op));
        let one_transport = msg.ops.iter().all(|op| router.route(op) == first);
        match first {
            // Queued here, answered by the connection that finishes it.
            Some(RdmaTransportLevel::Tcp) if one_transport => {
                ferry_core::inline::answer_on_completion(ctx, move |answer| {
                    router.submit_tcp_with_answer(msg.ops, msg.timeout, answer)
                })
            }
            // Posted and polled here: often complete at once.
            Some(RdmaTransportLevel::Nic) if one_transport => ferry_core::inline::answer(
                ctx,
                async move { router.submit(msg.ops, msg.timeout).await },
            ),
            // Mixed, unroutable or empty batches take the general path.
            _ => ctx.spawn(async move { router.submit(msg.ops, msg.timeout).await }),
        }
    }
}

/// Allocate `len` zeroed, page-aligned bytes and register them with every
/// running backend (as [`crate::Node::alloc`]). Answered with the
/// [`Region`].
#[derive(Clone, Copy, Debug)]
pub struct Alloc {
    /// Bytes.
    pub len: u64,
    /// The most a remote handle to the region may do.
    pub access: Access,
}

/// Register memory the caller made with every running backend (as
/// [`crate::Node::register`]). Answered with the [`Region`].
pub struct Register {
    /// The memory.
    pub memory: MemoryBlock,
    /// The most a remote handle to the region may do.
    pub access: Access,
}

impl Message<Alloc> for NodeActor {
    type Reply = DelegatedReply<Result<Region, RegisterError>>;

    async fn handle(&mut self, msg: Alloc, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let router = self.router.clone();
        // Registering with a NIC pins and maps every page: not for the mailbox.
        ctx.spawn(async move {
            let memory = router.alloc_memory(msg.len)?;
            router.register(memory, msg.access).await
        })
    }
}

impl Message<Register> for NodeActor {
    type Reply = DelegatedReply<Result<Region, RegisterError>>;

    async fn handle(&mut self, msg: Register, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let router = self.router.clone();
        ctx.spawn(async move { router.register(msg.memory, msg.access).await })
    }
}

impl Message<TransportLevel> for NodeActor {
    type Reply = Result<RdmaTransportLevel, Infallible>;

    async fn handle(
        &mut self,
        _: TransportLevel,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        Ok(self.router.transport_level())
    }
}

impl Message<TransportInfo> for NodeActor {
    type Reply = DelegatedReply<Result<NodeTransportInfo, Infallible>>;

    async fn handle(
        &mut self,
        _: TransportInfo,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let router = self.router.clone();
        ctx.spawn(async move { Ok(router.transport_info().await) })
    }
}

/// Which transports the node runs and, for each that could not start, why.
/// Answered with every transport, fastest first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Transports;

impl Message<Transports> for NodeActor {
    type Reply = Result<Vec<TransportStatus>, Infallible>;

    async fn handle(&mut self, _: Transports, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.router.transports.clone())
    }
}
