//! Weight publication: versioned tensor sets from publisher ranks (a
//! trainer's) to subscribers (inference processes), planned once per
//! subscriber and replayed every version, behind a fence.
//!
//! A set is a name. Each publisher rank declares its tensors' layout over
//! its memory and publishes it under the set's name ([`Publisher`]); it
//! says when its memory holds version `v` ([`WriteGuard::publish`]), and
//! the set's version `v` is ready once every rank says so. A subscriber
//! declares its own layout for the same tensors (another sharding; the
//! same element sizes), plans once against every rank's published layout,
//! and [`Subscriber::update`] pulls the newest complete version through
//! that plan: no planning, registering or metadata exchange per version.
//!
//! The fence, both ways:
//! - a subscriber never observes a mix of versions: its readers hold the
//!   buffer they read ([`Readers::read`]), and an update never writes a
//!   buffer a reader holds. With two buffers ([`Subscriber::new`] given two
//!   local layouts) an update fills the one readers are not using and then
//!   swaps; with one, it writes in place once the readers let go, and they
//!   wait for it;
//! - a publisher never overwrites version `v` while a subscriber reads it:
//!   readers hold a lease per rank while they pull; [`Publisher::write`]
//!   waits for the leases to end, up to its timeout, and past it takes the
//!   memory anyway, and the readers it overran fail their update with
//!   [`WeightsError::Overwritten`] and try again from the next version. A
//!   lease also ends when its reader's session does (a reader killed
//!   mid-update holds nobody up).
//!
//! Pulled, not pushed: a subscriber knows when it can take a version (its
//! readers paused, its second buffer free), joins late or falls behind
//! without the publishers tracking it, and gets the newest version, never
//! every one in between. The publishers serve leases and bytes; they keep
//! no per-subscriber state past a lease.

mod checksum;
mod leases;
mod publisher;
mod readers;
mod relay;
mod subscriber;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use publisher::{Publisher, WriteGuard};
pub use readers::{ReadGuard, Readers};
pub use subscriber::{Subscriber, Update};

use crate::{PlanError, XferError};

/// Why a publisher or subscriber call failed. Nothing half-done is left:
/// a failed update leaves the subscriber on its last complete version.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// No version is complete yet (some rank has published none, or the
    /// ranks' newest versions differ and no common one is left).
    #[error("no version of the set is complete on every publisher rank yet")]
    NoCompleteVersion,
    /// A publisher rank overwrote the version while this subscriber read
    /// it: nothing of the update counts; update again (from the next
    /// version).
    #[error("publisher rank {rank} overwrote version {version} while it was read")]
    Overwritten {
        /// The rank.
        rank: u32,
        /// The version read.
        version: u64,
    },
    /// A publisher rank could not be reached, or its node is not the one
    /// the subscriber planned against (restarted): make the subscriber
    /// again, which plans again.
    #[error("publisher rank {rank} is gone: {reason}")]
    PublisherLost {
        /// The rank.
        rank: u32,
        /// What was seen.
        reason: String,
    },
    /// Checksums were asked for ([`Subscriber::verify_checksums`]) and
    /// the bytes of `tensor` this subscriber holds from publisher rank
    /// `rank` (a relay: 0) are not those the rank held under the lease:
    /// the update counts for nothing, as if the rank had overwritten them.
    #[error("version {version} of tensor {tensor:?} from rank {rank} does not match its checksum")]
    ChecksumMismatch {
        /// The tensor.
        tensor: String,
        /// The rank.
        rank: u32,
        /// The version read.
        version: u64,
    },
    /// Readers held the buffer an update had to write until its deadline.
    #[error("readers held buffer {buffer} until the update's deadline")]
    ReadersHold {
        /// The buffer.
        buffer: usize,
    },
    /// A version number that does not grow.
    #[error("version {version} does not follow {last}")]
    VersionNotNewer {
        /// The version given.
        version: u64,
        /// The last one published.
        last: u64,
    },
    /// The layouts do not plan (see [`PlanError`]).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The bytes did not move (see [`XferError`]).
    #[error(transparent)]
    Xfer(#[from] XferError),
    /// A publisher answered with something this node cannot read.
    #[error("a publisher answered: {0}")]
    Protocol(String),
    /// The node was shut down.
    #[error("the node was shut down")]
    ShutDown,
}

/// The RPC handler a publisher rank serves for set `set`.
fn handler_name(set: &str) -> String {
    format!("ferry.weights:{set}")
}

/// The RPC handler a subscriber serves when it relays set `set` to other
/// subscribers (see [`Subscriber::serve_relay`]).
fn relay_handler_name(set: &str) -> String {
    format!("ferry.weights-relay:{set}")
}

/// The name a relaying subscriber publishes its buffer `buffer`'s layout
/// under.
fn relay_layout_name(set: &str, buffer: usize) -> String {
    format!("{set}#relay{buffer}")
}

/// What a subscriber asks a publisher rank (or a relay).
#[derive(Debug, Serialize, Deserialize)]
enum Ask {
    /// Which version its memory holds, if any.
    State,
    /// Which version its memory holds, answered once it holds `version`
    /// or a newer one, or after `wait_ms` (at most [`AWAIT_LIMIT`]): a
    /// subscriber waiting for a version asks once instead of polling.
    Await { version: u64, wait_ms: u64 },
    /// A lease on `version` for reading; refused if the rank holds another
    /// version or is being written.
    Lease { version: u64 },
    /// The lease ends; the answer says whether the version stayed intact.
    Release { lease: u64 },
    /// The checksums of these boxes of the leased memory (refused if the
    /// lease is not held intact).
    Checksums {
        lease: u64,
        boxes: Vec<checksum::TensorBox>,
    },
}

/// A publisher rank's answers.
#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    State {
        rank: u32,
        version: Option<u64>,
    },
    Leased {
        lease: u64,
        /// The buffer leased, of a relay's (a publisher rank has one,
        /// and leaves it out).
        #[serde(default, skip_serializing_if = "is_zero")]
        buffer: usize,
    },
    /// Not now: the rank holds `version` (or none), or is being written.
    Refused {
        version: Option<u64>,
        writing: bool,
    },
    Released {
        intact: bool,
    },
    /// One per box asked, in order.
    Checksums {
        sums: Vec<u64>,
    },
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The longest an [`Ask::Await`] waits on the serving side: a caller that
/// waits longer asks again.
const AWAIT_LIMIT: Duration = Duration::from_secs(10);

/// How long one lease may last at most: a reader that neither finishes nor
/// goes away (a stopped process) holds a writer up no longer than the
/// writer's own timeout anyway; this bounds the lease table.
const LEASE_LIMIT: Duration = Duration::from_secs(600);
