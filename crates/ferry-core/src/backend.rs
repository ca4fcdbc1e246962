use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{RdmaOp, SubmitError};

/// How bytes move, ordered slowest to fastest so callers can ask for
/// "at least `Nic`" with a comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RdmaTransportLevel {
    /// Kernel TCP sockets: works everywhere, costs CPU copies.
    Tcp,
    /// Same-host memory copy (reserved: no backend implements it yet).
    Memory,
    /// One-sided RDMA through an ibverbs NIC.
    Nic,
}

/// A data plane that executes batches of one-sided operations.
///
/// Implemented by cheap cloneable handles to backend manager actors, so a
/// worker can keep its own copy and submit without a central bottleneck.
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

    fn transport_level(&self) -> RdmaTransportLevel;

    /// `None` when the backend has stopped.
    fn transport_info(&self) -> impl Future<Output = Option<Self::TransportInfo>> + Send;
}
