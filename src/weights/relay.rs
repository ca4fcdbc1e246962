//! A subscriber's buffers served on to subscribers of the same layout, so
//! that the publishers' links carry each version once, not once per
//! subscriber (see [`super::Subscriber::serve_relay`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;

use super::leases::{Shared, wait_for, watch_reader};
use super::{Answer, Ask, WeightsError, checksum, relay_handler_name, relay_layout_name};
use crate::{LocalLayout, Node};

/// What a relaying subscriber serves: each buffer's layout, published, and
/// its version and leases. Dropping it stops serving.
pub(super) struct Relay {
    node: Node,
    set: String,
    /// One per buffer of the subscriber's.
    pub(super) buffers: Arc<[Arc<Shared>]>,
}

impl Relay {
    /// Publishes `buffers`' layouts (as [`relay_layout_name`]) and answers
    /// downstream subscribers: a relay holds the newest version of its
    /// buffers that is whole, and leases the buffer that holds it.
    pub(super) fn start(
        node: &Node,
        set: &str,
        buffers: &[LocalLayout],
    ) -> Result<Relay, WeightsError> {
        let unpublish = |n: usize| {
            (0..n).for_each(|b| {
                node.unpublish_layout(&relay_layout_name(set, b));
            })
        };
        for (b, buffer) in buffers.iter().enumerate() {
            if let Err(e) = node.publish_layout(&relay_layout_name(set, b), buffer) {
                unpublish(b);
                return Err(WeightsError::Protocol(e.to_string()));
            }
        }
        let published = Arc::new(Notify::new());
        let shared: Arc<[Arc<Shared>]> = (0..buffers.len())
            .map(|b| Arc::new(Shared::waking(b as u32, published.clone())))
            .collect();
        let served = shared.clone();
        let memory: Arc<[Arc<checksum::Served>]> = (buffers.iter())
            .map(|b| Arc::new(checksum::Served::new(b.clone())))
            .collect();
        let endpoint = node.0.router.endpoint.clone();
        let serving = node.serve_rpc(&relay_handler_name(set), move |request| {
            let ask: Result<Ask, _> = serde_json::from_slice(&request.body);
            let (shared, endpoint, from) = (served.clone(), endpoint.clone(), request.from);
            let (memory, published) = (memory.clone(), published.clone());
            async move {
                let ask = ask.map_err(|e| format!("not a weights request: {e}"))?;
                let answer = match ask {
                    // The lease's buffer is in its low bit, as in `answer`.
                    Ask::Checksums { lease, boxes } => {
                        let b = (lease & 1) as usize;
                        let (Some(buffer), Some(memory)) = (shared.get(b), memory.get(b)) else {
                            return Err(format!("no buffer {b}"));
                        };
                        memory.answer(buffer, lease >> 1, boxes).await?
                    }
                    Ask::Await { version, wait_ms } => {
                        let wait = Duration::from_millis(wait_ms);
                        let newest = || newest(&shared);
                        let version = wait_for(&published, newest, version, wait).await;
                        Answer::State { rank: 0, version }
                    }
                    ask => answer(&shared, ask, |b, lease, ended| {
                        watch_reader(&shared[b], &endpoint, from, lease, ended)
                    }),
                };
                serde_json::to_vec(&answer)
                    .map(Bytes::from)
                    .map_err(|e| e.to_string())
            }
        });
        if let Err(e) = serving {
            unpublish(buffers.len());
            return Err(WeightsError::Protocol(e.to_string()));
        }
        Ok(Relay {
            node: node.clone(),
            set: set.to_string(),
            buffers: shared,
        })
    }
}

/// A relay's answer to `ask` over its `buffers`. Lease ids carry their
/// buffer in the low bit (a subscriber has one buffer or two); `watch`
/// gets each lease granted (buffer, the buffer's own id, its end).
fn answer(
    buffers: &[Arc<Shared>],
    ask: Ask,
    watch: impl FnOnce(usize, u64, tokio_util::sync::CancellationToken),
) -> Answer {
    let newest = || newest(buffers);
    match ask {
        // An await is answered by the handler (`wait_for`); one that
        // reaches here is answered now.
        Ask::State | Ask::Await { .. } => Answer::State {
            rank: 0,
            version: newest(),
        },
        Ask::Lease { version } => {
            let Some(b) = buffers.iter().position(|b| b.version() == Some(version)) else {
                return Answer::Refused {
                    version: newest(),
                    writing: false,
                };
            };
            match buffers[b].answer(Ask::Lease { version }) {
                (Answer::Leased { lease, .. }, Some((_, ended))) => {
                    watch(b, lease, ended);
                    Answer::Leased {
                        lease: lease << 1 | b as u64,
                        buffer: b,
                    }
                }
                (other, _) => other,
            }
        }
        // Served with the memory by the handler (`checksum::Served::answer`).
        Ask::Checksums { .. } => Answer::Refused {
            version: newest(),
            writing: false,
        },
        Ask::Release { lease } => match buffers.get((lease & 1) as usize) {
            Some(buffer) => buffer.answer(Ask::Release { lease: lease >> 1 }).0,
            None => Answer::Released { intact: false },
        },
    }
}

/// The newest version whole in one of a relay's `buffers`.
fn newest(buffers: &[Arc<Shared>]) -> Option<u64> {
    buffers.iter().filter_map(|b| b.version()).max()
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.node.unserve_rpc(&relay_handler_name(&self.set));
        for b in 0..self.buffers.len() {
            self.node.unpublish_layout(&relay_layout_name(&self.set, b));
        }
    }
}
