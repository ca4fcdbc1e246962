//! The initiator's queue pairs to each peer, one per rail pair that works
//! (a link), connected on first use, watched while in use, and released
//! once all are broken and drained.
//!
//! Each link has a keeper task. While the peer has more than one usable
//! pair, it fails a pair that has work due and has completed nothing for
//! [`IbvConfig::stall_timeout`](crate::IbvConfig) (its work then moves to
//! the other pairs, see `batch`), and it connects a failed pair's rails
//! again, probed, every [`REPAIR_EVERY`], so a rail that comes back is used
//! again. A rail pair whose probe failed at connect is tried too, less and
//! less often (see `Missing`): a rail that was down when the peer was
//! first reached joins the link once it is up. Once no pair is usable the
//! keeper waits for them to drain and lets the link go: the next submit
//! connects afresh.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use ferry_control::Endpoint;
use ferry_core::{NodeAddr, OpError};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::connection::PeerQp;
use crate::device::{Fabric, Rail};
use crate::exchange::{self, PROBE_TIMEOUT};
use crate::wire::RailInfo;

/// How often a keeper looks at its link's pairs.
const KEEPER_TICK: Duration = Duration::from_millis(100);
/// How often a keeper tries to connect a failed pair's rails again.
pub(crate) const REPAIR_EVERY: Duration = Duration::from_secs(1);

/// The queue pairs to one peer: one per rail pair that worked at connect
/// (or since), in rail order, broken ones included until replaced.
pub(crate) struct Link {
    pairs: Mutex<Vec<Arc<PeerQp>>>,
    /// The peer's rails, as it described them at connect.
    theirs: Vec<RailInfo>,
}

impl Link {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<PeerQp>>> {
        self.pairs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether new submits may use it: some pair is neither broken nor
    /// retiring.
    pub fn is_usable(&self) -> bool {
        self.lock().iter().any(|qp| qp.is_usable())
    }

    /// The pairs new submits may use, now.
    pub fn usable(&self) -> Vec<Arc<PeerQp>> {
        self.lock()
            .iter()
            .filter(|qp| qp.is_usable())
            .cloned()
            .collect()
    }

    /// Every pair, broken ones included.
    pub fn all(&self) -> Vec<Arc<PeerQp>> {
        self.lock().clone()
    }

    /// The peer's rails, as it described them at connect.
    pub fn theirs(&self) -> &[RailInfo] {
        &self.theirs
    }
}

/// The link to one peer, once connected, and a lock that makes concurrent
/// first submits share one connection attempt.
#[derive(Default)]
struct PeerSlot {
    connected: Option<Arc<Link>>,
    connecting: Arc<tokio::sync::Mutex<()>>,
}

/// How long a peer no rail pair reached is taken for unreachable over
/// ibverbs before a submit tries it again (see [`Peers::reaches`]).
pub(crate) const NO_PAIR_RETRY: Duration = Duration::from_secs(30);

/// Links to peers, connected on first use. A B-tree: looked up for every
/// submit, and small maps need no hashing.
///
/// A slot whose connection attempt failed goes with its last waiter. A
/// slot holding a link goes once every queue pair of it is broken (its
/// peer left, or an op failed) and drained, unless a new link replaced it
/// meanwhile: destroying a queue pair whose flush completions are still
/// pending would free memory they may touch (see `connection`). While
/// some pair of a link is usable, submits use those and leave the broken
/// ones out.
#[derive(Default)]
pub(crate) struct Peers(
    Arc<Mutex<BTreeMap<NodeAddr, PeerSlot>>>,
    /// Peers that answered but no rail pair reached: when, and the error
    /// that said so.
    Mutex<BTreeMap<NodeAddr, (Instant, OpError)>>,
);

impl Peers {
    /// Whether ibverbs may reach `peer`: false for [`NO_PAIR_RETRY`] after
    /// a connect found that no rail pair reaches it.
    pub(crate) fn reaches(&self, peer: NodeAddr) -> bool {
        self.unreachable(peer).is_none()
    }

    /// The error of the connect that found no rail pair reaching `peer`,
    /// for [`NO_PAIR_RETRY`] after it.
    fn unreachable(&self, peer: NodeAddr) -> Option<OpError> {
        let mut unreachable = self.1.lock().unwrap_or_else(|e| e.into_inner());
        match unreachable.get(&peer) {
            Some((at, error)) if at.elapsed() < NO_PAIR_RETRY => Some(error.clone()),
            Some(_) => {
                unreachable.remove(&peer);
                None
            }
            None => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeAddr, PeerSlot>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The usable link to `peer`, if there is one.
    pub(crate) fn connected(&self, peer: NodeAddr) -> Option<Arc<Link>> {
        let link = self.lock().get(&peer)?.connected.clone()?;
        // A broken QP drains on its own, a retiring one finishes the work
        // it has; once none is usable, the next op gets a fresh link.
        link.is_usable().then_some(link)
    }

    /// The link to `peer`, connected (by `deadline`) if there is none.
    pub(crate) async fn get(
        &self,
        fabric: &Arc<Fabric>,
        endpoint: &Endpoint,
        peer: NodeAddr,
        deadline: Instant,
    ) -> Result<Arc<Link>, OpError> {
        match self.connected(peer) {
            Some(link) => Ok(link),
            // Boxed: connecting happens once per peer, and its large state
            // would otherwise be part of (and copied with) every submit's
            // future.
            None => Box::pin(self.connect(fabric, endpoint, peer, deadline)).await,
        }
    }

    async fn connect(
        &self,
        fabric: &Arc<Fabric>,
        endpoint: &Endpoint,
        peer: NodeAddr,
        deadline: Instant,
    ) -> Result<Arc<Link>, OpError> {
        let connecting = self.lock().entry(peer).or_default().connecting.clone();
        let connected = async {
            let _turn = connecting.lock().await;
            // Another submit may have connected while this one waited, or
            // found that no pair reaches: a batch of concurrent submits
            // probes once, not once each.
            if let Some(link) = self.connected(peer) {
                return Ok(link);
            }
            if let Some(error) = self.unreachable(peer) {
                return Err(error);
            }
            let (pairs, theirs) = match exchange::connect(fabric, endpoint, peer, deadline).await {
                Ok(connected) => connected,
                Err(exchange::Unconnected::Op(e)) => return Err(e),
                Err(exchange::Unconnected::NoPair(e)) => {
                    warn!(peer = %peer.endpoint, %e, "no rail pair reaches the peer: ibverbs is tried again in {NO_PAIR_RETRY:?}");
                    metrics::counter!("ferry_ibverbs_unreachable_peers_total").increment(1);
                    self.1
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(peer, (Instant::now(), e.clone()));
                    return Err(e);
                }
            };
            let link = Arc::new(Link {
                pairs: Mutex::new(pairs),
                theirs,
            });
            self.lock().entry(peer).or_default().connected = Some(link.clone());
            tokio::spawn(keep(
                Arc::downgrade(&self.0),
                Arc::downgrade(&link),
                fabric.clone(),
                endpoint.clone(),
                peer,
            ));
            Ok(link)
        }
        .await;
        // A slot that never got a queue pair (the peer could not be reached)
        // goes with its last waiter: the lock is dropped under the table's
        // lock, so of two waiters leaving at once the second removes it.
        // Slots holding a link stay (see `Peers`).
        let mut peers = self.lock();
        drop(connecting);
        if peers.get(&peer).is_some_and(|slot| {
            slot.connected.is_none() && Arc::strong_count(&slot.connecting) == 1
        }) {
            peers.remove(&peer);
        }
        connected
    }

    /// Peers with a slot: a link (usable or broken), or a connection
    /// attempt under way.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Every queue pair of every link.
    pub(crate) fn all(&self) -> Vec<Arc<PeerQp>> {
        self.lock()
            .values()
            .filter_map(|slot| slot.connected.as_ref())
            .flat_map(|link| link.all())
            .collect()
    }
}

type Table = Mutex<BTreeMap<NodeAddr, PeerSlot>>;

/// The link's keeper (see the module docs). Ends once the link is let go.
async fn keep(
    table: Weak<Table>,
    link: Weak<Link>,
    fabric: Arc<Fabric>,
    endpoint: Endpoint,
    peer: NodeAddr,
) {
    let mut repair_at = Instant::now() + REPAIR_EVERY;
    let mut missing = Missing::default();
    // A round of repairs runs beside the keeper's ticks: its probes take up
    // to a few seconds, and stalls must still be caught meanwhile.
    let mut repairing: Option<Round> = None;
    loop {
        tokio::time::sleep(KEEPER_TICK).await;
        if let Some(round) = repairing.take_if(|round| round.task.is_finished()) {
            missing.tried(&round.outcomes().await);
        }
        // The backend is gone, or the link was let go.
        if table.strong_count() == 0 {
            return;
        }
        let Some(held) = link.upgrade() else { return };
        let pairs = held.all();
        let usable: Vec<&Arc<PeerQp>> = pairs.iter().filter(|qp| qp.is_usable()).collect();
        if usable.is_empty() {
            // A round under way may bring a pair back: its end is awaited
            // first (it is bounded by its probes' deadline).
            if let Some(round) = repairing.take() {
                missing.tried(&round.outcomes().await);
                continue;
            }
            // Wait for every pair's flushes, then empty the slot if it
            // still holds this link.
            drop(held);
            for qp in &pairs {
                qp.drained().cancelled().await;
            }
            let Some(table) = table.upgrade() else { return };
            let mut peers = table.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(slot) = peers.get_mut(&peer)
                && slot
                    .connected
                    .as_ref()
                    .is_some_and(|l| std::ptr::eq(Arc::as_ptr(l), link.as_ptr()))
            {
                slot.connected = None;
                if Arc::strong_count(&slot.connecting) == 1 {
                    peers.remove(&peer);
                }
            }
            return;
        }
        fail_stalled(&usable, peer);
        if repairing.is_some() {
            continue;
        }
        // A pair on a rail that is down stays failed until the port is up.
        let now = Instant::now();
        let broken: Vec<Arc<PeerQp>> = if now >= repair_at {
            (pairs.iter())
                .filter(|qp| qp.is_broken() && qp.drained().is_cancelled() && !qp.rail().is_down())
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let absent = missing.due(unpaired(&fabric, &pairs, held.theirs()), now);
        if broken.is_empty() && absent.is_empty() {
            continue;
        }
        if !broken.is_empty() {
            repair_at = now + REPAIR_EVERY;
        }
        let tried = absent.iter().map(|(r, t)| (r.index, t.index)).collect();
        let task = tokio::spawn(repair(
            Owner {
                table: table.clone(),
                link: held,
                peer,
            },
            fabric.clone(),
            endpoint.clone(),
            broken,
            absent,
        ));
        repairing = Some(Round { task, tried });
    }
}

/// A round of repairs under way, and the missing pairs it tries.
struct Round {
    task: JoinHandle<Vec<((u8, u8), bool)>>,
    tried: Vec<(u8, u8)>,
}

impl Round {
    /// Each tried pair's outcome once the round ended; all failed if it
    /// panicked (their backoff must still grow).
    async fn outcomes(self) -> Vec<((u8, u8), bool)> {
        match self.task.await {
            Ok(outcomes) => outcomes,
            Err(_) => self.tried.into_iter().map(|pair| (pair, false)).collect(),
        }
    }
}

/// Fails the pairs among `usable` on a rail whose port went down, and those
/// with work due that made no progress for the stall timeout, while one
/// pair is left to take their work.
fn fail_stalled(usable: &[&Arc<PeerQp>], peer: NodeAddr) {
    let failing: Vec<(&Arc<PeerQp>, &str)> = usable
        .iter()
        .filter_map(|qp| {
            if qp.rail().is_down() {
                Some((*qp, "port_down"))
            } else if qp.is_busy() && qp.since_progress() >= qp.rail().stall_timeout {
                Some((*qp, "stall"))
            } else {
                None
            }
        })
        .collect();
    if failing.len() >= usable.len() {
        return;
    }
    for (qp, reason) in failing {
        let stall = qp.rail().stall_timeout;
        warn!(
            peer = %peer.endpoint,
            rail = %qp.rail().name(),
            remote_rail = qp.remote_rail(),
            reason,
            ?stall,
            "failing a rail pair (its port is down, or it stalled with work due): its work moves to the other pairs"
        );
        metrics::counter!(
            "ferry_rail_failovers_total",
            "rail" => qp.rail().name(),
            "reason" => reason
        )
        .increment(1);
        qp.break_with(qp.lost());
    }
}

/// Rail pairs the link lacks: our rails (their ports up) that no pair of
/// the link uses, matched with rails of the peer's that none uses, as
/// `exchange::connect` matches them: same rail to same rail first, then
/// leftovers to leftovers. A pair whose probe failed at connect (its rails
/// were down then, or slow to answer) is never in the link, so only this
/// brings it in later.
fn unpaired(
    fabric: &Fabric,
    pairs: &[Arc<PeerQp>],
    theirs: &[RailInfo],
) -> Vec<(Arc<Rail>, RailInfo)> {
    let mut taken: Vec<u8> = pairs.iter().map(|qp| qp.remote_rail()).collect();
    let mut ours: Vec<&Arc<Rail>> = (fabric.rails.iter())
        .filter(|r| !r.is_down() && !pairs.iter().any(|qp| qp.rail().index == r.index))
        .collect();
    let mut absent = Vec::new();
    for straight in [true, false] {
        ours.retain(|rail| {
            let their = theirs
                .iter()
                .find(|t| !taken.contains(&t.index) && (!straight || t.index == rail.index));
            let Some(&their) = their else { return true };
            taken.push(their.index);
            absent.push(((*rail).clone(), their));
            false
        });
    }
    absent.sort_by_key(|(rail, _)| rail.index);
    absent
}

/// When each of our rails that has no pair in the link is tried next
/// ([`unpaired`]): after [`REPAIR_EVERY`], then twice as long after each
/// failure, up to [`MISSING_RETRY_MAX`]; a rail pair that never works (on
/// a fabric where rail *i* reaches only rail *i*, one whose peer rail is
/// cabled elsewhere) then costs a probe every half minute.
#[derive(Default)]
struct Missing(BTreeMap<(u8, u8), (Instant, Duration)>);

/// Longest wait between tries of a rail pair missing from a link.
const MISSING_RETRY_MAX: Duration = Duration::from_secs(30);

impl Missing {
    /// Of `absent`, the pairs due for a try at `now`; forgets pairs that
    /// are no longer absent.
    fn due(
        &mut self,
        absent: Vec<(Arc<Rail>, RailInfo)>,
        now: Instant,
    ) -> Vec<(Arc<Rail>, RailInfo)> {
        let key = |(rail, their): &(Arc<Rail>, RailInfo)| (rail.index, their.index);
        self.0
            .retain(|pair, _| absent.iter().any(|a| key(a) == *pair));
        absent
            .into_iter()
            .filter(|a| {
                let (at, _) = *self
                    .0
                    .entry(key(a))
                    .or_insert((now + REPAIR_EVERY, REPAIR_EVERY));
                now >= at
            })
            .collect()
    }

    /// Takes in a round's outcomes: (our rail, theirs), and whether that
    /// pair connected.
    fn tried(&mut self, outcomes: &[((u8, u8), bool)]) {
        let now = Instant::now();
        for &(pair, connected) in outcomes {
            if connected {
                self.0.remove(&pair);
            } else if let Some((at, wait)) = self.0.get_mut(&pair) {
                *wait = (*wait * 2).min(MISSING_RETRY_MAX);
                *at = now + *wait;
            }
        }
    }
}

/// The link a repair round works for, and where it must still be for a
/// new queue pair to join it.
struct Owner {
    table: Weak<Table>,
    link: Arc<Link>,
    peer: NodeAddr,
}

impl Owner {
    /// Puts `qp` in the link with `place` (which hands it back when it has
    /// no place for it), if the link is still the one the table holds for
    /// the peer. Otherwise (let go meanwhile, replaced by a new link, the
    /// backend gone) nothing would ever use or break it, so it is broken
    /// here (its probe passed: nothing is outstanding).
    fn adopt(
        &self,
        qp: Arc<PeerQp>,
        place: impl FnOnce(&mut Vec<Arc<PeerQp>>, Arc<PeerQp>) -> Option<Arc<PeerQp>>,
    ) {
        let table = self.table.upgrade();
        let peers = table
            .as_ref()
            .map(|t| t.lock().unwrap_or_else(|e| e.into_inner()));
        let current = peers.as_ref().is_some_and(|peers| {
            (peers.get(&self.peer))
                .and_then(|slot| slot.connected.as_ref())
                .is_some_and(|l| Arc::ptr_eq(l, &self.link))
        });
        // Under the table's lock (taken before a link's, as everywhere):
        // the link cannot be let go between the look and the insert.
        let left = if current {
            place(&mut self.link.lock(), qp)
        } else {
            Some(qp)
        };
        drop(peers);
        if let Some(qp) = left {
            qp.break_with(qp.lost());
        }
    }
}

/// One round of repairs: a new queue pair, probed, for each of `broken`
/// (in its place) and each of `absent` (added, in rail order). Returns each
/// absent pair's outcome, by (our rail, theirs).
async fn repair(
    owner: Owner,
    fabric: Arc<Fabric>,
    endpoint: Endpoint,
    broken: Vec<Arc<PeerQp>>,
    absent: Vec<(Arc<Rail>, RailInfo)>,
) -> Vec<((u8, u8), bool)> {
    let peer = owner.peer;
    let connect = |rail: Arc<Rail>, their_rail: RailInfo| {
        let deadline = Instant::now() + PROBE_TIMEOUT + Duration::from_secs(1);
        let (fabric, endpoint) = (&fabric, &endpoint);
        async move {
            let name = rail.name();
            let connected =
                exchange::reconnect_pair(fabric, endpoint, peer, rail, their_rail, deadline).await;
            match &connected {
                Ok(_) => {
                    info!(peer = %peer.endpoint, rail = %name, remote_rail = their_rail.index, "rail pair works again")
                }
                Err(why) => {
                    debug!(peer = %peer.endpoint, rail = %name, remote_rail = their_rail.index, %why, "rail pair still down")
                }
            }
            connected.ok()
        }
    };
    for old in broken {
        let remote = old.remote_rail();
        let Some(&their_rail) = owner.link.theirs.iter().find(|t| t.index == remote) else {
            continue;
        };
        if let Some(qp) = connect(old.rail().clone(), their_rail).await {
            owner.adopt(qp, |pairs, qp| {
                match pairs.iter_mut().find(|q| Arc::ptr_eq(q, &old)) {
                    Some(slot) => {
                        *slot = qp;
                        None
                    }
                    None => Some(qp),
                }
            });
        }
    }
    let mut outcomes = Vec::with_capacity(absent.len());
    for (rail, their_rail) in absent {
        let pair = (rail.index, their_rail.index);
        let qp = connect(rail, their_rail).await;
        outcomes.push((pair, qp.is_some()));
        if let Some(qp) = qp {
            owner.adopt(qp, |pairs, qp| {
                let at = pairs.partition_point(|p| p.rail().index < pair.0);
                pairs.insert(at, qp);
                None
            });
        }
    }
    outcomes
}
