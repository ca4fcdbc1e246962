//! ferry's TCP fallback: the same one-sided READ/WRITE semantics as RDMA, for
//! hosts without an RDMA NIC.
//!
//! It is one data channel of the node's endpoint: [`TcpBackend::start`]
//! registers a handler for [`Channel::TCP_DATA`] with the
//! [`Endpoint`](ferry_control::Endpoint), which accepts, bounds and
//! hello-checks every connection and hands those of this channel over. The
//! owner of a region serves requests on them after checking region id,
//! generation, token, bounds and access; the initiator opens its connections
//! with the same hello, splits large ops into chunks and gathers runs of
//! small ones into one request each, spread over several connections per
//! peer, with a bounded window of bytes in flight on each. Large payloads
//! move between sockets and region memory without intermediate buffers;
//! small ones are copied through a buffer, which costs less than a system
//! call each. The data frames themselves are in [`frame`].
//!
//! [`Channel::TCP_DATA`]: ferry_control::Channel::TCP_DATA

#![warn(missing_docs)]

mod actor;
mod chunk;
mod client;
mod connection;
mod deadline;
pub mod frame;
mod gather;
mod io;
mod pool;
mod server;
mod table;

pub use actor::{
    DEFAULT_BUSY_POLL, DeregisterRegion, RegisteredRegions, TcpBackend, TcpConfig, TcpManagerActor,
    TcpRegistered, TcpTransportInfo,
};
pub use client::{NotificationResult, Notified};
/// The messages all managers share, re-exported where users look for them.
pub use ferry_core::{RegisterRegion, Submit, TransportInfo, TransportLevel};
pub use table::TcpRegistration;
