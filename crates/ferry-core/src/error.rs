use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Generation, NodeId};

/// Why one operation of a batch failed. The same enum is used for checks made
/// locally before anything is sent and for refusals reported by the remote side,
/// so callers match on one type whatever caught the problem.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum OpError {
    /// `offset..offset + len` (bytes) reaches past the end of a buffer of
    /// `bound` bytes.
    #[error("range {offset}+{len} lies outside the {bound}-byte buffer")]
    OutOfBounds { offset: u64, len: u64, bound: u64 },
    /// A slice was asked for with `end < start`: a caller bug, reported with
    /// the range as given rather than as an empty range out of bounds.
    #[error("range {start}..{end} is inverted: its end comes before its start")]
    InvertedRange { start: u64, end: u64 },
    /// A handle's `addr + len` wraps past the end of the 64-bit address space.
    /// No region the owner registered can look like that, so the handle was
    /// forged or corrupted on its way here.
    #[error(
        "handle range {addr:#x}+{len} wraps around the address space: forged or corrupt handle"
    )]
    AddressOverflow { addr: u64, len: u64 },
    #[error("local slice is {local} bytes but remote slice is {remote} bytes")]
    LengthMismatch { local: u64, remote: u64 },
    #[error("remote buffer is read-only")]
    ReadOnly,
    #[error("remote side rejected the access credentials (wrong token or key)")]
    AccessDenied,
    #[error("remote region was deregistered (handle generation {handle:?}, now {current:?})")]
    StaleGeneration {
        handle: Generation,
        current: Generation,
    },
    #[error("remote region does not exist")]
    UnknownRegion,
    #[error("endpoint {endpoint} is not node {expected}")]
    UnknownNode {
        expected: NodeId,
        endpoint: SocketAddr,
    },
    #[error("peer {endpoint} unreachable: {reason}")]
    PeerUnreachable {
        endpoint: SocketAddr,
        reason: String,
    },
    #[error("connection to {endpoint} lost before the op completed")]
    ConnectionLost { endpoint: SocketAddr },
    #[error("no transport shared with the remote side")]
    NoSharedTransport,
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// Outcome of a failed `Submit`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Op `index` (position in the submitted batch) failed. When several fail,
    /// the lowest index is reported.
    #[error("op {index} failed: {error}")]
    Op { index: usize, error: OpError },
    /// The deadline passed first. Memory the unfinished ops touch stays
    /// registered until the transport can no longer write to it.
    #[error("submit timed out after {timeout:?} with {unfinished} of {total} ops unfinished")]
    Timeout {
        timeout: Duration,
        unfinished: usize,
        total: usize,
    },
    /// The backend actor is not running (stopped or crashed).
    #[error("transport backend is not running")]
    BackendStopped,
}

/// Why memory could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("a region must be at least one byte long")]
    ZeroLength,
    #[error("could not allocate {0} bytes")]
    OutOfMemory(u64),
    /// More bytes than any memory range of this host can hold (over
    /// `isize::MAX`): no allocation or valid pointer range is that long.
    #[error("a region of {0} bytes does not fit in this host's address space")]
    TooLarge(u64),
    #[error("transport backend is not running")]
    BackendStopped,
    #[error("region id {0:?} is already registered with this backend")]
    IdInUse(crate::RegionId),
    #[error("backend could not register the memory: {0}")]
    Backend(String),
}
