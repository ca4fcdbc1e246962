//! RPC between nodes, the facade's side: serving named handlers (an async
//! closure, or a kameo actor) and calling a peer's, from a [`Node`] or
//! through its actor. The calls themselves run over the control session
//! ([`ferry_control::rpc`]).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{RpcError, RpcRequest};
use ferry_core::NodeAddr;
use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::error::SendError;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;

use crate::{IntoBody, Node, NodeActor};

impl Node {
    /// Answers peers' calls of `name` with `handler`, which gets the caller,
    /// the argument and the deadline, and returns the answer or a failure
    /// message. Each call runs as a task of its own and is stopped at its
    /// deadline, when its caller gives up, or when the session ends; a
    /// handler that panics fails that call only.
    pub fn serve_rpc<F, Fut>(&self, name: &str, handler: F) -> Result<(), RpcError>
    where
        F: Fn(RpcRequest) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Bytes, String>> + Send + 'static,
    {
        if self.0.router.is_shut_down() {
            return Err(RpcError::ShutDown);
        }
        self.0.router.rpc.serve(name, handler)
    }

    /// Answers peers' calls of `name` by asking `actor`, which handles
    /// [`RpcRequest`] and replies with the answer or a failure message. The
    /// actor's mailbox bounds how many calls wait for it; a stopped actor
    /// fails the calls.
    pub fn serve_rpc_actor<A>(&self, name: &str, actor: ActorRef<A>) -> Result<(), RpcError>
    where
        A: Actor + Message<RpcRequest, Reply = Result<Bytes, String>>,
    {
        self.serve_rpc(name, move |request| {
            let actor = actor.clone();
            async move {
                actor.ask(request).await.map_err(|e| match e {
                    SendError::HandlerError(message) => message,
                    other => format!("the handler's actor is unavailable: {other}"),
                })
            }
        })
    }

    /// Stops serving `name`; returns whether it was served. Calls running
    /// finish.
    pub fn unserve_rpc(&self, name: &str) -> bool {
        self.0.router.rpc.unserve(name)
    }

    /// Calls `peer`'s handler `name` with `body`; its answer, or a typed
    /// error within `timeout`. Concurrent calls to one peer share its
    /// control session. Dropping the future cancels the call on the peer.
    pub async fn call(
        &self,
        peer: NodeAddr,
        name: &str,
        body: impl IntoBody,
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        let router = &self.0.router;
        if router.is_shut_down() {
            return Err(RpcError::ShutDown);
        }
        router.rpc.call(peer, name, body.into_body(), timeout).await
    }
}

/// Call a peer's RPC handler through the node's actor (as
/// [`Node::call`]). Answered with the handler's answer.
#[derive(Clone, Debug)]
pub struct Call {
    /// The peer.
    pub peer: NodeAddr,
    /// The handler's name.
    pub name: String,
    /// The argument.
    pub body: Bytes,
    /// How long to wait for the answer.
    pub timeout: Duration,
}

impl Call {
    /// The message, with `body` as any [`IntoBody`] (`b"get"` included).
    pub fn new(peer: NodeAddr, name: &str, body: impl IntoBody, timeout: Duration) -> Self {
        Call {
            peer,
            name: name.to_string(),
            body: body.into_body(),
            timeout,
        }
    }
}

impl Message<Call> for NodeActor {
    type Reply = DelegatedReply<Result<Bytes, RpcError>>;

    async fn handle(&mut self, msg: Call, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let router = self.router.clone();
        // The call waits for the peer: never in the mailbox.
        ctx.spawn(async move {
            if router.is_shut_down() {
                return Err(RpcError::ShutDown);
            }
            router
                .rpc
                .call(msg.peer, &msg.name, msg.body, msg.timeout)
                .await
        })
    }
}
