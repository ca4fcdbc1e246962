//! A region as an owner granted it, whichever way: a mapping of its memfd
//! here, or its address range in the owner for `process_vm`. Planning
//! finds one per region (`plan.rs`) and the copies go through it
//! (`copy.rs`).

use std::sync::Arc;

use ferry_core::{Generation, OpError};

use crate::mapping::Mapping;
use crate::pvm::Grant;

/// A region as granted by its owner: mapped here, or reached over
/// `process_vm`.
#[derive(Clone)]
pub(crate) enum Target {
    /// Its memfd, mapped here.
    Mapped(Arc<Mapping>),
    /// Its owner's address range.
    ProcessVm(Arc<Grant>),
}

impl Target {
    pub(crate) fn generation(&self) -> Generation {
        match self {
            Target::Mapped(m) => m.generation(),
            Target::ProcessVm(g) => g.generation,
        }
    }

    pub(crate) fn writable(&self) -> bool {
        match self {
            Target::Mapped(m) => m.writable(),
            Target::ProcessVm(g) => g.writable,
        }
    }

    /// Whether the region is still registered under the grant's generation.
    pub fn is_alive(&self) -> bool {
        match self {
            Target::Mapped(m) => m.is_alive(),
            Target::ProcessVm(g) => g.is_alive(),
        }
    }

    /// Where the `len` remote bytes at the owner's address `addr` are,
    /// after checking they lie in the region: an address in the mapping
    /// here, or the owner's own for `process_vm`.
    pub fn locate(&self, addr: u64, len: u64) -> Result<u64, OpError> {
        match self {
            Target::Mapped(m) => m.locate(addr, len).map(|p| p as usize as u64),
            Target::ProcessVm(g) => g.locate(addr, len),
        }
    }

    /// The same mapping or grant (not only an equal one).
    pub fn same(&self, other: &Target) -> bool {
        match (self, other) {
            (Target::Mapped(a), Target::Mapped(b)) => Arc::ptr_eq(a, b),
            (Target::ProcessVm(a), Target::ProcessVm(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}
