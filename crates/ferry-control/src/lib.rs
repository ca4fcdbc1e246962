//! A ferry node's endpoint and control plane.
//!
//! Everything a peer opens to this node arrives at one listener: the
//! [`Endpoint`]. Each connection starts with a hello (see [`hello`]) naming
//! the client node and a [`Channel`]; the endpoint bounds how many
//! connections it holds ([`ConnectionLimits`]), serves the control channel
//! itself, and hands every other channel to the data plane that registered
//! a handler for it (the TCP data plane's requests, for one). The endpoint
//! knows nothing of the data planes: dependencies point from them to it.
//!
//! The control channel carries one [`Session`] per pair of nodes and
//! direction: framed (tokio-util codec, see [`frame`]), versioned, with
//! requests to named [`Service`]s multiplexed by request id, each with a
//! deadline. The ibverbs queue-pair exchange is such a service, and so are
//! calls of named handlers ([`rpc`]) and messages into a node's [`inbox`];
//! later ones (notifications, metadata) are new services or frame kinds on
//! the same session.

#![warn(missing_docs)]

pub mod auth;
mod endpoint;
mod error;
pub mod frame;
pub mod hello;
pub mod inbox;
mod limits;
pub mod rpc;
mod session;
pub mod socket;
pub mod wire;

pub use auth::{AuthFailure, ClusterSecret, SecretError};
pub use endpoint::{Connection, Endpoint, EndpointConfig};
pub use error::{ControlError, EndpointError};
pub use frame::{DEFAULT_MAX_FRAME, Service};
pub use hello::{Channel, Dialer, HelloStatus};
pub use inbox::{
    Delivery, DeliveryKind, Inbox, MessageError, Messages, NotificationSink, OfferError,
};
pub use limits::{
    ConnectionHold, ConnectionLimits, ConnectionPermit, DEFAULT_FRAME_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT, DEFAULT_SESSION_EVICTABLE_AFTER, EVICTABLE_AFTER, IdleClose,
};
pub use rpc::{Rpc, RpcError, RpcRequest};
pub use session::{Request, ServiceFuture, Session};
pub use socket::{DEFAULT_PEER_TIMEOUT, DEFAULT_SILENT_GRACE};

/// A service handler's failure, sent to the caller as its message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ServiceError(pub String);
