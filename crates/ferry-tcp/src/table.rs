//! The owner side's view of registered regions: what a remote request must
//! match before a single byte moves.
//!
//! A request's credentials are checked first (`ferry_core::Departed`
//! states the order): a token the slot and generation did not issue is
//! `AccessDenied` whether or not they exist. Then its access, then its
//! bounds, against what the credentials open: the region for its own
//! token, the innermost scope for a narrowed one.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, Weak};

use ferry_core::{
    Access, Departed, Generation, MemoryBlock, MemoryHold, MemoryHolder, RegionId, Scope, Scopes,
    SlotRefusal, tokens_equal,
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

/// Regions this node serves over TCP, keyed by slot id, and the tokens
/// of those that left lately.
#[derive(Default)]
pub struct RegionTable {
    entries: RwLock<Slots>,
}

#[derive(Default)]
struct Slots {
    live: HashMap<RegionId, Entry>,
    departed: Departed,
}

/// The narrowed credentials a connection presented last, and what they
/// open: a connection's requests through one narrowed handle then cost one
/// comparison each, as through the region's own token, instead of one
/// HMAC per scope. Keyed by slot and generation, whose token never
/// changes, so it cannot go stale; a request for another slot, or with
/// other credentials, checks afresh and takes its place.
#[derive(Default)]
pub struct ScopeCache {
    last: Option<Verified>,
}

struct Verified {
    region: RegionId,
    generation: Generation,
    token: u128,
    scopes: Scopes,
    opened: Scope,
}

impl ScopeCache {
    /// What `token` with `scopes` opened when last checked for `region`
    /// at `generation`, if it is what this connection presented last.
    fn get(
        &self,
        region: RegionId,
        generation: Generation,
        token: u128,
        scopes: &Scopes,
    ) -> Option<Scope> {
        let last = self.last.as_ref()?;
        let same = last.region == region
            && last.generation == generation
            && tokens_equal(last.token, token)
            && last.scopes == *scopes;
        same.then_some(last.opened)
    }
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
        match entries.live.entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(entry);
                true
            }
        }
    }

    /// Removes the entry if it still belongs to `generation`, remembering
    /// its token so that its holders hear it is gone. Returns whether
    /// something was removed.
    pub fn remove(&self, id: RegionId, generation: Generation) -> bool {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let Slots { live, departed } = &mut *entries;
        match live.entry(id) {
            std::collections::hash_map::Entry::Occupied(entry)
                if entry.get().generation == generation =>
            {
                departed.remember(id, generation, entry.remove().token);
                true
            }
            _ => false,
        }
    }

    pub fn registered(&self) -> Vec<(RegionId, Generation)> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = (entries.live.iter())
            .map(|(id, e)| (*id, e.generation))
            .collect();
        out.sort();
        out
    }

    /// Checks the credentials against the slot and generation, then access
    /// and bounds, in that order, and holds the memory for the access in
    /// `peer`'s name.
    pub fn authorize(
        &self,
        req: &Request,
        cache: &mut ScopeCache,
        peer: impl FnOnce() -> MemoryHolder,
    ) -> Result<Grant, Refusal> {
        let credentials = Credentials {
            region: req.region,
            generation: req.generation,
            token: req.token,
            scopes: &req.scopes,
        };
        let region = self.authorize_region(credentials, req.kind, cache)?;
        let offset = region.offset(req.addr, req.len)?;
        Ok(Grant {
            memory: region.hold(peer)?,
            offset,
        })
    }

    /// Checks credentials and access for a request of `kind`, once for
    /// all the ranges of a [`crate::frame::Ranges`] request; each range's
    /// bounds are then [`RegionCheck::offset`]'s. `cache` is the
    /// connection's: narrowed credentials it checked last are not hashed
    /// again.
    pub fn authorize_region(
        &self,
        credentials: Credentials<'_>,
        kind: RequestKind,
        cache: &mut ScopeCache,
    ) -> Result<RegionCheck, Refusal> {
        let Credentials {
            region,
            generation,
            token,
            scopes,
        } = credentials;
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let entry = entries.live.get(&region);
        let cached = entry
            .filter(|_| !scopes.is_empty())
            .and_then(|_| cache.get(region, generation, token, scopes));
        let opened = match (entry, cached) {
            (Some(entry), Some(opened)) if entry.generation == generation => opened,
            _ => {
                let live = entry.map(|e| {
                    let range = Scope {
                        addr: e.base,
                        len: e.len,
                        access: e.access,
                    };
                    (e.generation, e.token, range)
                });
                let opened = (entries.departed)
                    .check(live, region, generation, token, scopes)
                    .map_err(|refusal| match refusal {
                        SlotRefusal::UnknownRegion => Refusal::UnknownRegion,
                        SlotRefusal::StaleGeneration { current } => {
                            Refusal::StaleGeneration { current }
                        }
                        _ => Refusal::AccessDenied,
                    })?;
                if !scopes.is_empty() {
                    cache.last = Some(Verified {
                        region,
                        generation,
                        token,
                        scopes: *scopes,
                        opened,
                    });
                }
                opened
            }
        };
        // Checked above: the slot holds this generation.
        let entry = entry.ok_or(Refusal::UnknownRegion)?;
        if kind == RequestKind::Write
            && !(opened.access.allows_write() && entry.access.allows_write())
        {
            return Err(Refusal::ReadOnly);
        }
        Ok(RegionCheck {
            memory: entry.memory.clone(),
            base: entry.base,
            bounds: opened,
        })
    }
}

/// What a request presents: the slot and generation it names, and its
/// handle's token with the scopes that token was narrowed through.
#[derive(Clone, Copy)]
pub struct Credentials<'a> {
    /// The slot named.
    pub region: RegionId,
    /// The generation named.
    pub generation: Generation,
    /// The handle's TCP token.
    pub token: u128,
    /// The scopes `token` was narrowed through; empty for the region's own.
    pub scopes: &'a Scopes,
}

/// A region whose generation, token and access a request passed; what is
/// left to check is each range's bounds.
pub struct RegionCheck {
    memory: Weak<MemoryBlock>,
    base: u64,
    /// What the credentials opened: the region, or a scope inside it.
    bounds: Scope,
}

impl RegionCheck {
    /// The offset of `addr..addr + len` in the region, or why it does not
    /// lie inside what the credentials opened (the offset and bound then
    /// relative to that: the region, or the handle's scope).
    pub fn offset(&self, addr: u64, len: u64) -> Result<usize, Refusal> {
        if !self.bounds.covers(addr, len) {
            return Err(Refusal::OutOfBounds {
                offset: addr.wrapping_sub(self.bounds.addr),
                bound: self.bounds.len,
            });
        }
        // Inside the region, whose length fits usize.
        Ok(addr.wrapping_sub(self.base) as usize)
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
mod tests;
