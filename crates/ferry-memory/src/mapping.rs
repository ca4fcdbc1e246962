//! A peer's region mapped into this process (through the memfd its owner
//! granted), and what the initiator does with the mapping itself: locate
//! an op's bytes in it, watch its liveness word, fill in its page tables.
//! The invariant the liveness word keeps is `peer.rs`'s.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_core::{Generation, OpError, PAGE_SIZE};

use crate::shared::{alive, map_sealed};
use crate::wire::Reply;

/// The most bytes of one region [`Mapping::populate`] fills in: a bound
/// on the time (0.19 s per GiB here, a third of what faulting the pages
/// in costs) and page tables (2 MiB per GiB) that preparing a list over a
/// huge region takes; pages past it fault in on first use.
pub(crate) const POPULATE_MAX: u64 = 4 << 30;

/// [`Mapping::populate`] fills in this many bytes at a time (12 ms here),
/// checking between steps that the region is still registered.
const POPULATE_STEP: u64 = 64 << 20;

/// A peer's region mapped into this process.
pub(crate) struct Mapping {
    base: *mut u8,
    /// The region's bytes.
    len: u64,
    /// Where the liveness word is, from `base`.
    data_len: usize,
    /// The region's first byte in the owner: handles' addresses count
    /// from it.
    owner_base: u64,
    generation: Generation,
    writable: bool,
}

// SAFETY: a shared mapping valid until drop, accessed through raw pointers
// and the atomic liveness word only.
unsafe impl Send for Mapping {}
// SAFETY: as for Send.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the memfd `fd` as the reply describes it.
    pub fn map(fd: &OwnedFd, reply: Reply, generation: Generation, writable: bool) -> Option<Self> {
        let Reply::Granted {
            base,
            len,
            data_len,
        } = reply
        else {
            return None;
        };
        let data_len = usize::try_from(data_len).ok()?;
        // What the owner says is checked, not trusted: the mapping's length
        // must not overflow, and the memfd must hold it (below).
        let map_len = data_len.checked_add(PAGE_SIZE)?;
        if data_len % PAGE_SIZE != 0 || len > data_len as u64 {
            return None;
        }
        // The descriptor's size bounds what may be mapped, and its seal
        // keeps it so: neither a lying reply nor a later truncation can
        // make a copy through this mapping fault (SIGBUS).
        let mapped = map_sealed(fd.as_fd(), map_len, writable)?;
        Some(Mapping {
            base: mapped,
            len,
            data_len,
            owner_base: base,
            generation,
            writable,
        })
    }

    /// Fills in this process's page tables for the region's bytes at
    /// owner addresses `range` (clamped to the region, at most
    /// [`POPULATE_MAX`] bytes), so that the first copies through them do
    /// not take a page fault per 4 KiB. Best effort: a kernel without
    /// `MADV_POPULATE_*` (before 5.14) leaves the pages to fault in on
    /// first use. Blocks for as long as the kernel takes (0.19 s per GiB
    /// here).
    pub fn populate(&self, range: std::ops::Range<u64>) {
        let start = range.start.saturating_sub(self.owner_base).min(self.len);
        let end = range.end.saturating_sub(self.owner_base).min(self.len);
        let page = PAGE_SIZE as u64;
        let mut at = start / page * page;
        let end = end.div_ceil(page) * page;
        let end = end.min(at.saturating_add(POPULATE_MAX));
        let advice = if self.writable {
            libc::MADV_POPULATE_WRITE
        } else {
            libc::MADV_POPULATE_READ
        };
        // In steps, so that a region deregistered meanwhile stops it.
        while at < end && self.is_alive() {
            let len = (end - at).min(POPULATE_STEP);
            // SAFETY: `at..at + len` is page aligned and lies within the
            // mapping (`end` is at most the region's length rounded up to
            // a page, and the mapping's data part is page aligned and
            // holds the region); populating only fills in page tables, as
            // touching each page would.
            let failed =
                unsafe { libc::madvise(self.base.add(at as usize).cast(), len as usize, advice) }
                    != 0;
            if failed {
                let error = std::io::Error::last_os_error();
                tracing::debug!(%error, "memory transport: populating a mapping failed; its pages fault in on first use");
                return;
            }
            at += len;
        }
    }

    /// The region's generation the owner granted it under.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Whether it was granted (and mapped) for writes.
    pub fn writable(&self) -> bool {
        self.writable
    }

    fn liveness(&self) -> &AtomicU64 {
        // SAFETY: the trailer page is mapped (at least readable) while self
        // lives, page aligned; it is only accessed atomically.
        unsafe { AtomicU64::from_ptr(self.base.add(self.data_len).cast()) }
    }

    /// Whether the region is still registered under the mapping's
    /// generation.
    pub fn is_alive(&self) -> bool {
        self.liveness().load(Ordering::Acquire) == alive(self.generation)
    }

    /// Where the `len` remote bytes at the owner's address `addr` are in
    /// this mapping, after checking they lie inside the region.
    pub fn locate(&self, addr: u64, len: u64) -> Result<*mut u8, OpError> {
        let offset = addr.wrapping_sub(self.owner_base);
        if addr < self.owner_base || offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(OpError::OutOfBounds {
                offset,
                len,
                bound: self.len,
            });
        }
        // SAFETY: offset + len <= self.len <= data_len: inside the mapping.
        Ok(unsafe { self.base.add(offset as usize) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer used (this is the
        // last reference).
        unsafe { libc::munmap(self.base.cast(), self.data_len + PAGE_SIZE) };
    }
}
