use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Generation, NodeId};

/// Why one operation of a batch failed. The same enum is used for checks made
/// locally before anything is sent and for refusals reported by the remote side,
/// so callers match on one type whatever caught the problem.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum OpError {
    /// `offset..offset + len` (bytes) reaches past the end of a buffer of
    /// `bound` bytes.
    #[error("range {offset}+{len} lies outside the {bound}-byte buffer")]
    OutOfBounds {
        /// Start of the range, from the start of the buffer.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the buffer.
        bound: u64,
    },
    /// A slice was asked for with `end < start`: a caller bug, reported with
    /// the range as given rather than as an empty range out of bounds.
    #[error("range {start}..{end} is inverted: its end comes before its start")]
    InvertedRange {
        /// The range's start, as given.
        start: u64,
        /// The range's end, as given.
        end: u64,
    },
    /// A slice was asked for with a negative offset (only possible with a
    /// signed range, such as an unsuffixed literal): a caller bug.
    #[error("byte offset {0} is negative: offsets count from the start of the buffer")]
    NegativeOffset(i64),
    /// A handle's `addr + len` wraps past the end of the 64-bit address space.
    /// No region the owner registered can look like that, so the handle was
    /// forged or corrupted on its way here.
    #[error(
        "handle range {addr:#x}+{len} wraps around the address space: forged or corrupt handle"
    )]
    AddressOverflow {
        /// The handle's address in the owner's process.
        addr: u64,
        /// The handle's length in bytes.
        len: u64,
    },
    /// An op's local and remote slices differ in length (bytes); caught
    /// before anything is sent.
    #[error("local slice is {local} bytes but remote slice is {remote} bytes")]
    LengthMismatch {
        /// Length of the local slice.
        local: u64,
        /// Length of the remote slice.
        remote: u64,
    },
    /// A write to read-only memory: caught locally from the handle's
    /// [`Access`](crate::Access), or refused by the TCP owner when the handle
    /// claimed more access than the region was registered with.
    #[error("remote buffer is read-only")]
    ReadOnly,
    /// The owner refused the handle's credentials: a wrong TCP token, or an
    /// RDMA remote access error (wrong rkey, a region deregistered since the
    /// handle was made, or an access its registration does not allow).
    #[error("remote side rejected the access credentials (wrong token or key)")]
    AccessDenied,
    /// The handle's generation is not the one the owner's slot holds now.
    /// Older: its region was deregistered and the slot reused by a newer
    /// one. Newer: no region of that generation ever existed there, so the
    /// handle was forged or corrupted (a restarted owner is caught earlier,
    /// as [`OpError::UnknownNode`]). One variant for both, since the owner
    /// reports only the two generations; the text tells them apart.
    /// Reported by the TCP and same-host memory owners.
    #[error("{}", stale_generation_text(*handle, *current))]
    StaleGeneration {
        /// The generation the handle carries.
        handle: Generation,
        /// The generation the owner's slot has now.
        current: Generation,
    },
    /// The owner has no region in the handle's slot (deregistered, or never
    /// registered). Reported by the TCP and same-host memory owners.
    #[error("remote region does not exist")]
    UnknownRegion,
    /// Another node answers at the handle's endpoint: the owner restarted
    /// (a new process there has a new node id), or the handle names the
    /// wrong address. The new process's memory is never touched.
    #[error(
        "the node at {endpoint} is not the handle's owner {expected}: the owner restarted \
         (a new node id at that address) or the handle is wrong"
    )]
    UnknownNode {
        /// The owner the handle names.
        expected: NodeId,
        /// The endpoint the handle names.
        endpoint: SocketAddr,
    },
    /// No connection to the owner could be made, or its control session did
    /// not answer in time.
    #[error("peer {endpoint} unreachable: {reason}")]
    PeerUnreachable {
        /// The owner's endpoint.
        endpoint: SocketAddr,
        /// What went wrong, for people (the OS error, or the timeout).
        reason: String,
    },
    /// The connection, queue pair or control session to the owner broke (or
    /// stopped answering) before the op completed; for a write, a prefix of
    /// its bytes may have landed.
    #[error(
        "connection to {endpoint} lost before the op completed{}",
        lost_rails_text(rails)
    )]
    ConnectionLost {
        /// The owner's endpoint.
        endpoint: SocketAddr,
        /// Over ibverbs, the rail pairs the op could have taken, all of
        /// which failed (`"mlx5_0:1 -> rail 0"`: a local device and port,
        /// then the peer's rail): which NICs or wires to look at. Empty on
        /// the other transports. Build it with [`OpError::connection_lost`]
        /// where there is nothing to name.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        rails: Vec<String>,
    },
    /// None of this node's running transports can reach the handle: it
    /// carries no credentials for them, or the local region is not
    /// registered with the one that could.
    #[error("no transport shared with the remote side")]
    NoSharedTransport,
    /// Something the peer or the local NIC did broke the protocol (a
    /// malformed reply, a failed work completion, a peer's refusal of the
    /// queue-pair exchange); the text says what, for people.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The owner is at its connection limit and took no new connection from
    /// this node, which had none open to it to carry on over. Nothing was
    /// sent; the owner is up, so trying again later may succeed.
    #[error("peer {endpoint} is at its connection limit: {reason}")]
    PeerBusy {
        /// The owner's endpoint.
        endpoint: SocketAddr,
        /// What the owner said, for people.
        reason: String,
    },
    /// The owner and this node do not hold the same cluster secret (one
    /// has none, or another): nothing was sent. Not transient: the
    /// configuration of one of the two is wrong.
    #[error("peer {endpoint} refused: {reason}")]
    AuthFailed {
        /// The owner's endpoint.
        endpoint: SocketAddr,
        /// Which side lacks what, for people.
        reason: String,
    },
}

impl OpError {
    /// [`OpError::ConnectionLost`] with no rail pairs to name: a TCP
    /// connection, a same-host peer or a control session broke.
    pub fn connection_lost(endpoint: SocketAddr) -> Self {
        Self::ConnectionLost {
            endpoint,
            rails: Vec::new(),
        }
    }
}

/// [`OpError::ConnectionLost`]'s rails, for people: nothing when there are
/// none, else the pairs that failed.
fn lost_rails_text(rails: &[String]) -> String {
    if rails.is_empty() {
        String::new()
    } else {
        format!(" (every rail pair failed: {})", rails.join(", "))
    }
}

/// [`OpError::StaleGeneration`]'s text: a handle older than the slot
/// outlived its region; one newer than the slot never named a region.
fn stale_generation_text(handle: Generation, current: Generation) -> String {
    if handle < current {
        format!(
            "remote region was deregistered (the handle is of generation {handle}; \
             its slot now holds generation {current})"
        )
    } else {
        format!(
            "forged or wrong handle: it names generation {handle} of a slot \
             whose newest region is generation {current}"
        )
    }
}

/// Outcome of a failed `Submit`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// Op `index` (position in the submitted batch) failed. When several fail,
    /// the lowest index is reported.
    #[error("op {index} failed: {error}")]
    Op {
        /// Position of the op in the submitted batch.
        index: usize,
        /// Why it failed.
        error: OpError,
    },
    /// The deadline passed first. Memory the unfinished ops touch stays
    /// registered until the transport can no longer write to it.
    #[error("submit timed out after {timeout:?} with {unfinished} of {total} ops unfinished")]
    Timeout {
        /// The timeout the batch was submitted with.
        timeout: Duration,
        /// Ops of the batch that had not completed.
        unfinished: usize,
        /// Ops in the batch.
        total: usize,
    },
    /// The backend actor is not running (stopped or crashed).
    #[error("transport backend is not running")]
    BackendStopped,
    /// The node was shut down (`Node::shutdown`): it initiates and serves
    /// nothing any more, on any transport.
    #[error("the node was shut down: it initiates and serves no transfers")]
    ShutDown,
}

/// Why memory could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// A length of 0 bytes was asked for.
    #[error("a region must be at least one byte long")]
    ZeroLength,
    /// The host could not allocate (or map) this many bytes.
    #[error("could not allocate {0} bytes")]
    OutOfMemory(u64),
    /// More bytes than any memory range of this host can hold (over
    /// `isize::MAX`): no allocation or valid pointer range is that long.
    #[error("a region of {0} bytes does not fit in this host's address space")]
    TooLarge(u64),
    /// The backend actor is not running (stopped or crashed).
    #[error("transport backend is not running")]
    BackendStopped,
    /// The backend already holds a region with this id: registering the
    /// same region twice is a caller bug.
    #[error("region id {0} is already registered with this backend")]
    IdInUse(crate::RegionId),
    /// The backend refused the memory (for ibverbs, `ibv_reg_mr` failed,
    /// e.g. over the locked-memory limit); the text says why.
    #[error("backend could not register the memory: {0}")]
    Backend(String),
    /// The node was shut down (`Node::shutdown`): it registers nothing
    /// any more.
    #[error("the node was shut down: it registers no memory")]
    ShutDown,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids read as numbers, and a handle newer than its slot reads as the
    /// forgery it is, not as a deregistered region.
    #[test]
    fn stale_generation_tells_old_handles_from_forged_ones() {
        let old = OpError::StaleGeneration {
            handle: Generation(1),
            current: Generation(2),
        };
        assert_eq!(
            old.to_string(),
            "remote region was deregistered (the handle is of generation 1; \
             its slot now holds generation 2)"
        );
        let future = OpError::StaleGeneration {
            handle: Generation(2),
            current: Generation(1),
        };
        assert_eq!(
            future.to_string(),
            "forged or wrong handle: it names generation 2 of a slot \
             whose newest region is generation 1"
        );
        assert_eq!(
            RegisterError::IdInUse(crate::RegionId(7)).to_string(),
            "region id 7 is already registered with this backend"
        );
    }

    /// A lost ibverbs connection names the rail pairs that failed; one
    /// with none reads, and serializes, as it always did, so a peer built
    /// before rails decodes it.
    #[test]
    fn connection_lost_names_its_rails_only_when_it_has_some() {
        let endpoint: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let plain = OpError::connection_lost(endpoint);
        assert_eq!(
            plain.to_string(),
            "connection to 10.0.0.1:7000 lost before the op completed"
        );
        let json = serde_json::to_string(&plain).unwrap();
        assert_eq!(json, r#"{"ConnectionLost":{"endpoint":"10.0.0.1:7000"}}"#);
        assert_eq!(serde_json::from_str::<OpError>(&json).unwrap(), plain);

        let railed = OpError::ConnectionLost {
            endpoint,
            rails: vec!["mlx5_0:1 -> rail 0".into(), "mlx5_1:1 -> rail 1".into()],
        };
        assert_eq!(
            railed.to_string(),
            "connection to 10.0.0.1:7000 lost before the op completed \
             (every rail pair failed: mlx5_0:1 -> rail 0, mlx5_1:1 -> rail 1)"
        );
        let json = serde_json::to_string(&railed).unwrap();
        assert_eq!(serde_json::from_str::<OpError>(&json).unwrap(), railed);
    }
}
