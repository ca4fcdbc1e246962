//! How a posted request runs: a task of the node's runtime routes each
//! region once per post, cuts the request into slices, keeps a window of
//! them in flight through the node's routing, sends the notification
//! behind the last one, and settles the request's status once, whatever
//! happens (see the [module docs](super)).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{
    DescError, DescIndices, Indices, LocalDescList, OpKind, RdmaOp, RdmaTransportLevel,
    SubmitError, check_pairs, op_at,
};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{SLICE_BYTES, SLICE_OPS, SLICES_IN_FLIGHT, State, WINDOW_BYTES, XferError, XferStatus};
use crate::messages::{NotifyError, submit_with_notification};
use crate::meters::Submitted;
use crate::prepare::{PreparedRemote, route_regions};
use crate::router::Router;

/// What a request moves, shared by the request and the task driving it.
#[derive(Clone)]
pub(super) struct Job {
    pub(super) router: Arc<Router>,
    pub(super) kind: OpKind,
    /// The remote regions, routed and connected: where the ops go and whom
    /// a notification or outcome reaches. Its descriptors may be a plan's
    /// whole regions; the ops' own are in [`Ops::remote`].
    pub(super) remote: PreparedRemote,
    /// The ops, made with the request, or, for a request from a plan,
    /// expanded once when first needed (shared by the request's clones).
    pub(super) ops: Arc<OnceLock<Result<Ops, DescError>>>,
    /// Makes the ops of a request from a plan.
    pub(super) expand: Option<Arc<Expand>>,
    pub(super) notification: Option<Bytes>,
    /// The tag its outcome is told under to the owners, if any.
    pub(super) outcome: Option<u64>,
}

/// Makes a request's two descriptor lists, in step (op `k` pairs
/// descriptor `k` of each).
pub(crate) type Expand =
    dyn Fn() -> Result<(LocalDescList, PreparedRemote), DescError> + Send + Sync;

/// A request's ops: the pairs of descriptors, checked.
pub(super) struct Ops {
    pub(super) local: LocalDescList,
    pub(super) local_idx: Indices,
    pub(super) remote: PreparedRemote,
    pub(super) remote_idx: Indices,
    pub(super) count: usize,
    pub(super) bytes: u64,
}

impl Ops {
    /// Pairs `local_idx[k]` with `remote_idx[k]`, checking every index and
    /// every pair's lengths (the error names the position).
    pub(super) fn new(
        local: LocalDescList,
        local_idx: Indices,
        remote: PreparedRemote,
        remote_idx: Indices,
    ) -> Result<Ops, DescError> {
        check_pairs(&local, &local_idx, remote.list(), &remote_idx)?;
        let descs = local.descs();
        let bytes = match descs.lens_in(&local_idx) {
            Some(lens) => lens.iter().sum(),
            None => (0..local_idx.count())
                .map(|k| descs.get(local_idx.at(k) as usize).map_or(0, |d| d.len))
                .sum(),
        };
        Ok(Ops {
            count: local_idx.count(),
            local,
            local_idx,
            remote,
            remote_idx,
            bytes,
        })
    }

    /// Both lists whole, in step.
    fn in_step(local: LocalDescList, remote: PreparedRemote) -> Result<Ops, DescError> {
        let (n, m) = (local.descs().len(), remote.list().descs().len());
        let range = |count| Indices::Range { start: 0, count };
        Ops::new(local, range(n), remote, range(m))
    }
}

impl Job {
    /// The ops, expanded here if they were not yet. An expansion that
    /// failed fails every post of the request the same way.
    pub(super) fn ops(&self) -> Result<&Ops, DescError> {
        let made = self.ops.get_or_init(|| {
            let expand = self
                .expand
                .as_ref()
                .expect("a request without ops has an expansion");
            expand().and_then(|(local, remote)| Ops::in_step(local, remote))
        });
        made.as_ref().map_err(Clone::clone)
    }

    /// The ops if they are made; `None` if making them is work still to do.
    pub(super) fn ops_made(&self) -> Option<&Ops> {
        self.ops.get().and_then(|made| made.as_ref().ok())
    }

    /// The peer and transport its estimate is for: its first region's.
    pub(super) fn path(&self) -> (ferry_core::NodeAddr, RdmaTransportLevel) {
        let regions = self.remote.list().regions();
        let level = self
            .remote
            .levels()
            .first()
            .copied()
            .unwrap_or(RdmaTransportLevel::Tcp);
        let peer = regions
            .first()
            .map_or(self.router.addr(), |region| region.owner());
        (peer, level)
    }

    /// Whether every op goes to one peer over one transport: only such
    /// requests teach the estimates.
    fn single_path(&self, levels: &[RdmaTransportLevel]) -> bool {
        self.remote.owners().len() == 1 && levels.windows(2).all(|w| w[0] == w[1])
    }

    /// Each region's transport for this post, routed once per post and
    /// region (not per op): as prepared, unless a same-host owner closed
    /// its socket since (stopped, or restarted under a new id), whose
    /// regions then take the next transport, whose answer says what is at
    /// the address now. Errors name the first position of `ops` whose
    /// region has no transport left.
    fn levels_now(&self, ops: &Ops) -> Result<Vec<RdmaTransportLevel>, SubmitError> {
        let regions = self.remote.list().regions();
        if let Some(memory) = &self.router.memory {
            memory.forget_dead_owners_of(regions);
        }
        route_regions(&self.router, regions).map_err(|e| {
            let DescError::Region { region, error } = e else {
                unreachable!("routing names regions")
            };
            let descs = ops.remote.list().descs();
            let index = (0..ops.count)
                .find(|&k| {
                    descs
                        .get(ops.remote_idx.at(k) as usize)
                        .is_some_and(|d| d.region as usize == region)
                })
                .unwrap_or(0);
            SubmitError::Op { index, error }
        })
    }
}

impl Ops {
    /// The end of the slice starting at `start`, and its bytes.
    fn slice_end(&self, start: usize) -> (usize, u64) {
        let descs = self.local.descs();
        let mut bytes = 0;
        let mut end = start;
        while end < self.count && end - start < SLICE_OPS {
            let len = descs
                .get(self.local_idx.at(end) as usize)
                .map_or(0, |d| d.len);
            if end > start && bytes + len > SLICE_BYTES {
                break;
            }
            bytes += len;
            end += 1;
        }
        (end, bytes)
    }

    /// The pairs at positions `range`, for the memory transport.
    fn pairs(&self, kind: OpKind, range: std::ops::Range<usize>) -> ferry_memory::Pairs<'_> {
        ferry_memory::Pairs {
            kind,
            local: &self.local,
            local_idx: &self.local_idx,
            remote: self.remote.list(),
            remote_idx: &self.remote_idx,
            range,
        }
    }

    /// The ops of `kind` at positions `start..end`, and each one's
    /// transport. The pairs were checked when the ops were made; an error
    /// here would be a list that changed under them, and fails the post
    /// instead of a task.
    fn slice(
        &self,
        kind: OpKind,
        start: usize,
        end: usize,
        levels: &[RdmaTransportLevel],
    ) -> Result<(Vec<RdmaOp>, Vec<RdmaTransportLevel>), DescError> {
        let remote = self.remote.list();
        let mut ops = Vec::with_capacity(end - start);
        let mut op_levels = Vec::with_capacity(end - start);
        for k in start..end {
            let r = self.remote_idx.at(k);
            let op = op_at(kind, &self.local, self.local_idx.at(k), remote, r, k)?;
            let region = remote.descs().get(r as usize).map_or(0, |d| d.region);
            ops.push(op);
            op_levels.push(levels[region as usize]);
        }
        Ok((ops, op_levels))
    }
}

/// A post's status to settle: by its driver, or, if the driver never
/// finished (its runtime shut down and dropped the task), on drop, so that
/// nothing stays in progress forever. Settling disarms it: a later post may
/// already be in progress when the driver's frame goes.
struct Settle(Option<Arc<State>>);

impl Settle {
    fn settle(mut self, status: XferStatus) {
        if let Some(state) = self.0.take() {
            state.set_status(status);
        }
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        if let Some(state) = self.0.take() {
            let stopped = XferError::Submit(SubmitError::BackendStopped);
            state.set_status(XferStatus::Failed(stopped));
        }
    }
}

/// Runs a post whole on the calling thread when it can be: one slice of
/// ops, no notification, every region routed to same-host owners that the
/// memory transport reaches without waiting
/// ([`MemoryBackend::submit_now`](ferry_memory::MemoryBackend::submit_now)).
/// Settles the status and returns `true` then; otherwise returns `false`
/// with the status untouched, for [`drive`] (which makes again a copy
/// that failed here, and says why). A request from a plan whose ops are
/// not expanded yet is left to [`drive`] too: expanding is work for the
/// node's runtime, not the caller's thread.
pub(super) fn post_now(job: &Job, state: &State) -> bool {
    let router = &job.router;
    let Some(memory) = &router.memory else {
        return false;
    };
    let Some(ops) = job.ops_made() else {
        return false;
    };
    if job.notification.is_some()
        || ops.count == 0
        || ops.slice_end(0).0 < ops.count
        || router.is_shut_down()
    {
        return false;
    }
    let started = Instant::now();
    let Ok(levels) = job.levels_now(ops) else {
        return false;
    };
    if levels.iter().any(|l| *l != RdmaTransportLevel::Memory) {
        return false;
    }
    let Ok((slice, _)) = ops.slice(job.kind, 0, ops.count, &levels) else {
        return false;
    };
    let submitted = Submitted::new(&slice);
    if memory.submit_now(slice).is_err() {
        return false;
    }
    submitted.finish(&router.memory_meters, &Ok(()));
    state.completed.store(ops.count, Ordering::Relaxed);
    learn(job, ops, &levels, started.elapsed());
    tell_outcome(job, &Ok(()));
    state.set_status(XferStatus::Done);
    true
}

/// Teaches the estimates a post that took `took`, when every op went to
/// one peer over one transport.
fn learn(job: &Job, ops: &Ops, levels: &[RdmaTransportLevel], took: Duration) {
    if job.single_path(levels) {
        let (peer, level) = job.path();
        (job.router.estimates).record(peer, level, ops.count, ops.bytes, took);
    }
}

/// Runs one post and settles its status.
pub(super) async fn drive(
    job: Arc<Job>,
    state: Arc<State>,
    cancel: CancellationToken,
    timeout: Duration,
) {
    let settle = Settle(Some(state.clone()));
    let started = Instant::now();
    let result = run(&job, &state, &cancel, started + timeout, timeout).await;
    if let (Ok(levels), Some(ops)) = (&result, job.ops_made()) {
        learn(&job, ops, levels, started.elapsed());
    }
    let result = result.map(drop);
    tell_outcome(&job, &result);
    settle.settle(match result {
        Ok(()) => XferStatus::Done,
        Err(e) => XferStatus::Failed(e),
    });
}

/// Tells the owners a tagged request's outcome ([`crate::Xfer::with_outcome`]),
/// in the background: before its status settles, so that whoever learns
/// the request is done from the status finds its outcome on its way.
pub(super) fn tell_outcome(job: &Job, result: &Result<(), XferError>) {
    if let Some(tag) = job.outcome {
        let owners = match (job.remote.owners(), job.ops_made()) {
            ([one], _) => vec![*one],
            (_, Some(ops)) => touched_owners(ops),
            // Ops that could not be made touched nobody's memory; every
            // owner the request names hears that it failed.
            (all, None) => all.to_vec(),
        };
        crate::outcome::tell(&job.router, owners, tag, crate::outcome::of(result));
    }
}

/// Posts the slices, a window at a time; returns the transports taken.
async fn run(
    job: &Job,
    state: &State,
    cancel: &CancellationToken,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<RdmaTransportLevel>, XferError> {
    let router = &job.router;
    if router.is_shut_down() {
        return Err(SubmitError::ShutDown.into());
    }
    let ops = job.ops()?;
    let levels = job.levels_now(ops)?;
    let total = ops.count;
    if total == 0 {
        // No data for a notification to follow: it goes on its own to
        // each owner of the remote list, as NIXL's requests of no
        // descriptors do.
        if let Some(body) = &job.notification {
            notify_owners(router, job.remote.owners(), body, deadline).await?;
        }
        return Ok(levels);
    }
    // A notification rides behind the last slice's data only where one
    // owner is notified: that slice's ops may name only some of several
    // owners, and each must hear once all the request's bytes moved.
    let owners = match job.remote.owners() {
        _ if job.notification.is_none() => Vec::new(),
        [one] => vec![*one],
        _ => touched_owners(ops),
    };
    let behind_data = owners.len() == 1;
    let all_memory = router.memory.is_some()
        && levels
            .iter()
            .all(|&level| level == RdmaTransportLevel::Memory);
    let mut next = 0;
    // Whichever slice ends first frees its place in the window: in post
    // order, a slice that ended behind a slower one held its place, and a
    // same-host request of 8 KiB ops copied with one slice in flight for a
    // quarter of its time instead of an eighth (the outcome is counts and
    // the lowest failing position, which need no order).
    let mut in_flight = FuturesUnordered::new();
    let mut bytes_in_flight = 0;
    // The next slice, once measured: (end, bytes).
    let mut upcoming = None;
    let mut failure: Option<XferError> = None;
    let mut timed_out = false;
    // Ops of timed-out slices that did not finish: moved or not, unknown.
    let mut unknown = 0;
    loop {
        while failure.is_none()
            && !timed_out
            && in_flight.len() < SLICES_IN_FLIGHT
            && next < total
            && !cancel.is_cancelled()
        {
            let (end, bytes) = *upcoming.get_or_insert_with(|| ops.slice_end(next));
            if in_flight.len() >= 2 && bytes_in_flight + bytes > WINDOW_BYTES {
                break;
            }
            let notification = job
                .notification
                .clone()
                .filter(|_| end == total && behind_data);
            // The notification goes once every other slice is done.
            if notification.is_some() && !in_flight.is_empty() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                timed_out = true;
                break;
            }
            // A slice whose every region the memory transport reaches goes
            // as descriptor pairs, without an op made per pair.
            let post = match notification {
                None if all_memory => Post::Pairs,
                notification => match ops.slice(job.kind, next, end, &levels) {
                    Ok((ops, op_levels)) => Post::Ops(ops, op_levels, notification),
                    Err(e) => {
                        failure = Some(e.into());
                        break;
                    }
                },
            };
            let start = next;
            in_flight.push(async move {
                let result = match post {
                    Post::Pairs => {
                        let pairs = ops.pairs(job.kind, start..end);
                        (router.submit_memory_pairs(pairs, bytes, left).await)
                            .map_err(XferError::Submit)
                    }
                    Post::Ops(ops, op_levels, None) => router
                        .submit_routed(ops, op_levels, left)
                        .await
                        .map_err(XferError::Submit),
                    Post::Ops(ops, _, Some(body)) => {
                        submit_with_notification(router, ops, left, body)
                            .await
                            .map_err(|e| match e {
                                NotifyError::Submit(e) => XferError::Submit(e),
                                e => XferError::Notify(e),
                            })
                    }
                };
                (start, end, bytes, result)
            });
            bytes_in_flight += bytes;
            next = end;
            upcoming = None;
        }
        let Some((start, end, bytes, result)) = in_flight.next().await else {
            break;
        };
        bytes_in_flight -= bytes;
        match result {
            Ok(()) => {
                state.completed.fetch_add(end - start, Ordering::Relaxed);
            }
            Err(XferError::Submit(SubmitError::Timeout { unfinished, .. })) => {
                timed_out = true;
                let unfinished = unfinished.min(end - start);
                (state.completed).fetch_add(end - start - unfinished, Ordering::Relaxed);
                unknown += unfinished;
            }
            Err(XferError::Submit(SubmitError::Op { index, error })) => {
                let index = start + index;
                // The lowest failing position, as for a submit.
                match &failure {
                    Some(XferError::Submit(SubmitError::Op { index: lower, .. }))
                        if *lower < index => {}
                    _ => failure = Some(SubmitError::Op { index, error }.into()),
                }
            }
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    let completed = state.completed.load(Ordering::Relaxed);
    if let Some(failure) = failure {
        return Err(failure);
    }
    // The caller asked to stop: that is what it hears, also when the
    // window it had in flight could only end at the deadline.
    if cancel.is_cancelled() && completed < total {
        return Err(XferError::Cancelled {
            completed,
            unknown,
            total,
        });
    }
    if timed_out {
        return Err(SubmitError::Timeout {
            timeout,
            unfinished: total - completed,
            total,
        }
        .into());
    }
    if completed < total {
        return Err(XferError::Cancelled {
            completed,
            unknown,
            total,
        });
    }
    if !behind_data && let Some(body) = &job.notification {
        notify_owners(router, &owners, body, deadline).await?;
    }
    Ok(levels)
}

/// How a slice goes.
enum Post {
    /// As descriptor pairs, to the memory transport.
    Pairs,
    /// As ops, each with its transport, and the notification behind them.
    Ops(Vec<RdmaOp>, Vec<RdmaTransportLevel>, Option<Bytes>),
}

/// The owners whose memory the request's ops name, each once, in order of
/// first use.
fn touched_owners(ops: &Ops) -> Vec<ferry_core::NodeAddr> {
    let list = ops.remote.list();
    let (regions, descs) = (list.regions(), list.descs());
    let mut seen = vec![false; regions.len()];
    let mut owners = Vec::new();
    for k in 0..ops.count {
        let Some(desc) = descs.get(ops.remote_idx.at(k) as usize) else {
            continue;
        };
        let region = desc.region as usize;
        if seen.get(region) == Some(&false) {
            seen[region] = true;
            let owner = regions[region].owner();
            if !owners.contains(&owner) {
                owners.push(owner);
            }
        }
    }
    owners
}

/// Sends `body` as a notification to each of `owners` (a request of no
/// ops), each within what is left until `deadline`.
async fn notify_owners(
    router: &Router,
    owners: &[ferry_core::NodeAddr],
    body: &Bytes,
    deadline: Instant,
) -> Result<(), XferError> {
    if body.len() > router.messages.max_len() {
        return Err(XferError::Notify(NotifyError::TooLarge {
            len: body.len(),
            limit: router.messages.max_len(),
        }));
    }
    for &owner in owners {
        let left = deadline.saturating_duration_since(Instant::now());
        (router.messages.notify(owner, body.clone(), left).await)
            .map_err(|error| XferError::Notify(NotifyError::Notification { owner, error }))?;
    }
    Ok(())
}
