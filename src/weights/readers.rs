//! The readers' side of a subscriber's fence: which buffer holds the
//! newest complete version, and who reads it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The readers' side of a [`Subscriber`](super::Subscriber)'s fence: cheap to clone, for the
/// tasks that read the weights. [`Readers::read`] holds the buffer that
/// holds the newest complete version for as long as its guard lives, and
/// an update never writes a buffer a reader holds: it waits for it. With
/// two buffers readers hold the older one while the newer fills; with one,
/// readers and updates take turns.
#[derive(Clone)]
pub struct Readers {
    pub(super) locks: Arc<[Arc<tokio::sync::RwLock<()>>]>,
    pub(super) active: Arc<AtomicUsize>,
    /// The version each buffer holds whole ([`NO_VERSION`]: none, before
    /// the first update, or after one that failed while writing it).
    pub(super) versions: Arc<[AtomicU64]>,
    /// Woken when an update completes.
    pub(super) updated: Arc<tokio::sync::Notify>,
}

/// A buffer's version when it holds no version whole.
pub(super) const NO_VERSION: u64 = u64::MAX;

/// A buffer held for reading ([`Readers::read`]): it holds one complete
/// version until this drops.
pub struct ReadGuard {
    buffer: usize,
    version: u64,
    _held: tokio::sync::OwnedRwLockReadGuard<()>,
}

impl ReadGuard {
    /// The buffer held (its index in [`Subscriber::buffers`](super::Subscriber::buffers)).
    pub fn buffer(&self) -> usize {
        self.buffer
    }

    /// The version it holds.
    pub fn version(&self) -> u64 {
        self.version
    }
}

impl Readers {
    /// Holds the buffer that holds the newest complete version. Waits for
    /// an update under way that writes the only buffer, and for a
    /// complete version: before the first update, and, with one buffer,
    /// after an update that failed once it had begun writing (what the
    /// buffer holds then is no version). Bound it with a timeout where
    /// the updates may stop.
    pub async fn read(&self) -> ReadGuard {
        loop {
            // Listening before looking: an update that completes after
            // the look wakes this.
            let updated = self.updated.notified();
            tokio::pin!(updated);
            updated.as_mut().enable();
            let buffer = self.active.load(Ordering::Acquire);
            let held = self.locks[buffer].clone().read_owned().await;
            // Swapped while it waited: take the newer one.
            if self.active.load(Ordering::Acquire) != buffer && self.locks.len() > 1 {
                continue;
            }
            let version = self.versions[buffer].load(Ordering::Acquire);
            if version != NO_VERSION {
                return ReadGuard {
                    buffer,
                    version,
                    _held: held,
                };
            }
            drop(held);
            updated.await;
        }
    }
}
