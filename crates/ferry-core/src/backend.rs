use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{RdmaOp, SubmitError};

/// How bytes move, ordered slowest to fastest so callers can ask for
/// "at least `Nic`" with a comparison. Same-host memory beats a NIC: a copy
/// between mappings needs no wire at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RdmaTransportLevel {
    /// Kernel TCP sockets: works everywhere, costs CPU copies.
    Tcp,
    /// One-sided RDMA through an ibverbs NIC.
    Nic,
    /// Same-host memory: copies between mappings of shared regions
    /// (`ferry-memory`).
    Memory,
}

impl RdmaTransportLevel {
    /// Every level, slowest first.
    pub const ALL: [RdmaTransportLevel; 3] = [
        RdmaTransportLevel::Tcp,
        RdmaTransportLevel::Nic,
        RdmaTransportLevel::Memory,
    ];

    /// The name of the backend that provides it: `tcp`, `ibverbs`, `memory`.
    pub fn backend(self) -> &'static str {
        match self {
            RdmaTransportLevel::Tcp => "tcp",
            RdmaTransportLevel::Nic => "ibverbs",
            RdmaTransportLevel::Memory => "memory",
        }
    }
}

impl std::fmt::Display for RdmaTransportLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.backend())
    }
}

/// A data plane that executes batches of one-sided operations.
///
/// Implemented by cheap cloneable handles to backend manager actors, so a
/// worker can keep its own copy and submit without a central bottleneck,
/// and by the facade's `Node`, which routes each op to the fastest
/// transport both ends share.
///
/// Not usable as a trait object: `submit` and `transport_info` are async
/// (they return `impl Future`), `TransportInfo` is an associated type, and
/// `Clone` needs `Sized`, none of which `dyn` allows. Write code over it as
/// a generic (`fn run<B: RdmaBackend>(backend: &B)`); to pick a transport
/// at run time, which is what a `dyn RdmaBackend` is usually wanted for,
/// use `Node`, which does that per op.
///
/// ```compile_fail
/// let _: Option<Box<dyn ferry_core::RdmaBackend<TransportInfo = ()>>> = None;
/// ```
pub trait RdmaBackend: Clone + Send + Sync + 'static {
    /// The backend's raw, transport-specific details (listener address, or the
    /// verbs handles a GPU kernel needs to post work itself).
    type TransportInfo: Send + 'static;

    /// Runs every op of the batch. Resolves `Ok` once the last byte of every op
    /// is acknowledged by its remote side; `Err(Timeout)` when `timeout`
    /// passes first; `Err(Op { index, .. })` naming the first failing op.
    ///
    /// The ops have no order among themselves: they run concurrently, so two
    /// ops of one batch whose byte ranges overlap leave those bytes
    /// unspecified, as on RDMA. A zero-length op is checked locally (lengths,
    /// access, address range, a transport that reaches it) and then succeeds
    /// at once without contacting the remote side, so its success does not
    /// prove the remote region exists. See [`RdmaOp`].
    fn submit(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), SubmitError>> + Send;

    /// The transport this backend moves bytes with (the fastest, for one
    /// that routes between several).
    fn transport_level(&self) -> RdmaTransportLevel;

    /// The backend's raw details; `None` when the backend has stopped.
    fn transport_info(&self) -> impl Future<Output = Option<Self::TransportInfo>> + Send;
}
