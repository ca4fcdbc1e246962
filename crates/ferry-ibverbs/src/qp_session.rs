//! A submitter's use of a queue pair: posting its pieces with credits, and
//! polling for its own completions while they are close (see
//! `Shared::run`), so that small transfers cost no thread wake-up.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::BatchProgress;
use tokio::time::Instant;

use crate::connection::{MAX_POST, PeerQp, Piece};

/// One submitter's use of a QP: it posts its pieces through this and, while
/// the session is polling, polls the CQ for its completions itself (see
/// `Shared::run`). While any session polls, the poller task keeps the CQ
/// unarmed and sleeps, so completions raise no channel event and wake no
/// other thread, and the two never contend for the CQ or the in-flight lock.
/// The last session to stop polling hands whatever is still outstanding back
/// to the poller task.
pub(crate) struct QpSession {
    qp: Arc<PeerQp>,
    polling: bool,
}

impl QpSession {
    pub fn new(qp: Arc<PeerQp>) -> Self {
        QpSession { qp, polling: false }
    }

    pub fn qp(&self) -> &Arc<PeerQp> {
        &self.qp
    }

    pub fn is_polling(&self) -> bool {
        self.polling
    }

    /// Start before posting, so that the poller task stands aside before
    /// the first completion can arrive.
    pub fn start_polling(&mut self) {
        if !self.polling {
            self.polling = true;
            self.qp.inline_pollers.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn stop_polling(&mut self) {
        if !self.polling {
            return;
        }
        self.polling = false;
        let qp = &self.qp;
        let outstanding = || qp.credits.available_permits() < qp.max_credits;
        if qp.inline_pollers.fetch_sub(1, Ordering::SeqCst) == 1 && outstanding() {
            // A stored permit if the poller is not waiting yet: no lost wake-up.
            qp.poller_wake.notify_one();
        }
    }

    /// Posts all of `pieces` with one doorbell, if they fit in one and
    /// credits for all of them are free right now; returns whether it did.
    /// Otherwise (a full provider queue included) they stay in `pieces`.
    pub fn post_now(&mut self, pieces: &mut Vec<Piece>, progress: &Arc<BatchProgress>) -> bool {
        let count = pieces.len();
        if count > MAX_POST {
            return false;
        }
        let Ok(permits) = self.qp.credits.try_acquire_many(count as u32) else {
            return false;
        };
        permits.forget();
        let mut pending: VecDeque<Piece> = std::mem::take(pieces).into();
        let posted = self.qp.post_front(&mut pending, count, progress);
        if !posted {
            *pieces = pending.into();
        }
        posted
    }

    /// Posts `pieces` in order, as linked lists of at most `MAX_POST`
    /// requests, waiting for send-queue credits as needed until `deadline`.
    /// Out of credits while polling, the submitter polls for the completions
    /// that return them itself until `spin_until`, then stops polling and
    /// leaves them to the poller task. Pieces that cannot be posted are
    /// reported to `progress`.
    pub async fn post_all(
        &mut self,
        pieces: Vec<Piece>,
        progress: &Arc<BatchProgress>,
        spin_until: Instant,
        deadline: Instant,
    ) {
        let qp = self.qp.clone();
        let credits = &qp.credits;
        let mut pending: VecDeque<Piece> = pieces.into();
        while !pending.is_empty() {
            if progress.is_abandoned() {
                return;
            }
            // At least one credit, then whatever else is free right now.
            // Only wait (and arm a timer) when none is free.
            if self.polling && credits.available_permits() == 0 {
                spin_until_done(
                    spin_until,
                    || qp.poll_now(),
                    || credits.available_permits() > 0,
                );
            }
            match credits.try_acquire() {
                Ok(permit) => permit.forget(),
                Err(_) => {
                    self.stop_polling();
                    // Boxed: rarely needed, and large.
                    match Box::pin(tokio::time::timeout_at(deadline, credits.acquire())).await {
                        Ok(Ok(permit)) => permit.forget(),
                        // Deadline passed or semaphore closed: the caller's
                        // timeout path accounts for the pieces never posted.
                        _ => return,
                    }
                }
            }
            let mut count = 1;
            let more = (pending.len().min(MAX_POST) - 1).min(credits.available_permits());
            if more > 0
                && let Ok(permits) = credits.try_acquire_many(more as u32)
            {
                permits.forget();
                count += more;
            }
            if !qp.post_front(&mut pending, count, progress) {
                // The send queue was momentarily full: the pieces are back at
                // the front of `pending`, to be retried once completions have
                // had a chance to drain it.
                if Instant::now() >= deadline {
                    return;
                }
                tokio::task::yield_now().await;
            }
        }
    }
}

/// Calls `poll` (which returns how many completions it applied) until
/// `done()`, until `until` has passed, or until the thread's lender wants it
/// back; returns `done()`. The clock is read only every 64 polls: where it
/// is slow to read (an emulated HPET), reading it each time cost more than
/// polling.
pub(crate) fn spin_until_done(
    until: Instant,
    mut poll: impl FnMut() -> usize,
    mut done: impl FnMut() -> bool,
) -> bool {
    let mut polls = 0u32;
    while !done() {
        // A thread lent by the node's actor goes back as soon as another
        // message waits for it (see `ferry_core::inline`).
        if polls % 64 == 63 && (Instant::now() >= until || ferry_core::inline::wanted_back()) {
            return false;
        }
        polls = polls.wrapping_add(1);
        if poll() == 0 {
            std::hint::spin_loop();
        }
    }
    true
}

impl Drop for QpSession {
    fn drop(&mut self) {
        self.stop_polling();
    }
}
