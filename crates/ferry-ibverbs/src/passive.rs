//! The owner's side of the queue pairs: the `IBVERBS_CONNECT` service
//! tells an initiator this node's rails and, for each rail pair it
//! proposes, creates a QP on the owner's rail dedicated to that initiator,
//! with a ring of receive buffers for the notifications that ride it (see
//! `notify`), and a task that hands each one to the node's inbox and
//! returns its credit.
//!
//! A notification in a receive buffer has been acknowledged to its sender,
//! which has resolved its submit: it is delivered however long the inbox
//! stays full, in arrival order. While it waits, its credit stays with the
//! owner, which is how a consumer that stops reading holds senders back.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{ConnectionHold, NotificationSink, Request, Service, ServiceError, Session};
use ferry_core::MemoryBlock;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::connection::ChannelFd;
use crate::device::{Fabric, Rail};
use crate::exchange::{endpoint_of, rail_infos, random_psn};
use crate::verbs::{
    Completion, CompletionChannel, CompletionQueue, MemoryRegion, PathConfig, QueuePair, VerbsError,
};
use crate::wire::{
    PairInfo, QpInfo, RAILS_QUERY, STATUS_FAILED, STATUS_LIMIT, decode_pairs, decode_release,
    encode_pairs, encode_rails,
};

/// How long returning credits may take before the owner gives up on it
/// (the session is then as good as gone).
const CREDIT_RETURN_DEADLINE: Duration = Duration::from_secs(10);

/// How long the owner sleeps, idle, on credits it owes for fewer than a
/// quarter ring's notifications before it returns them anyway: a stream
/// that stops short of a quarter ring must not leave its sender short of
/// credits until the next one (it would notify over the control session,
/// and hit a full inbox sooner). Short against a pause, long against the
/// gaps within a stream, so that a stream still returns a quarter at a time.
const TAIL_CREDIT_RETURN: Duration = Duration::from_millis(1);
/// After its session ends, how long the receiving task waits for the
/// receives still posted to flush before it lets the QP go.
const DRAIN_DEADLINE: Duration = Duration::from_secs(1);

/// Which QP: the control session that asked for it, the initiator's rail,
/// this node's rail, and the slot (0: ferry's own pair; else a lease's).
type PairKey = (u64, u8, u8, u16);

/// The owner's queue pairs, one per control session and rail pair that
/// asked for one. A new exchange for the same pair on the same session
/// (the initiator's QP failed and it reconnects) replaces it; the
/// session's end destroys them all: at once if the peer closed or reset
/// it, after the session's silent grace if the peer went silent.
///
/// Any peer with a session may ask, and each QP costs the device and the
/// process (see `IbvConfig::max_passive_qps_per_session`): so many are
/// kept per session and in all ([`Caps`]), and one asked for beyond is
/// refused with [`STATUS_LIMIT`], which the asker sees as `PeerBusy`.
/// None is taken back to make room: the owner cannot see whether a
/// one-sided transfer uses it.
pub(crate) struct PassiveQps {
    qps: Mutex<HashMap<PairKey, Arc<PassiveQp>>>,
    caps: Caps,
    /// Whether a cap was reached (logged once per stretch).
    full: AtomicBool,
}

/// How many queue pairs are kept per session, and in all.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    pub per_session: usize,
    pub total: usize,
}

/// Which cap a queue pair asked for would pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cap {
    Session,
    Total,
}

/// Whether one more queue pair for `key` fits under `caps`, given those
/// kept now: one that replaces a kept pair (a reconnect) always does.
fn fits<V>(kept: &HashMap<PairKey, V>, key: &PairKey, caps: Caps) -> Result<(), Cap> {
    if kept.contains_key(key) {
        return Ok(());
    }
    if kept.len() >= caps.total {
        return Err(Cap::Total);
    }
    let of_session = kept.keys().filter(|k| k.0 == key.0).count();
    if of_session >= caps.per_session {
        return Err(Cap::Session);
    }
    Ok(())
}

impl PassiveQps {
    pub fn new(caps: Caps) -> Self {
        PassiveQps {
            qps: Mutex::default(),
            caps,
            full: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PairKey, Arc<PassiveQp>>> {
        self.qps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many queue pairs are kept here for initiators.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether a queue pair for `key` fits now (see [`fits`]); logs the
    /// first refusal of a stretch at a cap, and the stretch's end.
    fn room(&self, key: &PairKey, peer: ferry_core::NodeId) -> Result<(), Cap> {
        let fits = fits(&self.lock(), key, self.caps);
        match fits {
            Err(cap) => {
                metrics::counter!("ferry_ibverbs_passive_refused_total").increment(1);
                if !self.full.swap(true, Ordering::Relaxed) {
                    warn!(
                        node = %peer, ?cap, caps = ?self.caps,
                        "refusing queue pairs to initiators at a cap \
                         (IbvConfig::max_passive_qps_per_session, max_passive_qps)"
                    );
                }
            }
            Ok(()) if self.full.load(Ordering::Relaxed) && self.len() < self.caps.total / 2 => {
                self.full.store(false, Ordering::Relaxed);
                info!("queue pairs for initiators: under the caps again");
            }
            Ok(()) => {}
        }
        fits
    }
}

/// One initiator's QP here, and the receive buffers posted on it.
struct PassiveQp {
    /// Declared before the ring: destroyed first, so the NIC is done with
    /// the buffers before they are deregistered.
    qp: QueuePair,
    ring: Option<RecvRing>,
    /// Cancelled when the QP is replaced or its session ends.
    retired: CancellationToken,
    /// Keeps its session from being closed to make room at the endpoint's
    /// bound while the QP lives: the initiator uses it without a word on
    /// the session.
    _session: ConnectionHold,
}

struct RecvRing {
    mr: MemoryRegion,
    slots: u16,
    slot_len: u32,
}

impl PassiveQp {
    /// Posts receive buffer `slot`.
    fn post(&self, slot: u64) -> Result<(), VerbsError> {
        let Some(ring) = &self.ring else {
            return Ok(());
        };
        let offset = slot * u64::from(ring.slot_len);
        // SAFETY: the slot lies in the ring's MR, registered with local
        // write in this QP's PD; the ring outlives the QP (field order), and
        // nothing reads or writes the slot until its completion is polled
        // (`take` reads it only then, before posting it again).
        unsafe {
            self.qp.post_recv(
                slot,
                ring.mr.memory().addr() + offset,
                ring.slot_len,
                ring.mr.lkey(),
            )
        }
    }

    /// The notification a successful receive completion delivered, copied
    /// out of its buffer; `None` for a completion that names no buffer.
    fn take(&self, wc: &Completion) -> Option<Bytes> {
        let ring = self.ring.as_ref()?;
        if wc.wr_id >= u64::from(ring.slots) {
            return None;
        }
        let len = wc.byte_len.min(ring.slot_len) as usize;
        let mut body = vec![0; len];
        ring.mr
            .memory()
            .read_at(wc.wr_id * u64::from(ring.slot_len), &mut body)
            .ok()?;
        Some(body.into())
    }
}

/// The owner's side of the exchange: the `IBVERBS_CONNECT` service. It
/// answers a rails query with this node's rails, and a pairs proposal
/// with a QP per pair (`STATUS_FAILED` for a pair it could not set up,
/// `STATUS_LIMIT` for one over a cap).
pub(crate) async fn accept(
    fabric: Arc<Fabric>,
    passive: Arc<PassiveQps>,
    sink: NotificationSink,
    request: Request,
) -> Result<Bytes, ServiceError> {
    if request.body[..] == RAILS_QUERY {
        return Ok(encode_rails(&rail_infos(&fabric)).into());
    }
    if let Some(slot) = decode_release(&request.body) {
        // A lease was dropped: its queue pairs here go (slot 0, ferry's
        // own pairs, is never released this way).
        let session = request.session.id();
        let gone: Vec<Arc<PassiveQp>> = {
            let mut qps = passive.lock();
            let keys: Vec<PairKey> = qps
                .keys()
                .filter(|k| slot != 0 && k.0 == session && k.3 == slot)
                .copied()
                .collect();
            keys.iter().filter_map(|k| qps.remove(k)).collect()
        };
        gone.iter().for_each(|qp| qp.retired.cancel());
        return Ok(Bytes::new());
    }
    let peer = request.session.peer();
    let proposed = decode_pairs(&request.body)
        .ok_or_else(|| ServiceError("malformed queue-pair exchange frame".into()))?;
    let mut answers = Vec::with_capacity(proposed.len());
    for pair in proposed {
        let Some(rail) = fabric.rail(pair.owner_rail) else {
            answers.push(refused(pair, STATUS_FAILED));
            continue;
        };
        match accept_pair(&fabric, rail, &passive, &sink, &request.session, pair) {
            Ok(answer) => answers.push(answer),
            Err(Refused::Cap(cap)) => {
                debug!(node = %peer.id, ?cap, "a queue pair refused at a cap");
                answers.push(refused(pair, STATUS_LIMIT));
            }
            Err(Refused::Setup(e)) => {
                debug!(node = %peer.id, rail = %rail.name(), error = %e, "cannot set up a queue pair for a peer");
                answers.push(refused(pair, STATUS_FAILED));
            }
        }
    }
    Ok(encode_pairs(&answers).into())
}

/// The answer for a pair this node sets up no QP for, and why (`status`).
fn refused(pair: PairInfo, status: u8) -> PairInfo {
    PairInfo {
        qp: QpInfo { status, ..pair.qp },
        ..pair
    }
}

/// Why a pair got no QP here.
enum Refused {
    /// At a cap: nothing was created.
    Cap(Cap),
    /// Creating or connecting it failed.
    Setup(VerbsError),
}

impl From<VerbsError> for Refused {
    fn from(e: VerbsError) -> Self {
        Refused::Setup(e)
    }
}

/// Creates, connects and keeps this node's QP of one proposed pair.
fn accept_pair(
    fabric: &Fabric,
    rail: &Arc<Rail>,
    passive: &Arc<PassiveQps>,
    sink: &NotificationSink,
    session: &Session,
    pair: PairInfo,
) -> Result<PairInfo, Refused> {
    let theirs = pair.qp;
    let key = (
        session.id(),
        pair.initiator_rail,
        pair.owner_rail,
        pair.slot,
    );
    // Before anything is created: a flood of asks costs a look each.
    passive
        .room(&key, session.peer().id)
        .map_err(Refused::Cap)?;
    // A leased pair carries no notifications: no receive buffers for it.
    let slots = if pair.slot == 0 { rail.notify_slots } else { 0 };
    let slot_len = fabric
        .notify_slot_len
        .min(u32::try_from(sink.max_len()).unwrap_or(u32::MAX));
    let channel = CompletionChannel::new(&rail.context)?;
    channel.set_nonblocking()?;
    // Receives only: the QP never posts a send.
    let cq = CompletionQueue::new(&rail.context, u32::from(slots) + 1, Some(channel))?;
    let qp = QueuePair::new_rc(&rail.pd, &cq, 1, u32::from(slots))?;
    let ring = if slots > 0 && slot_len > 0 {
        let memory = MemoryBlock::alloc(u64::from(slots) * u64::from(slot_len)).map_err(|e| {
            VerbsError::Call {
                call: "allocating notification receive buffers",
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        Some(RecvRing {
            mr: MemoryRegion::register_local(&rail.pd, Arc::new(memory))?,
            slots,
            slot_len,
        })
    } else {
        None
    };
    let qp = PassiveQp {
        qp,
        ring,
        retired: CancellationToken::new(),
        _session: session.hold(),
    };
    let psn = random_psn();
    let path = PathConfig {
        port: rail.port,
        gid_index: rail.gid_index,
        mtu: rail.mtu.min(theirs.mtu as u32),
        timing: fabric.qp_timing,
    };
    qp.qp.to_init(rail.port)?;
    // Posted before the initiator can send: it learns of the buffers from
    // the reply.
    if qp.ring.is_some() {
        (0..u64::from(slots)).try_for_each(|slot| qp.post(slot))?;
    }
    qp.qp.to_rtr(&theirs.endpoint, &path)?;
    qp.qp.to_rts(psn, &path.timing)?;
    let has_ring = qp.ring.is_some();
    let answer = PairInfo {
        qp: QpInfo {
            status: 0,
            mtu: rail.mtu as u8,
            endpoint: endpoint_of(rail, &qp.qp, psn),
            recv_slots: if has_ring { slots } else { 0 },
            recv_slot_len: if has_ring { slot_len } else { 0 },
        },
        ..pair
    };
    let qp = Arc::new(qp);
    let (replaced, first_of_session) = {
        let mut qps = passive.lock();
        // Again under the lock: concurrent asks may have filled the caps
        // while this one was created (it is destroyed, unused).
        fits(&qps, &key, passive.caps).map_err(Refused::Cap)?;
        let first = !qps.keys().any(|k| k.0 == session.id());
        (qps.insert(key, qp.clone()), first)
    };
    if has_ring {
        tokio::spawn(receive_notifications(
            qp,
            session.clone(),
            sink.clone(),
            theirs.endpoint.qpn,
            rail.notify_coalesce,
        ));
    }
    if let Some(old) = replaced {
        old.retired.cancel();
    }
    if first_of_session {
        // The session's first QP: it (and every QP of the session after
        // it) lives until the session ends, or its silent grace after that.
        let passive = Arc::downgrade(passive);
        let session = session.clone();
        tokio::spawn(async move {
            session.closed().await;
            if session.went_silent() {
                // The initiator may still be reading or writing through
                // them (see `exchange::watch_session`); one-sided work
                // shows nothing here, so wait as long as it may go on.
                // Deregistering a region, not this, is what ends access
                // to its memory.
                let grace = session.silent_grace();
                debug!(node = %session.peer().id, ?grace, "control session went silent: its queue pairs stay for the grace");
                tokio::time::sleep(grace).await;
            }
            let gone: Vec<Arc<PassiveQp>> = passive.upgrade().map_or_else(Vec::new, |p| {
                let mut qps = p.lock();
                let keys: Vec<PairKey> = qps
                    .keys()
                    .filter(|k| k.0 == session.id())
                    .copied()
                    .collect();
                keys.iter().filter_map(|k| qps.remove(k)).collect()
            });
            gone.iter().for_each(|qp| qp.retired.cancel());
            debug!(node = %session.peer().id, "control session ended: its queue pairs are destroyed");
        });
    }
    Ok(answer)
}

/// Receives the notifications that ride one initiator's QP, hands them to
/// the inbox in arrival order (waiting for room as long as it takes), and
/// returns their credits in batches over `session`. Ends once the QP is
/// retired and its receives have drained, or the node's inbox is gone.
/// With a nonzero `coalesce`, a look that delivered something is followed
/// by another after that long instead of an armed sleep (see
/// `IbvConfig::notify_coalesce`).
async fn receive_notifications(
    qp: Arc<PassiveQp>,
    session: Session,
    sink: NotificationSink,
    initiator_qpn: u32,
    coalesce: Duration,
) {
    let from = session.peer();
    let cq = qp.qp.cq().clone();
    let Some(channel) = cq.channel().cloned() else {
        return;
    };
    let slots = qp.ring.as_ref().map_or(0, |r| r.slots);
    // SAFETY: `ChannelFd` owns the channel, so its fd stays open and the
    // same for the AsyncFd's whole life, as `register` requires.
    let fd =
        match unsafe { AsyncFd::register_with_interest(ChannelFd(channel), Interest::READABLE) } {
            Ok(fd) => fd,
            Err(e) => {
                warn!(node = %from.id, "cannot watch a notification queue: {e}");
                return;
            }
        };
    // Return a quarter ring at a time: few control messages, and the
    // sender never runs dry while the consumer keeps up.
    let return_every = u32::from(slots / 4).max(1);
    let mut posted = usize::from(slots);
    let mut held: VecDeque<Bytes> = VecDeque::new();
    let mut uncredited = 0u32;
    let mut wcs = [Completion::default(); 32];
    let mut armed = false;
    let mut draining: Option<tokio::time::Instant> = None;
    // Whether the looks since the last coalescing pause delivered anything.
    let mut delivered = false;
    loop {
        let n = cq.poll(&mut wcs).unwrap_or_else(|e| {
            debug!(node = %from.id, "polling a notification queue failed: {e}");
            posted = 0;
            0
        });
        for wc in &wcs[..n] {
            posted = posted.saturating_sub(1);
            if !wc.is_success() {
                if !wc.is_flush() {
                    debug!(node = %from.id, status = %wc.status_str(), "a notification receive failed");
                }
                continue;
            }
            if let Some(body) = qp.take(wc) {
                held.push_back(body);
            }
            if draining.is_none() {
                match qp.post(wc.wr_id) {
                    Ok(()) => posted += 1,
                    Err(e) => {
                        debug!(node = %from.id, "reposting a notification buffer failed: {e}")
                    }
                }
            }
        }
        while let Some(body) = held.pop_front() {
            if sink.deliver(from, body).await.is_err() {
                debug!(node = %from.id, "the inbox is gone: no more notifications");
                return;
            }
            uncredited += 1;
        }
        if uncredited >= return_every && draining.is_none() {
            tokio::spawn(return_credits(session.clone(), initiator_qpn, uncredited));
            uncredited = 0;
        }
        if n > 0 {
            delivered = true;
            continue;
        }
        if delivered && !armed && draining.is_none() && !coalesce.is_zero() {
            delivered = false;
            tokio::select! {
                _ = tokio::time::sleep(coalesce) => {}
                // Retirement is seen by the armed wait below, right after.
                _ = qp.retired.cancelled() => {}
            }
            continue;
        }
        if let Some(since) = draining {
            if posted == 0 || since.elapsed() >= DRAIN_DEADLINE {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        if !armed {
            // Arm, then poll once more: a completion that arrived before
            // the arm raises no event.
            if let Err(e) = cq.arm() {
                debug!(node = %from.id, "arming a notification queue failed: {e}");
            }
            armed = true;
            continue;
        }
        tokio::select! {
            ready = fd.readable() => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                    while let Ok(true) = cq.take_event() {}
                }
                armed = false;
            }
            // Still armed after this: the next look ends in this wait again.
            _ = tokio::time::sleep(TAIL_CREDIT_RETURN), if uncredited > 0 => {
                tokio::spawn(return_credits(session.clone(), initiator_qpn, uncredited));
                uncredited = 0;
            }
            _ = qp.retired.cancelled() => {
                // No receive is acknowledged after this: what arrived
                // already is delivered, the rest flushes.
                if let Err(e) = qp.qp.to_error() {
                    debug!(node = %from.id, "moving a queue pair to the error state failed: {e}");
                }
                draining = Some(tokio::time::Instant::now());
            }
        }
    }
}

/// Gives `count` credits back to the initiator of QP `initiator_qpn`, in a
/// tell: an answer would cost both ends a packet and a wake-up for nothing,
/// and on a software device those land on the CPUs that move the data.
async fn return_credits(session: Session, initiator_qpn: u32, count: u32) {
    let body = crate::wire::encode_credits(initiator_qpn, count);
    let sent = session
        .tell(
            Service::IBVERBS_CREDITS,
            Bytes::copy_from_slice(&body),
            CREDIT_RETURN_DEADLINE,
        )
        .await;
    if let Err(e) = sent
        && !session.is_closed()
    {
        warn!(node = %session.peer().id, "returning {count} notification credits failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_session_and_the_node_keep_at_most_their_caps_and_reconnects_always_fit() {
        let caps = Caps {
            per_session: 3,
            total: 5,
        };
        let mut kept: HashMap<PairKey, ()> = HashMap::new();
        // Session 1 asks for four leases' pairs: the fourth is over its cap.
        for slot in 1..=3 {
            let key = (1, 0, 0, slot);
            assert_eq!(fits(&kept, &key, caps), Ok(()));
            kept.insert(key, ());
        }
        assert_eq!(fits(&kept, &(1, 0, 0, 4), caps), Err(Cap::Session));
        // A reconnect of a pair it has replaces it: always room.
        assert_eq!(fits(&kept, &(1, 0, 0, 2), caps), Ok(()));
        // Session 2 has room of its own, until the node is full.
        for slot in 0..2 {
            let key = (2, 0, 0, slot);
            assert_eq!(fits(&kept, &key, caps), Ok(()));
            kept.insert(key, ());
        }
        assert_eq!(fits(&kept, &(2, 0, 0, 2), caps), Err(Cap::Total));
        assert_eq!(fits(&kept, &(3, 0, 0, 0), caps), Err(Cap::Total));
        assert_eq!(fits(&kept, &(2, 0, 0, 1), caps), Ok(()), "a reconnect");
        // Session 1 ends: its pairs go, and others fit again.
        kept.retain(|k, _| k.0 != 1);
        assert_eq!(fits(&kept, &(3, 0, 0, 0), caps), Ok(()));
    }
}
