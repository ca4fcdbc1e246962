//! Remote procedure calls: named handlers on one node, called by another
//! with bytes and a deadline, over the control session between them.
//!
//! A call is one request of the session's [`Service::RPC`], so it inherits
//! the session's properties: many calls share one connection, matched by
//! request id and answered in any order; the deadline travels to the
//! callee, whose handler is stopped when it passes, when the caller drops
//! the call, or when the session ends; a panicking handler fails its call
//! only. No thread is taken per call.
//!
//! The request body is `name length (u16 LE) | name | payload`; the answer
//! of a successful request is `outcome (u8) | payload`, the outcome saying
//! whether the named handler answered, did not exist, failed (payload: its
//! message) or answered more than the limit (payload: the length, u64 LE).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use ferry_core::NodeAddr;
use tokio::time::Instant;

use crate::{ControlError, Endpoint, EndpointError, Request, Service, ServiceError};

/// Default bound on a call's argument and on its answer, in bytes.
pub const DEFAULT_MAX_RPC_PAYLOAD: usize = 64 << 10;
/// Longest handler name, in bytes.
pub const MAX_RPC_NAME: usize = 255;

/// A call as a handler receives it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RpcRequest {
    /// The calling node, as its control session names it.
    /// Its `id` is the one the connection's hello named: proved, where the
    /// nodes hold a cluster secret (a member cannot name another node), a
    /// claim otherwise. Its `endpoint` is the address the sender
    /// advertises, as it says: not checked against the connection's source
    /// address, which differs behind NAT or for a node listening on every
    /// interface. Reply to `from` as to any node; decide whom to trust by
    /// `id`, under a secret.
    pub from: NodeAddr,
    /// The handler called.
    pub name: String,
    /// The caller's argument.
    pub body: Bytes,
    /// When the caller stops waiting; the handler is stopped then.
    pub deadline: Instant,
}

/// What a handler returns: its answer, or a failure message for the caller.
pub type RpcFuture = Pin<Box<dyn Future<Output = Result<Bytes, String>> + Send>>;
type Handler = Arc<dyn Fn(RpcRequest) -> RpcFuture + Send + Sync>;

/// Why a call failed, or a handler could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The peer and this node do not hold the same cluster secret: nothing
    /// was sent.
    #[error("{peer} refused: {reason}")]
    AuthFailed {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// Which side lacks what.
        reason: crate::AuthFailure,
    },
    /// The peer has no handler of that name.
    #[error("{peer} has no RPC handler named '{name}'")]
    NoSuchHandler {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// The name called.
        name: String,
    },
    /// The handler returned a failure, or panicked.
    #[error("RPC '{name}' on {peer} failed: {message}")]
    Failed {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// The name called.
        name: String,
        /// The handler's message.
        message: String,
    },
    /// No answer within the call's deadline (the handler was stopped).
    #[error("RPC '{name}' on {peer} got no answer within {after:?}")]
    Timeout {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// The name called.
        name: String,
        /// The call's timeout.
        after: Duration,
    },
    /// No control session to the peer could be opened.
    #[error("peer {peer} unreachable: {reason}")]
    Unreachable {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The session to the peer ended before the answer came.
    #[error("connection to {peer} lost before RPC '{name}' was answered")]
    ConnectionLost {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// The name called.
        name: String,
    },
    /// The peer runs as many calls of this node as it allows; try later.
    #[error("{peer} is busy: too many calls in flight")]
    Busy {
        /// The peer's endpoint.
        peer: SocketAddr,
    },
    /// The argument is over the limit: refused before any byte was sent.
    #[error("RPC argument of {len} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// The argument's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The handler answered more than the callee's limit; it was not sent.
    #[error("RPC '{name}' on {peer} answered {len} bytes, over its {limit}-byte limit")]
    AnswerTooLarge {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// The name called.
        name: String,
        /// The answer's length.
        len: u64,
        /// The callee's limit.
        limit: usize,
    },
    /// The node's actor did not take or answer the facade's `Call`
    /// (stopped, crashed, restarting): the call was never made. Only from
    /// asking a node's actor, through the conversion from kameo's
    /// `SendError` that lets `actor.ask(call).await?` return an `RpcError`.
    #[error("the node's actor is not running: the call was not made")]
    NodeStopped,
    /// The name is empty or longer than [`MAX_RPC_NAME`] bytes.
    #[error("'{0}' is not an RPC name (1 to 255 bytes)")]
    BadName(String),
    /// A handler of that name is registered already.
    #[error("an RPC handler named '{0}' is registered already")]
    NameTaken(String),
    /// This node was shut down: it calls and serves no handlers any more.
    #[error("the node was shut down: it makes and serves no calls")]
    ShutDown,
    /// The peer broke the protocol.
    #[error("RPC protocol violation by {peer}: {reason}")]
    Protocol {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// What was wrong.
        reason: String,
    },
}

impl<M> From<kameo::error::SendError<M, RpcError>> for RpcError {
    /// The handler's error as it is; an actor that did not take or answer
    /// the message as [`RpcError::NodeStopped`].
    fn from(e: kameo::error::SendError<M, RpcError>) -> Self {
        match e {
            kameo::error::SendError::HandlerError(e) => e,
            _ => RpcError::NodeStopped,
        }
    }
}

/// Outcome byte of an answer.
const ANSWERED: u8 = 0;
const NO_SUCH_HANDLER: u8 = 1;
const FAILED: u8 = 2;
const ANSWER_TOO_LARGE: u8 = 3;

/// A node's RPC handlers, and its calls of other nodes' handlers.
pub struct Rpc {
    endpoint: Endpoint,
    handlers: RwLock<HashMap<String, Handler>>,
    max_payload: usize,
}

impl Rpc {
    /// Serves calls on `endpoint`'s sessions; arguments and answers are
    /// bounded by `max_payload` bytes (and by the endpoint's frame limit).
    pub fn start(endpoint: &Endpoint, max_payload: usize) -> Result<Arc<Self>, EndpointError> {
        let max_payload = max_payload.min(endpoint.max_payload());
        let rpc = Arc::new(Rpc {
            endpoint: endpoint.clone(),
            handlers: RwLock::default(),
            max_payload,
        });
        // Weak: the endpoint holds its handlers, and must not keep this alive.
        let weak = Arc::downgrade(&rpc);
        endpoint.serve(Service::RPC, move |request| {
            let rpc = weak.upgrade();
            async move {
                match rpc {
                    Some(rpc) => rpc.answer(request).await,
                    None => Err(ServiceError("RPC stopped on this node".into())),
                }
            }
        })?;
        Ok(rpc)
    }

    /// The bound on arguments and answers, in bytes.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// Answers calls of `name` with `handler`.
    pub fn serve<F, Fut>(&self, name: &str, handler: F) -> Result<(), RpcError>
    where
        F: Fn(RpcRequest) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Bytes, String>> + Send + 'static,
    {
        check_name(name)?;
        let mut handlers = self.handlers.write().unwrap_or_else(|e| e.into_inner());
        if handlers.contains_key(name) {
            return Err(RpcError::NameTaken(name.into()));
        }
        let handler: Handler = Arc::new(move |r| -> RpcFuture { Box::pin(handler(r)) });
        handlers.insert(name.into(), handler);
        Ok(())
    }

    /// Removes the handler of `name`; returns whether there was one. Calls
    /// running keep running.
    pub fn unserve(&self, name: &str) -> bool {
        let mut handlers = self.handlers.write().unwrap_or_else(|e| e.into_inner());
        handlers.remove(name).is_some()
    }

    /// Calls `name` on `peer` with `body`; its answer, or a typed failure
    /// once `timeout` has passed (opening the session counts against it).
    pub async fn call(
        &self,
        peer: NodeAddr,
        name: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        check_name(name)?;
        if body.len() > self.max_payload {
            return Err(RpcError::TooLarge {
                len: body.len(),
                limit: self.max_payload,
            });
        }
        let deadline = Instant::now() + timeout;
        let endpoint = peer.endpoint;
        let error = |e: ControlError| call_error(e, name, timeout);
        let session = self.endpoint.session(peer, timeout).await.map_err(error)?;
        let request = encode_call(name, &body);
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = session
            .request(Service::RPC, request, left)
            .await
            .map_err(error)?;
        let protocol = |reason: &str| RpcError::Protocol {
            peer: endpoint,
            reason: reason.into(),
        };
        let &outcome = answer.first().ok_or_else(|| protocol("empty RPC answer"))?;
        let payload = answer.slice(1..);
        match outcome {
            ANSWERED => Ok(payload),
            NO_SUCH_HANDLER => Err(RpcError::NoSuchHandler {
                peer: endpoint,
                name: name.into(),
            }),
            FAILED => Err(RpcError::Failed {
                peer: endpoint,
                name: name.into(),
                message: String::from_utf8_lossy(&payload).into_owned(),
            }),
            ANSWER_TOO_LARGE if payload.len() == 8 => Err(RpcError::AnswerTooLarge {
                peer: endpoint,
                name: name.into(),
                len: u64::from_le_bytes(payload[..8].try_into().expect("8 bytes")),
                limit: self.max_payload,
            }),
            _ => Err(protocol("unknown RPC outcome")),
        }
    }

    /// Runs the named handler for one request of the RPC service.
    async fn answer(&self, request: Request) -> Result<Bytes, ServiceError> {
        let (name, body) = decode_call(&request.body)
            .map_err(|reason| ServiceError(format!("malformed RPC request: {reason}")))?;
        let handler = self
            .handlers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&name)
            .cloned();
        let Some(handler) = handler else {
            return Ok(Bytes::from_static(&[NO_SUCH_HANDLER]));
        };
        let call = RpcRequest {
            from: request.session.peer(),
            name,
            body,
            deadline: request.deadline,
        };
        let (outcome, payload) = match handler(call).await {
            Ok(answer) if answer.len() > self.max_payload => (
                ANSWER_TOO_LARGE,
                Bytes::copy_from_slice(&(answer.len() as u64).to_le_bytes()),
            ),
            Ok(answer) => (ANSWERED, answer),
            Err(message) => (FAILED, Bytes::from(message)),
        };
        let mut out = BytesMut::with_capacity(1 + payload.len());
        out.put_u8(outcome);
        out.put_slice(&payload);
        Ok(out.freeze())
    }
}

fn check_name(name: &str) -> Result<(), RpcError> {
    if name.is_empty() || name.len() > MAX_RPC_NAME {
        return Err(RpcError::BadName(name.into()));
    }
    Ok(())
}

/// What a call learns from its session.
fn call_error(e: ControlError, name: &str, timeout: Duration) -> RpcError {
    let peer = e.endpoint();
    match e {
        ControlError::Timeout { .. } => RpcError::Timeout {
            peer,
            name: name.into(),
            after: timeout,
        },
        ControlError::SessionClosed { .. } => RpcError::ConnectionLost {
            peer,
            name: name.into(),
        },
        ControlError::Busy { .. } => RpcError::Busy { peer },
        ControlError::AuthFailed { reason, .. } => RpcError::AuthFailed { peer, reason },
        // A handler that panicked, or a malformed request.
        ControlError::Failed { message, .. } => RpcError::Failed {
            peer,
            name: name.into(),
            message,
        },
        ControlError::Protocol { reason, .. } => RpcError::Protocol { peer, reason },
        ControlError::NoSuchService { .. } => RpcError::Protocol {
            peer,
            reason: "the peer serves no RPC".into(),
        },
        // Unreachable, refused, or another node at that address.
        other => RpcError::Unreachable {
            peer,
            reason: other.to_string(),
        },
    }
}

/// A call's request body: `name length (u16 LE) | name | payload`. The
/// caller has checked the name with `check_name`, so its length fits.
pub fn encode_call(name: &str, body: &[u8]) -> Bytes {
    let mut request = BytesMut::with_capacity(2 + name.len() + body.len());
    request.put_u16_le(name.len() as u16);
    request.put_slice(name.as_bytes());
    request.put_slice(body);
    request.freeze()
}

/// Reads a call's request body, as a peer sent it: the handler's name and
/// the caller's argument, or why the body is not a call.
pub fn decode_call(body: &Bytes) -> Result<(String, Bytes), &'static str> {
    let len = body.get(..2).ok_or("no name")?;
    let end = 2 + usize::from(u16::from_le_bytes([len[0], len[1]]));
    let name = body
        .get(2..end)
        .and_then(|n| std::str::from_utf8(n).ok())
        .ok_or("truncated or non-UTF-8 name")?;
    Ok((name.to_string(), body.slice(end..)))
}
