//! A publisher rank: its layout published under the set's name, the
//! version its memory holds, and the leases of the subscribers reading it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::NodeAddr;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Answer, Ask, LEASE_LIMIT, WeightsError, handler_name};
use crate::{LocalLayout, Node};

/// One publisher rank of a weight set (see [`crate::weights`]). Dropping
/// it stops serving the set and withdraws its published layout.
pub struct Publisher {
    node: Node,
    set: String,
    state: Arc<Shared>,
    /// Keeps the layout's regions registered and published.
    _local: LocalLayout,
}

struct Shared {
    rank: u32,
    inner: Mutex<State>,
    /// Woken when a lease ends.
    released: Notify,
}

#[derive(Default)]
struct State {
    /// The version the rank's memory holds, once published.
    version: Option<u64>,
    /// The last version published (versions only grow).
    last: Option<u64>,
    /// Set while the caller writes the memory: no lease is granted.
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
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn answer(&self, ask: Ask) -> (Answer, Option<(u64, CancellationToken)>) {
        let mut state = self.state();
        match ask {
            Ask::State => (
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
                (Answer::Leased { lease }, Some((lease, ended)))
            }
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

    /// Ends `lease` (its reader's session ended) if it is still held.
    fn drop_lease(&self, lease: u64) {
        if let Some(lease) = self.state().leases.remove(&lease) {
            lease.ended.cancel();
            self.released.notify_waiters();
        }
    }

    /// Leases that still hold the memory (granted within the limit).
    fn live_leases(&self, state: &State) -> usize {
        let now = Instant::now();
        (state.leases.values())
            .filter(|l| l.intact && now.duration_since(l.granted) < LEASE_LIMIT)
            .count()
    }
}

/// The memory of a [`Publisher`] rank, taken for writing: no reader holds
/// it while this lives. [`WriteGuard::publish`] says it holds a version;
/// dropping the guard without publishing leaves the rank with no version.
pub struct WriteGuard<'a> {
    publisher: &'a Publisher,
    published: bool,
}

impl Publisher {
    /// Rank `local.layout().rank` of the weight set `set`, over `local`'s
    /// memory: publishes the layout under `set` (and its regions, see
    /// [`Node::publish_layout`]) and starts answering subscribers. The
    /// memory holds no version until [`WriteGuard::publish`].
    pub fn start(node: &Node, set: &str, local: LocalLayout) -> Result<Publisher, WeightsError> {
        node.publish_layout(set, &local)
            .map_err(|e| WeightsError::Protocol(e.to_string()))?;
        let state = Arc::new(Shared {
            rank: local.layout().rank,
            inner: Mutex::default(),
            released: Notify::new(),
        });
        let shared = state.clone();
        let endpoint = node.0.router.endpoint.clone();
        let served = node.serve_rpc(&handler_name(set), move |request| {
            let ask: Result<Ask, _> = serde_json::from_slice(&request.body);
            let (shared, endpoint, from) = (shared.clone(), endpoint.clone(), request.from);
            async move {
                let ask = ask.map_err(|e| format!("not a weights request: {e}"))?;
                let (answer, lease) = shared.answer(ask);
                if let Some((lease, ended)) = lease {
                    watch_reader(&shared, &endpoint, from, lease, ended);
                }
                serde_json::to_vec(&answer)
                    .map(Bytes::from)
                    .map_err(|e| e.to_string())
            }
        });
        if let Err(e) = served {
            node.unpublish_layout(set);
            return Err(WeightsError::Protocol(e.to_string()));
        }
        Ok(Publisher {
            node: node.clone(),
            set: set.to_string(),
            state,
            _local: local,
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.state.rank
    }

    /// The version the rank's memory holds, if any.
    pub fn version(&self) -> Option<u64> {
        self.state.state().version
    }

    /// How many subscribers hold a lease on the rank's version now (are
    /// reading it): what a [`Publisher::write`] would wait for.
    pub fn readers(&self) -> usize {
        self.state.live_leases(&self.state.state())
    }

    /// Takes the rank's memory for writing the next version: new leases
    /// are refused from now on, and this waits, up to `timeout`, for the
    /// readers of the current version to finish. Past `timeout` it takes
    /// the memory anyway: the readers it overran fail their update
    /// ([`WeightsError::Overwritten`]) and try the next version. Returns
    /// the guard, and how many readers were overrun.
    pub async fn write(&self, timeout: Duration) -> (WriteGuard<'_>, usize) {
        let deadline = Instant::now() + timeout;
        let shared = &self.state;
        shared.state().writing = true;
        let guard = WriteGuard {
            publisher: self,
            published: false,
        };
        loop {
            let released = shared.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(overrun) = self.take_memory(Instant::now() >= deadline) {
                return (guard, overrun);
            }
            let _ = tokio::time::timeout_at(deadline, released).await;
        }
    }

    /// Takes the memory from its readers: when none holds it, or, with
    /// `overrun`, from those that do (their leases stop being intact).
    /// Returns how many were overrun; `None` if readers hold it still.
    fn take_memory(&self, overrun: bool) -> Option<usize> {
        let shared = &self.state;
        let mut state = shared.state();
        if shared.live_leases(&state) == 0 {
            state.version = None;
            return Some(0);
        }
        if !overrun {
            return None;
        }
        let mut overran = 0;
        for lease in state.leases.values_mut().filter(|l| l.intact) {
            lease.intact = false;
            overran += 1;
        }
        state.version = None;
        tracing::warn!(set = %self.set, rank = shared.rank, overrun = overran,
            "a weight set's rank was written while subscribers read it: their updates fail");
        Some(overran)
    }
}

impl Drop for Publisher {
    /// Stops serving the set and withdraws its layout: the node may start
    /// another publisher of the set (a trainer that restarts a rank in
    /// place), and subscribers made from now on do not plan against this
    /// one.
    fn drop(&mut self) {
        self.node.unserve_rpc(&handler_name(&self.set));
        self.node.unpublish_layout(&self.set);
    }
}

impl WriteGuard<'_> {
    /// The memory now holds version `version`, which must be newer than
    /// every version this rank published before: readers may lease it.
    pub fn publish(mut self, version: u64) -> Result<(), WeightsError> {
        let mut state = self.publisher.state.state();
        if let Some(last) = state.last
            && version <= last
        {
            return Err(WeightsError::VersionNotNewer { version, last });
        }
        state.version = Some(version);
        state.last = Some(version);
        state.writing = false;
        self.published = true;
        Ok(())
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if !self.published {
            let mut state = self.publisher.state.state();
            state.writing = false;
            state.version = None;
        }
    }
}

/// Ends `lease` when the reader's session goes: a reader killed
/// mid-update holds no writer up. The watch itself ends with the lease.
fn watch_reader(
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
