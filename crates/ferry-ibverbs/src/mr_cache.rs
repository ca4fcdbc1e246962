//! Registrations shared between overlapping regions: a region registered
//! inside one that is registered already, with the same access, reuses its
//! memory region (MR) instead of pinning and mapping the pages again. KV
//! caches register one large pool and then views of it; without sharing,
//! each view costs a full `ibv_reg_mr` (hundreds of µs, more per GiB) and
//! one of the device's MRs, of which some devices and drivers allow few.
//!
//! A hit needs the outer MR to be alive, and an MR holds its memory: the
//! address range cannot have been freed and reused by another allocation
//! meanwhile, the way caches keyed on a pointer alone go wrong. The inner
//! region holds the MR (and so the outer memory) for as long as it lives,
//! so the MR is deregistered once the last region using it is gone.
//!
//! What sharing gives away, and why it is off where that matters
//! ([`IbvConfig::share_registrations`](crate::IbvConfig)): the inner
//! region's handles carry the outer MR's rkey, which the NIC checks alone,
//! so a peer holding only an inner handle can reach every byte of the
//! outer range over RDMA, and an inner handle stays usable over RDMA until
//! the outer registration goes too. TCP and the same-host transport still
//! hold each handle to its own region's bounds and generation.

use std::sync::{Arc, Mutex, Weak};

use ferry_core::Access;

use crate::verbs::MemoryRegion;

/// Live MRs by the range they cover, and the access they were made with.
#[derive(Default)]
pub(crate) struct MrCache(Mutex<Vec<Entry>>);

/// One MR: `len` bytes at `addr`, made with `access` on device `nic`.
struct Entry {
    nic: usize,
    addr: u64,
    len: u64,
    access: Access,
    mr: Weak<MemoryRegion>,
}

impl MrCache {
    /// A live MR on device `nic` covering `addr..addr + len` made with
    /// `access`, if any.
    pub fn covering(
        &self,
        nic: usize,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Option<Arc<MemoryRegion>> {
        let mrs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let end = addr.checked_add(len)?;
        mrs.iter()
            .filter(|e| {
                e.nic == nic && e.access == access && e.addr <= addr && end <= e.addr + e.len
            })
            .find_map(|e| e.mr.upgrade())
    }

    /// Remembers `mr`, made on device `nic` over its memory with `access`;
    /// forgets MRs that are gone.
    pub fn insert(&self, nic: usize, mr: &Arc<MemoryRegion>, access: Access) {
        let memory = mr.memory();
        let mut mrs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        mrs.retain(|e| e.mr.strong_count() > 0);
        mrs.push(Entry {
            nic,
            addr: memory.addr(),
            len: memory.len(),
            access,
            mr: Arc::downgrade(mr),
        });
    }

    /// MRs alive now.
    pub fn live(&self) -> usize {
        let mrs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        mrs.iter().filter(|e| e.mr.strong_count() > 0).count()
    }
}
