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
//!   upgrades it for the duration of each access.
//!
//! `RegionInner`'s fields drop in declaration order: first the registrations
//! (no new remote access can start), then the id slot (the id may be reused,
//! with a new generation), then this region's reference to the bytes. The bytes
//! themselves are freed only when the last upgraded `Weak` is gone as well.

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::{
    Access, Generation, LocalSlice, NodeAddr, OpError, RegionId, RegisterError, RemoteBuffer,
    RemoteTransports,
};

/// Owned regions are page aligned: NICs register whole pages, and O_DIRECT or
/// GPU peer-memory users expect it.
pub const PAGE_SIZE: usize = 4096;

/// Regions at least this large are mapped on their own, 2 MiB aligned, and
/// asked to use transparent huge pages: copies through them (kernel socket
/// copies now, NIC DMA later) then walk 512x fewer page-table entries.
const HUGE_PAGE: usize = 2 << 20;

/// A contiguous range of host memory that transports may access through raw
/// pointers from any thread.
pub struct MemoryBlock {
    ptr: NonNull<u8>,
    len: usize,
    owner: BlockOwner,
}

enum BlockOwner {
    /// Allocated by ferry with this layout; freed on drop.
    Owned(Layout),
    /// Mapped by ferry: `len` bytes at `base`, unmapped on drop.
    Mapped { base: *mut libc::c_void, len: usize },
    /// The caller's memory, kept valid by the guard until the block drops.
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

// SAFETY: a MemoryBlock is a pointer to memory that is valid for its whole
// lifetime (owned allocation, or external memory the caller promised to keep
// valid while the guard lives). It exposes the bytes only through raw pointers
// and bounds-checked copies; concurrent transfers into one block behave like
// DMA into shared memory, which is why no `&[u8]` to it is ever handed out.
unsafe impl Send for MemoryBlock {}
// SAFETY: see `Send`; every access path goes through raw pointers.
unsafe impl Sync for MemoryBlock {}

impl MemoryBlock {
    /// Allocates `len` zeroed bytes, page aligned.
    pub fn alloc(len: usize) -> Result<Self, RegisterError> {
        if len == 0 {
            return Err(RegisterError::ZeroLength);
        }
        if len >= HUGE_PAGE {
            return Self::map_huge(len);
        }
        let layout = Layout::from_size_align(len.next_multiple_of(PAGE_SIZE), PAGE_SIZE)
            .map_err(|_| RegisterError::OutOfMemory(len))?;
        // SAFETY: the layout has a non-zero size (len >= 1 rounded up to a page).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(RegisterError::OutOfMemory(len))?;
        Ok(MemoryBlock {
            ptr,
            len,
            owner: BlockOwner::Owned(layout),
        })
    }

    /// Maps fresh (hence zeroed and untouched) memory, aligned to a huge page,
    /// and advises huge pages before the first touch. Where THP is disabled the
    /// advice is ignored and the block is plain 4 KiB pages.
    fn map_huge(len: usize) -> Result<Self, RegisterError> {
        let mapped = len
            .checked_next_multiple_of(HUGE_PAGE)
            .and_then(|l| l.checked_add(HUGE_PAGE))
            .ok_or(RegisterError::OutOfMemory(len))?;
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
            return Err(RegisterError::OutOfMemory(len));
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
        })
    }

    /// Wraps memory the caller owns.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be valid for reads and writes from any thread for as
    /// long as `keep_alive` has not been dropped, and nothing else may free or
    /// unmap it during that time. Ferry drops `keep_alive` only after the last
    /// transfer touching the block has finished.
    pub unsafe fn from_raw(
        ptr: NonNull<u8>,
        len: usize,
        keep_alive: Box<dyn Any + Send + Sync>,
    ) -> Result<Self, RegisterError> {
        if len == 0 {
            return Err(RegisterError::ZeroLength);
        }
        Ok(MemoryBlock {
            ptr,
            len,
            owner: BlockOwner::External(keep_alive),
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The virtual address remote handles refer to.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), OpError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(OpError::OutOfBounds {
                offset: offset as u64,
                len: len as u64,
                bound: self.len as u64,
            }),
        }
    }

    /// Copies `src` into the block at `offset`.
    ///
    /// A transfer running concurrently on the same bytes leaves them
    /// unspecified, exactly as a NIC's DMA would; order such accesses with the
    /// completion of the transfer.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), OpError> {
        self.check(offset, src.len())?;
        // SAFETY: bounds checked above; `src` is a distinct Rust allocation so
        // it cannot overlap memory owned by this block.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_ptr().add(offset), src.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` out into `dst`. Same concurrency rule as
    /// [`MemoryBlock::write_at`].
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), OpError> {
        self.check(offset, dst.len())?;
        // SAFETY: bounds checked above; `dst` is an exclusive Rust borrow, so it
        // cannot overlap this block's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
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
        match self.owner {
            // SAFETY: allocated in `alloc` with exactly this layout; the last
            // Arc is gone, so no transfer can reach the memory any more.
            BlockOwner::Owned(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: exactly the mapping made in `map_huge`; as above, nothing
            // can reach it any more.
            BlockOwner::Mapped { base, len } => unsafe {
                libc::munmap(base, len);
            },
            BlockOwner::External(_) => {}
        }
    }
}

impl fmt::Debug for MemoryBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemoryBlock({:#x}, {} bytes)", self.addr(), self.len)
    }
}

/// Allocator of region slots: ids are reused, generations are not.
#[derive(Clone, Default)]
pub struct RegionIds(Arc<Mutex<SlotTable>>);

#[derive(Default)]
struct SlotTable {
    generations: Vec<u32>,
    free: Vec<u32>,
}

impl RegionIds {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a free slot (the most recently released first) and bumps its
    /// generation.
    pub fn allocate(&self) -> RegionSlot {
        let mut table = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let id = match table.free.pop() {
            Some(id) => id,
            None => {
                table.generations.push(0);
                (table.generations.len() - 1) as u32
            }
        };
        let generation = &mut table.generations[id as usize];
        *generation = generation.wrapping_add(1);
        RegionSlot {
            id: RegionId(id),
            generation: Generation(*generation),
            ids: self.clone(),
        }
    }
}

/// An allocated slot; releases the id for reuse when dropped.
pub struct RegionSlot {
    id: RegionId,
    generation: Generation,
    ids: RegionIds,
}

impl RegionSlot {
    pub fn id(&self) -> RegionId {
        self.id
    }
    pub fn generation(&self) -> Generation {
        self.generation
    }
}

impl Drop for RegionSlot {
    fn drop(&mut self) {
        let mut table = self.ids.0.lock().unwrap_or_else(|e| e.into_inner());
        table.free.push(self.id.0);
    }
}

/// Everything a node gathers to make a [`Region`]: its slot, its bytes, and
/// what each backend returned when registering them.
pub struct RegionParts {
    pub slot: RegionSlot,
    pub memory: Arc<MemoryBlock>,
    pub access: Access,
    pub owner: NodeAddr,
    pub transports: RemoteTransports,
    /// Backend registrations; dropping one deregisters the region there.
    pub registrations: Vec<Box<dyn Any + Send + Sync>>,
}

/// Memory registered with a node. Cheap to clone; deregistered when the last
/// clone — including those held by in-flight transfers — is dropped.
#[derive(Clone)]
pub struct Region(Arc<RegionInner>);

/// Field order is the deregistration order; see the module docs.
struct RegionInner {
    #[expect(
        dead_code,
        reason = "held only so that dropping it deregisters the region"
    )]
    registrations: Vec<Box<dyn Any + Send + Sync>>,
    slot: RegionSlot,
    memory: Arc<MemoryBlock>,
    access: Access,
    owner: NodeAddr,
    transports: RemoteTransports,
}

impl Region {
    pub fn new(parts: RegionParts) -> Self {
        Region(Arc::new(RegionInner {
            registrations: parts.registrations,
            slot: parts.slot,
            memory: parts.memory,
            access: parts.access,
            owner: parts.owner,
            transports: parts.transports,
        }))
    }

    pub fn id(&self) -> RegionId {
        self.0.slot.id
    }
    pub fn generation(&self) -> Generation {
        self.0.slot.generation
    }
    pub fn len(&self) -> usize {
        self.0.memory.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.memory.is_empty()
    }
    /// The most a remote peer may do with this region.
    pub fn access(&self) -> Access {
        self.0.access
    }
    pub fn memory(&self) -> &Arc<MemoryBlock> {
        &self.0.memory
    }
    pub fn owner(&self) -> NodeAddr {
        self.0.owner
    }

    /// A serializable handle to the whole region with the region's access.
    pub fn remote(&self) -> RemoteBuffer {
        RemoteBuffer::new(
            self.0.owner,
            self.id(),
            self.generation(),
            self.0.memory.addr(),
            self.len() as u64,
            self.0.access,
            self.0.transports.clone(),
        )
    }

    /// A local slice for use in an [`crate::RdmaOp`].
    pub fn slice(&self, range: Range<usize>) -> Result<LocalSlice, OpError> {
        let len = range
            .end
            .checked_sub(range.start)
            .ok_or(OpError::OutOfBounds {
                offset: range.start as u64,
                len: 0,
                bound: self.len() as u64,
            })?;
        self.0.memory.check(range.start, len)?;
        Ok(LocalSlice::new(self.clone(), range.start, len))
    }

    /// The whole region as a local slice.
    pub fn whole(&self) -> LocalSlice {
        LocalSlice::new(self.clone(), 0, self.len())
    }

    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), OpError> {
        self.0.memory.write_at(offset, src)
    }
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), OpError> {
        self.0.memory.read_at(offset, dst)
    }
    pub fn to_vec(&self) -> Vec<u8> {
        self.0.memory.to_vec()
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id())
            .field("generation", &self.generation())
            .field("len", &self.len())
            .field("access", &self.access())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
