//! ferry's ibverbs backend: one-sided RDMA READ/WRITE through RDMA NICs
//! (or soft-RoCE), behind the same [`Submit`] semantics as the TCP fallback.
//! It uses every active port of every device (its rails; or those named
//! in [`IbvConfig::rails`]), probes which of its rails reach which of a
//! peer's, and spreads each batch over the pairs that do.
//!
//! All raw verbs calls live in [`verbs`]; the rest of the crate uses its safe
//! types. Queue pairs are exchanged over the node's control sessions
//! (`ferry-control`): [`IbvBackend::start`] serves
//! [`Service::IBVERBS_CONNECT`] on the node's [`Endpoint`], and the first
//! submit to a peer sends that request, carrying a fresh queue pair's
//! details, on the control session to the peer. The peer answers with the
//! details of a queue pair of its own, connected to ours, which it keeps for
//! as long as that session lives. One RC queue pair per peer and rail
//! pair, connected lazily, reconnected once all of them broke.
//!
//! [`Service::IBVERBS_CONNECT`]: ferry_control::Service::IBVERBS_CONNECT
//! [`Endpoint`]: ferry_control::Endpoint

#![warn(missing_docs)]

mod backend;
mod batch;
mod connection;
mod device;
mod exchange;
mod info;
mod lanes;
mod lease;
mod mr_cache;
mod notify;
mod passive;
mod peers;
mod placement;
mod ports;
mod qp_session;
mod report;
pub mod verbs;
#[doc(hidden)]
pub mod wire;

pub use backend::{
    FOREIGN_WR_ID_BIT, IbvBackend, IbvDevice, IbvManagerActor, IbvRegistered, IbvRegistration,
};
pub use device::{
    DEFAULT_MAX_PASSIVE_QPS, DEFAULT_MAX_PASSIVE_QPS_PER_SESSION, DEFAULT_MAX_WR_BYTES,
    DEFAULT_STALL_TIMEOUT, DEFAULT_STRIPE_MIN, IbvConfig, MAX_WR_BYTES_ENV, RAILS_ENV, RailName,
    SOFTWARE_NOTIFY_COALESCE, SOFTWARE_STALL_TIMEOUT,
};
/// What [`IbvBackend::submit_notified`] did with a notification.
pub use ferry_core::DataPathNotification;
/// The messages all managers share, re-exported where users look for them.
pub use ferry_core::{RegisterRegion, Submit, TransportInfo, TransportLevel};
pub use info::{IbvQpHandle, IbvRailInfo, IbvRegionKeys, IbvTransportInfo};
pub use lease::{IbvLease, LeasedQp};
pub use placement::{PinError, Placement, RailPair, RailPairs, RailSet};
pub use report::{DeviceReport, GidReport, PortReport, describe_devices};
pub use verbs::QpTiming;
/// The verbs bindings ferry is built with, for code that posts through the
/// raw handles of [`IbvTransportInfo`]: `rdma-sys`'s, with libibverbs's
/// functions that ferry calls loaded at run time.
pub use verbs::sys;
