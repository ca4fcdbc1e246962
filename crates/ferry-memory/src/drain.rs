//! The drain thread: where gates go whose registration dropped while a
//! peer's step was still in flight through them (see the invariant in
//! `gate.rs`), so that no caller's thread waits for a peer.
//!
//! A drained gate holds its region's memory in each stepping peer's name
//! (`MemoryHolder::ProcessVmPeer`) until that peer's step ends or the
//! peer exits; then the hold goes, and with the last one the gate is freed
//! for another registration. A peer that stays stopped keeps its hold for
//! as long as it stays stopped: the memory (and `from_raw`'s `keep_alive`)
//! is not handed back while a write may still land in it, and
//! `Region::close` names the process. It is logged every [`STUCK_AFTER`].
//!
//! One thread for the whole process, started with the first gate to drain
//! and ending once none is left: steps last microseconds, so it usually
//! lives for one nap. It polls (no futex to wait on: the counters live in
//! memory the peers write), napping from [`FIRST_NAP`] up to [`MAX_NAP`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::MemoryHold;

use crate::gate::{Gates, Holder};

/// How long a gate waits for a peer's step before the log says so. Steps
/// are at most one piece (about 100 µs), so only a stopped peer (a
/// debugger, `SIGSTOP`) holds a gate this long.
const STUCK_AFTER: Duration = Duration::from_secs(5);
/// The drain thread's first nap: a step usually ends within it.
const FIRST_NAP: Duration = Duration::from_micros(50);
/// Its longest nap, once peers have been stuck a while.
const MAX_NAP: Duration = Duration::from_millis(10);

/// A peer process with a step in flight through a closed gate.
pub(crate) struct Stuck {
    /// The peer's lane in the table.
    pub lane: u16,
    pub holder: Arc<Holder>,
    /// The region's memory, kept in the peer's name.
    pub hold: MemoryHold,
}

/// A closed gate waiting for its peers' steps.
pub(crate) struct Drain {
    gates: Arc<Gates>,
    index: u32,
    stuck: Vec<Stuck>,
    since: Instant,
}

impl Drain {
    pub fn new(gates: Arc<Gates>, index: u32, stuck: Vec<Stuck>) -> Drain {
        Drain {
            gates,
            index,
            stuck,
            since: Instant::now(),
        }
    }

    fn pids(&self) -> Vec<i32> {
        self.stuck.iter().map(|s| s.holder.pid).collect()
    }

    /// Takes out the holds of peers whose step ended (or who exited), into
    /// `released`; frees the gate once none is left, and says so.
    fn poll(&mut self, released: &mut Vec<MemoryHold>) -> bool {
        let table = self.gates.table();
        let mut at = 0;
        while at < self.stuck.len() {
            let s = &self.stuck[at];
            let stepping = table.in_flight(s.lane, self.index).load(Ordering::SeqCst) != 0;
            if stepping && !s.holder.pidfd.exited() {
                at += 1;
            } else {
                released.push(self.stuck.swap_remove(at).hold);
            }
        }
        if self.stuck.is_empty() {
            self.gates.free(self.index);
            return true;
        }
        if self.since.elapsed() >= STUCK_AFTER {
            tracing::error!(
                pids = ?self.pids(),
                "memory transport: peer processes have been inside a process_vm copy \
                 for {STUCK_AFTER:?} into a region that was dropped; its memory is held \
                 until their copy ends or they exit"
            );
            self.since = Instant::now();
        }
        false
    }
}

struct Queue {
    pending: Vec<Drain>,
    /// Whether the drain thread runs (it clears this as it ends, under the
    /// lock, so a gate handed off then starts a new one).
    running: bool,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    pending: Vec::new(),
    running: false,
});

fn lock() -> std::sync::MutexGuard<'static, Queue> {
    QUEUE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands `drain` to the drain thread, starting it if it does not run.
/// Never waits for a peer.
pub(crate) fn hand_off(drain: Drain) {
    tracing::warn!(
        pids = ?drain.pids(),
        "memory transport: a region was dropped while peer processes were inside a \
         process_vm copy into it; its memory is held until their copy ends"
    );
    let mut queue = lock();
    queue.pending.push(drain);
    if queue.running {
        return;
    }
    let started = std::thread::Builder::new()
        .name("ferry-gate-drain".into())
        .spawn(run);
    match started {
        Ok(_) => queue.running = true,
        // The gates stay queued, their memory held (never released early);
        // the next hand-off tries again.
        Err(e) => tracing::error!(
            "memory transport: cannot start the gate drain thread ({e}); \
             dropped regions' memory stays held until it can"
        ),
    }
}

/// The drain thread: polls the queued gates until none is left.
fn run() {
    let mut nap = FIRST_NAP;
    loop {
        let mut released = Vec::new();
        {
            let mut queue = lock();
            queue.pending.retain_mut(|d| !d.poll(&mut released));
            if queue.pending.is_empty() {
                queue.running = false;
                drop(queue);
                // Outside the lock: the last hold drops the caller's
                // `keep_alive`, whose drop may do anything (even register
                // another region).
                drop(released);
                return;
            }
        }
        if !released.is_empty() {
            nap = FIRST_NAP;
        }
        drop(released);
        std::thread::sleep(nap);
        nap = (nap * 2).min(MAX_NAP);
    }
}
