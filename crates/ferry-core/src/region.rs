//! Regions: registered memory as the node hands it out. A [`Region`] is
//! the block plus its registrations with every backend and its id slot;
//! their drop order is what the lifetime invariant in `memory.rs` rests on.

use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::release::Closing;
use crate::{
    Access, CloseError, Generation, LocalSlice, MemoryBlock, NodeAddr, OpError, RegionId,
    RemoteBuffer, RemoteTransports,
};
/// Allocator of region slots: ids are reused, generations are not.
#[derive(Clone, Default)]
pub struct RegionIds(Arc<Mutex<SlotTable>>);

#[derive(Default)]
struct SlotTable {
    generations: Vec<u32>,
    free: Vec<u32>,
}

impl RegionIds {
    /// An empty table, one per node: ids are only unique within it.
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
    /// The slot's id, free for reuse once this `RegionSlot` drops.
    pub fn id(&self) -> RegionId {
        self.id
    }
    /// The slot's generation, unique to this use of the id.
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
///
/// For code that assembles a node (the `ferry` facade, backend tests): a
/// region made from parts that do not belong together (registrations of other
/// memory, a slot of another node) would hand out handles that lie. The
/// `ferry` facade does not re-export this type, so its users get regions only
/// from `Node::alloc` and `Node::register`.
pub struct RegionParts {
    /// The region's id and generation, from the node's [`RegionIds`].
    pub slot: RegionSlot,
    /// The bytes every registration below refers to.
    pub memory: Arc<MemoryBlock>,
    /// The most a remote peer may do; handles carry it.
    pub access: Access,
    /// The node that registers the region; handles name it as the owner.
    pub owner: NodeAddr,
    /// The credentials each backend issued for `memory`; handles carry them.
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

impl RegionParts {
    /// The region these parts make up. A method here rather than a `Region`
    /// constructor, so that only code that can name `RegionParts` (not users
    /// of the `ferry` facade) can make a `Region`.
    pub fn into_region(self) -> Region {
        Region(Arc::new(RegionInner {
            registrations: self.registrations,
            slot: self.slot,
            memory: self.memory,
            access: self.access,
            owner: self.owner,
            transports: self.transports,
        }))
    }
}

impl Region {
    /// The region's slot in its node's table; names it only together with
    /// [`Region::generation`].
    pub fn id(&self) -> RegionId {
        self.0.slot.id
    }
    /// Which use of the slot this region is; handles carry it, so the owner
    /// refuses a handle that outlived its region.
    pub fn generation(&self) -> Generation {
        self.0.slot.generation
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.0.memory.len()
    }
    /// Always `false`: a region is at least one byte long.
    pub fn is_empty(&self) -> bool {
        self.0.memory.is_empty()
    }
    /// The most a remote peer may do with this region.
    pub fn access(&self) -> Access {
        self.0.access
    }
    /// The registered bytes. A clone of the `Arc` keeps the bytes alive, not
    /// the registration: hold the `Region` for as long as a transfer runs.
    pub fn memory(&self) -> &Arc<MemoryBlock> {
        &self.0.memory
    }
    /// The node that registered the region, as its handles name it.
    pub fn owner(&self) -> NodeAddr {
        self.0.owner
    }

    /// Drops this handle and says when the memory is the caller's again:
    /// once every other clone (this node's transfers in flight hold some)
    /// and every transport's hold is gone, so that no write can land in it
    /// any more. Dropping a region never waits for peers; this does, for as
    /// long as the caller likes. See [`Closing`].
    pub fn closing(self) -> Closing {
        let region: std::sync::Weak<dyn Any + Send + Sync> = Arc::downgrade(&self.0) as _;
        Closing::new(region, &self.0.memory)
    }

    /// Drops this handle and waits until the memory is the caller's again
    /// (for `MemoryBlock::from_raw`, its `keep_alive` dropped: no write can
    /// land in it), or until `deadline`; then [`CloseError::Held`] says who
    /// still holds it: other handles, or a peer still writing (a same-host
    /// process stopped inside a copy, a TCP chunk arriving). The memory
    /// then goes back by itself once they let go; [`Region::closing`] gives
    /// a [`Closing`] to wait on again.
    pub async fn close(self, deadline: tokio::time::Instant) -> Result<(), CloseError> {
        self.closing().wait(deadline).await
    }

    /// A serializable handle to the whole region with the region's access.
    pub fn remote(&self) -> RemoteBuffer {
        RemoteBuffer::new(
            self.0.owner,
            self.id(),
            self.generation(),
            self.0.memory.addr(),
            self.len(),
            self.0.access,
            self.0.transports.clone(),
        )
    }

    /// A local slice for use in an [`crate::RdmaOp`]: `range` is byte
    /// offsets into the region (`u64`, `usize` or a literal: see
    /// [`crate::ByteOffset`]) and must lie inside it.
    pub fn slice<T: crate::ByteOffset>(&self, range: Range<T>) -> Result<LocalSlice, OpError> {
        let range = crate::offset::byte_range(range)?;
        let len = range.end - range.start;
        self.0.memory.check(range.start, len)?;
        Ok(LocalSlice::new(self.clone(), range.start, len))
    }

    /// The whole region as a local slice.
    pub fn whole(&self) -> LocalSlice {
        LocalSlice::new(self.clone(), 0, self.len())
    }

    /// Copies `src` into the region at byte `offset`; see
    /// [`MemoryBlock::write_at`].
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), OpError> {
        self.0.memory.write_at(offset, src)
    }
    /// Copies bytes at byte `offset` out into `dst`; see
    /// [`MemoryBlock::read_at`].
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), OpError> {
        self.0.memory.read_at(offset, dst)
    }
    /// Copies the whole region into a new vector; same concurrency rule as
    /// [`MemoryBlock::read_at`].
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
