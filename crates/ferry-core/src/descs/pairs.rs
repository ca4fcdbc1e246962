//! A request's pairs: which descriptors of each list it uses, in order
//! ([`DescIndices`]), and their checks, made once when the request is
//! made ([`check_pairs`]), so that nothing moves when one is bad.

use std::ops::Range;
use std::sync::Arc;

use super::{DescError, Descs, LocalDescList, RemoteDescList};
use crate::{OpError, OpKind, RdmaOp};

/// Which descriptors of a list a request uses, in order: a slice of
/// indices (repeats allowed) or a range.
pub trait DescIndices {
    /// How many.
    fn count(&self) -> usize;
    /// The index at `position` (`position < count`).
    fn at(&self, position: usize) -> u64;
    /// The sequence as a range of indices, when it is one (checks then
    /// run over whole arrays; see [`Descs::lens_in`]).
    fn as_range(&self) -> Option<Range<usize>> {
        None
    }
    /// The same sequence, owned, for a request that outlives the caller's
    /// array: a range stays two numbers. Indices are checked against the
    /// lists afterwards; one past `u32::MAX` becomes `u32::MAX`, which no
    /// list of that many descriptors holds either.
    fn to_indices(&self) -> Indices {
        Indices::List(
            (0..self.count())
                .map(|p| u32::try_from(self.at(p)).unwrap_or(u32::MAX))
                .collect(),
        )
    }
}

/// An owned index sequence ([`DescIndices::to_indices`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Indices {
    /// `start`, `start + 1`, ... (`count` of them).
    Range {
        /// The first index.
        start: u64,
        /// How many.
        count: usize,
    },
    /// Any indices, repeats allowed.
    List(Arc<[u32]>),
}

impl DescIndices for Indices {
    fn count(&self) -> usize {
        match self {
            Indices::Range { count, .. } => *count,
            Indices::List(list) => list.len(),
        }
    }
    fn at(&self, position: usize) -> u64 {
        match self {
            Indices::Range { start, .. } => start + position as u64,
            Indices::List(list) => u64::from(list[position]),
        }
    }
    fn as_range(&self) -> Option<Range<usize>> {
        match *self {
            Indices::Range { start, count } => {
                let start = usize::try_from(start).ok()?;
                Some(start..start.checked_add(count)?)
            }
            Indices::List(_) => None,
        }
    }
    fn to_indices(&self) -> Indices {
        self.clone()
    }
}

impl DescIndices for &[u32] {
    fn count(&self) -> usize {
        self.len()
    }
    fn at(&self, position: usize) -> u64 {
        u64::from(self[position])
    }
}

impl DescIndices for &Vec<u32> {
    fn count(&self) -> usize {
        self.len()
    }
    fn at(&self, position: usize) -> u64 {
        u64::from(self[position])
    }
}

impl DescIndices for Range<usize> {
    fn count(&self) -> usize {
        self.len()
    }
    fn at(&self, position: usize) -> u64 {
        (self.start + position) as u64
    }
    fn as_range(&self) -> Option<Range<usize>> {
        Some(self.clone())
    }
    fn to_indices(&self) -> Indices {
        Indices::Range {
            start: self.start as u64,
            count: self.len(),
        }
    }
}

/// The ops of a request: for each position `k`, `kind` between local
/// descriptor `local_idx[k]` and remote descriptor `remote_idx[k]`.
/// Every index and every pair's lengths are checked before any op is
/// made: an error names the position, and nothing has moved.
pub fn ops_between(
    kind: OpKind,
    local: &LocalDescList,
    local_idx: impl DescIndices,
    remote: &RemoteDescList,
    remote_idx: impl DescIndices,
) -> Result<Vec<RdmaOp>, DescError> {
    check_pairs(local, &local_idx, remote, &remote_idx)?;
    (0..local_idx.count())
        .map(|k| op_at(kind, local, local_idx.at(k), remote, remote_idx.at(k), k))
        .collect()
}

/// Checks a request's pairs as [`ops_between`] does, without making its
/// ops: both index sequences as long, every index in its list, the two
/// descriptors of every pair as long. The error names the position.
pub fn check_pairs(
    local: &LocalDescList,
    local_idx: &impl DescIndices,
    remote: &RemoteDescList,
    remote_idx: &impl DescIndices,
) -> Result<(), DescError> {
    let count = local_idx.count();
    if remote_idx.count() != count {
        return Err(DescError::CountMismatch {
            local: count,
            remote: remote_idx.count(),
        });
    }
    // Two ranges over explicit lists (a request over whole prepared
    // lists): one comparison of the length arrays. Any difference is found
    // again below, with its position.
    if let (Some(l), Some(r)) = (
        local.descs.lens_in(local_idx),
        remote.descs.lens_in(remote_idx),
    ) && l.len() == count
        && l == r
    {
        return Ok(());
    }
    let lookup = |position: usize, index: u64, descs: &Descs| {
        usize::try_from(index)
            .ok()
            .and_then(|i| descs.get(i))
            .ok_or(DescError::IndexOutOfRange {
                position,
                index,
                len: descs.len(),
            })
    };
    for position in 0..count {
        let l = lookup(position, local_idx.at(position), &local.descs)?;
        let r = lookup(position, remote_idx.at(position), &remote.descs)?;
        if l.len != r.len {
            return Err(DescError::Descriptor {
                index: position,
                error: OpError::LengthMismatch {
                    local: l.len,
                    remote: r.len,
                },
            });
        }
    }
    Ok(())
}

/// The op between local descriptor `l` and remote descriptor `r`, a pair
/// [`check_pairs`] accepted. An index out of its list's range (a pair that
/// was never checked) is [`DescError::IndexOutOfRange`], at position
/// `position`.
pub fn op_at(
    kind: OpKind,
    local: &LocalDescList,
    l: u64,
    remote: &RemoteDescList,
    r: u64,
    position: usize,
) -> Result<RdmaOp, DescError> {
    let out_of_range = |index: u64, len: usize| DescError::IndexOutOfRange {
        position,
        index,
        len,
    };
    let local = usize::try_from(l)
        .ok()
        .and_then(|i| local.slice(i))
        .ok_or_else(|| out_of_range(l, local.descs.len()))?;
    let remote = usize::try_from(r)
        .ok()
        .and_then(|i| remote.slice(i))
        .ok_or_else(|| out_of_range(r, remote.descs.len()))?;
    Ok(match kind {
        OpKind::Read => RdmaOp::read(local, remote),
        OpKind::Write => RdmaOp::write(local, remote),
    })
}
