//! Both sides learn how a request ended. A KV hand-off frees the prefill
//! side's blocks only once the decode side is done with them; elsewhere a
//! reader that died left the owner waiting for a timeout of minutes. Here a
//! reader tags its request ([`Xfer::with_outcome`]), and when the request
//! settles it tells every owner whose memory it named how it ended
//! (`Service::OUTCOME`, a tell on its control session, after the bytes:
//! the request is done by then). The owner waits for that by the reader
//! and the tag ([`Node::wait_outcome`]), and gets exactly one answer:
//! completed, failed or cancelled by the reader, or the reader lost (the
//! owner's own session to it ended, or could not be opened), promptly,
//! not at the deadline.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use ferry_control::{Endpoint, Service, ServiceError};
use ferry_core::{NodeAddr, NodeId};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::Node;
use crate::xfer::XferError;

/// How a reader's request ended, as the reader told the owner.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Every op completed (a READ has its bytes; a WRITE's are in place).
    Completed,
    /// It failed: why, as the reader saw it.
    Failed {
        /// The reader's error, as text.
        reason: String,
    },
    /// The reader cancelled it (or dropped it in flight).
    Cancelled,
}

/// Why [`Node::wait_outcome`] has no outcome to give.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutcomeError {
    /// The reader is gone: this node's control session to it ended, or
    /// could not be opened, before it said how its request ended.
    #[error("the reader {reader} is gone: {reason}")]
    ReaderLost {
        /// The reader.
        reader: NodeAddr,
        /// What was seen.
        reason: String,
    },
    /// Nothing came by the deadline.
    #[error("no outcome from {reader} within {after:?}")]
    Timeout {
        /// The reader.
        reader: NodeAddr,
        /// The time waited.
        after: Duration,
    },
    /// Another caller waits for the same reader and tag.
    #[error("an outcome of {reader}'s request {tag} is already awaited")]
    AlreadyAwaited {
        /// The reader.
        reader: NodeAddr,
        /// The tag.
        tag: u64,
    },
    /// The node was shut down.
    #[error("the node was shut down")]
    ShutDown,
}

/// Outcomes that came before anyone waited for them, kept at most this
/// many (the oldest go first, counted in `ferry_outcomes_dropped_total`).
pub const KEPT_OUTCOMES: usize = 65_536;

/// How long after its session to the reader ended the owner still takes
/// the reader's outcome, which travels on the reader's own session and may
/// be read a moment after: a reader that told, then exited at once.
const LATE_OUTCOME: Duration = Duration::from_millis(200);

/// The owner's side: outcomes come in, waiters wait.
#[derive(Default)]
pub(crate) struct Outcomes {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    waiting: HashMap<(NodeId, u64), oneshot::Sender<Outcome>>,
    arrived: HashMap<(NodeId, u64), Outcome>,
    /// `arrived`'s keys, oldest first, for its bound.
    order: VecDeque<(NodeId, u64)>,
}

impl Outcomes {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An outcome from node `from` (its authenticated id) for `tag`.
    fn arrived(&self, from: NodeId, tag: u64, outcome: Outcome) {
        let mut state = self.state();
        let key = (from, tag);
        if let Some(waiter) = state.waiting.remove(&key) {
            // A waiter that gave up meanwhile: the outcome goes unheard.
            drop(waiter.send(outcome));
            return;
        }
        if state.arrived.insert(key, outcome).is_none() {
            state.order.push_back(key);
        }
        while state.arrived.len() > KEPT_OUTCOMES {
            let Some(oldest) = state.order.pop_front() else {
                break;
            };
            if state.arrived.remove(&oldest).is_some() {
                metrics::counter!("ferry_outcomes_dropped_total").increment(1);
            }
        }
    }

    /// Serves outcomes on `endpoint`.
    pub(crate) fn serve(self: &std::sync::Arc<Self>, endpoint: &Endpoint) {
        let outcomes = self.clone();
        // The service is the node's own: taken once, at spawn.
        let _ = endpoint.serve(Service::OUTCOME, move |request| {
            let answer = decode(&request.body)
                .map(|(tag, outcome)| {
                    outcomes.arrived(request.session.peer().id, tag, outcome);
                    Bytes::new()
                })
                .ok_or_else(|| ServiceError("malformed outcome".into()));
            async move { answer }
        });
    }
}

/// An outcome on the wire: the tag, a kind byte, and the failure's text.
fn encode(tag: u64, outcome: &Outcome) -> Bytes {
    let mut out = BytesMut::with_capacity(9);
    out.put_u64_le(tag);
    match outcome {
        Outcome::Completed => out.put_u8(0),
        Outcome::Failed { reason } => {
            out.put_u8(1);
            out.put_slice(&reason.as_bytes()[..reason.len().min(4096)]);
        }
        Outcome::Cancelled => out.put_u8(2),
    }
    out.freeze()
}

fn decode(body: &[u8]) -> Option<(u64, Outcome)> {
    let (tag, rest) = body.split_first_chunk::<8>()?;
    let (&kind, rest) = rest.split_first()?;
    let outcome = match kind {
        0 => Outcome::Completed,
        1 => Outcome::Failed {
            reason: String::from_utf8_lossy(rest).into_owned(),
        },
        2 => Outcome::Cancelled,
        _ => return None,
    };
    Some((u64::from_le_bytes(*tag), outcome))
}

/// The outcome a settled request reports.
pub(crate) fn of(result: &Result<(), XferError>) -> Outcome {
    match result {
        Ok(()) => Outcome::Completed,
        Err(XferError::Cancelled { .. }) => Outcome::Cancelled,
        Err(e) => Outcome::Failed {
            reason: e.to_string(),
        },
    }
}

/// Tells each of `owners` that the request tagged `tag` ended as
/// `outcome`, within `timeout` each, in the background: a request's
/// settling never waits for it. An owner that cannot be told is logged.
pub(crate) fn tell(
    router: &std::sync::Arc<crate::router::Router>,
    owners: Vec<NodeAddr>,
    tag: u64,
    outcome: Outcome,
) {
    const TELL_TIMEOUT: Duration = Duration::from_secs(10);
    let body = encode(tag, &outcome);
    let endpoint = router.endpoint.clone();
    router.runtime.spawn(async move {
        for owner in owners {
            let told = async {
                let session = endpoint.session(owner, TELL_TIMEOUT).await?;
                session
                    .tell(Service::OUTCOME, body.clone(), TELL_TIMEOUT)
                    .await
            };
            if let Err(e) = told.await {
                tracing::warn!(%owner, tag, "cannot tell a request's outcome: {e}");
            }
        }
    });
}

impl Node {
    /// How the request that node `reader` tagged `tag`
    /// ([`Xfer::with_outcome`](crate::Xfer::with_outcome)) ended, once it
    /// has: waits up to `timeout` for the reader to say. The answer comes
    /// once: an outcome that came before this call is given (and
    /// forgotten); a reader whose session to this node ends first, or that
    /// cannot be reached, is [`OutcomeError::ReaderLost`] as soon as that
    /// is seen. One caller at a time per reader and tag.
    pub async fn wait_outcome(
        &self,
        reader: NodeAddr,
        tag: u64,
        timeout: Duration,
    ) -> Result<Outcome, OutcomeError> {
        let router = &self.0.router;
        if router.is_shut_down() {
            return Err(OutcomeError::ShutDown);
        }
        let deadline = Instant::now() + timeout;
        let outcomes = &router.outcomes;
        let key = (reader.id, tag);
        let mut told = {
            let mut state = outcomes.state();
            if let Some(outcome) = state.arrived.remove(&key) {
                return Ok(outcome);
            }
            if state.waiting.contains_key(&key) {
                return Err(OutcomeError::AlreadyAwaited { reader, tag });
            }
            let (tx, rx) = oneshot::channel();
            state.waiting.insert(key, tx);
            rx
        };
        // Forgets the wait however it ends.
        struct Forget<'a>(&'a Outcomes, (NodeId, u64));
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                self.0.state().waiting.remove(&self.1);
            }
        }
        let _forget = Forget(outcomes, key);
        let lost = |reason: String| OutcomeError::ReaderLost { reader, reason };
        // This node's own session to the reader: its end is the reader's.
        let session = tokio::select! {
            outcome = &mut told => return outcome.map_err(|_| OutcomeError::ShutDown),
            session = tokio::time::timeout_at(deadline, router.endpoint.session(reader, timeout)) => session,
        };
        let gone = match session {
            Err(_) => {
                return Err(OutcomeError::Timeout {
                    reader,
                    after: timeout,
                });
            }
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(session)) => {
                tokio::select! {
                    outcome = &mut told => return outcome.map_err(|_| OutcomeError::ShutDown),
                    () = session.closed() => "its control session ended".to_string(),
                    () = tokio::time::sleep_until(deadline) => {
                        return Err(OutcomeError::Timeout { reader, after: timeout });
                    }
                }
            }
        };
        // An outcome told just before the reader went may still be on its
        // way on the reader's own session.
        match tokio::time::timeout(LATE_OUTCOME, &mut told).await {
            Ok(Ok(outcome)) => Ok(outcome),
            _ => Err(lost(gone)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip_and_garbage_is_refused() {
        for outcome in [
            Outcome::Completed,
            Outcome::Cancelled,
            Outcome::Failed {
                reason: "peer gone".into(),
            },
        ] {
            assert_eq!(decode(&encode(42, &outcome)), Some((42, outcome)));
        }
        assert_eq!(decode(b"short"), None);
        assert_eq!(decode(&[0, 0, 0, 0, 0, 0, 0, 0, 9]), None);
    }

    #[test]
    fn early_outcomes_are_kept_within_their_bound() {
        let outcomes = Outcomes::default();
        for tag in 0..(KEPT_OUTCOMES as u64 + 10) {
            outcomes.arrived(NodeId(1), tag, Outcome::Completed);
        }
        let state = outcomes.state();
        assert_eq!(state.arrived.len(), KEPT_OUTCOMES);
        assert!(!state.arrived.contains_key(&(NodeId(1), 0)));
        assert!(
            state
                .arrived
                .contains_key(&(NodeId(1), KEPT_OUTCOMES as u64 + 9))
        );
    }
}
