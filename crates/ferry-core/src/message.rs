//! Messages every backend manager actor accepts. They are plain data here;
//! each backend implements kameo's `Message` for them, so a worker can send
//! the same `Submit` to whichever manager it holds.

use std::sync::Arc;
use std::time::Duration;

use crate::{Access, Generation, MemoryBlock, RdmaOp, RegionId};

/// Run a batch of one-sided ops. Answered when every op has completed, one
/// has failed, or `timeout` passes; the manager keeps serving other messages
/// meanwhile.
///
/// The ops have no order among themselves: they run concurrently, and ops
/// whose byte ranges overlap leave those bytes unspecified, as on RDMA. A
/// zero-length op is only checked locally and succeeds without contacting
/// its remote side. See [`RdmaOp`].
#[derive(Debug)]
pub struct Submit {
    pub ops: Vec<RdmaOp>,
    pub timeout: Duration,
}

/// Make a region reachable through a backend. `access` is the most a remote
/// handle may do; the reply carries the credentials for remote handles and a
/// guard that deregisters the region when dropped.
pub struct RegisterRegion {
    pub id: RegionId,
    pub generation: Generation,
    pub access: Access,
    pub memory: Arc<MemoryBlock>,
}
