//! Setting up the queue pairs to a peer: the `IBVERBS_CONNECT` service on
//! the nodes' control session. The initiator asks for the owner's rails,
//! proposes rail pairs (each with a QP of its own on its rail), and the
//! owner creates a QP on its rail for each (`passive`) and answers with
//! its details and its notification receive buffers; it keeps them for as
//! long as the session lives (and, if the session went silent, for the
//! session's silent grace).
//!
//! Which pairs reach each other is found out, not assumed: every pair is
//! probed with a zero-length RDMA WRITE before it carries work, and a pair
//! whose probe does not complete within [`PROBE_TIMEOUT`] is never used. So
//! on a rail-only fabric, where NIC *i* reaches only NIC *i* of other
//! nodes, only straight pairs are chosen. Straight pairs (the same rail
//! index at both ends) are tried first; only rails left without a working
//! pair then try the other side's leftover rails. Each pair's path MTU is
//! the smaller of its two ports'.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Endpoint, Service, Session};
use ferry_core::{NodeAddr, OpError, random_u128};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::connection::PeerQp;
use crate::device::{Fabric, Rail};
use crate::notify::NotifyLane;
use crate::verbs::{
    Completion, CompletionChannel, CompletionQueue, PathConfig, QpEndpoint, QueuePair, VerbsError,
    WorkRequest,
};
use crate::wire::{
    PairInfo, QpInfo, RAILS_QUERY, RailInfo, STATUS_LIMIT, decode_pairs, decode_rails, encode_pairs,
};

/// How long a pair's probe may take before the pair counts as unable to
/// reach: long against a working path's round trip (microseconds on a NIC,
/// about a millisecond on soft-RoCE in a VM, plus ARP for the first packet),
/// short against a connect's usual deadline.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);

pub(crate) fn random_psn() -> u32 {
    (random_u128() as u32) & 0x00ff_ffff
}

pub(crate) fn endpoint_of(rail: &Rail, qp: &QueuePair, psn: u32) -> QpEndpoint {
    QpEndpoint {
        qpn: qp.qpn(),
        psn,
        gid: rail.gid,
        lid: rail.lid,
    }
}

/// What this node tells an initiator about its rails.
pub(crate) fn rail_infos(fabric: &Fabric) -> Vec<RailInfo> {
    fabric
        .rails
        .iter()
        .map(|r| RailInfo {
            index: r.index,
            ethernet: r.ethernet,
            mtu: r.mtu as u8,
            lid: r.lid,
            gid: r.gid,
        })
        .collect()
}

/// Why [`connect`] made no queue pair.
pub(crate) enum Unconnected {
    /// The exchange itself failed (the peer is unreachable, or refused).
    Op(OpError),
    /// The peer answered, and no pair of rails reaches it.
    NoPair(OpError),
}

impl<E: Into<OpError>> From<E> for Unconnected {
    fn from(e: E) -> Self {
        Unconnected::Op(e.into())
    }
}

/// A QP on one of our rails, at INIT, for one proposed pair.
struct Proposed {
    rail: Arc<Rail>,
    owner_rail: RailInfo,
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    channel: Option<Arc<CompletionChannel>>,
    psn: u32,
}

/// Connects queue pairs to `peer` on every rail pair that works: exchanges
/// details over this node's control session to it (by `deadline`), probes
/// each pair, brings the working ones to RTS and starts their completion
/// pollers. Returns them with the peer's rails. Fails with
/// `PeerUnreachable`, naming the pairs tried, when none works
/// ([`Unconnected::NoPair`]: the peer answered, but no rail reaches it).
pub(crate) async fn connect(
    fabric: &Arc<Fabric>,
    endpoint: &Endpoint,
    peer: NodeAddr,
    deadline: Instant,
) -> Result<(Vec<Arc<PeerQp>>, Vec<RailInfo>), Unconnected> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let session = endpoint.session(peer, left()).await?;
    let reply = session
        .request(
            Service::IBVERBS_CONNECT,
            Bytes::from_static(&RAILS_QUERY),
            left(),
        )
        .await?;
    let theirs = decode_rails(&reply).ok_or_else(|| {
        OpError::Protocol("malformed rail list in the queue-pair exchange".into())
    })?;
    let mut tried = Vec::new();
    // Straight pairs first, then leftovers against leftovers.
    let straight: Vec<(Arc<Rail>, RailInfo)> = fabric
        .rails
        .iter()
        .filter_map(|r| {
            let t = theirs.iter().find(|t| t.index == r.index)?;
            Some((r.clone(), *t))
        })
        .collect();
    let mut pairs = try_pairs(fabric, &session, peer, straight, deadline, &mut tried).await?;
    let used_local =
        |pairs: &[Arc<PeerQp>], r: &Rail| pairs.iter().any(|p| p.rail().index == r.index);
    let used_remote =
        |pairs: &[Arc<PeerQp>], t: &RailInfo| pairs.iter().any(|p| p.remote_rail() == t.index);
    let cross: Vec<(Arc<Rail>, RailInfo)> = fabric
        .rails
        .iter()
        .filter(|r| !used_local(&pairs, r))
        .flat_map(|r| {
            theirs
                .iter()
                .filter(|t| !used_remote(&pairs, t) && t.index != r.index)
                .map(move |t| (r.clone(), *t))
        })
        .collect();
    if !cross.is_empty() {
        let found = match try_pairs(fabric, &session, peer, cross, deadline, &mut tried).await {
            Ok(found) => found,
            // Refused at the owner's caps: the straight pairs it kept serve.
            Err(OpError::PeerBusy { .. }) if !pairs.is_empty() => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        // Each rail at most once at either end: a QP beyond that is
        // dropped (its probe passed, so nothing is outstanding on it).
        for qp in found {
            if !used_local(&pairs, qp.rail())
                && !pairs.iter().any(|p| p.remote_rail() == qp.remote_rail())
            {
                pairs.push(qp);
            } else {
                qp.break_with(qp.lost());
            }
        }
    }
    if pairs.is_empty() {
        return Err(Unconnected::NoPair(OpError::PeerUnreachable {
            endpoint: peer.endpoint,
            reason: format!("no rail pair reaches it over ibverbs: {}", tried.join("; ")),
        }));
    }
    pairs.sort_by_key(|p| p.rail().index);
    let chosen: Vec<String> = pairs
        .iter()
        .map(|p| {
            format!(
                "{} -> rail {} (MTU {})",
                p.rail().name(),
                p.remote_rail(),
                128u32 << p.mtu()
            )
        })
        .collect();
    if fabric.rails.len() > 1 || theirs.len() > 1 {
        info!(peer = %peer.endpoint, pairs = %chosen.join(", "), "rail pairs connected");
    }
    Ok((pairs, theirs))
}

/// Connects a new queue pair between our `rail` and the peer's
/// `their_rail`, probed as at connect, by `deadline`: for a pair whose
/// queue pair failed and whose rails may work again.
pub(crate) async fn reconnect_pair(
    fabric: &Arc<Fabric>,
    endpoint: &Endpoint,
    peer: NodeAddr,
    rail: Arc<Rail>,
    their_rail: RailInfo,
    deadline: Instant,
) -> Result<Arc<PeerQp>, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    let session = endpoint
        .session(peer, left)
        .await
        .map_err(|e| e.to_string())?;
    let mut tried = Vec::new();
    let pairs = try_pairs(
        fabric,
        &session,
        peer,
        vec![(rail, their_rail)],
        deadline,
        &mut tried,
    )
    .await
    .map_err(|e| e.to_string())?;
    pairs.into_iter().next().ok_or_else(|| tried.join("; "))
}

/// Proposes `candidates` to the owner, probes the pairs it accepted and
/// returns those whose probe completed, each as a [`PeerQp`] ferry posts
/// on, watched by its control session; each tried pair's fate goes to
/// `tried`, for the error that names them when none works.
async fn try_pairs(
    fabric: &Arc<Fabric>,
    session: &Session,
    peer: NodeAddr,
    candidates: Vec<(Arc<Rail>, RailInfo)>,
    deadline: Instant,
    tried: &mut Vec<String>,
) -> Result<Vec<Arc<PeerQp>>, OpError> {
    let setup = |e: VerbsError| OpError::Protocol(format!("queue pair setup: {e}"));
    let mut pairs = Vec::new();
    for c in propose(fabric, session, candidates, 0, None, deadline, tried).await? {
        let credits = c.qp.max_send_wr().min(c.rail.max_send_wr) as usize;
        let lane = NotifyLane::new(&c.rail.pd, c.theirs.recv_slots, c.theirs.recv_slot_len)
            .map_err(setup)?;
        let channel = c
            .channel
            .expect("ferry's own pairs have a completion channel");
        let qp = PeerQp::start(
            peer,
            c.rail.clone(),
            c.owner_rail,
            c.mtu,
            c.qp,
            c.cq,
            channel,
            credits,
            lane,
        );
        debug!(peer = %peer.endpoint, rail = %c.rail.name(), remote_rail = c.owner_rail, qpn = qp.qpn(), remote_qpn = c.theirs.endpoint.qpn, "rail pair connected");
        tokio::spawn(watch_session(
            Arc::downgrade(&qp),
            session.clone(),
            qp.closed().clone(),
        ));
        pairs.push(qp);
    }
    Ok(pairs)
}

/// A queue pair of ours connected (and probed) to one of the owner's.
pub(crate) struct Connected {
    pub rail: Arc<Rail>,
    pub owner_rail: u8,
    /// `ibv_mtu` value of the pair's path.
    pub mtu: u32,
    pub qp: QueuePair,
    pub cq: Arc<CompletionQueue>,
    pub channel: Option<Arc<CompletionChannel>>,
    /// The owner's side, as it answered.
    pub theirs: QpInfo,
}

/// Creates a QP on our rail of each candidate (in `slot`: 0 for ferry's
/// own pairs, with a completion channel and the rail's queue depth; a
/// lease's number, with `depth` and no channel), proposes them to the
/// owner, brings those it accepted to RTS, probes them together, and
/// returns those whose probe completed by `deadline` (at most
/// [`PROBE_TIMEOUT`] from now). Each tried pair's fate goes to `tried`.
/// `PeerBusy` when none connected and the owner refused some at its caps
/// on queue pairs for initiators ([`STATUS_LIMIT`]): it is up, and may
/// have room later.
pub(crate) async fn propose(
    fabric: &Arc<Fabric>,
    session: &Session,
    candidates: Vec<(Arc<Rail>, RailInfo)>,
    slot: u16,
    depth: Option<u32>,
    deadline: Instant,
    tried: &mut Vec<String>,
) -> Result<Vec<Connected>, OpError> {
    let setup = |e: VerbsError| OpError::Protocol(format!("queue pair setup: {e}"));
    let left = || deadline.saturating_duration_since(Instant::now());
    let mut proposed = Vec::new();
    for (rail, owner_rail) in candidates {
        if rail.ethernet != owner_rail.ethernet {
            tried.push(format!(
                "{} -> rail {}: link layers differ",
                rail.name(),
                owner_rail.index
            ));
            continue;
        }
        let channel = match depth {
            Some(_) => None,
            None => {
                let channel = CompletionChannel::new(&rail.context).map_err(setup)?;
                channel.set_nonblocking().map_err(setup)?;
                Some(channel)
            }
        };
        let depth = depth.unwrap_or(rail.max_send_wr);
        // One completion per request at most, and at most `depth` requests
        // outstanding (credits, or the lease's contract): the CQ cannot
        // overflow.
        let cq = CompletionQueue::new(&rail.context, depth + 1, channel.clone()).map_err(setup)?;
        let qp = QueuePair::new_rc(&rail.pd, &cq, depth, 1).map_err(setup)?;
        qp.to_init(rail.port).map_err(setup)?;
        proposed.push(Proposed {
            rail,
            owner_rail,
            qp,
            cq,
            channel,
            psn: random_psn(),
        });
    }
    if proposed.is_empty() {
        return Ok(Vec::new());
    }
    let request: Vec<PairInfo> = proposed
        .iter()
        .map(|p| PairInfo {
            initiator_rail: p.rail.index,
            owner_rail: p.owner_rail.index,
            slot,
            qp: QpInfo {
                status: 0,
                mtu: p.rail.mtu as u8,
                endpoint: endpoint_of(&p.rail, &p.qp, p.psn),
                recv_slots: 0,
                recv_slot_len: 0,
            },
        })
        .collect();
    let reply = session
        .request(
            Service::IBVERBS_CONNECT,
            Bytes::from(encode_pairs(&request)),
            left(),
        )
        .await?;
    let answers = decode_pairs(&reply)
        .filter(|a| {
            a.len() == request.len()
                && a.iter().zip(&request).all(|(a, r)| {
                    (a.initiator_rail, a.owner_rail, a.slot)
                        == (r.initiator_rail, r.owner_rail, r.slot)
                })
        })
        .ok_or_else(|| OpError::Protocol("malformed queue-pair exchange reply".into()))?;
    // Bring every accepted pair to RTS and post its probe, then wait for
    // the probes together: an unreachable pair costs one timeout, not one each.
    let mut probing = Vec::new();
    let mut at_limit = false;
    for (p, answer) in proposed.into_iter().zip(answers) {
        let name = format!("{} -> rail {}", p.rail.name(), p.owner_rail.index);
        if answer.qp.status == STATUS_LIMIT {
            at_limit = true;
            tried.push(format!("{name}: {AT_LIMIT}"));
            continue;
        }
        if answer.qp.status != 0 {
            tried.push(format!(
                "{name}: the peer could not set up its queue pair (its debug log says why)"
            ));
            continue;
        }
        let mtu = p.rail.mtu.min(u32::from(answer.qp.mtu));
        let path = PathConfig {
            port: p.rail.port,
            gid_index: p.rail.gid_index,
            mtu,
            timing: fabric.qp_timing,
        };
        let ready =
            p.qp.to_rtr(&answer.qp.endpoint, &path)
                .and_then(|()| p.qp.to_rts(p.psn, &path.timing))
                .and_then(|()| post_probe(&p.qp));
        match ready {
            Ok(()) => probing.push((p, answer.qp, mtu, name)),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    let probe_until = deadline.min(Instant::now() + PROBE_TIMEOUT);
    let mut outcome: Vec<Option<Result<(), String>>> = vec![None; probing.len()];
    let mut wcs = [Completion::default(); 4];
    while outcome.iter().any(Option::is_none) && Instant::now() < probe_until {
        for (slot, (p, ..)) in outcome.iter_mut().zip(&probing) {
            if slot.is_none()
                && let Ok(n) = p.cq.poll(&mut wcs)
                && n > 0
            {
                *slot = Some(if wcs[0].is_success() {
                    Ok(())
                } else {
                    Err(format!("probe failed: {}", wcs[0].status_str()))
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut connected = Vec::new();
    for ((p, theirs, mtu, name), result) in probing.into_iter().zip(outcome) {
        match result {
            Some(Ok(())) => {
                tried.push(format!("{name}: connected"));
                connected.push(Connected {
                    rail: p.rail,
                    owner_rail: p.owner_rail.index,
                    mtu,
                    qp: p.qp,
                    cq: p.cq,
                    channel: p.channel,
                    theirs,
                });
            }
            failed => {
                let why = failed.map_or_else(
                    || format!("no answer to the probe within {PROBE_TIMEOUT:?}"),
                    |r| r.err().unwrap_or_default(),
                );
                debug!(%name, %why, "rail pair unusable");
                tried.push(format!("{name}: {why}"));
                // The probe moved no memory: the QP is destroyed at once
                // (an error state first, so the device stops retrying it).
                let _ = p.qp.to_error();
            }
        }
    }
    if connected.is_empty() && at_limit {
        return Err(OpError::PeerBusy {
            endpoint: session.peer().endpoint,
            reason: AT_LIMIT.into(),
        });
    }
    Ok(connected)
}

/// What an initiator is told of a pair refused at the owner's caps.
const AT_LIMIT: &str = "it keeps as many queue pairs for initiators as it may \
    (IbvConfig::max_passive_qps_per_session, max_passive_qps)";

/// Posts the zero-length, signaled RDMA WRITE that proves a pair works: it
/// names no memory, so it needs no key and touches nothing at the owner.
fn post_probe(qp: &QueuePair) -> Result<(), VerbsError> {
    let probe = WorkRequest::empty_write(0);
    let mut buffers = Default::default();
    // SAFETY: a zero-length request carries no gather entry and reaches
    // no memory at either end.
    unsafe { qp.post(&[probe], &mut buffers) }.map_err(|(_, e)| e)
}

/// Fails the QP once the control session it was set up over ends, since
/// RC retries would report a dead peer much later (never, on soft-RoCE):
///
/// - closed or reset by the peer (its process died): at once;
/// - the peer went silent for the peer timeout (its host or the path is
///   down, or every keepalive probe was lost): at once if the QP is idle or
///   has completed nothing for that long. Otherwise its transfers are still
///   completing, the path works for them, and they go on: the QP retires
///   (new submits get a fresh one, over a new session) and is failed once
///   idle, once it stalls for the peer timeout, or at the session's silent
///   grace, after which the owner lets its end go (`passive::accept`).
///   Each transfer's own deadline bounds it meanwhile.
async fn watch_session(conn: std::sync::Weak<PeerQp>, session: Session, closed: CancellationToken) {
    tokio::select! {
        _ = closed.cancelled() => return,
        _ = session.closed() => {}
    }
    let peer_timeout = session.peer_timeout();
    let grace_ends = Instant::now() + session.silent_grace();
    loop {
        let Some(qp) = conn.upgrade() else { return };
        let progressing = session.went_silent()
            && qp.is_busy()
            && qp.since_progress() < peer_timeout
            && Instant::now() < grace_ends;
        if !progressing {
            qp.break_with(qp.lost());
            return;
        }
        if qp.is_usable() {
            debug!(peer = %qp.peer().endpoint, qpn = qp.qpn(), "control session went silent with transfers completing: they go on, new ones get a new queue pair");
            qp.retire();
        }
        drop(qp);
        tokio::select! {
            _ = closed.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}
