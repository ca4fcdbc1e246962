//! ferry's ibverbs backend: one-sided RDMA READ/WRITE through an RDMA NIC
//! (or soft-RoCE), behind the same `Submit` semantics as the TCP fallback.
//!
//! All raw verbs calls live in [`verbs`]; the rest of the crate uses its safe
//! types. Queue pairs are connected lazily, one per peer, by a request on
//! the node's control session to that peer (`ferry-control`'s
//! `Service::IBVERBS_CONNECT`; see `connection`).

mod backend;
mod connection;
mod device;
mod report;
pub mod verbs;
mod wire;

pub use backend::{
    FOREIGN_WR_ID_BIT, IbvBackend, IbvDevice, IbvManagerActor, IbvQpHandle, IbvRegionKeys,
    IbvRegistered, IbvRegistration, IbvTransportInfo,
};
pub use device::IbvConfig;
/// The messages all managers share, re-exported where users look for them.
pub use ferry_core::{RegisterRegion, Submit, TransportInfo, TransportLevel};
/// The verbs bindings ferry is built with, for code that posts through the
/// raw handles of [`IbvTransportInfo`].
pub use rdma_sys as sys;
pub use report::{DeviceReport, GidReport, PortReport, describe_devices};
