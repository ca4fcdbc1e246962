//! One RC queue pair to one peer: posting work with credits, and turning
//! completions into op outcomes. (Setting it up with the peer is
//! `exchange`'s job.)
//!
//! # Memory safety
//!
//! Every posted work request has a record in `Inflight::records`, in post
//! order, holding its local memory: a `Region` clone, or for a
//! notification the send buffer it was copied into. A record is dropped
//! only when the completion of that request, or of a later signaled one on the
//! same QP (RC completes in order), has been polled — including flush
//! completions after the QP entered the error state. So no local byte a
//! request may touch is unregistered or freed before the NIC is done with it.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{BatchProgress, NodeAddr, OpError};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::device::Rail;
use crate::notify::NotifyLane;
use crate::verbs::{Completion, CompletionChannel, CompletionQueue, QueuePair, VerbsError};

mod inflight;

use inflight::{Inflight, Posted};
pub(crate) use inflight::{Piece, Pin, Rescue};

/// Signal one work request in this many (and always the last one posted):
/// fewer completions to poll, credits still returned steadily.
const SIGNAL_EVERY: usize = 16;
/// ... and at least once per this many bytes: completions then come often
/// enough, even for large requests on a slow link, that a pair going
/// without one while work is due has stalled (see `peers`' stall check).
const SIGNAL_BYTES: u64 = 256 << 10;
/// Most work requests posted with one doorbell.
pub(crate) const MAX_POST: usize = 64;
/// Empty polls (each a yield to the runtime) the poller makes, while work is
/// outstanding, before it arms the CQ and sleeps: while completions of a long
/// batch follow each other closely the CQ stays unarmed, so they raise no
/// channel events and wake no thread.
const BUSY_POLLS: u32 = 64;
/// How often a sleeping poller looks at its QP regardless, to notice that it
/// is broken and drained.
const IDLE_CHECK: Duration = Duration::from_millis(100);

/// ferry's own work-request ids never have this bit set; code posting through
/// the raw handles must set it, so its completions are told apart.
pub const FOREIGN_WR_ID_BIT: u64 = 1 << 63;

pub(crate) struct PeerQp {
    peer: NodeAddr,
    /// This end's rail, and the peer's rail index at the other end.
    rail: Arc<Rail>,
    remote_rail: u8,
    /// `ibv_mtu` value the pair's path uses: the smaller of both ports'.
    mtu: u32,
    qp: QueuePair,
    pub(crate) credits: Semaphore,
    /// All credits: fewer are available exactly while work is outstanding.
    pub(crate) max_credits: usize,
    inflight: Mutex<Inflight>,
    /// Mirrors `Inflight::broken.is_some()`, for a lock-free check per submit.
    broken: AtomicBool,
    /// Set once the control session ended silently while work was under
    /// way: that work goes on, new submits get a fresh QP (see
    /// `exchange::watch_session`).
    retiring: AtomicBool,
    next_wr_id: AtomicU64,
    /// Sessions polling the CQ themselves right now (see `QpSession`).
    pub(crate) inline_pollers: AtomicUsize,
    /// Wakes the poller task when the last inline poller leaves with work
    /// still outstanding.
    pub(crate) poller_wake: Notify,
    /// Cancelled when the QP is broken: stops the control-stream watcher,
    /// which closes the stream and so lets the peer destroy its QP.
    closed: CancellationToken,
    /// Cancelled once the QP is broken and every request posted on it has
    /// completed (flushes included): from then on nothing refers to the
    /// memory it pinned, and dropping it is safe.
    drained: CancellationToken,
    /// Notifications on this QP, if the peer posted receive buffers for it.
    notify: Option<NotifyLane>,
    /// When a completion was last applied (or the QP started): the
    /// data plane's own sign that the path to the peer works.
    progressed_at: Mutex<std::time::Instant>,
}

/// The completion channel's fd for tokio's reactor. Owning the channel means
/// the fd stays open for as long as the reactor watches it.
pub(crate) struct ChannelFd(pub Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

impl PeerQp {
    pub fn peer(&self) -> NodeAddr {
        self.peer
    }

    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// This end's rail.
    pub fn rail(&self) -> &Arc<Rail> {
        &self.rail
    }

    /// The peer's rail index at the other end.
    pub fn remote_rail(&self) -> u8 {
        self.remote_rail
    }

    /// The pair for people and errors: "rxe0:1 -> rail 1".
    pub fn pair_name(&self) -> String {
        format!("{} -> rail {}", self.rail.name(), self.remote_rail)
    }

    /// [`OpError::ConnectionLost`] naming this pair.
    pub fn lost(&self) -> OpError {
        OpError::ConnectionLost {
            endpoint: self.peer.endpoint,
            rails: vec![self.pair_name()],
        }
    }

    /// `ibv_mtu` value of the pair's path.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// Bytes posted on this QP and not yet completed.
    pub fn outstanding_bytes(&self) -> u64 {
        self.lock().bytes
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Notifications on this QP, if the peer takes them here.
    pub fn notify_lane(&self) -> Option<&NotifyLane> {
        self.notify.as_ref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inflight> {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether any posted request of `progress` is still outstanding.
    pub fn has_work_of(&self, progress: &Arc<BatchProgress>) -> bool {
        self.lock()
            .records
            .iter()
            .any(|r| Arc::ptr_eq(&r.progress, progress))
    }

    /// Fails the QP: outstanding requests flush (their completions release
    /// their memory) and no new work is accepted.
    pub fn break_with(&self, error: OpError) {
        let mut inflight = self.lock();
        if inflight.broken.is_none() {
            debug!(peer = %self.peer.endpoint, qpn = self.qp.qpn(), %error, "queue pair failed");
            inflight.broken = Some(error);
            self.broken.store(true, Ordering::Release);
            if let Err(e) = self.qp.to_error() {
                debug!(error = %e, "moving the queue pair to the error state failed");
            }
            self.closed.cancel();
        }
    }

    /// Posts the first `count` pieces of `pending` (credits for them already
    /// taken) as one linked list and removes them. Returns false, with the
    /// refused pieces back at the front of `pending` and their credits
    /// returned, if the provider's send queue was full (ENOMEM). That can
    /// happen even within our credits: a provider may report a completion a
    /// moment before it frees the send-queue slot (soft-RoCE does). Any other
    /// refusal fails the QP.
    pub(crate) fn post_front(
        &self,
        pending: &mut VecDeque<Piece>,
        count: usize,
        progress: &Arc<BatchProgress>,
    ) -> bool {
        // Ids are assigned and records queued under the same lock as the
        // post, so records are in posting order — the order the requests
        // complete in — and their ids strictly increase (`complete` relies
        // on both).
        let mut guard = self.lock();
        let inflight = &mut *guard;
        if let Some(error) = inflight.broken.clone() {
            drop(guard);
            self.credits.add_permits(count);
            for mut piece in pending.drain(..count) {
                match piece.rescue.take() {
                    Some(rescue) if !matches!(piece.pin, Pin::Notification(_)) => {
                        rescue.push(piece)
                    }
                    _ => progress.piece_done(piece.op, Err(error.clone())),
                }
            }
            return true;
        }
        inflight.wrs.clear();
        let mut bytes = 0;
        let mut unsignaled = 0;
        for (i, piece) in pending.iter().take(count).enumerate() {
            bytes += u64::from(piece.wr.len);
            unsignaled += u64::from(piece.wr.len);
            let mut wr = piece.wr;
            wr.wr_id = self.next_wr_id.fetch_add(1, Ordering::Relaxed);
            wr.signaled = i == count - 1
                || i % SIGNAL_EVERY == SIGNAL_EVERY - 1
                || unsignaled >= SIGNAL_BYTES;
            if wr.signaled {
                unsignaled = 0;
            }
            inflight.wrs.push(wr);
        }
        let before = inflight.records.len();
        inflight.records.extend(
            pending
                .drain(..count)
                .zip(&inflight.wrs)
                .map(|(piece, wr)| Posted {
                    wr: *wr,
                    op: piece.op,
                    progress: progress.clone(),
                    pin: piece.pin,
                    rescue: piece.rescue,
                }),
        );
        // SAFETY: every request's local range lies in a memory region of this
        // QP's protection domain (checked when the piece was built), and the
        // record pushed above pins that region until the request's completion
        // (or a later one) is polled; see the module docs.
        let was_idle = before == 0;
        let Err((index, e)) = (unsafe { self.qp.post(&inflight.wrs, &mut inflight.buffers) })
        else {
            if was_idle {
                // Work is due from now: a stall is counted from here, not
                // from the last completion of an earlier burst.
                *self.progressed_at.lock().unwrap_or_else(|e| e.into_inner()) =
                    std::time::Instant::now();
            }
            inflight.bytes += bytes;
            self.rail.count_posted(count as u64, bytes);
            return true;
        };
        let posted_bytes: u64 = inflight.wrs[..index]
            .iter()
            .map(|wr| u64::from(wr.len))
            .sum();
        inflight.bytes += posted_bytes;
        self.rail.count_posted(index as u64, posted_bytes);
        // Requests from `index` on were not posted: take their records back.
        let refused: Vec<Posted> = inflight.records.drain(before + index..).collect();
        let refused_wrs = inflight.wrs.split_off(index);
        drop(guard);
        self.credits.add_permits(refused.len());
        let queue_full = matches!(&e, VerbsError::Call { source, .. } if source.raw_os_error() == Some(libc::ENOMEM));
        if queue_full {
            for (record, wr) in refused.into_iter().zip(refused_wrs).rev() {
                pending.push_front(Piece {
                    op: record.op,
                    wr,
                    pin: record.pin,
                    rescue: record.rescue,
                });
            }
            return false;
        }
        let error = OpError::Protocol(format!("posting to the send queue failed: {e}"));
        for record in refused {
            record.progress.piece_done(record.op, Err(error.clone()));
        }
        self.break_with(error);
        true
    }

    /// Applies completions: every record up to and including the completed
    /// request is finished (RC completes in order) and its credit returned.
    fn complete(&self, completions: &[Completion]) {
        *self.progressed_at.lock().unwrap_or_else(|e| e.into_inner()) = std::time::Instant::now();
        let mut freed = 0;
        let mut failure = None;
        {
            let mut inflight = self.lock();
            for wc in completions {
                let error =
                    (!wc.is_success()).then(|| self.error_for(wc, inflight.broken.as_ref()));
                let retired = inflight.retire(wc, error.as_ref());
                freed += retired;
                if retired > 0
                    && let Some(e) = error
                    && !wc.is_flush()
                {
                    failure.get_or_insert(e);
                }
            }
        }
        self.credits.add_permits(freed);
        if let Some(error) = failure {
            self.break_with(error);
        }
    }

    fn error_for(&self, wc: &Completion, broken: Option<&OpError>) -> OpError {
        if wc.is_remote_access_error() {
            OpError::AccessDenied
        } else if wc.is_flush() {
            broken.cloned().unwrap_or_else(|| self.lost())
        } else if wc.is_retry_exceeded() {
            self.lost()
        } else {
            OpError::Protocol(format!("work completion failed: {}", wc.status_str()))
        }
    }

    /// Polls the CQ once and applies what it finds; returns how many
    /// completions there were. Safe to call from any task alongside the
    /// poller: both poll the same (thread-safe) CQ and apply completions
    /// under the in-flight lock.
    pub fn poll_now(&self) -> usize {
        let mut wcs = [Completion::default(); 16];
        match self.qp.cq().poll(&mut wcs) {
            Ok(0) => 0,
            Ok(n) => {
                self.complete(&wcs[..n]);
                n
            }
            Err(e) => {
                self.break_with(OpError::Protocol(e.to_string()));
                0
            }
        }
    }

    /// Polls the CQ until the QP is broken and drained: busy for a short
    /// window after activity, then asleep on the completion channel. While a
    /// submitter polls inline ([`QpSession`](crate::qp_session::QpSession)) it sleeps with the CQ
    /// unarmed instead. Correctness does not depend on that hand-off: the CQ
    /// is thread safe and completions are applied under the in-flight lock,
    /// so both may poll at once.
    async fn poll_completions(
        self: Arc<Self>,
        cq: Arc<CompletionQueue>,
        channel: Arc<CompletionChannel>,
    ) {
        // SAFETY: `ChannelFd` owns the channel, so its fd stays open and the
        // same for the AsyncFd's whole life, as `register` requires.
        let fd = match unsafe {
            AsyncFd::register_with_interest(ChannelFd(channel), Interest::READABLE)
        } {
            Ok(fd) => fd,
            Err(e) => {
                return self.break_with(OpError::Protocol(format!("completion channel: {e}")));
            }
        };
        let mut wcs = [Completion::default(); 64];
        let mut idle = 0;
        loop {
            let n = cq.poll(&mut wcs).unwrap_or_else(|e| {
                self.break_with(OpError::Protocol(e.to_string()));
                0
            });
            if n > 0 {
                self.complete(&wcs[..n]);
                idle = 0;
                continue;
            }
            let outstanding = {
                let inflight = self.lock();
                if inflight.broken.is_some() && inflight.records.is_empty() {
                    self.drained.cancel();
                    return;
                }
                !inflight.records.is_empty()
            };
            if self.inline_pollers.load(Ordering::SeqCst) > 0 {
                let _ = tokio::time::timeout(IDLE_CHECK, self.poller_wake.notified()).await;
                idle = 0;
                continue;
            }
            if outstanding && idle < BUSY_POLLS {
                idle += 1;
                tokio::task::yield_now().await;
                continue;
            }
            // Arm, then poll once more: a completion that arrived before the
            // arm raises no event.
            if let Err(e) = cq.arm() {
                self.break_with(OpError::Protocol(e.to_string()));
            }
            let n = cq.poll(&mut wcs).unwrap_or(0);
            if n > 0 {
                self.complete(&wcs[..n]);
                idle = 0;
                continue;
            }
            let wait = async {
                tokio::select! {
                    ready = fd.readable() => {
                        if let Ok(mut guard) = ready {
                            guard.clear_ready();
                            while let Ok(true) = cq.take_event() {}
                        }
                    }
                    _ = self.poller_wake.notified() => {}
                }
            };
            let _ = tokio::time::timeout(IDLE_CHECK, wait).await;
            idle = 0;
        }
    }
}

impl PeerQp {
    /// Wraps a queue pair on `rail`, brought to RTS for `peer`'s rail
    /// `remote_rail` with path MTU `mtu`, with `credits` send-queue slots
    /// (and `notify`, if the peer posted receive buffers for our
    /// notifications), and starts its completion poller.
    #[expect(
        clippy::too_many_arguments,
        reason = "one constructor, each part distinct"
    )]
    pub(crate) fn start(
        peer: NodeAddr,
        rail: Arc<Rail>,
        remote_rail: u8,
        mtu: u32,
        qp: QueuePair,
        cq: Arc<CompletionQueue>,
        channel: Arc<CompletionChannel>,
        credits: usize,
        notify: Option<NotifyLane>,
    ) -> Arc<PeerQp> {
        let conn = Arc::new(PeerQp {
            peer,
            rail,
            remote_rail,
            mtu,
            qp,
            credits: Semaphore::new(credits),
            max_credits: credits,
            inflight: Mutex::new(Inflight::default()),
            broken: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
            next_wr_id: AtomicU64::new(0),
            inline_pollers: AtomicUsize::new(0),
            poller_wake: Notify::new(),
            closed: CancellationToken::new(),
            drained: CancellationToken::new(),
            notify,
            progressed_at: Mutex::new(std::time::Instant::now()),
        });
        tokio::spawn(conn.clone().poll_completions(cq, channel));
        conn
    }

    /// Cancelled once the QP is broken.
    pub(crate) fn closed(&self) -> &CancellationToken {
        &self.closed
    }

    /// Cancelled once the QP is broken and drained: whoever keeps it for
    /// new work may let it go.
    pub(crate) fn drained(&self) -> &CancellationToken {
        &self.drained
    }

    /// Takes no new submits from now on (`is_usable` turns false); work
    /// already under way goes on.
    pub(crate) fn retire(&self) {
        self.retiring.store(true, Ordering::Release);
    }

    /// Whether new submits may use this QP: neither broken nor retiring.
    pub(crate) fn is_usable(&self) -> bool {
        !self.is_broken() && !self.retiring.load(Ordering::Acquire)
    }

    /// Whether work posted on this QP is still outstanding.
    pub(crate) fn is_busy(&self) -> bool {
        self.credits.available_permits() < self.max_credits
    }

    /// How long ago a completion was last applied.
    pub(crate) fn since_progress(&self) -> std::time::Duration {
        self.progressed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }
}
