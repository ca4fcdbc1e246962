//! The copy threads: one per core (at most [`MAX_THREADS`]), shared by
//! every batch of the process, each taking chunks of the batch with the
//! fewest threads on it, the oldest first ([`Pool::pick`]).
//!
//! Why not a blocking thread or two per batch: a request moves in slices
//! of up to 1,024 ops, two or more in flight, and with each slice split
//! across its own threads the slices ran side by side and ended together.
//! Then every core waited while the request's task posted the next two
//! (a few hundred microseconds, each time), and only one thread copied
//! the last slice. A same-host request of 32,768 8 KiB reads had no copy
//! running for 15-40% of its time, and reached 0.6 of two threads'
//! `memcpy` of the same pairs. Here the threads finish the oldest slice
//! together, so it ends first, and its successor is posted while they
//! copy the next one; the last slice is shared too.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::oneshot;

use crate::copy::{Batch, Piece, copy_run};
use crate::pvm::Fail;

/// At most this many copy threads, however many cores: two batches at
/// once on as many threads as one batch may take (four, `copy.rs`).
const MAX_THREADS: usize = 8;

/// A batch's copies, cut into chunks that the threads (and, on a
/// current-thread runtime, the waiting task) claim one at a time.
pub(crate) struct Job {
    batch: Arc<Batch>,
    chunks: Vec<Vec<Piece>>,
    /// The next chunk to claim.
    next: AtomicUsize,
    /// Chunks copied.
    done: AtomicUsize,
    /// How many pool threads may work on it at once.
    limit: usize,
    /// Per planned op: 0 while no piece of it failed, else the first
    /// failure's code ([`code`]).
    outcome: Vec<AtomicU8>,
    /// Its submit stopped waiting (timed out, or dropped): the chunks not
    /// claimed yet are left, as a batch's later ops are after a timeout.
    abandoned: AtomicBool,
    finished: Mutex<Option<oneshot::Sender<()>>>,
}

impl Job {
    /// A job for `chunks` of `batch`, which up to `limit` pool threads
    /// work on; and the receiver that hears when every chunk is copied.
    pub fn new(
        batch: Arc<Batch>,
        chunks: Vec<Vec<Piece>>,
        limit: usize,
    ) -> (Arc<Job>, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let outcome = (0..batch.planned.len()).map(|_| AtomicU8::new(0)).collect();
        let job = Job {
            batch,
            chunks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            limit,
            outcome,
            abandoned: AtomicBool::new(false),
            finished: Mutex::new(Some(tx)),
        };
        (Arc::new(job), rx)
    }

    /// Copies the next unclaimed chunk; false when none is left.
    pub fn copy_next(&self) -> bool {
        if self.abandoned.load(Ordering::Relaxed) {
            return false;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let Some(chunk) = self.chunks.get(i) else {
            return false;
        };
        // A copy that panicked (a bug) fails its chunk's ops, not the
        // thread: the batch still ends, and the pool keeps its threads.
        let results = std::panic::catch_unwind(AssertUnwindSafe(|| copy_run(&self.batch, chunk)))
            .unwrap_or_else(|_| {
                let planned = chunk.iter().map(Piece::planned);
                planned.map(|p| (p, Err(Fail::Dead))).collect()
            });
        for (planned, result) in results {
            if let Err(fail) = result {
                // The first failure of an op is the one it reports.
                let _ = self.outcome[planned].compare_exchange(
                    0,
                    code(fail),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
        }
        // AcqRel: the last chunk's thread sees every other chunk's
        // outcome before it says the job is done.
        if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.chunks.len() {
            let tx = self
                .finished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(tx) = tx {
                let _ = tx.send(());
            }
        }
        true
    }

    /// Whether every chunk has been claimed (or none will be).
    fn exhausted(&self) -> bool {
        self.abandoned.load(Ordering::Relaxed)
            || self.next.load(Ordering::Relaxed) >= self.chunks.len()
    }

    /// Leaves the chunks not claimed yet uncopied.
    pub fn abandon(&self) {
        self.abandoned.store(true, Ordering::Relaxed);
    }

    /// How each planned op went, once the job is done (its receiver
    /// answered).
    pub fn outcome(&self) -> Vec<Result<(), Fail>> {
        (self.outcome.iter())
            .map(|c| match c.load(Ordering::Acquire) {
                0 => Ok(()),
                c => Err(fail(c)),
            })
            .collect()
    }
}

fn code(fail: Fail) -> u8 {
    match fail {
        Fail::Dead => 1,
        Fail::Refused => 2,
        Fail::Gone => 3,
        Fail::Fault => 4,
        Fail::ReadOnly => 5,
    }
}

fn fail(code: u8) -> Fail {
    match code {
        1 => Fail::Dead,
        2 => Fail::Refused,
        3 => Fail::Gone,
        4 => Fail::Fault,
        _ => Fail::ReadOnly,
    }
}

/// The queue the threads take jobs from.
pub(crate) struct Pool {
    /// Jobs with chunks left, oldest first, each with how many threads
    /// work on it now.
    jobs: Mutex<VecDeque<(Arc<Job>, usize)>>,
    work: Condvar,
}

/// The process's pool and how many threads it has, started at first use;
/// `None` where not one thread could be started. A child forked after
/// the threads started has none of them: it starts its own.
pub(crate) fn pool() -> Option<(&'static Pool, usize)> {
    type Started = (u32, Option<(&'static Pool, usize)>);
    static POOL: Mutex<Option<Started>> = Mutex::new(None);
    let pid = std::process::id();
    let mut current = POOL.lock().unwrap_or_else(|e| e.into_inner());
    match &*current {
        Some((started_in, pool)) if *started_in == pid => *pool,
        _ => current.insert((pid, start())).1,
    }
}

/// A pool with a thread per core, up to [`MAX_THREADS`]; `None` if not
/// one would start. Its memory is never freed: its threads run for the
/// life of the process.
fn start() -> Option<(&'static Pool, usize)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool: &'static Pool = Box::leak(Box::new(Pool::new()));
    let started = (0..cores.min(MAX_THREADS))
        .filter(|i| {
            let spawned = std::thread::Builder::new()
                .name(format!("ferry-copy-{i}"))
                .spawn(move || serve(pool));
            if let Err(e) = &spawned {
                tracing::warn!("ferry-memory: cannot start a copy thread: {e}");
            }
            spawned.is_ok()
        })
        .count();
    (started > 0).then_some((pool, started))
}

/// A copy thread: copies chunks of the job [`Pool::take`] gives it until
/// none is left or [`Pool::wanted_elsewhere`] says to move.
fn serve(pool: &'static Pool) {
    let mut left = None;
    loop {
        let job = pool.take(left.take());
        while job.copy_next() && !pool.wanted_elsewhere(&job) {}
        left = Some(job);
    }
}

impl Pool {
    fn new() -> Self {
        Pool {
            jobs: Mutex::new(VecDeque::new()),
            work: Condvar::new(),
        }
    }

    /// Hands `job` to the threads (none where its limit is 0: the caller
    /// copies it).
    pub(crate) fn push(&self, job: Arc<Job>) {
        if job.limit == 0 {
            return;
        }
        (self.jobs.lock().unwrap_or_else(|e| e.into_inner())).push_back((job, 0));
        self.work.notify_all();
    }

    /// The next job for a thread that `left` (if any), waiting for one.
    fn take(&self, left: Option<Arc<Job>>) -> Arc<Job> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(left) = left {
            Self::leave(&mut jobs, &left);
        }
        loop {
            if let Some(job) = Self::pick(&mut jobs) {
                return job;
            }
            jobs = self.work.wait(jobs).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn leave(jobs: &mut VecDeque<(Arc<Job>, usize)>, left: &Arc<Job>) {
        if let Some((_, workers)) = jobs.iter_mut().find(|(j, _)| Arc::ptr_eq(j, left)) {
            *workers -= 1;
        }
    }

    /// The job with the fewest threads on it, the oldest among equals,
    /// and room for one more: counted as taken. So the slices of one
    /// request end one after another, each finished by every thread that
    /// is free, while a batch that arrives behind a long one starts within
    /// a chunk's time (see [`Pool::wanted_elsewhere`]).
    fn pick(jobs: &mut VecDeque<(Arc<Job>, usize)>) -> Option<Arc<Job>> {
        jobs.retain(|(job, _)| !job.exhausted());
        let (job, workers) = (jobs.iter_mut())
            .filter(|(job, workers)| *workers < job.limit)
            .min_by_key(|(_, workers)| *workers)?;
        *workers += 1;
        Some(job.clone())
    }

    /// Whether a thread on `job` should move to another: one that no
    /// thread works on, while `job` has more than this one.
    fn wanted_elsewhere(&self, job: &Arc<Job>) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let shared = (jobs.iter()).any(|(j, workers)| Arc::ptr_eq(j, job) && *workers > 1);
        shared && (jobs.iter()).any(|(j, workers)| *workers == 0 && !j.exhausted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job of `chunks` chunks that copy nothing.
    fn job(chunks: usize, limit: usize) -> (Arc<Job>, oneshot::Receiver<()>) {
        let batch = Arc::new(Batch {
            planned: Vec::new(),
            targets: Vec::new(),
            keep: crate::copy::Keep::Ops(Vec::new()),
        });
        Job::new(batch, (0..chunks).map(|_| Vec::new()).collect(), limit)
    }

    fn workers(pool: &Pool) -> Vec<usize> {
        let jobs = pool.jobs.lock().unwrap();
        jobs.iter().map(|(_, w)| *w).collect()
    }

    #[test]
    fn threads_go_to_the_job_with_fewest_the_oldest_first_within_limits() {
        let pool = Pool::new();
        let (a, _) = job(8, 2);
        let (b, _) = job(8, 1);
        pool.push(a.clone());
        pool.push(b.clone());
        let mut jobs = pool.jobs.lock().unwrap();
        let picks: Vec<_> = (0..4).map(|_| Pool::pick(&mut jobs)).collect();
        drop(jobs);
        assert!(Arc::ptr_eq(picks[0].as_ref().unwrap(), &a));
        assert!(Arc::ptr_eq(picks[1].as_ref().unwrap(), &b));
        // b is at its limit of one: a again, then nothing has room.
        assert!(Arc::ptr_eq(picks[2].as_ref().unwrap(), &a));
        assert!(picks[3].is_none());
        assert_eq!(workers(&pool), [2, 1]);
    }

    #[test]
    fn a_thread_moves_to_a_job_nobody_serves_only_from_a_shared_one() {
        let pool = Pool::new();
        let (a, _) = job(8, 2);
        pool.push(a.clone());
        let first = pool.take(None);
        assert!(!pool.wanted_elsewhere(&first), "nothing else waits");
        let second = pool.take(None);
        let (b, _) = job(8, 2);
        pool.push(b.clone());
        assert!(pool.wanted_elsewhere(&second), "b waits, a has two threads");
        let moved = pool.take(Some(second));
        assert!(Arc::ptr_eq(&moved, &b));
        assert_eq!(workers(&pool), [1, 1]);
        // Each has one thread: nobody moves.
        assert!(!pool.wanted_elsewhere(&first));
        assert!(!pool.wanted_elsewhere(&moved));
    }

    #[test]
    fn a_job_says_done_once_after_its_last_chunk_and_leaves_the_queue() {
        let pool = Pool::new();
        let (a, mut done) = job(3, 2);
        pool.push(a.clone());
        let taken = pool.take(None);
        assert!(taken.copy_next() && taken.copy_next());
        assert!(done.try_recv().is_err(), "one chunk is left");
        assert!(taken.copy_next());
        assert!(!taken.copy_next(), "no fourth chunk");
        assert_eq!(done.try_recv(), Ok(()));
        assert_eq!(a.outcome(), Vec::<Result<(), Fail>>::new());
        let mut jobs = pool.jobs.lock().unwrap();
        assert!(Pool::pick(&mut jobs).is_none());
        assert!(jobs.is_empty(), "an exhausted job is dropped");
    }

    #[test]
    fn an_abandoned_job_copies_no_more_and_never_says_done() {
        let pool = Pool::new();
        let (a, mut done) = job(3, 2);
        pool.push(a.clone());
        assert!(a.copy_next());
        a.abandon();
        assert!(!a.copy_next());
        assert_eq!(a.done.load(Ordering::Relaxed), 1);
        assert!(done.try_recv().is_err());
        assert!(Pool::pick(&mut pool.jobs.lock().unwrap()).is_none());
    }
}
