//! ferry's TCP fallback: the same one-sided READ/WRITE semantics as RDMA, for
//! hosts without an RDMA NIC.
//!
//! The owner of a region serves requests on its node's listener after checking
//! region id, generation, token, bounds and access; the initiator splits ops
//! into chunks spread over several connections per peer, with many chunks in
//! flight on each, and payload bytes move between sockets and region memory
//! without intermediate buffers.

mod actor;
mod client;
pub mod frame;
mod io;
mod server;
mod table;

pub use actor::{
    DeregisterRegion, RegisteredRegions, TcpBackend, TcpConfig, TcpManagerActor, TcpManagerArgs,
    TcpRegistered, TcpTransportInfo, TransportInfo, TransportLevel, submit_outcome,
};
pub use client::connect_control;
/// The messages all managers share, re-exported where users look for them.
pub use ferry_core::{RegisterRegion, Submit};
pub use server::ControlConnection;
pub use table::TcpRegistration;
