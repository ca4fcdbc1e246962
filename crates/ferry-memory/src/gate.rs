//! The gate table: how an owner knows that no `process_vm_writev` of a
//! peer lands in its memory after the registration is dropped.
//!
//! Memory wrapped with `MemoryBlock::from_raw` is the caller's: once its
//! region is dropped, the caller may reuse it at once. A memfd region's
//! late write lands in orphaned pages; a late `process_vm_writev` would
//! land in whatever the caller put there since. So each such registration
//! gets a *gate*, and every peer copy passes through it.
//!
//! The table is one sealed memfd per owner, mapped read-write by the owner
//! and by every same-host peer it grants a `process_vm` region (sent once
//! with each grant). It holds, per gate, a *live word* (the registration's
//! stamp while it is registered, 0 after), and per *lane* (one per peer
//! process) and gate an *in-flight counter*.
//!
//! **Invariant (no write once the memory is released).** A peer copies at
//! most [`PIECE`](crate::pvm::PIECE) bytes per step, and each step is:
//! increment its lane's counter for the gate, read the live word, copy only
//! if it holds the grant's stamp, decrement — all four SeqCst. The owner's
//! deregistration ([`Gate::close`]) stores 0 in the live word (SeqCst); the
//! gate, and with it a hold on the region's `MemoryBlock`, is then kept
//! until every lane's counter for the gate has been seen 0 or that lane's
//! peer process has exited. In the single total order of SeqCst
//! operations, a step whose read saw the stamp comes before the owner's
//! store, so its increment does too, and the owner's later read of the
//! counter sees it until the step's decrement, which follows the end of
//! its system call. A process that has exited (its pidfd readable: every
//! thread left the kernel) cannot write. Hence no piece lands once the hold
//! is gone, and so none once `MemoryBlock::from_raw`'s `keep_alive` has
//! been dropped (the hold keeps the block, which keeps `keep_alive`).
//! Enforced here (the owner's half: [`Gate`]'s drop and `drain.rs`) and in
//! `pvm.rs` (the peer's half).
//!
//! **No thread waits for a peer.** A step takes microseconds, but a peer
//! stopped inside one (`SIGSTOP`, a debugger) stays inside for as long as
//! it is stopped, and nothing can take a started `process_vm_writev` back:
//! the peer has the pid and the address, and the kernel lets it. Killing it
//! would be drastic and is not ferry's call. So a gate whose steps are not
//! all done when its registration drops goes to the drain thread
//! (`drain.rs`), holding the memory in the stopped peer's name
//! (`MemoryHolder::ProcessVmPeer`), for as long as the peer stays stopped
//! or until it exits; the drop itself returns at once, and
//! `Region::close` says which process holds the memory.
//!
//! A lane belongs to one peer process, named by a pidfd the owner takes
//! from the socket (`SO_PEERPIDFD`, else `pidfd_open` of `SO_PEERCRED`'s
//! pid): the kernel names the peer, not the peer's words. A lane of a
//! process that exited is wiped and given to the next process.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::{MemoryBlock, MemoryHolder};

use crate::drain::{Drain, Stuck};

/// Registrations one owner carries over `process_vm` at once; more go over
/// the next transport.
pub(crate) const GATES: usize = 4096;
/// Peer processes one owner grants `process_vm` regions at once.
pub(crate) const LANES: usize = 1024;
const LIVE_BYTES: usize = GATES * 8;
const LANE_BYTES: usize = GATES * 4;
/// The memfd's length: live words, then the lanes' counters. Sparse: a
/// page is only allocated when touched.
pub(crate) const TABLE_LEN: usize = LIVE_BYTES + LANES * LANE_BYTES;

/// A mapping of a gate table: the owner's, or a peer's.
pub(crate) struct Table {
    base: *mut u8,
}

// SAFETY: shared memory valid until drop, only accessed through atomics.
unsafe impl Send for Table {}
// SAFETY: as for Send.
unsafe impl Sync for Table {}

impl Table {
    /// A fresh table in a sealed memfd, and the memfd.
    fn create() -> std::io::Result<(Table, OwnedFd)> {
        // SAFETY: a NUL-terminated name and valid flags; failure is -1.
        let raw = unsafe {
            libc::memfd_create(
                c"ferry-gates".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: memfd_create just returned it; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on a descriptor this function owns.
        let sealed = unsafe {
            libc::ftruncate(raw, TABLE_LEN as libc::off_t) == 0
                && libc::fcntl(
                    raw,
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
                ) == 0
        };
        if !sealed {
            return Err(std::io::Error::last_os_error());
        }
        let table = Table::map_raw(raw).ok_or_else(std::io::Error::last_os_error)?;
        Ok((table, fd))
    }

    /// Maps a table an owner sent, after checking that the memfd is long
    /// enough and sealed against shrinking (so no access can fault).
    pub fn map(fd: &OwnedFd) -> Option<Table> {
        use std::os::fd::AsFd;
        crate::shared::map_sealed(fd.as_fd(), TABLE_LEN, true).map(|base| Table { base })
    }

    fn map_raw(raw: RawFd) -> Option<Table> {
        // SAFETY: a shared mapping of the table's length of a memfd at
        // least that long and sealed against shrinking; no address hint.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                TABLE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        (base != libc::MAP_FAILED).then(|| Table { base: base.cast() })
    }

    /// Gate `gate`'s live word; `gate < GATES`.
    pub fn live(&self, gate: u32) -> &AtomicU64 {
        assert!((gate as usize) < GATES);
        // SAFETY: inside the mapping (checked above), 8-byte aligned (the
        // mapping is page aligned), only ever accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.add(gate as usize * 8).cast()) }
    }

    /// Lane `lane`'s in-flight counter for gate `gate`.
    pub fn in_flight(&self, lane: u16, gate: u32) -> &AtomicU32 {
        assert!((gate as usize) < GATES && (lane as usize) < LANES);
        let at = LIVE_BYTES + lane as usize * LANE_BYTES + gate as usize * 4;
        // SAFETY: inside the mapping (checked above), 4-byte aligned, only
        // ever accessed atomically.
        unsafe { AtomicU32::from_ptr(self.base.add(at).cast()) }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map_raw`, no longer used.
        unsafe { libc::munmap(self.base.cast(), TABLE_LEN) };
    }
}

/// A pidfd: whether the process it names has exited.
pub(crate) struct Pidfd(OwnedFd);

impl Pidfd {
    /// The peer process on the other end of `socket`, as the kernel names
    /// it. `SO_PEERPIDFD` (Linux 6.5) names it race-free; before that,
    /// `pidfd_open` of `SO_PEERCRED`'s pid (which could, if the peer died
    /// in between, name a newer process with its pid: one that never had a
    /// grant, so waiting for it is merely slower).
    pub fn of_peer(socket: BorrowedFd<'_>, pid: Option<i32>) -> Option<Pidfd> {
        /// `SO_PEERPIDFD` where the generic socket constants apply.
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        const SO_PEERPIDFD: libc::c_int = 77;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        {
            let mut fd: libc::c_int = -1;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into `fd`.
            let ok = unsafe {
                libc::getsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    SO_PEERPIDFD,
                    (&raw mut fd).cast(),
                    &mut len,
                )
            } == 0;
            if ok && fd >= 0 {
                // SAFETY: the kernel just made this descriptor for us.
                return Some(Pidfd(unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        let _ = socket;
        Pidfd::open(pid.filter(|&p| p > 0)?)
    }

    /// A pidfd for `pid`.
    pub fn open(pid: i32) -> Option<Pidfd> {
        // SAFETY: a plain syscall; failure is -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: pidfd_open just returned it; nothing else owns it.
        Some(Pidfd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
    }

    /// Whether the process has exited: every one of its threads has left
    /// the kernel, so none is inside a `process_vm_writev`.
    pub fn exited(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, no wait.
        let n = unsafe { libc::poll(&mut poll, 1, 0) };
        n > 0 && poll.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// A lane's peer process.
pub(crate) struct Holder {
    pub pid: i32,
    pub pidfd: Pidfd,
}

struct State {
    /// Gates free for a registration.
    free: Vec<u32>,
    /// Gates never used yet start here.
    fresh: u32,
    lanes: Vec<Option<Arc<Holder>>>,
}

/// An owner's gate table and who holds which gate and lane.
pub(crate) struct Gates {
    table: Table,
    fd: OwnedFd,
    /// Stamps are never reused: a peer's grant of an earlier registration
    /// in the same gate never matches the live word.
    serial: AtomicU64,
    state: Mutex<State>,
}

impl Gates {
    /// A fresh table; `None` where this kernel cannot give one (no memfd,
    /// no pidfds), and `from_raw` memory then goes over the next transport.
    pub fn new() -> Option<Arc<Gates>> {
        // SAFETY: a plain getter.
        Pidfd::open(unsafe { libc::getpid() })?;
        let (table, fd) = Table::create().ok()?;
        Some(Arc::new(Gates {
            table,
            fd,
            serial: AtomicU64::new(1),
            state: Mutex::new(State {
                free: Vec::new(),
                fresh: 0,
                lanes: vec![None; LANES],
            }),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The table's memfd, for a grant.
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// The table itself (for this node's own view and tests).
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Gate `index` is shut and no step through it can still write: free
    /// for another registration.
    pub(crate) fn free(&self, index: u32) {
        self.lock().free.push(index);
    }

    /// A gate for a new registration of `memory`, open (live); `None` if
    /// all are taken. The gate holds `memory` until no step through it can
    /// write any more (the invariant).
    pub fn open(self: &Arc<Self>, memory: Arc<MemoryBlock>) -> Option<Gate> {
        let index = {
            let mut state = self.lock();
            match state.free.pop() {
                Some(index) => index,
                None if (state.fresh as usize) < GATES => {
                    state.fresh += 1;
                    state.fresh - 1
                }
                None => return None,
            }
        };
        let stamp = (self.serial.fetch_add(1, Ordering::Relaxed) << 1) | 1;
        self.table.live(index).store(stamp, Ordering::SeqCst);
        Some(Gate {
            gates: self.clone(),
            index,
            stamp,
            memory,
        })
    }

    /// The lane of the peer process behind `pidfd` (whose pid is `pid`):
    /// its own if it has one, else a free one, wiped. `None` if every lane
    /// belongs to a live process.
    pub fn lane(&self, pid: i32, pidfd: Pidfd) -> Option<u16> {
        let mut state = self.lock();
        if let Some(at) = state.lanes.iter().position(|l| {
            l.as_ref()
                .is_some_and(|h| h.pid == pid && !h.pidfd.exited())
        }) {
            return Some(at as u16);
        }
        let at = state
            .lanes
            .iter()
            .position(|l| l.as_ref().is_none_or(|h| h.pidfd.exited()))?;
        // The lane's last process is gone (or it never had one): its
        // counters may hold what a dying peer left. Wiped before the new
        // process gets the lane; a deregistration waiting on the old
        // holder sees it exited and stops looking at this lane.
        for gate in 0..GATES as u32 {
            self.table
                .in_flight(at as u16, gate)
                .store(0, Ordering::SeqCst);
        }
        state.lanes[at] = Some(Arc::new(Holder { pid, pidfd }));
        Some(at as u16)
    }
}

/// One registration's gate. Dropping it closes it (if [`Gate::close`]
/// was not called) without waiting for anyone: the gate and its hold on the
/// memory go at once if no peer step is in flight through it, else to the
/// drain thread until none is (the module's invariant).
pub(crate) struct Gate {
    gates: Arc<Gates>,
    index: u32,
    stamp: u64,
    /// The registration's memory, kept until no step can write into it.
    memory: Arc<MemoryBlock>,
}

impl Gate {
    /// Its index in the table.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// What the live word holds while it is open.
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    /// Whether it is still open.
    #[cfg(test)]
    pub fn is_open(&self) -> bool {
        self.gates.table.live(self.index).load(Ordering::SeqCst) == self.stamp
    }

    /// Closes the gate: no step that starts from now on copies through it.
    /// Steps already past their check may still be copying; the drop waits
    /// those out, off this thread.
    pub fn close(&self) {
        self.gates.table.live(self.index).store(0, Ordering::SeqCst);
    }

    /// The peer processes whose steps through this gate may still write:
    /// their lane's counter is not 0 and they have not exited. Read after
    /// [`close`](Self::close), so any step it misses started after the
    /// close and will not copy.
    fn stuck(&self) -> Vec<(u16, Arc<Holder>)> {
        let table = &self.gates.table;
        let holders: Vec<(u16, Arc<Holder>)> = self
            .gates
            .lock()
            .lanes
            .iter()
            .enumerate()
            .filter_map(|(i, h)| Some((i as u16, h.clone()?)))
            .collect();
        holders
            .into_iter()
            .filter(|(lane, holder)| {
                table.in_flight(*lane, self.index).load(Ordering::SeqCst) != 0
                    && !holder.pidfd.exited()
            })
            .collect()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.close();
        let stuck = self.stuck();
        if stuck.is_empty() {
            // No step can write: the memory goes with this gate, now.
            self.gates.free(self.index);
            return;
        }
        // Held in each stepping peer's name until its step ends or it
        // exits; the gate is freed only then, so its counters are not
        // reused under a step still in flight.
        let stuck = stuck
            .into_iter()
            .map(|(lane, holder)| Stuck {
                hold: self
                    .memory
                    .hold(MemoryHolder::ProcessVmPeer { pid: holder.pid }),
                lane,
                holder,
            })
            .collect();
        crate::drain::hand_off(Drain::new(self.gates.clone(), self.index, stuck));
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn block() -> Arc<MemoryBlock> {
        Arc::new(MemoryBlock::alloc(4096).unwrap())
    }

    /// Waits (a generous deadline) until `done`.
    fn eventually(what: &str, done: impl Fn() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn gates_are_stamped_closed_and_reused_with_a_new_stamp() {
        let gates = Gates::new().expect("memfd and pidfds");
        let a = gates.open(block()).unwrap();
        assert!(a.is_open());
        let (index, stamp) = (a.index(), a.stamp());
        assert_eq!(gates.table().live(index).load(Ordering::SeqCst), stamp);
        // SAFETY: a plain getter.
        let me = unsafe { libc::getpid() };
        let lane = gates.lane(me, Pidfd::open(me).unwrap()).unwrap();
        assert_eq!(gates.lane(me, Pidfd::open(me).unwrap()), Some(lane));
        a.close();
        assert!(!a.is_open());
        drop(a);
        let b = gates.open(block()).unwrap();
        assert_eq!(b.index(), index, "the gate is reused");
        assert_ne!(b.stamp(), stamp, "with a new stamp");
    }

    #[test]
    fn a_step_in_flight_holds_the_memory_not_the_dropping_thread() {
        let gates = Gates::new().unwrap();
        // SAFETY: a plain getter.
        let me = unsafe { libc::getpid() };
        let lane = gates.lane(me, Pidfd::open(me).unwrap()).unwrap();
        let memory = block();
        let gate = gates.open(memory.clone()).unwrap();
        let index = gate.index();
        // A step of this process is "inside its copy".
        let counter = gates.table().in_flight(lane, index);
        counter.fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        drop(gate);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "the drop waited for the step"
        );
        assert_eq!(
            gates.table().live(index).load(Ordering::SeqCst),
            0,
            "closed"
        );
        // The memory is held until the step ends, and the gate not reused.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(Arc::strong_count(&memory), 2, "the memory was let go");
        let other = gates.open(block()).unwrap();
        assert_ne!(other.index(), index, "a gate with a step in flight reused");
        counter.fetch_sub(1, Ordering::SeqCst);
        eventually("the memory is let go once the step ended", || {
            Arc::strong_count(&memory) == 1
        });
        eventually("the gate is freed", || gates.lock().free.contains(&index));
        drop(other);
    }

    #[test]
    fn a_lane_of_an_exited_process_holds_nothing_up() {
        let gates = Gates::new().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let pidfd = Pidfd::open(pid).unwrap();
        let lane = gates.lane(pid, pidfd).unwrap();
        let memory = block();
        let gate = gates.open(memory.clone()).unwrap();
        // The child "died inside a step".
        gates
            .table()
            .in_flight(lane, gate.index())
            .store(1, Ordering::SeqCst);
        child.wait().unwrap();
        drop(gate);
        eventually("an exited peer holds the memory", || {
            Arc::strong_count(&memory) == 1
        });
    }
}
