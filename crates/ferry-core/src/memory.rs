//! Registered memory and the rule that keeps it safe.
//!
//! # The lifetime invariant
//!
//! No registered byte is freed, reused or deregistered while a transfer may
//! still touch it. It is enforced by reference counts, not by bookkeeping:
//!
//! * The bytes live in a [`MemoryBlock`], always behind an `Arc`.
//! * A [`Region`] is an `Arc<RegionInner>` holding that block plus the
//!   registrations with every backend. User handles are clones of it.
//! * Every in-flight operation holds its own `Region` clone for as long as the
//!   transport may read or write the local bytes — after a timeout too, until
//!   the transport has given the memory up.
//! * A backend serving remote access keeps only a `Weak<MemoryBlock>` and
//!   upgrades it for the duration of each access, or holds the block (a
//!   [`MemoryHold`], naming who) for as long as a peer may still write into
//!   it after deregistration.
//!
//! `RegionInner`'s fields drop in declaration order: first the registrations
//! (no new remote access can start), then the id slot (the id may be reused,
//! with a new generation), then this region's reference to the bytes. The bytes
//! themselves are freed (or, for `MemoryBlock::from_raw`, their `keep_alive`
//! dropped) only when the last upgraded `Weak` and the last hold are gone as
//! well. No drop here waits for a peer; [`Region::close`] waits for that last
//! moment (`release.rs`).
//!
//! [`Region`]: crate::Region
//! [`Region::close`]: crate::Region::close

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::release::Release;
use crate::{MemoryHold, MemoryHolder, OpError, RegisterError};

/// Owned regions are page aligned: NICs register whole pages, and O_DIRECT or
/// GPU peer-memory users expect it.
pub const PAGE_SIZE: usize = 4096;

/// Regions at least this large are mapped on their own, 2 MiB aligned, and
/// asked to use transparent huge pages: copies through them (kernel socket
/// copies now, NIC DMA later) then walk 512x fewer page-table entries.
const HUGE_PAGE: usize = 2 << 20;

/// A contiguous range of host memory that transports may access through raw
/// pointers from any thread.
///
/// Lengths and offsets in its API are bytes, as `u64`, like every length in
/// ferry's public API. Inside, `len` is kept as the `usize` pointer arithmetic
/// needs; construction refuses a length that does not fit.
pub struct MemoryBlock {
    ptr: NonNull<u8>,
    /// At most `isize::MAX` (checked by `host_len`), so `as u64` is lossless
    /// and any offset up to it converts back with `as usize`.
    len: usize,
    owner: BlockOwner,
    /// Who holds the block past its registrations, and who waits for it to
    /// go (`release.rs`).
    release: Arc<Release>,
}

enum BlockOwner {
    /// Allocated by ferry with this layout; freed on drop.
    Owned(Layout),
    /// Mapped by ferry: `len` bytes at `base`, unmapped on drop.
    Mapped { base: *mut libc::c_void, len: usize },
    /// The caller's memory, kept valid by the guard until the block drops.
    External(Box<dyn Any + Send + Sync>),
}

// SAFETY: a MemoryBlock is a pointer to memory that is valid for its whole
// lifetime (owned allocation, or external memory the caller promised to keep
// valid while the guard lives). It exposes the bytes only through raw pointers
// and bounds-checked copies; concurrent transfers into one block behave like
// DMA into shared memory, which is why no `&[u8]` to it is ever handed out.
unsafe impl Send for MemoryBlock {}
// SAFETY: see `Send`; every access path goes through raw pointers.
unsafe impl Sync for MemoryBlock {}

/// `len` as the `usize` pointer arithmetic uses, if a memory range that long
/// can exist at all: Rust (`ptr::add`, `Layout`) and the kernel never give
/// out one longer than `isize::MAX` bytes.
fn host_len(len: u64) -> Result<usize, RegisterError> {
    if len == 0 {
        return Err(RegisterError::ZeroLength);
    }
    match isize::try_from(len) {
        // Positive and at most `isize::MAX`, so it fits `usize` too.
        Ok(fits) => Ok(fits as usize),
        Err(_) => Err(RegisterError::TooLarge(len)),
    }
}

impl MemoryBlock {
    /// Allocates `len` zeroed bytes, page aligned.
    pub fn alloc(len: u64) -> Result<Self, RegisterError> {
        let len = host_len(len)?;
        if len >= HUGE_PAGE {
            return Self::map_huge(len);
        }
        let out_of_memory = || RegisterError::OutOfMemory(len as u64);
        let layout = Layout::from_size_align(len.next_multiple_of(PAGE_SIZE), PAGE_SIZE)
            .map_err(|_| out_of_memory())?;
        // SAFETY: the layout has a non-zero size (len >= 1 rounded up to a page).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(out_of_memory)?;
        Ok(MemoryBlock {
            ptr,
            len,
            owner: BlockOwner::Owned(layout),
            release: Release::new(),
        })
    }

    /// Maps fresh (hence zeroed and untouched) memory, aligned to a huge page,
    /// and advises huge pages before the first touch. Where THP is disabled the
    /// advice is ignored and the block is plain 4 KiB pages.
    fn map_huge(len: usize) -> Result<Self, RegisterError> {
        let out_of_memory = || RegisterError::OutOfMemory(len as u64);
        let mapped = len
            .checked_next_multiple_of(HUGE_PAGE)
            .and_then(|l| l.checked_add(HUGE_PAGE))
            .ok_or_else(out_of_memory)?;
        // SAFETY: an anonymous private mapping with no address hint has no
        // preconditions; failure is reported as MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(out_of_memory());
        }
        let start = (base as usize).next_multiple_of(HUGE_PAGE);
        // SAFETY: `start..start + len` lies inside the mapping just created
        // (it is at most HUGE_PAGE - 1 bytes past `base`, and `mapped` has
        // that much slack). madvise is only advice; its failure is harmless.
        unsafe {
            libc::madvise(
                start as *mut _,
                len.next_multiple_of(HUGE_PAGE),
                libc::MADV_HUGEPAGE,
            )
        };
        Ok(MemoryBlock {
            ptr: NonNull::new(start as *mut u8).expect("mmap never returns address 0 here"),
            len,
            owner: BlockOwner::Mapped { base, len: mapped },
            release: Release::new(),
        })
    }

    /// Wraps memory the caller owns: `len` bytes at `ptr`.
    ///
    /// Refuses a zero `len` ([`RegisterError::ZeroLength`]) and one longer
    /// than any memory range can be, over `isize::MAX` bytes
    /// ([`RegisterError::TooLarge`]).
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be valid for reads and writes from any thread for as
    /// long as `keep_alive` has not been dropped, and nothing else may free or
    /// unmap it during that time. Ferry drops `keep_alive` only after the last
    /// transfer touching the block has finished, on every transport: no
    /// write lands in the memory once `keep_alive` has been dropped.
    ///
    /// Dropping the region does not wait for that: a peer may still be
    /// writing (a TCP chunk arriving, a same-host peer stopped inside a
    /// `process_vm` copy), and a drop never blocks its thread on a peer.
    /// The transport keeps the block, and so `keep_alive`, until no write
    /// can land, which may be after the drop returned; `keep_alive` is then
    /// dropped on whichever thread lets go last. To know when the memory is
    /// yours again, call [`Region::close`] (or [`Region::closing`]) instead
    /// of dropping the region: it returns once `keep_alive` is gone, or says
    /// who still holds it.
    ///
    /// [`Region::close`]: crate::Region::close
    /// [`Region::closing`]: crate::Region::closing
    pub unsafe fn from_raw(
        ptr: NonNull<u8>,
        len: u64,
        keep_alive: Box<dyn Any + Send + Sync>,
    ) -> Result<Self, RegisterError> {
        let len = host_len(len)?;
        Ok(MemoryBlock {
            ptr,
            len,
            owner: BlockOwner::External(keep_alive),
            release: Release::new(),
        })
    }

    /// Keeps the block (and a `from_raw` block's `keep_alive`) alive until
    /// the hold drops, naming `holder` as the reason to whoever waits for
    /// the region to close. For a backend that may still touch the bytes
    /// after its registration dropped, or while it serves one access.
    pub fn hold(self: &Arc<Self>, holder: MemoryHolder) -> MemoryHold {
        MemoryHold::new(self.clone(), holder)
    }

    pub(crate) fn release(&self) -> &Arc<Release> {
        &self.release
    }

    /// What keeps memory wrapped by [`MemoryBlock::from_raw`] alive, for a
    /// backend that recognizes it (the memory transport finds its shared
    /// mappings this way). `None` for memory `alloc` allocated.
    pub fn keep_alive(&self) -> Option<&(dyn Any + Send + Sync)> {
        match &self.owner {
            BlockOwner::External(keep_alive) => Some(keep_alive.as_ref()),
            _ => None,
        }
    }

    /// Address of the first byte, for transports that copy or DMA through
    /// raw pointers; valid while the block lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes. It always fits `usize` (construction checks), so a
    /// backend handing it to a C API may convert it with `as usize`.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Always `false`: construction refuses a zero length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The virtual address remote handles refer to.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Fails unless `offset..offset + len` (bytes) lies inside the block.
    pub(crate) fn check(&self, offset: u64, len: u64) -> Result<(), OpError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(OpError::OutOfBounds {
                offset,
                len,
                bound: self.len(),
            }),
        }
    }

    /// Copies `src` into the block at byte `offset`.
    ///
    /// A transfer running concurrently on the same bytes leaves them
    /// unspecified, exactly as a NIC's DMA would; order such accesses with the
    /// completion of the transfer.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), OpError> {
        self.check(offset, src.len() as u64)?;
        // SAFETY: bounds checked above, so `offset <= self.len` fits usize and
        // `offset + src.len()` stays inside the allocation; `src` is a distinct
        // Rust allocation so it cannot overlap memory owned by this block.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.as_ptr().add(offset as usize),
                src.len(),
            )
        };
        Ok(())
    }

    /// Copies bytes at byte `offset` out into `dst`. Same concurrency rule as
    /// [`MemoryBlock::write_at`].
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), OpError> {
        self.check(offset, dst.len() as u64)?;
        // SAFETY: bounds checked above, so `offset <= self.len` fits usize and
        // `offset + dst.len()` stays inside the allocation; `dst` is an
        // exclusive Rust borrow, so it cannot overlap this block's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copies the whole block into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len];
        self.read_at(0, &mut out).expect("whole block is in bounds");
        out
    }
}

impl Drop for MemoryBlock {
    fn drop(&mut self) {
        match &mut self.owner {
            // SAFETY: allocated in `alloc` with exactly this layout; the last
            // Arc is gone, so no transfer can reach the memory any more.
            BlockOwner::Owned(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), *layout) },
            // SAFETY: exactly the mapping made in `map_huge`; as above, nothing
            // can reach it any more.
            BlockOwner::Mapped { base, len } => unsafe {
                libc::munmap(*base, *len);
            },
            // Dropped here rather than after this function, so that whoever
            // waits for the release learns of it only once the caller's
            // memory is theirs. (A zero-sized box allocates nothing.)
            BlockOwner::External(keep_alive) => drop(std::mem::replace(keep_alive, Box::new(()))),
        }
        self.release.fire();
    }
}

impl fmt::Debug for MemoryBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemoryBlock({:#x}, {} bytes)", self.addr(), self.len)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    use crate::{Access, NodeAddr, Region, RegionIds, RegionParts, RemoteTransports};

    #[test]
    fn slots_are_reused_with_a_new_generation() {
        let ids = RegionIds::new();
        let a = ids.allocate();
        let b = ids.allocate();
        assert_ne!(a.id(), b.id());
        let (a_id, a_gen) = (a.id(), a.generation());
        drop(a);
        let c = ids.allocate();
        assert_eq!(c.id(), a_id);
        assert_ne!(c.generation(), a_gen);
    }

    #[test]
    fn owned_blocks_are_page_aligned_zeroed_and_bounds_checked() {
        let block = MemoryBlock::alloc(10_000).unwrap();
        assert_eq!(block.addr() % PAGE_SIZE as u64, 0);
        assert!(block.to_vec().iter().all(|&b| b == 0));
        block.write_at(9_998, &[1, 2]).unwrap();
        assert_eq!(
            block.write_at(9_999, &[1, 2]),
            Err(OpError::OutOfBounds {
                offset: 9_999,
                len: 2,
                bound: 10_000
            })
        );
        let mut out = [0; 2];
        block.read_at(9_998, &mut out).unwrap();
        assert_eq!(out, [1, 2]);
        assert_eq!(
            MemoryBlock::alloc(0).unwrap_err(),
            RegisterError::ZeroLength
        );
    }

    #[test]
    fn large_blocks_are_huge_page_aligned_and_zeroed() {
        let len = (5 << 20) + 3;
        let block = MemoryBlock::alloc(len).unwrap();
        assert_eq!(block.addr() % HUGE_PAGE as u64, 0);
        assert_eq!(block.len(), len);
        assert!(block.to_vec().iter().all(|&b| b == 0));
        block.write_at(len - 1, &[9]).unwrap();
        assert!(block.write_at(len, &[9]).is_err());
    }

    #[test]
    fn external_memory_guard_lives_until_the_block_drops() {
        let backing = Arc::new(Mutex::new(vec![7u8; 64]));
        let ptr = NonNull::new(backing.lock().unwrap().as_mut_ptr()).unwrap();
        // SAFETY: the Vec is kept alive by the guard (an Arc clone) and never resized.
        let block = unsafe { MemoryBlock::from_raw(ptr, 64, Box::new(backing.clone())) }.unwrap();
        assert_eq!(Arc::strong_count(&backing), 2);
        assert_eq!(block.to_vec(), vec![7u8; 64]);
        drop(block);
        assert_eq!(Arc::strong_count(&backing), 1);
    }

    #[test]
    fn lengths_no_memory_range_can_have_are_refused() {
        let too_large = isize::MAX as u64 + 1;
        assert_eq!(
            MemoryBlock::alloc(too_large).unwrap_err(),
            RegisterError::TooLarge(too_large)
        );
        let mut byte = 0u8;
        let ptr = NonNull::from(&mut byte);
        for len in [too_large, u64::MAX] {
            // SAFETY: refused before the block exists, so the pointer is never used.
            let refused = unsafe { MemoryBlock::from_raw(ptr, len, Box::new(())) };
            assert_eq!(refused.unwrap_err(), RegisterError::TooLarge(len));
        }
        // SAFETY: as above.
        let empty = unsafe { MemoryBlock::from_raw(ptr, 0, Box::new(())) };
        assert_eq!(empty.unwrap_err(), RegisterError::ZeroLength);
    }

    /// A region of `len` bytes registered with no backend.
    pub(crate) fn region(len: u64) -> Region {
        region_of(MemoryBlock::alloc(len).unwrap())
    }

    /// A region of `block` registered with no backend.
    pub(crate) fn region_of(block: MemoryBlock) -> Region {
        RegionParts {
            slot: RegionIds::new().allocate(),
            memory: Arc::new(block),
            access: Access::ReadWrite,
            owner: NodeAddr {
                id: crate::NodeId(1),
                endpoint: "127.0.0.1:1".parse().unwrap(),
            },
            transports: RemoteTransports::default(),
            registrations: vec![],
        }
        .into_region()
    }

    #[test]
    fn region_slices_are_bounds_checked_with_clear_errors() {
        let region = region(100);
        assert_eq!(region.len(), 100);
        let slice = region.slice(10..30).unwrap();
        assert_eq!((slice.offset(), slice.len()), (10, 20));
        assert_eq!(region.slice(100..100).unwrap().len(), 0);
        assert_eq!(
            region.slice(90..101).unwrap_err(),
            OpError::OutOfBounds {
                offset: 90,
                len: 11,
                bound: 100
            }
        );
        #[allow(clippy::reversed_empty_ranges)]
        let inverted = region.slice(10..5).unwrap_err();
        assert_eq!(inverted, OpError::InvertedRange { start: 10, end: 5 });
        assert_eq!(
            inverted.to_string(),
            "range 10..5 is inverted: its end comes before its start"
        );
        // Offsets past what any address could be are out of bounds, not wrapped.
        assert_eq!(
            region.write_at(u64::MAX, &[1]),
            Err(OpError::OutOfBounds {
                offset: u64::MAX,
                len: 1,
                bound: 100
            })
        );
        region.write_at(99, &[7]).unwrap();
        let mut out = [0];
        region.read_at(99, &mut out).unwrap();
        assert_eq!(out, [7]);
    }
}
