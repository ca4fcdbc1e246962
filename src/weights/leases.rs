//! One buffer's version and the leases of the readers pulling it: what a
//! publisher rank serves, and what a relaying subscriber serves for each
//! of its buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::NodeAddr;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{AWAIT_LIMIT, Answer, Ask, LEASE_LIMIT, WeightsError};

/// A buffer served to readers: the version it holds and their leases.
pub(super) struct Shared {
    /// The rank (a publisher's), or the buffer (a relay's), named in
    /// answers and logs.
    pub(super) rank: u32,
    inner: Mutex<State>,
    /// Woken when a lease ends.
    released: Notify,
    /// Woken when a version is published (shared by a relay's buffers).
    published: Arc<Notify>,
}

#[derive(Default)]
struct State {
    /// The version the memory holds, once published.
    version: Option<u64>,
    /// The last version published (versions only grow).
    last: Option<u64>,
    /// Set while the memory is written: no lease is granted.
    writing: bool,
    leases: HashMap<u64, Lease>,
    next_lease: u64,
}

struct Lease {
    granted: Instant,
    /// Cancelled when the lease ends, which ends its watcher.
    ended: CancellationToken,
    /// Cleared when a writer overran the lease: its reader's bytes are
    /// not the version it leased.
    intact: bool,
}

impl Shared {
    pub(super) fn new(rank: u32) -> Shared {
        Shared::waking(rank, Arc::default())
    }

    /// A buffer whose publications wake `published`'s waiters: a relay's
    /// buffers share one, so that a wait for a version watches them all.
    pub(super) fn waking(rank: u32, published: Arc<Notify>) -> Shared {
        Shared {
            rank,
            inner: Mutex::default(),
            released: Notify::new(),
            published,
        }
    }

    /// What wakes when this buffer publishes a version.
    pub(super) fn published(&self) -> &Notify {
        &self.published
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The version the memory holds, if any (none while it is written).
    pub(super) fn version(&self) -> Option<u64> {
        let state = self.state();
        state.version.filter(|_| !state.writing)
    }

    /// Answers a reader's `ask`; a lease granted comes back with the token
    /// that ends it, for [`watch_reader`].
    pub(super) fn answer(&self, ask: Ask) -> (Answer, Option<(u64, CancellationToken)>) {
        let mut state = self.state();
        match ask {
            // An await is answered by its server (`wait_for`); one that
            // reaches here is answered now.
            Ask::State | Ask::Await { .. } => (
                Answer::State {
                    rank: self.rank,
                    version: state.version,
                },
                None,
            ),
            Ask::Lease { version } => {
                if state.writing || state.version != Some(version) {
                    let refused = Answer::Refused {
                        version: state.version,
                        writing: state.writing,
                    };
                    return (refused, None);
                }
                state.next_lease += 1;
                let lease = state.next_lease;
                let ended = CancellationToken::new();
                state.leases.insert(
                    lease,
                    Lease {
                        granted: Instant::now(),
                        ended: ended.clone(),
                        intact: true,
                    },
                );
                let leased = Answer::Leased { lease, buffer: 0 };
                (leased, Some((lease, ended)))
            }
            // Answered with the memory by its server (`checksum::Served::answer`).
            Ask::Checksums { .. } => (
                Answer::Refused {
                    version: state.version,
                    writing: state.writing,
                },
                None,
            ),
            Ask::Release { lease } => {
                let intact = state.leases.remove(&lease).is_some_and(|l| {
                    l.ended.cancel();
                    l.intact
                });
                drop(state);
                self.released.notify_waiters();
                (Answer::Released { intact }, None)
            }
        }
    }

    /// The version `lease` holds, if it holds the memory: granted, not
    /// ended, not overrun.
    pub(super) fn holds(&self, lease: u64) -> Option<u64> {
        let state = self.state();
        let intact = state.leases.get(&lease).is_some_and(|l| l.intact);
        state.version.filter(|_| intact)
    }

    /// Ends `lease` (its reader's session ended) if it is still held.
    fn drop_lease(&self, lease: u64) {
        if let Some(lease) = self.state().leases.remove(&lease) {
            lease.ended.cancel();
            self.released.notify_waiters();
        }
    }

    /// Leases that still hold the memory (granted within the limit).
    pub(super) fn live_leases(&self) -> usize {
        let state = self.state();
        let now = Instant::now();
        (state.leases.values())
            .filter(|l| l.intact && now.duration_since(l.granted) < LEASE_LIMIT)
            .count()
    }

    /// Takes the memory for writing: new leases are refused from now on,
    /// and this waits until `deadline` for the readers that hold it; past
    /// it, it takes it from them (their leases stop being intact: their
    /// reads fail [`WeightsError::Overwritten`]). Returns how many readers
    /// were overrun. `what` names the memory in the warning an overrun logs.
    pub(super) async fn take(&self, deadline: Instant, what: &str) -> usize {
        self.state().writing = true;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(overrun) = self.take_now(Instant::now() >= deadline, what) {
                return overrun;
            }
            let _ = tokio::time::timeout_at(deadline, released).await;
        }
    }

    /// Takes the memory from its readers: when none holds it, or, with
    /// `overrun`, from those that do. `None` if readers hold it still.
    fn take_now(&self, overrun: bool, what: &str) -> Option<usize> {
        if self.live_leases() == 0 {
            self.state().version = None;
            return Some(0);
        }
        if !overrun {
            return None;
        }
        let mut state = self.state();
        let mut overran = 0;
        for lease in state.leases.values_mut().filter(|l| l.intact) {
            lease.intact = false;
            overran += 1;
        }
        state.version = None;
        tracing::warn!(
            memory = what,
            rank = self.rank,
            overrun = overran,
            "weights were written while readers pulled them: their updates fail"
        );
        Some(overran)
    }

    /// The memory now holds `version`, newer than every one before: readers
    /// may lease it.
    pub(super) fn publish(&self, version: u64) -> Result<(), WeightsError> {
        let mut state = self.state();
        if let Some(last) = state.last
            && version <= last
        {
            return Err(WeightsError::VersionNotNewer { version, last });
        }
        state.version = Some(version);
        state.last = Some(version);
        state.writing = false;
        drop(state);
        self.published.notify_waiters();
        Ok(())
    }

    /// The write was given up: the memory holds no version.
    pub(super) fn abandon(&self) {
        let mut state = self.state();
        state.writing = false;
        state.version = None;
    }
}

/// The version `newest` says is held, once it is `version` or newer, or
/// when `wait` (at most [`AWAIT_LIMIT`]) has passed: the answer to an
/// [`Ask::Await`]. `published` wakes the wait when a version is published.
pub(super) async fn wait_for(
    published: &Notify,
    newest: impl Fn() -> Option<u64>,
    version: u64,
    wait: Duration,
) -> Option<u64> {
    let deadline = Instant::now() + wait.min(AWAIT_LIMIT);
    loop {
        let woken = published.notified();
        tokio::pin!(woken);
        // Enabled before the look, so that a publication between the look
        // and the wait is not missed.
        woken.as_mut().enable();
        let held = newest();
        if held.is_some_and(|v| v >= version) {
            return held;
        }
        if tokio::time::timeout_at(deadline, woken).await.is_err() {
            return newest();
        }
    }
}

/// Ends `lease` when the reader's session goes: a reader killed
/// mid-update holds no writer up. The watch itself ends with the lease.
pub(super) fn watch_reader(
    shared: &Arc<Shared>,
    endpoint: &ferry_control::Endpoint,
    reader: NodeAddr,
    lease: u64,
    ended: CancellationToken,
) {
    let (shared, endpoint) = (Arc::downgrade(shared), endpoint.clone());
    tokio::spawn(async move {
        let gone = async {
            if let Ok(session) = endpoint.session(reader, Duration::from_secs(10)).await {
                session.closed().await;
            }
        };
        tokio::select! {
            () = ended.cancelled() => return,
            () = gone => {}
        }
        if let Some(shared) = shared.upgrade() {
            shared.drop_lease(lease);
        }
    });
}
