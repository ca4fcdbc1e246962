//! A publisher rank: its layout published under the set's name, the
//! version its memory holds, and the leases of the subscribers reading it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::leases::{Shared, wait_for, watch_reader};
use super::{Answer, Ask, WeightsError, checksum, handler_name};
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
        let state = Arc::new(Shared::new(local.layout().rank));
        let shared = state.clone();
        let memory = Arc::new(checksum::Served::new(local.clone()));
        let endpoint = node.0.router.endpoint.clone();
        let served = node.serve_rpc(&handler_name(set), move |request| {
            let ask: Result<Ask, _> = serde_json::from_slice(&request.body);
            let (shared, endpoint, from) = (shared.clone(), endpoint.clone(), request.from);
            let memory = memory.clone();
            async move {
                let ask = ask.map_err(|e| format!("not a weights request: {e}"))?;
                let answer = match ask {
                    Ask::Checksums { lease, boxes } => memory.answer(&shared, lease, boxes).await?,
                    Ask::Await { version, wait_ms } => {
                        let wait = Duration::from_millis(wait_ms);
                        let held = || shared.version();
                        let version = wait_for(shared.published(), held, version, wait).await;
                        Answer::State {
                            rank: shared.rank,
                            version,
                        }
                    }
                    ask => {
                        let (answer, lease) = shared.answer(ask);
                        if let Some((lease, ended)) = lease {
                            watch_reader(&shared, &endpoint, from, lease, ended);
                        }
                        answer
                    }
                };
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
        self.state.version()
    }

    /// How many subscribers hold a lease on the rank's version now (are
    /// reading it): what a [`Publisher::write`] would wait for.
    pub fn readers(&self) -> usize {
        self.state.live_leases()
    }

    /// Takes the rank's memory for writing the next version: new leases
    /// are refused from now on, and this waits, up to `timeout`, for the
    /// readers of the current version to finish. Past `timeout` it takes
    /// the memory anyway: the readers it overran fail their update
    /// ([`WeightsError::Overwritten`]) and try the next version. Returns
    /// the guard, and how many readers were overrun.
    pub async fn write(&self, timeout: Duration) -> (WriteGuard<'_>, usize) {
        let guard = WriteGuard {
            publisher: self,
            published: false,
        };
        let overrun = self.state.take(Instant::now() + timeout, &self.set).await;
        (guard, overrun)
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
        self.publisher.state.publish(version)?;
        self.published = true;
        Ok(())
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if !self.published {
            self.publisher.state.abandon();
        }
    }
}
