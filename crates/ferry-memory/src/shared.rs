//! Shared regions: memory ferry allocates in a sealed memfd, so that a
//! process on the same host can map the very same pages.
//!
//! Layout of the memfd: the region's bytes, rounded up to a page, then one
//! trailer page whose first word is the region's *liveness word*:
//! `alive(generation)` while the region is registered under that
//! generation, 0 otherwise. Peers map the trailer with the bytes and read
//! the word around every copy (see `peer.rs`), which is how a deregistered
//! region is refused without a round trip per op.
//!
//! The memfd is sealed against shrinking and growing before anyone maps
//! it: no process can truncate it under a peer's mapping, so a copy through
//! a mapping can never fault (`SIGBUS`), even after the owner died. Pages
//! live while any mapping or descriptor does; they are never reused for
//! another region, so a copy through a stale mapping touches only that
//! region's orphaned pages.

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;

use ferry_core::{Generation, MemoryBlock, PAGE_SIZE, RegisterError};

/// The liveness word's value for a region registered under `generation`.
pub fn alive(generation: Generation) -> u64 {
    (u64::from(generation.0) << 1) | 1
}

/// The owner's mapping of a shared region; kept alive by the region's
/// [`MemoryBlock`] and recognized by the memory backend at registration.
pub struct SharedMapping {
    fd: OwnedFd,
    base: *mut u8,
    /// Bytes the region has (what the block exposes).
    len: usize,
    /// The bytes rounded up to a page: where the trailer starts.
    data_len: usize,
}

// SAFETY: the mapping is plain shared memory valid until drop; every access
// goes through raw pointers or the atomic liveness word.
unsafe impl Send for SharedMapping {}
// SAFETY: as for Send.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// The memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: shared regions are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the trailer page starts (the memfd's mapped length is this
    /// plus one page).
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// The first byte.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// The liveness word.
    pub fn liveness(&self) -> &AtomicU64 {
        // SAFETY: the trailer page is mapped read-write for as long as self
        // lives and starts page aligned, so the word is aligned and valid;
        // every access to it is atomic.
        unsafe { AtomicU64::from_ptr(self.base.add(self.data_len).cast()) }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: base..base+data_len+PAGE_SIZE is the mapping made in
        // `alloc`; the block that exposed it is gone (this is its guard).
        unsafe { libc::munmap(self.base.cast(), self.data_len + PAGE_SIZE) };
    }
}

/// Allocates `len` zeroed bytes in a sealed memfd, mapped shared.
pub fn alloc(len: u64) -> Result<MemoryBlock, RegisterError> {
    let out_of_memory = || RegisterError::OutOfMemory(len);
    if len == 0 {
        return Err(RegisterError::ZeroLength);
    }
    let len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= isize::MAX as usize / 2)
        .ok_or(RegisterError::TooLarge(len))?;
    let data_len = len.next_multiple_of(PAGE_SIZE);
    let map_len = data_len + PAGE_SIZE;
    // SAFETY: a NUL-terminated name and valid flags; failure is -1.
    let raw = unsafe {
        libc::memfd_create(
            c"ferry-region".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(out_of_memory());
    }
    // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let fd_raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: plain syscalls on a descriptor this function owns.
    let sealed = unsafe {
        libc::ftruncate(fd_raw, map_len as libc::off_t) == 0
            && libc::fcntl(
                fd_raw,
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            ) == 0
    };
    if !sealed {
        return Err(out_of_memory());
    }
    // SAFETY: a shared mapping of the whole memfd, no address hint.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd_raw,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(out_of_memory());
    }
    let mapping = SharedMapping {
        fd,
        base: base.cast(),
        len,
        data_len,
    };
    let ptr = std::ptr::NonNull::new(mapping.base).ok_or_else(out_of_memory)?;
    // SAFETY: `len` bytes at `ptr` stay mapped read-write until the guard
    // (the mapping) drops, which the block does last.
    unsafe { MemoryBlock::from_raw(ptr, len as u64, Box::new(mapping)) }
}

/// Maps the first `map_len` bytes of a memfd another process handed over,
/// shared, after checking what it is rather than trusting its sender: it
/// must hold `map_len` bytes and be sealed against shrinking, so that no
/// truncation, then or later, can make an access through the mapping fault
/// (`SIGBUS`). `None` if it is not such a memfd or cannot be mapped; the
/// caller unmaps what it gets.
pub(crate) fn map_sealed(fd: BorrowedFd<'_>, map_len: usize, writable: bool) -> Option<*mut u8> {
    use std::os::fd::AsRawFd;
    let raw = fd.as_raw_fd();
    // SAFETY: stat is plain data, which fstat fills; F_GET_SEALS only reads.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
    // SAFETY: fstat writes into a local struct.
    if unsafe { libc::fstat(raw, &mut stat) } != 0
        || (stat.st_size as u64) < map_len as u64
        || seals < 0
        || seals & libc::F_SEAL_SHRINK == 0
    {
        return None;
    }
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: a shared mapping of the first map_len bytes of the memfd,
    // which is at least that long and sealed against shrinking.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            prot,
            libc::MAP_SHARED,
            raw,
            0,
        )
    };
    (mapped != libc::MAP_FAILED).then_some(mapped.cast())
}

/// The shared mapping behind `block`, if ferry allocated it here.
pub fn mapping_of(block: &MemoryBlock) -> Option<&SharedMapping> {
    block.keep_alive()?.downcast_ref::<SharedMapping>()
}

/// This kernel's boot id: two processes with the same one run on the same
/// host (and kernel). Not proof enough by itself: the socket connect is.
pub fn boot_id() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    u128::from_str_radix(&hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn shared_regions_are_sealed_zeroed_and_carry_a_liveness_word() {
        let block = alloc(10_000).unwrap();
        assert_eq!(block.len(), 10_000);
        assert!(block.to_vec().iter().all(|&b| b == 0));
        let mapping = mapping_of(&block).expect("a shared block");
        assert_eq!(mapping.data_len(), 12_288);
        mapping
            .liveness()
            .store(alive(Generation(7)), Ordering::Release);
        assert_eq!(mapping.liveness().load(Ordering::Acquire), 15);
        // Nobody, the owner included, can shrink it under a mapping.
        let fd = std::os::fd::AsRawFd::as_raw_fd(&mapping.fd());
        // SAFETY: a plain syscall on a live descriptor.
        assert_ne!(unsafe { libc::ftruncate(fd, 0) }, 0);
        // Plain memory has no mapping to share.
        assert!(mapping_of(&MemoryBlock::alloc(4096).unwrap()).is_none());
        assert!(boot_id().is_some());
    }
}
