//! The copies of a batch, once every op has its mapping or `process_vm`
//! grant: inline when small, else cut into chunks by bytes (a long op
//! split too) that the process's copy threads take (`pool.rs`; one
//! thread's memcpy does not saturate memory). On a current-thread runtime
//! the waiting task copies chunks too, one per poll.

use std::sync::Arc;

use ferry_core::{LocalDescList, OpKind, RdmaOp};

use crate::pool;
use crate::pvm::{Fail, Grant, Vectors};
use crate::target::Target;

/// Batches shorter than this are copied on the calling task.
pub(crate) const INLINE: u64 = (1 << 20) + 1;
/// Each thread gets at least this many bytes: a batch of 1,024 blocks of
/// 4 KiB takes two. One thread's `process_vm` copies of 4 KiB blocks move
/// about 3 GB/s, and a second thread's start costs tens of microseconds
/// against the millisecond such a batch takes (through NIXL: 3.2-3.4 ->
/// 4.7-4.9 GB/s on a 2-core host with a core free; no change when both
/// cores are busy).
const PER_THREAD: u64 = 2 << 20;
/// At most this many threads per batch.
const MAX_THREADS: usize = 4;
/// What a copy on a current-thread runtime moves before it yields: a poll
/// of the runtime takes about this long (a third of a millisecond).
const STEP: usize = 1 << 20;
/// What a copy thread claims at a time: small enough that two threads
/// end a slice of 8 MiB within a tenth of a millisecond of each other,
/// large enough that a `process_vm` call still carries hundreds of
/// kilobytes. At most [`STEP`], as the task on a current-thread runtime
/// copies one per poll.
const CHUNK: usize = 512 << 10;

/// One op, ready to copy: its bytes on both sides, checked.
pub(crate) struct Planned {
    /// Its index in the batch: of its op, or of its descriptor pair from
    /// the slice's first.
    pub index: usize,
    /// Its mapping or grant: [`Batch::targets`]`[target]`.
    pub target: u32,
    pub kind: OpKind,
    /// Its local bytes, in a region the batch keeps ([`Keep`]).
    pub local: *mut u8,
    /// Its remote bytes: an address in the target's mapping here, or the
    /// owner's address for a `process_vm` grant.
    pub remote: u64,
    pub len: u64,
}

/// What keeps a batch's local regions alive while a thread copies (a
/// timed-out submit may drop its own reference first).
pub(crate) enum Keep {
    /// The batch's ops, which hold their regions.
    Ops(Vec<RdmaOp>),
    /// The list a slice of descriptor pairs points into.
    Descs(#[expect(dead_code, reason = "held only to keep its regions alive")] LocalDescList),
}

/// A batch's ops to copy, and what they copy through. Shared with the
/// copy threads: it keeps both sides' memory alive while a thread copies.
pub(crate) struct Batch {
    pub planned: Vec<Planned>,
    /// The mappings and grants the planned ops name, once each.
    pub targets: Vec<Target>,
    pub keep: Keep,
}

/// A byte range of one planned op, for one thread.
pub(crate) struct Piece {
    planned: usize,
    offset: usize,
    len: usize,
}

impl Piece {
    /// The planned op it is part of.
    pub fn planned(&self) -> usize {
        self.planned
    }
}

// SAFETY: `local` points into a region the batch keeps alive (`Keep`),
// `remote` into a mapping its targets keep (a grant's address is only
// handed to the kernel); both are only used for copies, like DMA.
unsafe impl Send for Planned {}
// SAFETY: as for Send; a Planned is only read.
unsafe impl Sync for Planned {}

/// Copies `len` bytes at `offset` of the op; `Err(Fail::Dead)` if its
/// region was not alive throughout.
fn copy(batch: &Batch, planned: &Planned, offset: usize, len: usize) -> Result<(), Fail> {
    // In range: offset + len <= the op's length.
    let local = planned.local.wrapping_add(offset);
    let mapping = match &batch.targets[planned.target as usize] {
        Target::Mapped(mapping) => mapping,
        Target::ProcessVm(grant) => {
            return grant.copy(planned.kind, local, planned.remote + offset as u64, len);
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
        let remote = (planned.remote as usize as *mut u8).add(offset);
        match planned.kind {
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
    let total: u64 = batch.planned.iter().map(|p| p.len).sum();
    if total < INLINE {
        return run_here(&batch);
    }
    let Some((pool, threads)) = pool::pool() else {
        return run_in_steps(&batch).await;
    };
    let wanted = (total / PER_THREAD).clamp(1, threads.min(MAX_THREADS) as u64) as usize;
    // On a current-thread runtime (the NIXL plugin's, which the caller
    // polling for the request drives) this task copies too, a chunk per
    // poll, in place of one of the threads: one more thread competed for
    // a 2-core host's cores with the two spinning callers.
    let here = on_current_thread();
    let limit = wanted - usize::from(here);
    let (job, done) = pool::Job::new(batch.clone(), cut(whole(&batch), CHUNK), limit);
    // Chunks no thread claimed yet stay uncopied if this future is
    // dropped (its submit timed out): they would only hold the cores.
    let _abandon = Abandon(&job);
    pool.push(job.clone());
    if here {
        while job.copy_next() {
            tokio::task::yield_now().await;
        }
    }
    // The last chunk copied sends, also where a copy panicked (its ops
    // fail); a sender dropped unsent cannot happen while `job` holds it.
    match done.await {
        Ok(()) => job.outcome(),
        Err(_) => vec![Err(Fail::Dead); batch.planned.len()],
    }
}

/// Abandons its job when dropped: the waiting future's end.
struct Abandon<'a>(&'a pool::Job);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// Copies a batch here, a step at a time between polls: for a process
/// where no copy thread would start.
async fn run_in_steps(batch: &Batch) -> Vec<Result<(), Fail>> {
    let mut outcome = vec![Ok(()); batch.planned.len()];
    for (i, step) in cut(whole(batch), STEP).iter().enumerate() {
        if i > 0 {
            tokio::task::yield_now().await;
        }
        merge(&mut outcome, copy_run(batch, step));
    }
    outcome
}

/// Each piece's result into its op's outcome, where no earlier piece of
/// the op failed.
fn merge(outcome: &mut [Result<(), Fail>], pieces: Vec<(usize, Result<(), Fail>)>) {
    for (i, result) in pieces {
        if outcome[i].is_ok() {
            outcome[i] = result;
        }
    }
}

/// Whether this task runs on a current-thread runtime.
fn on_current_thread() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
}

/// `pieces` cut, in order, into groups of at most `size` bytes (the last
/// may hold fewer), a piece split where it crosses a group's end: a batch
/// into the threads' runs, a run into the steps of a current-thread copy.
fn cut(pieces: Vec<Piece>, size: usize) -> Vec<Vec<Piece>> {
    let mut groups = vec![Vec::new()];
    let mut room = size;
    for piece in pieces {
        let mut offset = piece.offset;
        let end = piece.offset + piece.len;
        while offset < end {
            if room == 0 {
                groups.push(Vec::new());
                room = size;
            }
            let len = room.min(end - offset);
            let group = groups.last_mut().expect("never empty");
            group.push(Piece {
                planned: piece.planned,
                offset,
                len,
            });
            offset += len;
            room -= len;
        }
    }
    groups
}

/// One piece per planned op, whole.
fn whole(batch: &Batch) -> Vec<Piece> {
    (0..batch.planned.len())
        .map(|i| Piece {
            planned: i,
            offset: 0,
            len: batch.planned[i].len as usize,
        })
        .collect()
}

/// Copies a batch (of fewer than [`INLINE`] bytes) on the calling thread;
/// how each planned op went.
pub(crate) fn run_here(batch: &Batch) -> Vec<Result<(), Fail>> {
    let mut outcome = vec![Ok(()); batch.planned.len()];
    for (i, result) in copy_run(batch, &whole(batch)) {
        outcome[i] = result;
    }
    outcome
}

/// Copies `run`'s pieces in order; each piece's planned op and how it
/// went. Consecutive pieces through one `process_vm` grant go in one
/// vectored call each (up to [`pvm::IOVECS`] iovecs a side and
/// [`pvm::PIECE`] bytes, one gated step; adjacent pieces share iovecs): a
/// request of 1,024 4 KiB blocks in memory NIXL registered took 1,024
/// system calls, a third of its time, before.
pub(crate) fn copy_run(batch: &Batch, run: &[Piece]) -> Vec<(usize, Result<(), Fail>)> {
    let mut out = Vec::with_capacity(run.len());
    let mut at = 0;
    while at < run.len() {
        let (group, vectors) = vectored_group(batch, &run[at..]);
        if group > 1 {
            let pieces = &run[at..at + group];
            let (grant, kind) = grant_of(batch, &pieces[0]).expect("a process_vm piece");
            if let Some(result) = grant.copy_vectored(kind, &vectors) {
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
    match &batch.targets[planned.target as usize] {
        Target::ProcessVm(grant) => Some((grant, planned.kind)),
        Target::Mapped(_) => None,
    }
}

/// How many of `pieces`, from the first, go in one vectored call, and
/// that call's iovecs: those through the first one's grant with its op
/// kind, within the call's bounds (0 if the first is not a `process_vm`
/// piece).
fn vectored_group(batch: &Batch, pieces: &[Piece]) -> (usize, Vectors) {
    let mut vectors = Vectors::default();
    let Some((first, kind)) = pieces.first().and_then(|p| grant_of(batch, p)) else {
        return (0, vectors);
    };
    for piece in pieces {
        // Checked first: `segment` takes `process_vm` pieces only.
        let same = grant_of(batch, piece).is_some_and(|(g, k)| Arc::ptr_eq(g, first) && k == kind);
        if !same {
            break;
        }
        let (local, remote, len) = segment(batch, piece);
        if !vectors.push(local, remote, len) {
            break;
        }
    }
    (vectors.segments(), vectors)
}

/// A `process_vm` piece's local address, remote address and length.
fn segment(batch: &Batch, piece: &Piece) -> (*mut u8, u64, usize) {
    let planned = &batch.planned[piece.planned];
    let local = planned.local.wrapping_add(piece.offset);
    (local, planned.remote + piece.offset as u64, piece.len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_splits_pieces_at_group_ends_and_keeps_every_byte_in_order() {
        let piece = |planned, offset, len| Piece {
            planned,
            offset,
            len,
        };
        let run = vec![
            piece(0, 7, 3 * STEP + 5),
            piece(1, 0, 10),
            piece(2, 0, STEP),
        ];
        let steps = cut(run, STEP);
        let bytes: Vec<usize> = steps
            .iter()
            .map(|s| s.iter().map(|p| p.len).sum())
            .collect();
        assert_eq!(bytes, [STEP, STEP, STEP, STEP, 15]);
        let flat: Vec<(usize, usize, usize)> = steps
            .iter()
            .flatten()
            .map(|p| (p.planned, p.offset, p.len))
            .collect();
        assert_eq!(
            flat,
            [
                (0, 7, STEP),
                (0, 7 + STEP, STEP),
                (0, 7 + 2 * STEP, STEP),
                (0, 7 + 3 * STEP, 5),
                (1, 0, 10),
                (2, 0, STEP - 15),
                (2, STEP - 15, 15),
            ]
        );
        assert!(cut(Vec::new(), STEP).iter().all(Vec::is_empty));
    }
}
