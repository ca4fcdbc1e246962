use crate::{OpError, Region, RemoteBuffer};

/// Direction of a one-sided operation, named from the local side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Remote bytes into local memory.
    Read,
    /// Local bytes into remote memory.
    Write,
}

/// A byte range of a local region. Holding one keeps the region registered.
#[derive(Clone, Debug)]
pub struct LocalSlice {
    region: Region,
    offset: usize,
    len: usize,
}

impl LocalSlice {
    /// Built by [`Region::slice`], which has checked the bounds.
    pub(crate) fn new(region: Region, offset: usize, len: usize) -> Self {
        LocalSlice {
            region,
            offset,
            len,
        }
    }
    pub fn region(&self) -> &Region {
        &self.region
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Address of the first byte; valid while `self` (and so the region) lives.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `offset <= region.len()` was checked when the slice was made
        // and the allocation is at least `region.len()` bytes long.
        unsafe { self.region.memory().as_ptr().add(self.offset) }
    }
}

/// One one-sided operation: `local` and `remote` must have the same length.
#[derive(Clone, Debug)]
pub struct RdmaOp {
    pub kind: OpKind,
    pub local: LocalSlice,
    pub remote: RemoteBuffer,
}

impl RdmaOp {
    /// Read `remote` into `local`.
    pub fn read(local: LocalSlice, remote: RemoteBuffer) -> Self {
        RdmaOp {
            kind: OpKind::Read,
            local,
            remote,
        }
    }

    /// Write `local` into `remote`.
    pub fn write(local: LocalSlice, remote: RemoteBuffer) -> Self {
        RdmaOp {
            kind: OpKind::Write,
            local,
            remote,
        }
    }

    pub fn len(&self) -> usize {
        self.local.len
    }

    pub fn is_empty(&self) -> bool {
        self.local.is_empty()
    }

    /// Checks every backend makes before posting: equal lengths, a remote
    /// address range that does not wrap, and write access for a write. Bounds
    /// of the remote region are the owner's to check.
    pub fn validate(&self) -> Result<(), OpError> {
        self.remote.check_address_range()?;
        if self.local.len as u64 != self.remote.len() {
            return Err(OpError::LengthMismatch {
                local: self.local.len as u64,
                remote: self.remote.len(),
            });
        }
        if self.kind == OpKind::Write && !self.remote.access().allows_write() {
            return Err(OpError::ReadOnly);
        }
        Ok(())
    }
}
