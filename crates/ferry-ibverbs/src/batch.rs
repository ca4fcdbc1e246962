//! Running one batch: its ops checked and split into pieces per peer, posted
//! on each peer's queue pair, completed (or failed, or timed out) as one.

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
use crate::connection::{Piece, Pin};
use crate::device::Device;
use crate::mr_cache::MrCache;
use crate::notify::{PendingNotification, attach_notification};
use crate::passive::PassiveQps;
use crate::peers::Peers;
use crate::qp_session::{QpSession, spin_until_done};
use crate::verbs::{RdmaOpcode, WorkRequest};

/// How long a submitting task polls for its own completions before it waits
/// for the poller task instead.
const INLINE_POLL: Duration = Duration::from_micros(200);

/// The data plane's state, shared by the manager actor and every handle:
/// batches run in the submitter's task against it.
pub(crate) struct Shared {
    pub(crate) device: Arc<Device>,
    /// The node's endpoint: queue pairs are set up over its control sessions.
    pub(crate) endpoint: Endpoint,
    pub(crate) peers: Peers,
    pub(crate) registry: Arc<Registry>,
    /// Live MRs, for regions registered inside registered ones.
    pub(crate) mrs: MrCache,
    /// Queue pairs this node keeps for initiators.
    pub(crate) passive: Arc<PassiveQps>,
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
            notification.filter(|_| groups.len() == 1 && !groups[0].pieces.is_empty());
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
        let max_msg = u64::from(self.device.max_msg);
        let progress = Arc::new(BatchProgress::with_notifications(
            ops.iter().map(|op| op.len().div_ceil(max_msg) as u32),
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
            pieces: Vec::new(),
            session: None,
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
        // A single-peer batch polls from the start, so its QP's poller task
        // stands aside before the first completion arrives, and it polls
        // while waiting for credits. A batch over several peers starts
        // polling once all is posted: waiting for one QP's credits while
        // keeping another's poller aside could stall other submitters there.
        let single_peer = groups.len() == 1;
        // The common case waits for nothing: one peer, its QP connected,
        // credits free for every piece, done within the inline window. It
        // runs right here; what it leaves, the async work below picks up.
        if single_peer && self.try_now(&mut groups[0], &progress, &sent, spin_until) {
            return finish(progress.outcome());
        }
        let work = async {
            for group in &mut groups {
                // A session try_now began is used as it is. Without
                // pieces (posted already, or only zero-length ops) no QP
                // is needed.
                if group.session.is_none()
                    && (!group.pieces.is_empty() || group.notification.is_some())
                {
                    match self
                        .peers
                        .get(&self.device, &self.endpoint, group.peer, deadline)
                        .await
                    {
                        Ok(qp) => {
                            attach_notification(
                                &mut group.notification,
                                &mut group.pieces,
                                &qp,
                                &progress,
                                &sent,
                            );
                            let session = group.session.insert(QpSession::new(qp));
                            if single_peer {
                                session.start_polling();
                            }
                        }
                        Err(e) => {
                            std::mem::take(&mut group.pieces)
                                .into_iter()
                                .for_each(|p| progress.piece_done(p.op, Err(e.clone())));
                            if let Some(n) = group.notification.take() {
                                progress.piece_done(n.index, Ok(()));
                            }
                            continue;
                        }
                    }
                }
                let pieces = std::mem::take(&mut group.pieces);
                let Some(session) = group.session.as_mut().filter(|_| !pieces.is_empty()) else {
                    continue;
                };
                session
                    .post_all(pieces, &progress, spin_until, deadline)
                    .await;
            }
            if !single_peer {
                groups
                    .iter_mut()
                    .filter_map(|g| g.session.as_mut())
                    .for_each(QpSession::start_polling);
            }
            let poll = || {
                groups
                    .iter()
                    .filter_map(|g| g.session.as_ref())
                    .filter(|s| s.is_polling())
                    .map(|s| s.qp().poll_now())
                    .sum()
            };
            spin_until_done(spin_until, poll, || progress.is_done());
            groups.iter_mut().for_each(|g| g.session = None);
            progress.all_done().await;
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
                qp.break_with(OpError::ConnectionLost {
                    endpoint: qp.peer().endpoint,
                });
            }
        }
        Err(error)
    }

    /// Posts `group` and polls for its completions without waiting for
    /// anything: only if its QP is connected and credits for all its pieces
    /// are free. Returns whether the batch finished; if not, the pieces not
    /// posted are left in the group, and the session (still polling) too.
    fn try_now(
        &self,
        group: &mut PeerGroup,
        progress: &Arc<BatchProgress>,
        sent: &AtomicBool,
        spin_until: Instant,
    ) -> bool {
        let Some(qp) = self.peers.connected(group.peer) else {
            return false;
        };
        attach_notification(
            &mut group.notification,
            &mut group.pieces,
            &qp,
            progress,
            sent,
        );
        let session = group.session.insert(QpSession::new(qp));
        session.start_polling();
        session.post_now(&mut group.pieces, progress)
            && spin_until_done(
                spin_until,
                || session.qp().poll_now(),
                || progress.is_done(),
            )
    }

    /// Checks every op before anything is posted, and turns them into work
    /// requests grouped by peer (in a list: a batch rarely spans more than a
    /// few). Ops larger than the port's message limit become several.
    fn prepare(&self, ops: &[RdmaOp]) -> Result<Vec<PeerGroup>, SubmitError> {
        let max_msg = self.device.max_msg as usize;
        let mut groups: Vec<PeerGroup> = Vec::with_capacity(1);
        let registry = self.registry.lock();
        for (index, op) in ops.iter().enumerate() {
            op.validate()
                .map_err(|error| SubmitError::Op { index, error })?;
            let region = op.local.region();
            let (Some(remote), Some(&(lkey, _))) = (
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
                        pieces: Vec::with_capacity(ops.len() - index),
                        session: None,
                        notification: None,
                    });
                    groups.len() - 1
                }
            };
            let group = &mut groups[group];
            let opcode = match op.kind {
                OpKind::Read => RdmaOpcode::Read,
                OpKind::Write => RdmaOpcode::Write,
            };
            // An op's length is its local slice's, which fits usize.
            for (at, len) in pieces_of(op.len() as usize, max_msg) {
                group.pieces.push(Piece {
                    op: index,
                    wr: WorkRequest {
                        wr_id: 0,
                        opcode,
                        local_addr: op.local.as_ptr() as u64 + at as u64,
                        len: len as u32,
                        lkey,
                        remote_addr: op.remote.addr() + at as u64,
                        rkey: remote.rkey,
                        signaled: false,
                        fence: false,
                    },
                    pin: Pin::Region(region.clone()),
                });
            }
        }
        Ok(groups)
    }
}

/// The (offset, length) pieces an op of `len` bytes is posted as, each at
/// most `max` bytes: `len.div_ceil(max)` of them.
fn pieces_of(len: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len).step_by(max).map(move |at| (at, max.min(len - at)))
}

/// The part of a batch that goes to one peer.
struct PeerGroup {
    peer: NodeAddr,
    pieces: Vec<Piece>,
    /// The submitter's use of the peer's QP, once connected.
    session: Option<QpSession>,
    /// To post behind `pieces` once the QP is known.
    notification: Option<PendingNotification>,
}

#[cfg(test)]
mod tests {
    use super::pieces_of;

    #[test]
    fn ops_split_into_pieces_that_cover_them_exactly() {
        assert_eq!(
            pieces_of(10, 4).collect::<Vec<_>>(),
            [(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(pieces_of(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
        assert_eq!(pieces_of(3, 4).collect::<Vec<_>>(), [(0, 3)]);
        assert_eq!(pieces_of(0, 4).count(), 0);
        for len in [1, 4095, 4096, 4097, (1 << 20) + 3] {
            let pieces: Vec<_> = pieces_of(len, 4096).collect();
            assert_eq!(pieces.len(), len.div_ceil(4096));
            let mut next = 0;
            for (at, piece) in pieces {
                assert_eq!(at, next);
                assert!((1..=4096).contains(&piece));
                next += piece;
            }
            assert_eq!(next, len);
        }
    }
}
