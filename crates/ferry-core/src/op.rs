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
    offset: u64,
    len: u64,
}

impl LocalSlice {
    /// Built by [`Region::slice`], which has checked the bounds.
    pub(crate) fn new(region: Region, offset: u64, len: u64) -> Self {
        LocalSlice {
            region,
            offset,
            len,
        }
    }
    /// The region the slice lies in.
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// Where the slice starts in its region, in bytes.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the slice is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Address of the first byte; valid while `self` (and so the region) lives.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `offset <= region.len()` was checked when the slice was made
        // (so it fits usize: a region's length does) and the allocation is at
        // least `region.len()` bytes long.
        unsafe { self.region.memory().as_ptr().add(self.offset as usize) }
    }
}

/// One one-sided operation: `local` and `remote` must have the same length.
///
/// Ops submitted together in one batch have no order among themselves: a
/// backend runs them concurrently, split into pieces over several connections
/// or work requests. Two ops of a batch whose byte ranges overlap (a write and
/// a read of the same remote bytes, two writes to them, or two reads into the
/// same local bytes) leave those bytes unspecified, as on RDMA; put them in
/// separate batches, the second submitted after the first completed.
///
/// A zero-length op is checked locally like any other (equal lengths, write
/// access, a remote address range that does not wrap, a transport that
/// reaches the remote side) and then succeeds at once without contacting the
/// remote side: it does not prove that the remote node is reachable or that
/// the remote region still exists.
#[derive(Clone, Debug)]
pub struct RdmaOp {
    /// Read or write, from the local side.
    pub kind: OpKind,
    /// The local bytes: destination of a read, source of a write.
    pub local: LocalSlice,
    /// The remote bytes, as a (sliced) handle from their owner.
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

    /// Bytes this op moves.
    pub fn len(&self) -> u64 {
        self.local.len
    }

    /// Whether the op moves no bytes; see the type's docs for what such an
    /// op checks.
    pub fn is_empty(&self) -> bool {
        self.local.is_empty()
    }

    /// Checks every backend makes before posting: a remote address range that
    /// does not wrap ([`OpError::AddressOverflow`]), equal lengths, and write
    /// access for a write. Bounds of the remote region are the owner's to
    /// check.
    pub fn validate(&self) -> Result<(), OpError> {
        self.remote.check_address_range()?;
        if self.local.len != self.remote.len() {
            return Err(OpError::LengthMismatch {
                local: self.local.len,
                remote: self.remote.len(),
            });
        }
        if self.kind == OpKind::Write && !self.remote.access().allows_write() {
            return Err(OpError::ReadOnly);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::region;

    #[test]
    fn ops_on_forged_wrapping_handles_fail_validation() {
        let local = region(100);
        let mut json = serde_json::to_value(local.remote()).unwrap();
        json["len"] = u64::MAX.into();
        let forged: RemoteBuffer = serde_json::from_value(json).unwrap();
        let op = RdmaOp::read(local.whole(), forged);
        // The lengths differ too (100 against u64::MAX): the forged range is
        // what gets reported.
        assert_eq!(op.len(), 100);
        assert_eq!(
            op.validate(),
            Err(OpError::AddressOverflow {
                addr: local.memory().addr(),
                len: u64::MAX
            })
        );
    }

    #[test]
    fn validation_checks_lengths_and_access() {
        let local = region(100);
        let remote = local.remote();
        let short = RdmaOp::write(local.slice(0..10).unwrap(), remote.clone());
        assert_eq!(
            short.validate(),
            Err(OpError::LengthMismatch {
                local: 10,
                remote: 100
            })
        );
        let read_only = RdmaOp::write(local.whole(), remote.read_only());
        assert_eq!(read_only.validate(), Err(OpError::ReadOnly));
        assert_eq!(RdmaOp::read(local.whole(), remote).validate(), Ok(()));
    }
}
