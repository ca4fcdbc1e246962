//! The copies of a batch, once every op has its mapping or `process_vm`
//! grant: inline when small, else on blocking threads, a long batch or op
//! split across a few of them by bytes (one thread's memcpy does not
//! saturate memory).

use std::sync::Arc;

use ferry_core::{OpKind, RdmaOp};

use crate::mapping::Mapping;
use crate::pvm::{Fail, Grant};

/// Batches shorter than this are copied on the calling task.
const INLINE: u64 = (1 << 20) + 1;
/// Each thread gets at least this many bytes.
const PER_THREAD: u64 = 4 << 20;
/// At most this many threads per batch.
const MAX_THREADS: usize = 4;

/// Where an op's remote bytes are, checked against the region.
pub(crate) enum Located {
    /// In a mapping of the region's memfd, at this address here.
    Mapped {
        mapping: Arc<Mapping>,
        remote: *mut u8,
    },
    /// In the owner's address space, at this address there.
    ProcessVm { grant: Arc<Grant>, remote: u64 },
}

/// One op, ready to copy: where its remote bytes are, checked.
pub(crate) struct Planned {
    /// Its index in the batch.
    pub index: usize,
    pub at: Located,
}

/// A batch's ops and the ones of them to copy. Shared with the copy
/// threads: its ops keep their local regions alive while a thread copies
/// (a timed-out submit may drop its own reference first).
pub(crate) struct Batch {
    pub ops: Vec<RdmaOp>,
    pub planned: Vec<Planned>,
}

impl Batch {
    /// The op `planned` copies.
    pub fn op(&self, planned: &Planned) -> &RdmaOp {
        &self.ops[planned.index]
    }
}

/// A byte range of one planned op, for one thread.
struct Piece {
    planned: usize,
    offset: usize,
    len: usize,
}

// SAFETY: the pointer points into the mapping that `mapping` keeps (a
// grant's address is only handed to the kernel), and is only used for
// copies, like DMA.
unsafe impl Send for Located {}
// SAFETY: as for Send; a Located is only read.
unsafe impl Sync for Located {}

/// Copies `len` bytes at `offset` of the op; `Err(Fail::Dead)` if its
/// region was not alive throughout.
fn copy(batch: &Batch, planned: &Planned, offset: usize, len: usize) -> Result<(), Fail> {
    let op = batch.op(planned);
    let (mapping, remote) = match &planned.at {
        Located::Mapped { mapping, remote } => (mapping, *remote),
        Located::ProcessVm { grant, remote } => {
            // In range: offset + len <= the op's length.
            let local = op.local.as_ptr().wrapping_add(offset);
            return grant.copy(op.kind, local, remote + offset as u64, len);
        }
    };
    if !mapping.is_alive() {
        return Err(Fail::Dead);
    }
    // SAFETY: offset + len <= the op's length, and `remote..+len(op)` lies
    // in the mapping (`Mapping::locate`), `local..+len(op)` in the op's
    // local region; both live (see `Planned`). They may be the same pages
    // (a node copying within its own region through the transport), at
    // other addresses: `copy` keeps that sound, and the bytes where source
    // and destination overlap are unspecified, as for overlapping ops.
    unsafe {
        let local = op.local.as_ptr().add(offset);
        let remote = remote.add(offset);
        match op.kind {
            OpKind::Write => std::ptr::copy(local, remote, len),
            OpKind::Read => std::ptr::copy(remote, local, len),
        }
    }
    // The copy's stores are visible before the second look at the word,
    // which the owner clears with SeqCst: a write seen as done cannot land
    // after the owner stopped sharing the region.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    if mapping.is_alive() {
        Ok(())
    } else {
        Err(Fail::Dead)
    }
}

/// Runs every copy; returns, for each planned op in order, how it went
/// (for a dead region, the owner is asked why).
pub(crate) async fn run(batch: Arc<Batch>) -> Vec<Result<(), Fail>> {
    let total: u64 = batch.planned.iter().map(|p| batch.op(p).len()).sum();
    if total < INLINE {
        return (batch.planned.iter())
            .map(|p| copy(&batch, p, 0, batch.op(p).len() as usize))
            .collect();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (total / PER_THREAD).clamp(1, cores.min(MAX_THREADS) as u64);
    let share = total.div_ceil(threads) as usize;
    // Cut the batch into `threads` runs of about `share` bytes.
    let mut runs: Vec<Vec<Piece>> = vec![Vec::new()];
    let mut room = share;
    for (i, p) in batch.planned.iter().enumerate() {
        let mut offset = 0;
        let len = batch.op(p).len() as usize;
        while offset < len {
            if room == 0 {
                runs.push(Vec::new());
                room = share;
            }
            let take = room.min(len - offset);
            runs.last_mut().expect("never empty").push(Piece {
                planned: i,
                offset,
                len: take,
            });
            offset += take;
            room -= take;
        }
    }
    let tasks = runs.into_iter().map(|run| {
        let batch = batch.clone();
        tokio::task::spawn_blocking(move || {
            run.into_iter()
                .map(|piece| {
                    let planned = &batch.planned[piece.planned];
                    let result = copy(&batch, planned, piece.offset, piece.len);
                    (piece.planned, result)
                })
                .collect::<Vec<_>>()
        })
    });
    let mut outcome = vec![Ok(()); batch.planned.len()];
    for done in futures_join(tasks).await {
        match done {
            Ok(pieces) => {
                for (i, result) in pieces {
                    if outcome[i].is_ok() {
                        outcome[i] = result;
                    }
                }
            }
            // A copy thread cannot panic short of a bug; its ops are
            // reported through the owner's answer, not as done.
            Err(_) => outcome.iter_mut().for_each(|a| *a = Err(Fail::Dead)),
        }
    }
    outcome
}

/// Awaits every task (no extra dependency for one join).
async fn futures_join<T>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for task in tasks.collect::<Vec<_>>() {
        out.push(task.await);
    }
    out
}
