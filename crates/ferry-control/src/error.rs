//! The control plane's errors: one enum for everything a caller of the
//! endpoint or of a session can be told, and its mapping onto the data
//! planes' [`OpError`].

use std::net::SocketAddr;
use std::time::Duration;

use ferry_core::{NodeId, OpError};

use crate::{AuthFailure, Channel, HelloStatus, Service};

/// Why talking to a peer's endpoint failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// No connection could be made, or it broke during the hello.
    #[error("peer {endpoint} unreachable: {reason}")]
    Unreachable {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// The operating system's error.
        reason: String,
    },
    /// Another node answers at the endpoint: a restarted process, or a
    /// handle naming the wrong address (the node there refused a hello
    /// meant for `expected`, and says nothing of itself).
    #[error("endpoint {endpoint} is not node {expected} (another node answers there)")]
    WrongNode {
        /// The node the caller meant.
        expected: NodeId,
        /// The endpoint.
        endpoint: SocketAddr,
    },
    /// The peer refused the connection: another protocol version, a channel
    /// it does not serve, its connection limit ([`HelloStatus::Busy`]), or
    /// (no status) it hung up before answering: it stopped, died or is
    /// shutting down (an endpoint at its limit says `Busy` first).
    #[error("{endpoint} refused the connection: {}", match status {
        Some(HelloStatus::Busy) => "at its connection limit, with no idle connection to make room".into(),
        Some(status) => format!("{status:?}"),
        None => "closed it before answering the hello (stopped, dying, or shutting down)".into(),
    })]
    Refused {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// What its hello reply said, if it sent one.
        status: Option<HelloStatus>,
    },
    /// The two nodes do not hold the same cluster secret (see
    /// [`crate::auth`]): the connection was closed before anything of its
    /// channel crossed.
    #[error("{endpoint} refused: {reason}")]
    AuthFailed {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// Which side lacks what.
        reason: AuthFailure,
    },
    /// The peer broke the protocol; the session (or connection) was closed.
    #[error("protocol violation on the session with {endpoint}: {reason}")]
    Protocol {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// What was wrong.
        reason: String,
    },
    /// The session closed before the request was answered.
    #[error("control session with {endpoint} closed")]
    SessionClosed {
        /// The peer's endpoint.
        endpoint: SocketAddr,
    },
    /// No answer within the request's deadline.
    #[error("{service} request to {endpoint} got no answer within {after:?}")]
    Timeout {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// The service called.
        service: Service,
        /// The deadline.
        after: Duration,
    },
    /// The peer has no handler for the service.
    #[error("{endpoint} has no handler for {service}")]
    NoSuchService {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// The service called.
        service: Service,
    },
    /// The peer has too many requests of this session in flight.
    #[error("{endpoint} is busy: too many {service} requests in flight")]
    Busy {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// The service called.
        service: Service,
    },
    /// The peer's handler failed.
    #[error("{endpoint} failed the {service} request: {message}")]
    Failed {
        /// The peer's endpoint.
        endpoint: SocketAddr,
        /// The service called.
        service: Service,
        /// The handler's message.
        message: String,
    },
}

impl ControlError {
    /// The peer endpoint the error is about.
    pub fn endpoint(&self) -> SocketAddr {
        match self {
            ControlError::Unreachable { endpoint, .. }
            | ControlError::WrongNode { endpoint, .. }
            | ControlError::Refused { endpoint, .. }
            | ControlError::AuthFailed { endpoint, .. }
            | ControlError::Protocol { endpoint, .. }
            | ControlError::SessionClosed { endpoint }
            | ControlError::Timeout { endpoint, .. }
            | ControlError::NoSuchService { endpoint, .. }
            | ControlError::Busy { endpoint, .. }
            | ControlError::Failed { endpoint, .. } => *endpoint,
        }
    }
}

impl From<ControlError> for OpError {
    /// What an op learns when its transport could not set itself up with the
    /// peer: unreachable, the wrong node, a lost connection, the peer at its
    /// connection limit, or (for every other refusal and failure of the
    /// peer) a protocol error carrying the reason.
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::Unreachable { endpoint, reason } => {
                OpError::PeerUnreachable { endpoint, reason }
            }
            ControlError::WrongNode {
                expected, endpoint, ..
            } => OpError::UnknownNode { expected, endpoint },
            ControlError::SessionClosed { endpoint } => OpError::connection_lost(endpoint),
            ControlError::AuthFailed { endpoint, reason } => OpError::AuthFailed {
                endpoint,
                reason: reason.to_string(),
            },
            ControlError::Timeout { endpoint, .. } => OpError::PeerUnreachable {
                endpoint,
                reason: e.to_string(),
            },
            ControlError::Refused {
                endpoint,
                status: Some(HelloStatus::Busy),
            } => OpError::PeerBusy {
                endpoint,
                reason: e.to_string(),
            },
            // A hang-up without the `Busy` reply: an owner at its limit
            // sends that reply before it closes, so this is one that
            // stopped or died, not a busy one.
            ControlError::Refused {
                endpoint,
                status: None,
            } => OpError::PeerUnreachable {
                endpoint,
                reason: e.to_string(),
            },
            other => OpError::Protocol(other.to_string()),
        }
    }
}

/// Why the endpoint could not start, or a handler could not be registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Binding the listener failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The endpoint listens on every interface and was given no address to
    /// advertise: handles would carry `0.0.0.0`, which no peer can reach.
    #[error(
        "listening on {listen} (every interface) needs an address peers can reach this node at: \
         set one with NodeBuilder::advertise, FERRY_ADVERTISE or `ferry serve --advertise`"
    )]
    Unadvertised {
        /// The unspecified listen address.
        listen: SocketAddr,
    },
    /// The address to advertise is itself unspecified.
    #[error("cannot advertise {advertise}: peers need a concrete address, not an unspecified one")]
    UnspecifiedAdvertise {
        /// The address given.
        advertise: SocketAddr,
    },
    /// Another handler already serves the channel.
    #[error("{0:?} already has a handler")]
    ChannelTaken(Channel),
    /// Another handler already serves the service.
    #[error("{0} already has a handler")]
    ServiceTaken(Service),
}
