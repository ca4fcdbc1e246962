use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use crate::{OpError, SubmitError};

/// Where a batch's outcome goes when nobody awaits it: called exactly once,
/// by whoever finishes the batch (the last piece, or the deadline). It runs
/// on that thread, inside transport code: it must be short and must not
/// block (send a reply, record a metric).
pub type Answer = Box<dyn FnOnce(Result<(), SubmitError>) + Send>;

/// Completion bookkeeping of one submitted batch, shared by every piece (TCP
/// chunk, RDMA work request) its ops were split into. Every backend answers a
/// submit from one of these, so they agree on what the caller is told.
pub struct BatchProgress {
    /// Pieces still unfinished, per op (then per notification, see
    /// [`BatchProgress::with_notifications`]).
    op_pieces: Vec<AtomicU32>,
    /// How many entries of `op_pieces` are the batch's ops.
    ops: usize,
    remaining: AtomicUsize,
    /// Lowest-indexed failure so far.
    error: Mutex<Option<(usize, OpError)>>,
    /// Whether `error` was ever set: most batches succeed, and their outcome
    /// needs no lock.
    failed: AtomicBool,
    /// Set once the caller has been answered `Timeout`.
    abandoned: AtomicBool,
    done: Notify,
    /// Set by [`BatchProgress::answer_when_done`]; taken exactly once.
    answer: Mutex<Option<Answer>>,
}

impl BatchProgress {
    /// `pieces[i]` is how many pieces op `i` was split into.
    pub fn new(pieces: impl IntoIterator<Item = u32>) -> Self {
        Self::with_notifications(pieces, 0)
    }

    /// As [`BatchProgress::new`], plus one piece per notification after the
    /// ops: notification `k` finishes as op `ops + k`, so a failed op (a
    /// lower index) is what the batch reports first. A timeout counts only
    /// the ops.
    pub fn with_notifications(pieces: impl IntoIterator<Item = u32>, notifications: usize) -> Self {
        let mut op_pieces: Vec<AtomicU32> = pieces.into_iter().map(AtomicU32::new).collect();
        let ops = op_pieces.len();
        op_pieces.extend((0..notifications).map(|_| AtomicU32::new(1)));
        let remaining = op_pieces
            .iter()
            .map(|c| c.load(Ordering::Relaxed) as usize)
            .sum();
        BatchProgress {
            op_pieces,
            ops,
            remaining: AtomicUsize::new(remaining),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            done: Notify::new(),
            answer: Mutex::new(None),
        }
    }

    /// Pieces not yet finished, over all ops. Right after [`BatchProgress::new`]
    /// a 0 means there is nothing to send: answer the submit at once.
    pub fn total_pieces(&self) -> usize {
        self.op_pieces
            .iter()
            .map(|c| c.load(Ordering::Relaxed) as usize)
            .sum()
    }

    /// Adds `extra` pieces to op `op`, which was counted as fewer: for a
    /// transport that decides how to split an op only once it knows the
    /// paths it takes. Call it before any piece of the op is posted, so
    /// the op cannot have finished already.
    pub fn add_pieces(&self, op: usize, extra: u32) {
        if extra > 0 {
            self.op_pieces[op].fetch_add(extra, Ordering::AcqRel);
            self.remaining.fetch_add(extra as usize, Ordering::AcqRel);
        }
    }

    /// Records the outcome of one piece of op `op`.
    pub fn piece_done(&self, op: usize, result: Result<(), OpError>) {
        if let Err(e) = result {
            self.record_error(op, e);
        }
        self.op_pieces[op].fetch_sub(1, Ordering::AcqRel);
        self.pieces_finished(1);
    }

    /// Records the outcome of ops `first..first + count`, each one piece,
    /// finished together (one request carried them all): every one done, or
    /// `Err((k, e))`, op `first + k` failed with `e` and the request moved
    /// none of them. Only op `first + k` is marked failed: it is the cause,
    /// and a batch reports its lowest failure; the others are counted
    /// finished, as they are, since the batch fails anyway.
    pub fn ops_done(&self, first: usize, count: usize, result: Result<(), (usize, OpError)>) {
        if count == 0 {
            return;
        }
        if let Err((k, e)) = result {
            self.record_error(first + k.min(count - 1), e);
        }
        for pieces in &self.op_pieces[first..first + count] {
            pieces.fetch_sub(1, Ordering::AcqRel);
        }
        self.pieces_finished(count);
    }

    fn record_error(&self, op: usize, e: OpError) {
        let mut error = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if error.as_ref().is_none_or(|(index, _)| op < *index) {
            *error = Some((op, e));
        }
        self.failed.store(true, Ordering::Release);
    }

    /// Counts `n` pieces finished; the last one answers the batch.
    fn pieces_finished(&self, n: usize) {
        if self.remaining.fetch_sub(n, Ordering::AcqRel) == n {
            self.done.notify_one();
            if let Some(answer) = self.take_answer() {
                answer(self.outcome());
            }
        }
    }

    /// Hands the batch's outcome to `answer` once every piece has finished
    /// (at once, if they already have), unless [`BatchProgress::expire`]
    /// answers first: for a submitter that answers its caller from the
    /// completing thread instead of awaiting [`BatchProgress::all_done`] in
    /// a task of its own (one task hop less per submit).
    pub fn answer_when_done(&self, answer: Answer) {
        *self.answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(answer);
        // A last piece that finished before the answer was in place found
        // none to take: answer here instead. (The lock orders the two.)
        if self.is_done()
            && let Some(answer) = self.take_answer()
        {
            answer(self.outcome());
        }
    }

    /// The deadline passed: answers [`BatchProgress::timed_out`] through the
    /// answer given to [`BatchProgress::answer_when_done`], unless the batch
    /// was answered already. Returns whether it answered.
    pub fn expire(&self, timeout: Duration) -> bool {
        match self.take_answer() {
            Some(answer) => {
                answer(Err(self.timed_out(timeout)));
                true
            }
            None => false,
        }
    }

    fn take_answer(&self) -> Option<Answer> {
        self.answer.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Whether every piece has finished, for a submitter that polls
    /// completions itself instead of awaiting [`BatchProgress::all_done`].
    pub fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Resolves when every piece has finished.
    pub async fn all_done(&self) {
        if self.remaining.load(Ordering::Acquire) > 0 {
            self.done.notified().await;
        }
    }

    /// Marks the caller as answered; see [`BatchProgress::is_abandoned`].
    pub(crate) fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
    }

    /// Whether the caller was already answered: unsent pieces need not be sent.
    pub fn is_abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    /// The answer once every piece finished: the lowest-indexed failure, if any.
    pub fn outcome(&self) -> Result<(), SubmitError> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let error = self.error.lock().unwrap_or_else(|e| e.into_inner());
        match error.as_ref() {
            Some((index, e)) => Err(SubmitError::Op {
                index: *index,
                error: e.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The answer when the deadline passed first: a failure already seen, or
    /// `Timeout` counting the unfinished ops.
    pub fn timed_out(&self, timeout: Duration) -> SubmitError {
        self.abandon();
        self.outcome().err().unwrap_or(SubmitError::Timeout {
            timeout,
            unfinished: self.op_pieces[..self.ops]
                .iter()
                .filter(|c| c.load(Ordering::Acquire) > 0)
                .count(),
            total: self.ops,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Seen = std::sync::Arc<Mutex<Vec<Result<(), SubmitError>>>>;

    /// An answer that records what it was called with, and how often.
    fn recorder() -> (Answer, Seen) {
        let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        (Box::new(move |r| sink.lock().unwrap().push(r)), seen)
    }

    #[test]
    fn an_answer_is_given_exactly_once_by_whoever_finishes_first() {
        // The last piece answers.
        let p = BatchProgress::new([1, 1]);
        let (answer, seen) = recorder();
        p.answer_when_done(answer);
        p.piece_done(1, Err(OpError::AccessDenied));
        assert!(seen.lock().unwrap().is_empty(), "one piece still runs");
        p.piece_done(0, Ok(()));
        assert!(!p.expire(Duration::from_secs(1)), "already answered");
        let expected = Err(SubmitError::Op {
            index: 1,
            error: OpError::AccessDenied,
        });
        assert_eq!(*seen.lock().unwrap(), vec![expected]);

        // Finished before the answer was given: answered at once.
        let p = BatchProgress::new([1]);
        p.piece_done(0, Ok(()));
        let (answer, seen) = recorder();
        p.answer_when_done(answer);
        assert_eq!(*seen.lock().unwrap(), vec![Ok(())]);

        // The deadline answers; the piece finishing later does not again.
        let p = BatchProgress::new([2]);
        let (answer, seen) = recorder();
        p.answer_when_done(answer);
        p.piece_done(0, Ok(()));
        assert!(p.expire(Duration::from_secs(3)));
        assert!(p.is_abandoned());
        p.piece_done(0, Ok(()));
        let timeout = Err(SubmitError::Timeout {
            timeout: Duration::from_secs(3),
            unfinished: 1,
            total: 1,
        });
        assert_eq!(*seen.lock().unwrap(), vec![timeout]);
    }

    #[test]
    fn ops_finished_together_name_the_failing_one() {
        let p = BatchProgress::new([1, 1, 1, 1, 2]);
        let (answer, seen) = recorder();
        p.answer_when_done(answer);
        p.ops_done(0, 2, Ok(()));
        p.ops_done(2, 3, Err((1, OpError::ReadOnly)));
        assert!(seen.lock().unwrap().is_empty(), "op 4 has a piece left");
        assert_eq!(
            p.timed_out(Duration::from_secs(1)),
            SubmitError::Op {
                index: 3,
                error: OpError::ReadOnly
            }
        );
        p.piece_done(4, Ok(()));
        assert!(p.is_done());
    }

    #[test]
    fn lowest_failing_op_wins_and_timeouts_count_unfinished_ops() {
        let p = BatchProgress::new([2, 1, 1]);
        assert_eq!(p.total_pieces(), 4);
        p.piece_done(2, Err(OpError::AccessDenied));
        p.piece_done(0, Ok(()));
        assert_eq!(
            p.timed_out(Duration::from_secs(1)),
            SubmitError::Op {
                index: 2,
                error: OpError::AccessDenied
            }
        );
        assert!(p.is_abandoned());
        p.piece_done(1, Err(OpError::UnknownRegion));
        assert_eq!(
            p.outcome(),
            Err(SubmitError::Op {
                index: 1,
                error: OpError::UnknownRegion
            })
        );

        let q = BatchProgress::new([1, 2]);
        q.piece_done(1, Ok(()));
        assert_eq!(
            q.timed_out(Duration::from_secs(1)),
            SubmitError::Timeout {
                timeout: Duration::from_secs(1),
                unfinished: 2,
                total: 2
            }
        );
    }
}
