//! Messages every manager actor accepts (the node's and each backend's).
//! They are plain data here; each manager implements kameo's `Message` for
//! them, so a worker can send the same `Submit` to whichever manager it holds.

use std::sync::Arc;
use std::time::Duration;

use crate::{Access, Generation, MemoryBlock, RdmaOp, RegionId, RegisterError, SubmitError};

/// Run a batch of one-sided ops. Answered when every op has completed, one
/// has failed, or `timeout` passes; the manager keeps serving other messages
/// meanwhile.
///
/// The ops have no order among themselves: they run concurrently, and ops
/// whose byte ranges overlap leave those bytes unspecified, as on RDMA. A
/// zero-length op is only checked locally and succeeds without contacting
/// its remote side. See [`RdmaOp`].
///
/// The answer is a `Result<(), SubmitError>`; kameo wraps it in a
/// `SendError`, which converts back with `?` or `SubmitError::from` (a
/// manager that is not running becomes [`SubmitError::BackendStopped`]).
#[derive(Debug)]
pub struct Submit {
    /// The batch.
    pub ops: Vec<RdmaOp>,
    /// How long the caller waits; what is still unfinished then is failed
    /// with [`SubmitError::Timeout`], and work not yet sent is dropped.
    pub timeout: Duration,
}

/// Which transport a manager moves bytes with (for the node's manager: the
/// fastest it runs). Answered with a [`crate::RdmaTransportLevel`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TransportLevel;

/// The manager's raw, transport-specific details (see
/// [`crate::RdmaBackend::TransportInfo`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct TransportInfo;

/// Make a region reachable through a backend. `access` is the most a remote
/// handle may do; the reply carries the credentials for remote handles and a
/// guard that deregisters the region when dropped.
pub struct RegisterRegion {
    /// The region's slot in its node.
    pub id: RegionId,
    /// The slot's generation.
    pub generation: Generation,
    /// The most a remote handle may do.
    pub access: Access,
    /// The bytes.
    pub memory: Arc<MemoryBlock>,
}

impl From<kameo::error::SendError<Submit, SubmitError>> for SubmitError {
    /// A failed transfer as it is; a manager that did not take or answer the
    /// message (stopped, crashed, restarting) as `BackendStopped`.
    fn from(e: kameo::error::SendError<Submit, SubmitError>) -> Self {
        match e {
            kameo::error::SendError::HandlerError(e) => e,
            _ => SubmitError::BackendStopped,
        }
    }
}

impl<M> From<kameo::error::SendError<M, RegisterError>> for RegisterError {
    /// For every message answered with a registration (the node's `Alloc`
    /// and `Register`, a backend's [`RegisterRegion`]): a refusal as it is;
    /// a manager that did not take or answer the message as
    /// `BackendStopped`.
    fn from(e: kameo::error::SendError<M, RegisterError>) -> Self {
        match e {
            kameo::error::SendError::HandlerError(e) => e,
            _ => RegisterError::BackendStopped,
        }
    }
}
