//! Transport-neutral vocabulary of ferry: node and region identity, registered
//! memory, serializable remote handles, one-sided operations, the backend
//! trait, the messages every manager actor accepts ([`Submit`],
//! [`RegisterRegion`], [`TransportLevel`], [`TransportInfo`]) and the typed
//! errors every backend reports.
//!
//! Nothing here moves bytes. Backends (`ferry-tcp`, `ferry-ibverbs`) do,
//! answering each submit through the same [`BatchProgress`], and the `ferry`
//! facade routes operations between them.
//!
//! Every length and offset in this API is a count of bytes, as `u64`,
//! whether it describes local memory ([`Region`], [`LocalSlice`]) or a remote
//! handle ([`RemoteBuffer`]); the ranges given to `slice` may also be
//! `usize` (see [`ByteOffset`]).

#![warn(missing_docs)]

mod backend;
mod descs;
mod error;
mod gone;
mod handle;
mod ids;
pub mod inline;
mod memory;
mod message;
mod notified;
mod offset;
mod op;
mod progress;
mod region;
mod release;
mod token;

pub use backend::{RdmaBackend, RdmaTransportLevel};
pub use descs::{
    Desc, DescError, DescIndices, Descs, Indices, LocalDescList, RemoteDescList, check_pairs,
    op_at, ops_between,
};
pub use error::{OpError, RegisterError, SubmitError};
pub use gone::{DEPARTED, Departed, SlotRefusal};
pub use handle::{
    Access, IbvRemote, MAX_RAILS, MemRemote, RailKeys, RemoteBuffer, RemoteTransports, TcpRemote,
};
pub use ids::{Generation, NodeAddr, NodeId, RegionId, random_u128, tokens_equal};
pub use memory::{MemoryBlock, PAGE_SIZE};
pub use message::{RegisterRegion, Submit, TransportInfo, TransportLevel};
pub use notified::DataPathNotification;
pub use offset::ByteOffset;
pub use op::{LocalSlice, OpKind, RdmaOp};
pub use progress::{Answer, BatchProgress};
pub use region::{Region, RegionIds, RegionParts, RegionSlot};
pub use release::{CloseError, Closing, MemoryHold, MemoryHolder};
pub use token::{MAX_SCOPES, SCOPE_LEN, Scope, Scopes, scope_token};
