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
        let whole = (0..batch.planned.len()).map(|i| Piece {
            planned: i,
            offset: 0,
            len: batch.op(&batch.planned[i]).len() as usize,
        });
        let mut outcome = vec![Ok(()); batch.planned.len()];
        for (i, result) in copy_run(&batch, whole.collect()) {
            outcome[i] = result;
        }
        return outcome;
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
        tokio::task::spawn_blocking(move || copy_run(&batch, run))
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

/// Copies `run`'s pieces in order; each piece's planned op and how it
/// went. Consecutive pieces through one `process_vm` grant go in one
/// vectored call each (up to [`pvm::IOVECS`] pieces and [`pvm::PIECE`]
/// bytes, one gated step): a request of 1,024 4 KiB blocks in memory NIXL
/// registered took 1,024 system calls, a third of its time, before.
fn copy_run(batch: &Batch, run: Vec<Piece>) -> Vec<(usize, Result<(), Fail>)> {
    let mut out = Vec::with_capacity(run.len());
    let mut at = 0;
    while at < run.len() {
        let group = vectored_group(batch, &run[at..]);
        if group > 1 {
            let pieces = &run[at..at + group];
            let (grant, kind) = grant_of(batch, &pieces[0]).expect("a process_vm piece");
            let segments: Vec<_> = pieces.iter().map(|p| segment(batch, p)).collect();
            if let Some(result) = grant.copy_vectored(kind, &segments) {
                out.extend(pieces.iter().map(|p| (p.planned, result)));
                at += group;
                continue;
            }
            // Stopped short (a fault somewhere): piece by piece, which
            // says which op failed. Repeating a copy is harmless.
        }
        for piece in &run[at..at + group.max(1)] {
            let planned = &batch.planned[piece.planned];
            out.push((piece.planned, copy(batch, planned, piece.offset, piece.len)));
        }
        at += group.max(1);
    }
    out
}

/// The grant and op kind of a `process_vm` piece.
fn grant_of<'a>(batch: &'a Batch, piece: &Piece) -> Option<(&'a Arc<Grant>, OpKind)> {
    let planned = &batch.planned[piece.planned];
    match &planned.at {
        Located::ProcessVm { grant, .. } => Some((grant, batch.op(planned).kind)),
        Located::Mapped { .. } => None,
    }
}

/// How many of `pieces`, from the first, go in one vectored call: those
/// through the first one's grant with its op kind, within the call's
/// bounds (0 if the first is not a `process_vm` piece).
fn vectored_group(batch: &Batch, pieces: &[Piece]) -> usize {
    let Some((first, kind)) = pieces.first().and_then(|p| grant_of(batch, p)) else {
        return 0;
    };
    let mut bytes = 0;
    pieces
        .iter()
        .take(crate::pvm::IOVECS)
        .take_while(|p| {
            bytes += p.len;
            bytes <= crate::pvm::PIECE
                && grant_of(batch, p).is_some_and(|(g, k)| Arc::ptr_eq(g, first) && k == kind)
        })
        .count()
}

/// A `process_vm` piece's local address, remote address and length.
fn segment(batch: &Batch, piece: &Piece) -> (*mut u8, u64, usize) {
    let planned = &batch.planned[piece.planned];
    let Located::ProcessVm { remote, .. } = planned.at else {
        unreachable!("grouped by grant_of")
    };
    let local = batch.op(planned).local.as_ptr().wrapping_add(piece.offset);
    (local, remote + piece.offset as u64, piece.len)
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
