//! Who moves the bytes: NIXL's caller, while it polls, or a thread of the
//! plugin's own, while it does not.
//!
//! NIXL's callers (vLLM, SGLang, NIXL's benchmarks) post a request and
//! then spin on `check_xfer_state`, and the target side spins on
//! `get_new_notifs`; NIXL's UCX backend moves the bytes inside those
//! calls. With a runtime worker of ferry's own beside the spinning caller,
//! a 2-core host had four busy threads for two cores (two per process), and
//! a 1 MiB TCP write through NIXL ran at half of ferry's own Python API.
//!
//! So every engine of the process runs on one current-thread runtime, and
//! a caller that polls in a loop drives it: each `checkXfer` and
//! `getNotifs` (and a post) runs the tasks that are ready and polls the
//! sockets once, on the caller's thread, as UCX's progress does. Otherwise
//! the background thread drives it: a caller that checks now and then (a
//! serving loop's once per step) reads the status and leaves the runtime
//! where it is; one that polls again within [`HOT`] takes it over; and
//! [`QUIET`] after its last poll the background thread takes it back, so a
//! request posted and checked only later still moves, and a node still
//! serves its peers when its own agent is idle. A call never waits for the
//! runtime: when another thread drives it, the call leaves the work there.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;
use tokio::sync::Notify;

/// How long after a caller's last poll the background thread takes the
/// runtime back. It looks that often while a caller drives (two context
/// switches each time, on a core the callers need: at 200 us they were
/// 10,000 a second, most of a 2-core host's); only an in-flight request
/// whose caller stopped polling waits this long, once.
pub const QUIET: Duration = Duration::from_millis(1);

/// A caller polling again within this long is polling in a loop, and takes
/// the runtime over from the background thread (a Python loop calls in
/// every microsecond or few).
pub const HOT: Duration = Duration::from_micros(50);

/// The process's runtime and the state of who drives it.
pub struct Driver {
    runtime: Runtime,
    epoch: Instant,
    /// When a caller's last poll began, or its last drive ended, in
    /// nanoseconds since `epoch`.
    last_poll: AtomicU64,
    /// Set while a caller drives the runtime: it is polling, however long
    /// ago its poll began (a drive that receives a 16 MiB block takes
    /// milliseconds).
    caller_driving: AtomicBool,
    /// Set while the background thread drives the runtime (or is about
    /// to): a poll then leaves the work to it.
    background: AtomicBool,
    /// Ends the background thread's turn: a caller wants to drive.
    hand_over: Notify,
    /// Blocking calls waiting on the runtime right now: the background
    /// thread drives while there are any.
    blocked: AtomicUsize,
    /// Wakes the background thread from its wait for quiet.
    wake: (Mutex<()>, Condvar),
    /// Held by the caller driving the runtime: a second caller polling at
    /// the same time leaves the work to the first.
    polling: Mutex<()>,
}

/// The process's driver, with its background thread started.
pub fn driver() -> &'static Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    static BACKGROUND: std::sync::Once = std::sync::Once::new();
    let driver = DRIVER.get_or_init(|| Driver {
        runtime: tokio::runtime::Builder::new_current_thread()
            .thread_name("ferry-nixl")
            .enable_all()
            .build()
            .expect("a tokio runtime: an epoll instance"),
        epoch: Instant::now(),
        last_poll: AtomicU64::new(0),
        caller_driving: AtomicBool::new(false),
        background: AtomicBool::new(false),
        hand_over: Notify::new(),
        blocked: AtomicUsize::new(0),
        wake: (Mutex::new(()), Condvar::new()),
        polling: Mutex::new(()),
    });
    BACKGROUND.call_once(|| {
        std::thread::Builder::new()
            .name("ferry-nixl".into())
            .spawn(move || driver.background())
            .expect("a thread for the plugin's runtime");
    });
    driver
}

impl Driver {
    /// The runtime's handle, for nodes and requests to spawn their tasks.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime.handle()
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn since_last_poll(&self) -> Duration {
        Duration::from_nanos(self.now().saturating_sub(self.last_poll.load(SeqCst)))
    }

    /// Whether the callers have gone quiet: none drives now, and none
    /// polled for QUIET.
    fn quiet(&self) -> bool {
        !self.caller_driving.load(SeqCst) && self.since_last_poll() >= QUIET
    }

    /// Runs `future` to its end on the calling thread, the runtime driven
    /// meanwhile by the background thread (for a registration, a connect:
    /// NIXL's calls that wait by contract).
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        /// Counts a blocking call until it ends, panicking included (the
        /// boundary catches the panic; the count must not stay up).
        struct Blocked<'a>(&'a AtomicUsize);
        impl Drop for Blocked<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, SeqCst);
            }
        }
        self.blocked.fetch_add(1, SeqCst);
        let _blocked = Blocked(&self.blocked);
        // Under the lock, so the wake-up cannot fall between the
        // background thread's look at `blocked` and its wait.
        drop(self.wake.0.lock().unwrap_or_else(|e| e.into_inner()));
        self.wake.1.notify_one();
        self.runtime.handle().block_on(future)
    }

    /// One step of progress on the calling thread: the ready tasks run and
    /// the sockets are polled once (twice, so that what the poll woke also
    /// runs). Returns at once, having done nothing, when another thread
    /// drives the runtime; `false` then.
    pub fn poll(&self) -> bool {
        self.poll_with(|| (), |_| false).1
    }

    /// `start` (a request's post), then, unless `settled` says its result
    /// needs nothing more, one step of progress, on the calling thread
    /// when it may drive: inside the runtime, so what `start` spawns is
    /// queued here, without waking the runtime's thread. Whether this call
    /// drove, with `start`'s result.
    pub fn poll_with<T>(
        &self,
        start: impl FnOnce() -> T,
        settled: impl FnOnce(&T) -> bool,
    ) -> (T, bool) {
        let now = self.now();
        let previous = self.last_poll.swap(now, SeqCst);
        if self.blocked.load(SeqCst) > 0 {
            return (start(), false);
        }
        if self.background.load(SeqCst) {
            if Duration::from_nanos(now.saturating_sub(previous)) < HOT {
                self.hand_over.notify_one();
            }
            return (start(), false);
        }
        let Ok(_turn) = self.polling.try_lock() else {
            return (start(), false);
        };
        // The background thread saw this poll's time before deciding to
        // drive (see `background`), unless this thread stalled for longer
        // than QUIET since: then this permit ends its turn.
        self.hand_over.notify_one();
        /// Marks the caller's drive, and its end as a poll: a long drive
        /// is not quiet, and the next poll times its gap from its end.
        /// Also when the drive panics (the boundary catches it).
        struct Driving<'a>(&'a Driver);
        impl Drop for Driving<'_> {
            fn drop(&mut self) {
                self.0.last_poll.store(self.0.now(), SeqCst);
                self.0.caller_driving.store(false, SeqCst);
            }
        }
        self.caller_driving.store(true, SeqCst);
        let _driving = Driving(self);
        let out = self.runtime.block_on(async {
            let out = start();
            if !settled(&out) {
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
            }
            out
        });
        (out, true)
    }

    /// The background thread: waits until no caller has polled for
    /// QUIET and none drives (or a blocking call needs the runtime), then
    /// drives it until a caller polls.
    fn background(&self) {
        loop {
            {
                let mut guard = self.wake.0.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if self.quiet() || self.blocked.load(SeqCst) > 0 {
                        break;
                    }
                    // QUIET after the last poll, or, while a caller
                    // drives, QUIET from now.
                    let left = QUIET.saturating_sub(self.since_last_poll());
                    let wait = if left.is_zero() { QUIET } else { left };
                    guard = (self.wake.1.wait_timeout(guard, wait))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            // Announced before looking at the callers again, as a poll
            // stores its time before looking at this flag: of two at the
            // same moment, one sees the other.
            self.background.store(true, SeqCst);
            if self.quiet() || self.blocked.load(SeqCst) > 0 {
                self.runtime.block_on(self.hand_over.notified());
            }
            self.background.store(false, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    const DEADLINE: Duration = Duration::from_secs(10);

    /// The driver is the process's: one test at a time, or one test's
    /// blocking call keeps another's polls from driving.
    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        static SERIAL: Mutex<()> = Mutex::new(());
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn a_task_this_thread_never_polls_for_still_runs() {
        let _serial = one_at_a_time();
        let (tx, rx) = mpsc::channel();
        driver().handle().spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            tx.send(()).unwrap();
        });
        rx.recv_timeout(DEADLINE)
            .expect("the background thread drove the task to its end");
    }

    #[test]
    fn a_polling_caller_runs_the_tasks_itself() {
        let _serial = one_at_a_time();
        let driver = driver();
        let me = std::thread::current().id();
        let (tx, rx) = mpsc::channel();
        let (mut on_caller, mut driven) = (0, 0);
        for _ in 0..100 {
            let tx = tx.clone();
            driver.handle().spawn(async move {
                tx.send(std::thread::current().id()).unwrap();
            });
            let start = Instant::now();
            loop {
                driven += usize::from(driver.poll());
                if let Ok(ran_on) = rx.try_recv() {
                    on_caller += usize::from(ran_on == me);
                    break;
                }
                assert!(start.elapsed() < DEADLINE, "a task never ran");
            }
        }
        // Each poll leaves the work to the background thread when it
        // drives at that moment; a caller that keeps polling gets the
        // runtime within a hand-over, and then runs the tasks.
        assert!(driven > 0, "no poll ever drove the runtime");
        assert!(on_caller > 0, "no task ran on the polling thread");
    }

    #[test]
    fn a_drive_longer_than_quiet_keeps_the_runtime_on_the_caller() {
        let _serial = one_at_a_time();
        let driver = driver();
        let me = std::thread::current().id();
        let start = Instant::now();
        // A task that holds the caller's drive for five QUIETs, and then
        // tells whether the background thread set out to take over.
        loop {
            let (tx, rx) = mpsc::channel();
            driver.handle().spawn(async move {
                std::thread::sleep(5 * QUIET);
                let background = driver.background.load(SeqCst);
                tx.send((std::thread::current().id(), background)).unwrap();
            });
            let (ran_on, background) = loop {
                driver.poll();
                if let Ok(got) = rx.try_recv() {
                    break got;
                }
                assert!(start.elapsed() < DEADLINE, "the task never ran");
            };
            // Run by the background thread (it drove when the task came):
            // not the case this test is about; again.
            if ran_on == me {
                assert!(!background, "the background thread took a drive for quiet");
                break;
            }
            assert!(start.elapsed() < DEADLINE, "no poll ever drove the task");
        }
    }

    #[test]
    fn a_check_now_and_then_leaves_the_runtime_to_the_background_thread() {
        let _serial = one_at_a_time();
        let driver = driver();
        let start = Instant::now();
        while !driver.background.load(SeqCst) {
            assert!(
                start.elapsed() < DEADLINE,
                "the background thread never drove"
            );
            std::thread::sleep(QUIET);
        }
        for _ in 0..3 {
            std::thread::sleep(3 * QUIET);
            assert!(!driver.poll(), "a lone poll took the runtime");
            assert!(driver.background.load(SeqCst));
        }
    }

    #[test]
    fn a_blocking_call_completes_while_another_thread_polls() {
        let _serial = one_at_a_time();
        let driver = driver();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let poller = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(SeqCst) {
                    driver.poll();
                }
            })
        };
        let start = Instant::now();
        let slept = driver.block_on(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            start.elapsed()
        });
        stop.store(true, SeqCst);
        poller.join().unwrap();
        assert!(slept >= Duration::from_millis(20));
        assert!(start.elapsed() < DEADLINE);
    }
}
