//! ferry: one-sided READ/WRITE transfers between processes, over RDMA where
//! both ends have a NIC and over TCP where they don't.
//!
//! A process spawns one node inside its tokio runtime and kameo actor
//! system. The node registers memory as [`Region`]s, hands out serializable
//! [`RemoteBuffer`] handles to them, and runs batches of [`RdmaOp`]s, each
//! routed to the fastest transport both ends share. Worker actors send
//! [`Submit`] to the node's [`NodeActor`]; other code holds the cheap
//! [`Node`] handle. Both take the same routing path; [`Node::route`] and
//! [`Node::path`] say which transport it picks for an op. Messages,
//! notifications and RPC arguments take any [`IntoBody`]: `b"done"`,
//! `Vec<u8>`, `String`, [`Bytes`]. The crates, the path of a submit and the
//! invariants are described in `docs/architecture.md`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use ferry::prelude::*;
//! use std::time::Duration;
//!
//! let node = Node::builder().listen("127.0.0.1:0".parse()?).spawn().await?;
//! let local = node.alloc(1 << 20, Access::ReadWrite).await?;
//! # let remote: RemoteBuffer = local.remote();
//! // `remote` came from another node, e.g. serialized with serde.
//! let op = RdmaOp::read(local.slice(0..4096)?, remote.slice(0..4096)?);
//! node.submit(vec![op], Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod actor;
mod advertise;
mod body;
mod builder;
mod estimate;
mod messages;
mod meters;
mod names;
mod node;
mod outcome;
mod plans;
mod prepare;
mod router;
mod rpc;
mod tables;
mod transports;
pub mod weights;
mod xfer;

#[cfg(test)]
mod ask_tests;

pub use actor::{Alloc, NodeActor, Register, Transports};
pub use body::IntoBody;
pub use builder::{ADVERTISE_ENV, DISABLE_IBVERBS_ENV, DISABLE_MEMORY_ENV, NodeBuilder, NodeError};
/// Every message, notification, RPC argument and answer is one: re-exported
/// so that a program needs no `bytes` dependency of its own to name it.
pub use bytes::Bytes;
pub use estimate::{Estimate, EstimateMethod};
/// The node's endpoint and control plane, for direct use of its sessions.
pub use ferry_control as control;
pub use ferry_control::{
    AuthFailure, ClusterSecret, ConnectionLimits, DEFAULT_PEER_TIMEOUT, DEFAULT_SILENT_GRACE,
    Delivery, DeliveryKind, EndpointConfig, Inbox, MessageError, RpcError, RpcRequest, SecretError,
};
pub use ferry_core::{
    Access, ByteOffset, CloseError, Closing, Generation, IbvRemote, LocalSlice, MemoryBlock,
    MemoryHolder, NodeAddr, NodeId, OpError, OpKind, PAGE_SIZE, RailKeys, RdmaBackend, RdmaOp,
    RdmaTransportLevel, Region, RegionId, RegisterError, RemoteBuffer, RemoteTransports, Submit,
    SubmitError, TransportInfo, TransportLevel,
};
pub use ferry_core::{
    Desc, DescError, DescIndices, Descs, Indices, LocalDescList, RemoteDescList, check_pairs,
    op_at, ops_between,
};
/// Narrowed credentials: what a serialized slice or read-only handle opens.
pub use ferry_core::{MAX_SCOPES, Scope, Scopes, scope_token};
pub use ferry_discovery as discovery;
#[cfg(feature = "etcd")]
pub use ferry_discovery::etcd::{EtcdConfig, EtcdError};
pub use ferry_discovery::{DiscoveryError, Loaded, LookupError, MetadataError, NodeMetadata};
/// The ibverbs backend, for direct use of its actor, messages and raw handles.
pub use ferry_ibverbs as ibverbs;
/// Tensor layouts and the planner ([`ferry_layout`]): see [`Node::plan_transfer`].
pub use ferry_layout as layout;
/// The same-host memory transport.
pub use ferry_memory as memory;
pub use ferry_memory::MemoryPath;
/// The TCP fallback backend, for direct use of its actor and messages.
pub use ferry_tcp as tcp;
pub use messages::{InboxTaken, NotifyError, SendMessage, SubmitWithNotification};
pub use names::NameTaken;
pub use node::Node;
pub use outcome::{KEPT_OUTCOMES, Outcome, OutcomeError};
pub use plans::{LocalLayout, PeerLayout, PlanError, TransferPlan};
pub use prepare::{Connect, Connected, PrepareError, PrepareRemote, PreparedRemote};
pub use router::{NodeTransportInfo, TransportPath};
pub use rpc::Call;
pub use tables::PeerTables;
pub use transports::{TransportState, TransportStatus};
pub use xfer::{
    MakeXfer, PostError, SLICE_BYTES, SLICE_OPS, SLICES_IN_FLIGHT, WINDOW_BYTES, Xfer, XferError,
    XferStatus,
};

/// What a program using ferry usually needs, in one import.
pub mod prelude {
    pub use crate::{
        Access, Alloc, Bytes, Node, NodeActor, NodeBuilder, OpError, OpKind, RdmaBackend, RdmaOp,
        RdmaTransportLevel, Region, RemoteBuffer, Submit, SubmitError,
    };
}

/// The README's and the guide's (docs/) code blocks, as doc tests.
#[cfg(doctest)]
mod doctests;

/// Regions come only from [`Node::alloc`] and [`Node::register`]: a region
/// assembled by hand would hand out handles that lie. Neither a `Region`
/// constructor nor `RegionParts` is reachable through this crate:
///
/// ```compile_fail
/// let _ = ferry::Region::new;
/// ```
///
/// ```compile_fail
/// let _: Option<ferry::RegionParts> = None;
/// ```
#[cfg(doctest)]
pub struct RegionsOnlyFromNodes;
