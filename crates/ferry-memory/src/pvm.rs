//! The initiator's side of `process_vm_readv`/`process_vm_writev`: copies
//! straight between this process and a same-host owner's memory, for
//! regions the owner cannot share as a memfd (`MemoryBlock::from_raw`).
//!
//! The kernel allows them where the caller may ptrace the owner (same uid
//! and not made undumpable, or `CAP_SYS_PTRACE`, subject to Yama). Before
//! the first op on an owner this side [`probe`]s that once; a refusal is
//! remembered and the owner's `process_vm` regions go over the next
//! transport. Each step copies at most [`PIECE`] bytes through the owner's
//! gate (see `gate.rs`), so that a deregistration waits for one piece at
//! most; within a step the call is repeated until every byte moved,
//! because the kernel may move fewer than asked.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::{Generation, OpError, OpKind};

use crate::gate::{GATES, LANES, Table};

/// The most one step copies: a deregistration waits at most this long.
pub(crate) const PIECE: usize = 1 << 20;
/// The most segments one vectored call takes (the kernel's `UIO_MAXIOV`).
pub(crate) const IOVECS: usize = 1024;

/// What a probe of an owner found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The kernel lets this process reach the owner's memory.
    Permitted,
    /// It does not (`EPERM`): other transports carry the owner's regions.
    Refused,
    /// No such process (`ESRCH`): the owner is gone.
    Gone,
}

/// Whether this process may copy from process `pid`: one byte read at
/// `addr` (whatever is there, or nothing: a fault still says the kernel
/// allowed the access, since it checks the permission first).
pub(crate) fn probe(pid: i32, addr: u64) -> Probe {
    if pid <= 0 {
        return Probe::Refused;
    }
    let mut byte = 0u8;
    match transfer(pid, OpKind::Read, &raw mut byte, addr, 1) {
        Ok(()) | Err(Fail::Fault) => Probe::Permitted,
        Err(Fail::Gone) => Probe::Gone,
        Err(_) => Probe::Refused,
    }
}

/// Why a `process_vm` copy stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fail {
    /// The gate was shut: the region was deregistered (ask the owner why).
    Dead,
    /// `EPERM`: the kernel no longer lets this process reach the owner.
    Refused,
    /// `ESRCH`: the owner process is gone.
    Gone,
    /// `EFAULT` (or no progress): the owner's registered range is not
    /// mapped in it, which its registration promised it would be.
    Fault,
    /// A write to a region granted read-only.
    ReadOnly,
}

/// A region an owner granted over `process_vm`.
pub(crate) struct Grant {
    table: Arc<Table>,
    lane: u16,
    gate: u32,
    stamp: u64,
    /// The owner's pid, from the kernel (`SO_PEERCRED`).
    pid: i32,
    /// The region's first byte and length in the owner's address space.
    base: u64,
    len: u64,
    pub generation: Generation,
    pub writable: bool,
}

impl Grant {
    /// A grant as the owner's reply describes it; `None` if the reply
    /// names a gate or lane outside the table.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        table: Arc<Table>,
        lane: u16,
        gate: u32,
        stamp: u64,
        pid: i32,
        (base, len): (u64, u64),
        generation: Generation,
        writable: bool,
    ) -> Option<Grant> {
        ((gate as usize) < GATES && (lane as usize) < LANES && base.checked_add(len).is_some())
            .then_some(Grant {
                table,
                lane,
                gate,
                stamp,
                pid,
                base,
                len,
                generation,
                writable,
            })
    }

    /// Whether the region is still registered (its gate open).
    pub fn is_alive(&self) -> bool {
        self.table.live(self.gate).load(Ordering::Acquire) == self.stamp
    }

    /// The owner's address `addr` of `len` remote bytes, after checking
    /// they lie in the region.
    pub fn locate(&self, addr: u64, len: u64) -> Result<u64, OpError> {
        let offset = addr.wrapping_sub(self.base);
        if addr < self.base || offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(OpError::OutOfBounds {
                offset,
                len,
                bound: self.len,
            });
        }
        Ok(addr)
    }

    /// Copies `len` bytes between `local` and the owner's `remote`, one
    /// gated step of at most [`PIECE`] bytes at a time (the invariant in
    /// `gate.rs`).
    pub fn copy(&self, kind: OpKind, local: *mut u8, remote: u64, len: usize) -> Result<(), Fail> {
        // The kernel does not know the owner granted read-only: refused here.
        if kind == OpKind::Write && !self.writable {
            return Err(Fail::ReadOnly);
        }
        let counter = self.table.in_flight(self.lane, self.gate);
        let live = self.table.live(self.gate);
        let mut done = 0;
        while done < len {
            let piece = PIECE.min(len - done);
            counter.fetch_add(1, Ordering::SeqCst);
            let open = live.load(Ordering::SeqCst) == self.stamp;
            let moved = if open {
                // In range: done + piece <= len, the local range's length.
                transfer(
                    self.pid,
                    kind,
                    local.wrapping_add(done),
                    remote + done as u64,
                    piece,
                )
            } else {
                Err(Fail::Dead)
            };
            counter.fetch_sub(1, Ordering::SeqCst);
            moved?;
            done += piece;
        }
        Ok(())
    }
}

/// The two iovec lists of one vectored `process_vm` call, built a
/// segment at a time. A segment that continues the previous one on a side
/// extends that side's last iovec instead of adding one, each side on its
/// own: the kernel pins the owner's pages once per remote iovec (about
/// 600 ns each here), so 16,384 adjacent 64 B blocks, NIXL's descriptors
/// unmerged, took 16 calls of 1,024 iovecs and 780 ns per block, where one
/// iovec pair carries them all.
#[derive(Default)]
pub(crate) struct Vectors {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
    bytes: usize,
    segments: usize,
}

impl Vectors {
    /// Adds `len` bytes at `local` here and `remote` in the owner, unless
    /// that would take either side past [`IOVECS`] or the call past
    /// [`PIECE`] bytes: `false` then, and nothing changed.
    pub fn push(&mut self, local: *mut u8, remote: u64, len: usize) -> bool {
        if self.bytes + len > PIECE {
            return false;
        }
        let local_joins = self
            .local
            .last()
            .is_some_and(|v| (v.iov_base as usize).wrapping_add(v.iov_len) == local as usize);
        let remote_joins = self
            .remote
            .last()
            .is_some_and(|v| (v.iov_base as u64).wrapping_add(v.iov_len as u64) == remote);
        if (!local_joins && self.local.len() == IOVECS)
            || (!remote_joins && self.remote.len() == IOVECS)
        {
            return false;
        }
        let join = |list: &mut Vec<libc::iovec>, joins: bool, at: *mut libc::c_void| match list
            .last_mut()
        {
            Some(last) if joins => last.iov_len += len,
            _ => list.push(libc::iovec {
                iov_base: at,
                iov_len: len,
            }),
        };
        join(&mut self.local, local_joins, local.cast());
        join(&mut self.remote, remote_joins, remote as *mut libc::c_void);
        self.bytes += len;
        self.segments += 1;
        true
    }

    /// How many segments were pushed.
    pub fn segments(&self) -> usize {
        self.segments
    }
}

impl Grant {
    /// Copies `vectors`' segments between this process and the owner in
    /// one vectored call, as one gated step (at most [`IOVECS`] iovecs a
    /// side and [`PIECE`] bytes, as [`Vectors::push`] keeps them). `None`
    /// when the kernel moved fewer bytes than asked (a fault in one
    /// segment, or a short copy): the caller copies them one by one,
    /// which says which failed.
    pub fn copy_vectored(&self, kind: OpKind, vectors: &Vectors) -> Option<Result<(), Fail>> {
        if kind == OpKind::Write && !self.writable {
            return Some(Err(Fail::ReadOnly));
        }
        let (local, remote) = (&vectors.local, &vectors.remote);
        let counter = self.table.in_flight(self.lane, self.gate);
        counter.fetch_add(1, Ordering::SeqCst);
        let moved = if self.table.live(self.gate).load(Ordering::SeqCst) == self.stamp {
            // SAFETY: each local iovec covers ranges of ops' local regions
            // (adjacent ones joined, possibly of two regions that lie side
            // by side), all kept alive by the batch for the call; the
            // remote iovecs are only dereferenced by the kernel in the
            // owner, which checks them; the counts are the vectors'
            // lengths (at most IOVECS).
            let n = unsafe {
                let (l, r) = (local.as_ptr(), remote.as_ptr());
                let (ln, rn) = (local.len() as libc::c_ulong, remote.len() as libc::c_ulong);
                match kind {
                    OpKind::Read => libc::process_vm_readv(self.pid, l, ln, r, rn, 0),
                    OpKind::Write => libc::process_vm_writev(self.pid, l, ln, r, rn, 0),
                }
            };
            match n {
                n if n >= 0 && n as usize == vectors.bytes => Some(Ok(())),
                n if n >= 0 => None,
                _ => match std::io::Error::last_os_error().raw_os_error() {
                    Some(libc::EPERM | libc::EACCES) => Some(Err(Fail::Refused)),
                    Some(libc::ESRCH) => Some(Err(Fail::Gone)),
                    // EINTR, EFAULT, ...: one by one, with its retries.
                    _ => None,
                },
            }
        } else {
            Some(Err(Fail::Dead))
        };
        counter.fetch_sub(1, Ordering::SeqCst);
        moved
    }
}

/// Moves `len` bytes between `local` (this process) and `remote` (process
/// `pid`), repeating the call until every byte moved: the kernel may stop
/// short (it copies page by page and stops at a fault).
fn transfer(pid: i32, kind: OpKind, local: *mut u8, remote: u64, len: usize) -> Result<(), Fail> {
    let mut done = 0;
    while done < len {
        let local_iov = libc::iovec {
            iov_base: local.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote + done as u64) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec is `len - done` bytes of memory this
        // process owns for the call (an op's local region, kept alive by
        // the op, or a byte on the stack); the remote iovec is only
        // dereferenced by the kernel in the other process, which checks it.
        let n = unsafe {
            match kind {
                OpKind::Read => libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0),
                OpKind::Write => libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0),
            }
        };
        if n < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EPERM | libc::EACCES) => return Err(Fail::Refused),
                Some(libc::ESRCH) => return Err(Fail::Gone),
                _ => return Err(Fail::Fault),
            }
        }
        if n == 0 {
            return Err(Fail::Fault);
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_within_this_process_in_pieces_and_probes() {
        // SAFETY: a plain getter.
        let me = unsafe { libc::getpid() };
        let src: Vec<u8> = (0..(3 * PIECE + 5)).map(|i| (i * 7) as u8).collect();
        assert_eq!(probe(me, src.as_ptr() as u64), Probe::Permitted);
        assert_eq!(probe(me, 0), Probe::Permitted, "a fault is no refusal");
        let mut dst = vec![0u8; src.len()];
        transfer(
            me,
            OpKind::Read,
            dst.as_mut_ptr(),
            src.as_ptr() as u64,
            src.len(),
        )
        .unwrap();
        assert_eq!(dst, src);
        assert_eq!(
            transfer(me, OpKind::Read, dst.as_mut_ptr(), 8, 4),
            Err(Fail::Fault)
        );
    }

    #[test]
    fn vectors_join_segments_that_continue_on_each_side_alone() {
        /// An iovec list as (address, length) pairs.
        type Spans = Vec<(usize, usize)>;
        let list = |l: &[libc::iovec]| -> Spans {
            l.iter().map(|v| (v.iov_base as usize, v.iov_len)).collect()
        };
        let sides = |v: &Vectors| (list(&v.local), list(&v.remote));
        let at = |a: usize| a as *mut u8;
        let mut v = Vectors::default();
        assert!(v.push(at(100), 5000, 10));
        assert!(v.push(at(110), 5010, 6), "both continue");
        assert!(v.push(at(116), 9000, 4), "only the local side continues");
        assert!(v.push(at(300), 9004, 4), "only the remote side continues");
        assert!(v.push(at(50), 20, 1), "neither");
        assert_eq!(v.segments(), 5);
        assert_eq!(v.bytes, 25);
        assert_eq!(
            sides(&v),
            (
                vec![(100, 20), (300, 4), (50, 1)],
                vec![(5000, 16), (9000, 8), (20, 1)],
            )
        );

        // Bounds: bytes, then iovecs per side; a refused push changes nothing.
        let mut v = Vectors::default();
        assert!(v.push(at(0), 0, PIECE - 1));
        assert!(!v.push(at(PIECE - 1), (PIECE - 1) as u64, 2));
        assert!(
            v.push(at(PIECE - 1), (PIECE - 1) as u64, 1),
            "fills PIECE exactly"
        );
        let mut v = Vectors::default();
        for k in 0..IOVECS {
            assert!(v.push(at(2 * k), k as u64, 1), "apart here, adjacent there");
        }
        assert!(
            !v.push(at(2 * IOVECS), IOVECS as u64, 1),
            "a 1,025th local iovec"
        );
        assert!(
            v.push(at(2 * IOVECS - 1), IOVECS as u64, 1),
            "continues both sides"
        );
        assert_eq!(sides(&v).1, vec![(0, IOVECS + 1)]);
        assert_eq!(v.segments(), IOVECS + 1);
    }
}
