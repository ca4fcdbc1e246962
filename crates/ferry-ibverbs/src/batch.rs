//! Running one batch: its ops checked and grouped by peer, split into
//! pieces over the peer's rail pairs, posted on their queue pairs,
//! completed (or failed, or timed out) as one.
//!
//! How a peer's share is spread over its rail pairs: when it is smaller
//! than the stripe threshold ([`IbvConfig::stripe_min`](crate::IbvConfig)),
//! all of it goes to the pair with the fewest bytes outstanding, so a small
//! batch keeps one queue pair's ordering and its notification can ride
//! behind it. Otherwise each op of at least the threshold is cut into equal
//! parts, one per pair, and each smaller op goes whole to the pair with the
//! fewest bytes outstanding or assigned so far.
//!
//! With several pairs, each piece carries the batch's [`Rescue`]: when its
//! pair fails under it (flushed, retries exhausted, or stalled, see
//! `peers`), the piece is posted again on a pair that still works, with
//! that pair's keys, and the batch completes as if nothing happened. Only
//! when no pair is left does it fail, with `ConnectionLost`. Before a
//! failed pair's pieces are posted again, its queue pair is in the error
//! state and their (flush) completions have been polled: nothing of the
//! first attempt can still land later. What a caller may assume about a
//! failed op's destination bytes is unchanged: any prefix of them may have
//! been written. Notifications to a peer with several pairs go over the
//! control session after the data (`NotSent`): a SEND on a pair that fails
//! may or may not have arrived, and sending it again could deliver it twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use ferry_control::Endpoint;
use ferry_core::{
    BatchProgress, DataPathNotification, NodeAddr, OpError, OpKind, RdmaOp, SubmitError,
};
use tokio::time::Instant;
use tracing::{Instrument, debug, debug_span};

use crate::backend::Registry;
use crate::connection::Rescue;
use crate::device::Fabric;
use crate::lanes::{Lane, OpKeys, OpPlan};
use crate::mr_cache::MrCache;
use crate::notify::PendingNotification;
use crate::passive::PassiveQps;
use crate::peers::Peers;
use crate::qp_session::spin_until_done;
use crate::verbs::RdmaOpcode;

/// How long a submitting task polls for its own completions before it waits
/// for the poller task instead.
const INLINE_POLL: Duration = Duration::from_micros(200);

/// The data plane's state, shared by the manager actor and every handle:
/// batches run in the submitter's task against it.
pub(crate) struct Shared {
    pub(crate) fabric: Arc<Fabric>,
    /// The node's endpoint: queue pairs are set up over its control sessions.
    pub(crate) endpoint: Endpoint,
    pub(crate) peers: Peers,
    pub(crate) registry: Arc<Registry>,
    /// Live MRs, for regions registered inside registered ones.
    pub(crate) mrs: MrCache,
    /// Queue pairs this node keeps for initiators.
    pub(crate) passive: Arc<PassiveQps>,
    /// Leases made so far: the next one's slot.
    pub(crate) leases: std::sync::atomic::AtomicU32,
}

impl Shared {
    /// Runs one batch to completion or deadline, in a tracing span.
    pub(crate) async fn submit(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        self.submit_notified(ops, timeout, None).await.map(|_| ())
    }

    /// As `submit`, with a notification to put behind a single owner's ops.
    pub(crate) async fn submit_notified(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Option<Bytes>,
    ) -> Result<DataPathNotification, SubmitError> {
        // (Fields are only evaluated when the span is enabled.) A batch
        // usually goes to one peer; name the first.
        let span = debug_span!(
            "submit",
            transport = "ibverbs",
            peer = ?ops.first().map(|op| op.remote.owner().endpoint),
            ops = ops.len(),
            bytes = ops.iter().map(RdmaOp::len).sum::<u64>()
        );
        let result = self
            .run(ops, timeout, notification)
            .instrument(span.clone())
            .await;
        debug!(parent: &span, ?result, "submit finished");
        result
    }

    async fn run(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: Option<Bytes>,
    ) -> Result<DataPathNotification, SubmitError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut groups = self.prepare(&ops)?;
        // Only a single owner can be notified on its QP: it alone cannot
        // know whether another owner's share of the batch failed.
        let notification =
            notification.filter(|_| groups.len() == 1 && groups[0].plans.iter().any(|p| p.len > 0));
        // A batch that reads notifies once its reads are back, in a SEND of
        // its own (below), not in a SEND fenced behind them: a fence holds
        // every later request on the QP, other batches' included, until the
        // reads return, and soft-RoCE's fence never lifted once a read
        // response was lost (the batch stalled until its deadline). Waiting
        // for the reads' completion costs only the time to post the SEND.
        let reads = ops.iter().any(|op| op.kind == OpKind::Read);
        let (behind, after) = match notification {
            Some(payload) if reads => (None, Some((groups[0].peer, payload))),
            behind => (behind, None),
        };
        // One piece per op until its rail pairs are known (`split`).
        let progress = Arc::new(BatchProgress::with_notifications(
            ops.iter().map(|op| u32::from(!op.is_empty())),
            usize::from(behind.is_some()),
        ));
        let notify_index = ops.len();
        if let Some(payload) = behind {
            groups[0].notification = Some(PendingNotification {
                payload,
                index: notify_index,
            });
        }
        drop(ops);
        let outcome = self
            .execute(groups, progress, notify_index, started, deadline, timeout)
            .await;
        let (Some((peer, payload)), Ok(DataPathNotification::NotSent)) = (after, &outcome) else {
            return outcome;
        };
        let alone = PeerGroup {
            peer,
            plans: Vec::new(),
            lanes: Vec::new(),
            keys: Vec::new(),
            notification: Some(PendingNotification { payload, index: 0 }),
        };
        let progress = Arc::new(BatchProgress::with_notifications([], 1));
        self.execute(vec![alone], progress, 0, Instant::now(), deadline, timeout)
            .await
    }

    /// Posts `groups` (each op's pieces, and a notification behind them if
    /// one is attached; a group may hold only a notification) and waits for
    /// `progress` until `deadline`. `notify_index` is the notification's
    /// index in `progress`; `started` begins the inline polling window.
    async fn execute(
        &self,
        mut groups: Vec<PeerGroup>,
        progress: Arc<BatchProgress>,
        notify_index: usize,
        started: Instant,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<DataPathNotification, SubmitError> {
        if progress.total_pieces() == 0 {
            return Ok(DataPathNotification::NotSent);
        }
        // Set once the notification is posted behind the ops.
        let sent = AtomicBool::new(false);
        let finish = |outcome: Result<(), SubmitError>| {
            let sent = sent.load(Ordering::Acquire);
            match outcome {
                Ok(()) if sent => Ok(DataPathNotification::Accepted),
                Ok(()) => Ok(DataPathNotification::NotSent),
                Err(SubmitError::Op { index, error }) if sent && index == notify_index => {
                    Ok(DataPathNotification::Failed(error))
                }
                Err(e) => Err(e),
            }
        };
        // Small transfers finish within microseconds: the submitter polls
        // for them itself rather than sleep until the poller task wakes it,
        // which costs several thread wake-ups. Bounded; then the poller task
        // takes over.
        let spin_until = started + INLINE_POLL;
        // The common case waits for nothing: one peer, its link connected,
        // the share on one pair, credits free for every piece, done within
        // the inline window. It runs right here; what it leaves, the async
        // work below picks up.
        let rescue = Arc::new(Rescue::default());
        if groups.len() == 1 && self.try_now(&mut groups[0], &progress, &sent, spin_until, &rescue)
        {
            return finish(progress.outcome());
        }
        let work = async {
            let single_peer = groups.len() == 1;
            for group in &mut groups {
                if group.lanes.is_empty()
                    && (!group.plans.is_empty() || group.notification.is_some())
                {
                    match self
                        .peers
                        .get(&self.fabric, &self.endpoint, group.peer, deadline)
                        .await
                    {
                        Ok(link) => {
                            self.spread(group, &link, &progress, &sent, &rescue);
                        }
                        Err(e) => {
                            for plan in std::mem::take(&mut group.plans) {
                                if plan.len > 0 {
                                    progress.piece_done(plan.op, Err(e.clone()));
                                }
                            }
                            if let Some(n) = group.notification.take() {
                                progress.piece_done(n.index, Ok(()));
                            }
                            continue;
                        }
                    }
                }
                // A single pair to a single peer polls from the start, so its
                // poller task stands aside before the first completion
                // arrives, and it polls while waiting for credits. Pairs
                // posted together start polling once all is posted: waiting
                // for one QP's credits while keeping another's poller aside
                // could stall other submitters there.
                let inline = single_peer && group.lanes.len() == 1;
                let posting = group.lanes.iter_mut().map(|lane| {
                    if inline {
                        lane.session.start_polling();
                    }
                    let pieces = std::mem::take(&mut lane.pieces);
                    let progress = &progress;
                    async move {
                        if !pieces.is_empty() {
                            lane.session
                                .post_all(pieces, progress, spin_until, deadline)
                                .await;
                        }
                    }
                });
                futures_util::future::join_all(posting).await;
            }
            groups
                .iter_mut()
                .flat_map(|g| g.lanes.iter_mut())
                .for_each(|lane| lane.session.start_polling());
            let poll = || {
                groups
                    .iter()
                    .flat_map(|g| g.lanes.iter())
                    .filter(|lane| lane.session.is_polling())
                    .map(|lane| lane.session.qp().poll_now())
                    .sum()
            };
            spin_until_done(spin_until, poll, || progress.is_done());
            groups.iter_mut().for_each(|g| g.lanes.clear());
            loop {
                tokio::select! {
                    biased;
                    _ = progress.all_done() => break,
                    _ = rescue.wake.notified() => {
                        self.post_again(&groups, &rescue, &progress, deadline).await;
                    }
                }
            }
        };
        // Pinned so the outcome is decided before the work future is dropped.
        let mut work = std::pin::pin!(work);
        // Most small batches are done within the first poll (they poll
        // inline): only one still running after it needs a timer.
        let first = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
        if first.is_ready() || tokio::time::timeout_at(deadline, work).await.is_ok() {
            return finish(progress.outcome());
        }
        let error = progress.timed_out(timeout);
        // Flush what is still outstanding: the flush completions release the
        // pinned memory; the next op reconnects.
        for qp in self.peers.all() {
            if qp.has_work_of(&progress) {
                qp.break_with(qp.lost());
            }
        }
        Err(error)
    }

    /// Posts `group` and polls for its completions without waiting for
    /// anything: only if its link is connected, its share goes to one pair
    /// and credits for all its pieces are free. Returns whether the batch
    /// finished; if not, what was not posted is left in the group, split
    /// into its lanes (the session still polling).
    fn try_now(
        &self,
        group: &mut PeerGroup,
        progress: &Arc<BatchProgress>,
        sent: &AtomicBool,
        spin_until: Instant,
        rescue: &Arc<Rescue>,
    ) -> bool {
        let Some(link) = self.peers.connected(group.peer) else {
            return false;
        };
        self.spread(group, &link, progress, sent, rescue);
        let [lane] = &mut group.lanes[..] else {
            return false;
        };
        lane.session.start_polling();
        lane.session.post_now(&mut lane.pieces, progress)
            && spin_until_done(
                spin_until,
                || lane.session.qp().poll_now(),
                || progress.is_done(),
            )
    }

    /// Checks every op before anything is posted, and groups them by peer
    /// (in a list: a batch rarely spans more than a few), each with its
    /// keys on every rail at both ends.
    fn prepare(&self, ops: &[RdmaOp]) -> Result<Vec<PeerGroup>, SubmitError> {
        let mut groups: Vec<PeerGroup> = Vec::with_capacity(1);
        let registry = self.registry.lock();
        for (index, op) in ops.iter().enumerate() {
            op.validate()
                .map_err(|error| SubmitError::Op { index, error })?;
            let region = op.local.region();
            let (Some(remote), Some(keys)) = (
                op.remote.transports().ibverbs,
                registry.get(&(region.id(), region.generation())),
            ) else {
                return Err(SubmitError::Op {
                    index,
                    error: OpError::NoSharedTransport,
                });
            };
            let peer = op.remote.owner();
            let group = match groups.iter().position(|g| g.peer == peer) {
                Some(i) => i,
                None => {
                    groups.push(PeerGroup {
                        peer,
                        plans: Vec::with_capacity(ops.len() - index),
                        lanes: Vec::new(),
                        keys: Vec::new(),
                        notification: None,
                    });
                    groups.len() - 1
                }
            };
            groups[group].plans.push(OpPlan {
                op: index,
                opcode: match op.kind {
                    OpKind::Read => RdmaOpcode::Read,
                    OpKind::Write => RdmaOpcode::Write,
                },
                local_addr: op.local.as_ptr() as u64,
                remote_addr: op.remote.addr(),
                len: op.len(),
                keys: OpKeys {
                    lkeys: keys.lkeys,
                    rkeys: remote.rkeys,
                    route: keys.route,
                },
                region: region.clone(),
            });
        }
        Ok(groups)
    }
}

/// The part of a batch that goes to one peer.
pub(crate) struct PeerGroup {
    pub(crate) peer: NodeAddr,
    /// Its ops, until `spread` turns them into `lanes`.
    pub(crate) plans: Vec<OpPlan>,
    /// Its pieces, by rail pair, once the peer's link is known.
    pub(crate) lanes: Vec<Lane>,
    /// Each op's keys on every rail at both ends, by op index (sorted):
    /// what a rescued piece is keyed with on its new pair.
    pub(crate) keys: Vec<(usize, OpKeys)>,
    /// To post behind the pieces once the pairs are known.
    pub(crate) notification: Option<PendingNotification>,
}
