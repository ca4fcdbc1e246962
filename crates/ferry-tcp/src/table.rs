//! The owner side's view of registered regions: what a remote request must
//! match before a single byte moves.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, Weak};

use ferry_core::{
    Access, Generation, MemoryBlock, MemoryHold, MemoryHolder, RegionId, token_grants,
};

use crate::frame::{Refusal, Request, RequestKind};

struct Entry {
    generation: Generation,
    token: u128,
    access: Access,
    /// Weak: registration must not keep memory alive; each access upgrades it
    /// for exactly as long as it touches the bytes.
    memory: Weak<MemoryBlock>,
    base: u64,
    len: u64,
}

/// Regions this node serves over TCP, keyed by slot id.
#[derive(Default)]
pub struct RegionTable {
    entries: RwLock<HashMap<RegionId, Entry>>,
}

/// A request that passed every check: the memory it may touch, held in
/// the requesting peer's name until the chunk is served. This hold is what
/// keeps a chunk's bytes from landing in memory its caller got back: a
/// region's drop removes its entry (no new chunk is granted) without
/// waiting, and the memory, with `from_raw`'s `keep_alive`, goes only once
/// the last chunk granted before that has been served
/// (`Region::close` waits for it and names the peer).
pub struct Grant {
    pub memory: MemoryHold,
    pub offset: usize,
}

impl RegionTable {
    /// Adds a region; refuses (returns false) if `id` is taken, so one
    /// registration can never silently replace another.
    pub fn insert(
        &self,
        id: RegionId,
        generation: Generation,
        token: u128,
        access: Access,
        memory: &Arc<MemoryBlock>,
    ) -> bool {
        let entry = Entry {
            generation,
            token,
            access,
            memory: Arc::downgrade(memory),
            base: memory.addr(),
            len: memory.len(),
        };
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        match entries.entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(entry);
                true
            }
        }
    }

    /// Removes the entry if it still belongs to `generation`. Returns whether
    /// something was removed.
    pub fn remove(&self, id: RegionId, generation: Generation) -> bool {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if entries.get(&id).is_some_and(|e| e.generation == generation) {
            entries.remove(&id);
            true
        } else {
            false
        }
    }

    pub fn registered(&self) -> Vec<(RegionId, Generation)> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = entries.iter().map(|(id, e)| (*id, e.generation)).collect();
        out.sort();
        out
    }

    /// Checks region, generation, token, access and bounds, in that order, and
    /// holds the memory for the access in `peer`'s name.
    pub fn authorize(
        &self,
        req: &Request,
        peer: impl FnOnce() -> MemoryHolder,
    ) -> Result<Grant, Refusal> {
        let region = self.authorize_region(req.region, req.generation, req.token, req.kind)?;
        let offset = region.offset(req.addr, req.len)?;
        Ok(Grant {
            memory: region.hold(peer)?,
            offset,
        })
    }

    /// Checks region, generation, token and access for a request of `kind`,
    /// once for all the ranges of a [`crate::frame::Ranges`] request; each
    /// range's bounds are then [`RegionCheck::offset`]'s.
    pub fn authorize_region(
        &self,
        region: RegionId,
        generation: Generation,
        token: u128,
        kind: RequestKind,
    ) -> Result<RegionCheck, Refusal> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let entry = entries.get(&region).ok_or(Refusal::UnknownRegion)?;
        if entry.generation != generation {
            return Err(Refusal::StaleGeneration {
                current: entry.generation,
            });
        }
        // The region's token, or (for a read) its read-only one.
        if !token_grants(entry.token, token, kind == RequestKind::Write) {
            return Err(Refusal::AccessDenied);
        }
        if kind == RequestKind::Write && !entry.access.allows_write() {
            return Err(Refusal::ReadOnly);
        }
        Ok(RegionCheck {
            memory: entry.memory.clone(),
            base: entry.base,
            len: entry.len,
        })
    }
}

/// A region whose generation, token and access a request passed; what is
/// left to check is each range's bounds.
pub struct RegionCheck {
    memory: Weak<MemoryBlock>,
    base: u64,
    len: u64,
}

impl RegionCheck {
    /// The offset of `addr..addr + len` in the region, or why it does not
    /// lie inside.
    pub fn offset(&self, addr: u64, len: u64) -> Result<usize, Refusal> {
        let offset = addr.wrapping_sub(self.base);
        let in_bounds =
            addr >= self.base && offset.checked_add(len).is_some_and(|end| end <= self.len);
        if !in_bounds {
            return Err(Refusal::OutOfBounds {
                offset,
                bound: self.len,
            });
        }
        // Below the region's length, which fits usize.
        Ok(offset as usize)
    }

    /// Holds the memory in `peer`'s name for as long as the access lasts.
    pub fn hold(&self, peer: impl FnOnce() -> MemoryHolder) -> Result<MemoryHold, Refusal> {
        // The entry is removed before the region's memory reference drops, so
        // a failed upgrade only happens in that short window: same as gone.
        let memory = self.memory.upgrade().ok_or(Refusal::UnknownRegion)?;
        Ok(memory.hold(peer()))
    }
}

/// Dropping this removes the region from the table: the TCP half of
/// deregistration, run when the last `Region` clone goes away.
pub struct TcpRegistration {
    pub(crate) table: Arc<RegionTable>,
    pub(crate) id: RegionId,
    pub(crate) generation: Generation,
}

impl Drop for TcpRegistration {
    fn drop(&mut self) {
        self.table.remove(self.id, self.generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(kind: RequestKind, generation: u32, token: u128, addr: u64, len: u64) -> Request {
        Request {
            kind,
            id: 1,
            region: RegionId(0),
            generation: Generation(generation),
            addr,
            len,
            token,
            tag: 0,
        }
    }

    fn peer() -> MemoryHolder {
        MemoryHolder::TcpPeer {
            node: ferry_core::NodeId(7),
            remote: "127.0.0.1:9".parse().unwrap(),
        }
    }

    #[test]
    fn every_check_refuses_with_its_own_reason() {
        let table = RegionTable::default();
        let mem = Arc::new(MemoryBlock::alloc(100).unwrap());
        let base = mem.addr();
        assert!(table.insert(RegionId(0), Generation(2), 55, Access::ReadOnly, &mem));
        assert!(
            !table.insert(RegionId(0), Generation(3), 56, Access::ReadWrite, &mem),
            "id taken"
        );
        let ok = table
            .authorize(&request(RequestKind::Read, 2, 55, base + 10, 90), peer)
            .unwrap();
        assert_eq!(ok.offset, 10);
        drop(ok);
        let refuse = |r: Request| table.authorize(&r, peer).err().unwrap();
        assert_eq!(
            refuse(request(RequestKind::Read, 1, 55, base, 1)),
            Refusal::StaleGeneration {
                current: Generation(2)
            }
        );
        assert_eq!(
            refuse(request(RequestKind::Read, 2, 56, base, 1)),
            Refusal::AccessDenied
        );
        assert_eq!(
            refuse(request(RequestKind::Write, 2, 55, base, 1)),
            Refusal::ReadOnly
        );
        assert_eq!(
            refuse(request(RequestKind::Read, 2, 55, base + 10, 91)),
            Refusal::OutOfBounds {
                offset: 10,
                bound: 100
            }
        );
        assert!(matches!(
            refuse(request(RequestKind::Read, 2, 55, base - 1, 1)),
            Refusal::OutOfBounds { .. }
        ));
        assert!(matches!(
            refuse(request(RequestKind::Read, 2, 55, u64::MAX, 2)),
            Refusal::OutOfBounds { .. }
        ));
        assert!(!table.remove(RegionId(0), Generation(1)));
        assert!(table.remove(RegionId(0), Generation(2)));
        assert_eq!(
            refuse(request(RequestKind::Read, 2, 55, base, 1)),
            Refusal::UnknownRegion
        );
    }
}
