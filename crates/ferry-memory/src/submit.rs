//! Running a batch: each op planned (`plan.rs`), copied (`copy.rs`), and
//! what failed said by index, the lowest first. Two forms of a batch: ops,
//! and a slice of a request's descriptor pairs, planned per region and
//! copied without an op made per pair.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{
    DescIndices, Indices, LocalDescList, OpError, OpKind, RdmaOp, RemoteDescList, SubmitError,
    op_at,
};

use crate::copy::{self, Batch, Keep, Planned};
use crate::{MemoryBackend, peer, plan, pvm};

/// A slice of a request as descriptor pairs ([`MemoryBackend::submit_pairs`]):
/// pair `k`, for each `k` in `range`, moves the bytes of local descriptor
/// `local_idx[k]` from or to remote descriptor `remote_idx[k]`, both of
/// `kind`. The pairs are those a request checked when it was made
/// ([`ferry_core::check_pairs`]: indices in range, lengths equal).
#[derive(Clone)]
pub struct Pairs<'a> {
    /// Read or write, from the local side.
    pub kind: OpKind,
    /// The local descriptors.
    pub local: &'a LocalDescList,
    /// Which local descriptor each pair moves.
    pub local_idx: &'a Indices,
    /// The remote descriptors.
    pub remote: &'a RemoteDescList,
    /// Which remote descriptor each pair moves.
    pub remote_idx: &'a Indices,
    /// The slice's positions in the index arrays.
    pub range: Range<usize>,
}

impl MemoryBackend {
    /// Runs a small batch now, on the calling thread, when nothing in it
    /// needs waiting for: every op valid, its owner linked and alive, its
    /// region mapped or granted here already (by an earlier batch, or
    /// [`prepare`](Self::prepare)), and fewer bytes in all than
    /// [`submit`](Self::submit) copies inline anyway. Otherwise, or when a
    /// copy fails, the ops come back for `submit`, which waits for what is
    /// missing and says what failed (a failed copy is made again there:
    /// the same bytes to the same place).
    ///
    /// For a request of a few small ops, the async path around the copy
    /// (a timer, a batch on the heap, a future of kilobytes moved into
    /// place) cost more than the copy: an 8-byte write through NIXL spent
    /// 2-3 µs there against 1.4 µs in `process_vm_writev`.
    pub fn submit_now(&self, ops: Vec<RdmaOp>) -> Result<(), Vec<RdmaOp>> {
        let mut total = 0u64;
        for op in &ops {
            if op.validate().is_err() {
                return Err(ops);
            }
            total = total.saturating_add(op.len());
        }
        if total >= copy::INLINE {
            return Err(ops);
        }
        let mut planned = Vec::with_capacity(ops.len());
        let mut seen = plan::Seen::default();
        for (index, op) in ops.iter().enumerate() {
            match self.plan_known(op, &mut seen) {
                Ok(Some(Some((target, remote)))) => planned.push(of_op(index, op, target, remote)),
                Ok(Some(None)) => {}
                Ok(None) | Err(_) => return Err(ops),
            }
        }
        let targets = seen.into_targets().into_iter().map(|(_, t)| t).collect();
        let batch = Batch {
            planned,
            targets,
            keep: Keep::Ops(ops),
        };
        let copied = copy::run_here(&batch).iter().all(Result::is_ok);
        let Keep::Ops(ops) = batch.keep else {
            unreachable!("made with its ops")
        };
        if copied { Ok(()) } else { Err(ops) }
    }

    /// Runs a batch whose ops all [`routes`](Self::routes) accepted: the
    /// copies run in this process (a long batch split across a few
    /// threads), no owner CPU involved. `Err(Op)` names the lowest failing
    /// op; the others still ran.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        // A batch with a bad op moves nothing, as on the other transports.
        for (index, op) in ops.iter().enumerate() {
            op.validate()
                .map_err(|error| SubmitError::Op { index, error })?;
        }
        let total = ops.len();
        let run = async {
            let mut failed: Vec<(usize, OpError)> = Vec::new();
            let mut planned = Vec::with_capacity(ops.len());
            let mut seen = plan::Seen::default();
            for (index, op) in ops.iter().enumerate() {
                match self.plan(op, &mut seen).await {
                    Ok(Some((target, remote))) => planned.push(of_op(index, op, target, remote)),
                    Ok(None) => {}
                    Err(error) => failed.push((index, error)),
                }
            }
            let (links, batch) = batch(planned, seen, Keep::Ops(ops));
            let outcome = copy::run(batch.clone()).await;
            let Keep::Ops(ops) = &batch.keep else {
                unreachable!("made with its ops")
            };
            for (planned, outcome) in batch.planned.iter().zip(outcome) {
                if let Err(fail) = outcome {
                    let link = &links[planned.target as usize];
                    let error = why_failed(link, &ops[planned.index], fail).await;
                    failed.push((planned.index, error));
                }
            }
            failed.into_iter().min_by_key(|(index, _)| *index)
        };
        settle(run, timeout, total).await
    }

    /// Runs a slice of a request's descriptor pairs, as [`submit`](Self::submit)
    /// runs the same pairs as ops (every remote region routed here), with
    /// the same checks and errors (`Op`'s index counts from the slice's
    /// first pair). Each region is planned once, not each pair, and no op
    /// is made: for a request of tens of thousands of 8 KiB pairs, making
    /// and planning an op per pair was a tenth of the CPU its copies had.
    pub async fn submit_pairs(
        &self,
        pairs: Pairs<'_>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        let Pairs {
            kind,
            local,
            local_idx,
            remote,
            remote_idx,
            ref range,
        } = pairs;
        let (remote_descs, handles) = (remote.descs(), remote.regions());
        // A batch with a bad pair moves nothing, as for ops: the only
        // check a pair's lists did not make is a write's access.
        if kind == OpKind::Write {
            for k in range.clone() {
                let region = remote_descs
                    .get(remote_idx.at(k) as usize)
                    .map(|r| r.region);
                if region.is_some_and(|r| !handles[r as usize].access().allows_write()) {
                    let (index, error) = (k - range.start, OpError::ReadOnly);
                    return Err(SubmitError::Op { index, error });
                }
            }
        }
        let total = range.len();
        let run = async {
            let mut slice = SliceDraft {
                pairs: pairs.clone(),
                // Addresses, not pointers: the future holds them across
                // awaits.
                bases: (local.regions().iter())
                    .map(|r| r.memory().as_ptr() as usize)
                    .collect(),
                by_region: vec![None; handles.len()],
                planned: Vec::with_capacity(total),
                failed: Vec::new(),
                seen: plan::Seen::default(),
                next: range.start,
            };
            // Planned on this thread, leaving it only where a region's
            // owner must be asked for its mapping or grant.
            while let Some(region) = slice.plan() {
                let handle = &handles[region as usize];
                let target = self.target(handle, kind, &mut slice.seen).await;
                slice.by_region[region as usize] = Some(target);
            }
            let SliceDraft {
                planned,
                mut failed,
                seen,
                ..
            } = slice;
            let (links, batch) = batch(planned, seen, Keep::Descs(local.clone()));
            let outcome = copy::run(batch.clone()).await;
            for (planned, outcome) in batch.planned.iter().zip(outcome) {
                if let Err(fail) = outcome {
                    let k = range.start + planned.index;
                    let (l, r) = (local_idx.at(k), remote_idx.at(k));
                    let error = match op_at(kind, local, l, remote, r, k) {
                        Ok(op) => why_failed(&links[planned.target as usize], &op, fail).await,
                        Err(e) => OpError::Protocol(e.to_string()),
                    };
                    failed.push((planned.index, error));
                }
            }
            failed.into_iter().min_by_key(|(index, _)| *index)
        };
        settle(run, timeout, total).await
    }
}

/// A slice of pairs being planned ([`MemoryBackend::submit_pairs`]).
struct SliceDraft<'a> {
    pairs: Pairs<'a>,
    /// Each local region's first byte, as an address.
    bases: Vec<usize>,
    /// Per remote region, its target in `seen`, or why it has none;
    /// `None` until its first pair.
    by_region: Vec<Option<Result<u32, OpError>>>,
    planned: Vec<Planned>,
    failed: Vec<(usize, OpError)>,
    seen: plan::Seen,
    /// The next pair to plan.
    next: usize,
}

impl SliceDraft<'_> {
    /// Plans the pairs from `next` on; stops at a pair whose remote region
    /// has no target looked up yet, and returns that region (`None` once
    /// every pair is planned). A plain loop, not an async one, whose state
    /// lived in the future's fields: a slice of 1,024 pairs took 24-29 µs
    /// to plan there, 18-19 here.
    fn plan(&mut self) -> Option<u32> {
        let Pairs {
            kind,
            local,
            local_idx,
            remote,
            remote_idx,
            ref range,
        } = self.pairs;
        let (local_descs, remote_descs) = (local.descs(), remote.descs());
        let handles = remote.regions();
        while self.next < range.end {
            let k = self.next;
            let index = k - range.start;
            let l = local_descs.get(local_idx.at(k) as usize);
            let Some((l, r)) = l.zip(remote_descs.get(remote_idx.at(k) as usize)) else {
                // A request checks its pairs when made: a bug, reported
                // rather than panicking a task.
                let error = OpError::Protocol(format!("pair {k} is not in its lists"));
                self.failed.push((index, error));
                self.next += 1;
                continue;
            };
            if l.len > 0 {
                let target = match &self.by_region[r.region as usize] {
                    None => return Some(r.region),
                    Some(Ok(target)) => *target,
                    Some(Err(error)) => {
                        self.failed.push((index, error.clone()));
                        self.next += 1;
                        continue;
                    }
                };
                let addr = handles[r.region as usize].addr() + r.offset;
                match self.seen.locate(target, addr, r.len) {
                    Ok(remote) => self.planned.push(Planned {
                        index,
                        target,
                        kind,
                        // In the region: the list checked its bounds.
                        local: (self.bases[l.region as usize] + l.offset as usize) as *mut u8,
                        remote,
                        len: l.len,
                    }),
                    Err(error) => self.failed.push((index, error)),
                }
            }
            self.next += 1;
        }
        None
    }
}

/// Op `index` of a batch, planned to `remote` through target `target`.
fn of_op(index: usize, op: &RdmaOp, target: u32, remote: u64) -> Planned {
    Planned {
        index,
        target,
        kind: op.kind,
        local: op.local.as_ptr(),
        remote,
        len: op.len(),
    }
}

/// The batch to copy, shared with the copy threads, and each target's
/// link (by the targets' index) for what failed.
fn batch(
    planned: Vec<Planned>,
    seen: plan::Seen,
    keep: Keep,
) -> (Vec<Arc<peer::Link>>, Arc<Batch>) {
    let (links, targets) = seen.into_targets().into_iter().unzip();
    let batch = Batch {
        planned,
        targets,
        keep,
    };
    (links, Arc::new(batch))
}

/// Why a copy of `op` through `link` failed (for a dead region, the owner
/// is asked).
async fn why_failed(link: &peer::Link, op: &RdmaOp, fail: pvm::Fail) -> OpError {
    let endpoint = op.remote.owner().endpoint;
    match fail {
        pvm::Fail::Dead => link.why_dead(op).await,
        pvm::Fail::ReadOnly => OpError::ReadOnly,
        // The probe said yes, and now the kernel says no (the owner
        // changed its credentials): remembered, so the next ops take the
        // next transport.
        pvm::Fail::Refused => {
            link.refuse_process_vm();
            OpError::PeerUnreachable {
                endpoint,
                reason: "the kernel refuses process_vm access to the owner (EPERM)".into(),
            }
        }
        pvm::Fail::Gone => OpError::connection_lost(endpoint),
        pvm::Fail::Fault => OpError::Protocol(
            "the owner's registered memory is not mapped in it (process_vm: EFAULT)".into(),
        ),
    }
}

/// A batch's run (which returns its lowest failure) within `timeout`.
async fn settle(
    run: impl Future<Output = Option<(usize, OpError)>>,
    timeout: Duration,
    total: usize,
) -> Result<(), SubmitError> {
    match tokio::time::timeout(timeout, run).await {
        Ok(None) => Ok(()),
        Ok(Some((index, error))) => Err(SubmitError::Op { index, error }),
        // Copies already on threads finish (they keep what they touch
        // alive); nothing is known of which did.
        Err(_) => Err(SubmitError::Timeout {
            timeout,
            unfinished: total,
            total,
        }),
    }
}
