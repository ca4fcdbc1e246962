//! A subscriber: its own layout of the set's tensors, planned once against
//! every publisher rank's, and updated to the newest complete version.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::NodeAddr;
use tokio::time::Instant;

use super::Readers;
use super::checksum::{TensorBox, checksums, shared_boxes};
use super::readers::NO_VERSION;
use super::relay::Relay;
use super::{Answer, Ask, WeightsError, handler_name, relay_handler_name, relay_layout_name};
use crate::layout::{Direction, PlanOptions, RankLayout};
use crate::{LocalLayout, Node, PeerLayout, TransferPlan};

/// How long past the wait an [`Ask::Await`] call may take to come back:
/// the source answers at the wait's end, and the answer has to travel.
const AWAIT_SLACK: Duration = Duration::from_millis(500);

/// A subscriber of a weight set (see [`crate::weights`]).
pub struct Subscriber {
    node: Node,
    set: String,
    /// Where versions come from: the publisher ranks (each one's node and
    /// rank id), or one relaying subscriber (rank 0).
    ranks: Vec<(NodeAddr, u32)>,
    /// The RPC handler the sources answer on.
    handler: String,
    /// One plan per buffer (one: in place; two: double-buffered) and per
    /// source buffer (a publisher rank has one; a relay one or two).
    plans: Vec<Vec<TransferPlan>>,
    /// The buffers, kept registered.
    buffers: Vec<LocalLayout>,
    /// Who reads which buffer, and which one is current.
    readers: Readers,
    version: Option<u64>,
    /// Serving its buffers on to other subscribers, once asked.
    relay: Option<Relay>,
    /// The boxes of elements this subscriber shares with each source: per
    /// publisher rank, or per relay buffer.
    boxes: Vec<Vec<TensorBox>>,
    /// Whether updates check checksums ([`Subscriber::verify_checksums`]).
    verify: bool,
}

/// What [`Subscriber::update`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Update {
    /// The version the subscriber holds now.
    pub version: u64,
    /// Whether this update moved a new version (`false`: it held the
    /// newest complete one already).
    pub changed: bool,
    /// The buffer that holds it: the one readers use from now on.
    pub buffer: usize,
}

impl Subscriber {
    /// A subscriber of set `set` as published by the nodes at
    /// `publishers` (one per rank), into `buffers`: one layout (updates
    /// write in place: pause your readers around [`Subscriber::update`]),
    /// or two over the same tensors (an update fills the buffer readers do
    /// not use, then makes it [`Subscriber::active`]). Fetches each rank's
    /// published layout and plans once per buffer, within `timeout`.
    pub async fn new(
        node: &Node,
        set: &str,
        publishers: &[std::net::SocketAddr],
        buffers: Vec<LocalLayout>,
        timeout: Duration,
    ) -> Result<Subscriber, WeightsError> {
        check_buffers(&buffers)?;
        let deadline = Instant::now() + timeout;
        let mut peers = Vec::new();
        let mut ranks = Vec::new();
        for &address in publishers {
            let left = deadline.saturating_duration_since(Instant::now());
            let lost = |reason: String| WeightsError::PublisherLost {
                rank: u32::MAX,
                reason,
            };
            let (name, _) = node
                .fetch_metadata(address, left)
                .await
                .map_err(|e| lost(e.to_string()))?;
            let peer = node.peer_layout(&name, set)?;
            let addr = node
                .peer_metadata(&name)
                .map(|m| m.node)
                .ok_or_else(|| lost("its metadata went".into()))?;
            ranks.push((addr, peer.layout().rank));
            peers.push(peer);
        }
        let mut plans = Vec::new();
        for buffer in &buffers {
            let left = deadline.saturating_duration_since(Instant::now());
            let options = PlanOptions {
                direction: Direction::Pull,
                ..Default::default()
            };
            plans.push(vec![
                node.plan_transfer(buffer, &peers, options, left).await?,
            ]);
        }
        let sources: Vec<_> = peers.iter().map(|p| p.layout().clone()).collect();
        Ok(Subscriber::assemble(
            node,
            set,
            (ranks, handler_name(set)),
            (plans, &sources),
            buffers,
        ))
    }

    /// [`Subscriber::new`] with the publisher ranks' nodes named rather
    /// than addressed: each name is looked up through this node's names
    /// ([`Node::lookup`]: in etcd, on a node that uses it, or among the
    /// peers whose metadata it holds), all within `timeout`. A name not
    /// found by then fails [`WeightsError::PublisherLost`] naming it.
    pub async fn by_names(
        node: &Node,
        set: &str,
        publishers: &[&str],
        buffers: Vec<LocalLayout>,
        timeout: Duration,
    ) -> Result<Subscriber, WeightsError> {
        let deadline = Instant::now() + timeout;
        let mut addresses = Vec::with_capacity(publishers.len());
        for name in publishers {
            let left = deadline.saturating_duration_since(Instant::now());
            let found = node.lookup(name, left).await;
            let metadata = found.map_err(|e| WeightsError::PublisherLost {
                rank: u32::MAX,
                reason: format!("{name:?} was not found: {e}"),
            })?;
            addresses.push(metadata.node.endpoint);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        Subscriber::new(node, set, &addresses, buffers, left).await
    }

    /// A subscriber of set `set` that takes its versions from another
    /// subscriber, the one at `relay` (which called
    /// [`Subscriber::serve_relay`]), instead of from the publishers: so
    /// that the publishers' links carry each version once however many
    /// subscribers there are. Its buffers must hold the tensors as the
    /// relay's do, or part of them (another replica of the same shard, a
    /// sub-shard); a relay can itself relay, which makes a tree. Plans
    /// once per buffer against each of the relay's, within `timeout`. The
    /// fence holds as with publishers: the relay does not write a buffer
    /// this subscriber is reading (it waits, bounded by half its update's
    /// time, then this update fails [`WeightsError::Overwritten`]).
    pub async fn from_relay(
        node: &Node,
        set: &str,
        relay: std::net::SocketAddr,
        buffers: Vec<LocalLayout>,
        timeout: Duration,
    ) -> Result<Subscriber, WeightsError> {
        check_buffers(&buffers)?;
        let deadline = Instant::now() + timeout;
        let lost = |reason: String| WeightsError::PublisherLost { rank: 0, reason };
        let (name, _) = node
            .fetch_metadata(relay, timeout)
            .await
            .map_err(|e| lost(e.to_string()))?;
        let addr = node
            .peer_metadata(&name)
            .map(|m| m.node)
            .ok_or_else(|| lost("its metadata went".into()))?;
        let mut sources: Vec<PeerLayout> =
            vec![node.peer_layout(&name, &relay_layout_name(set, 0))?];
        if let Ok(second) = node.peer_layout(&name, &relay_layout_name(set, 1)) {
            sources.push(second);
        }
        let options = PlanOptions {
            direction: Direction::Pull,
            remote_covers_local_only: true,
            ..Default::default()
        };
        let mut plans = Vec::new();
        for buffer in &buffers {
            let mut per_source = Vec::new();
            for source in &sources {
                let left = deadline.saturating_duration_since(Instant::now());
                let peer = std::slice::from_ref(source);
                per_source.push(node.plan_transfer(buffer, peer, options, left).await?);
            }
            plans.push(per_source);
        }
        let ranks = vec![(addr, 0)];
        let sources: Vec<_> = sources.iter().map(|p| p.layout().clone()).collect();
        Ok(Subscriber::assemble(
            node,
            set,
            (ranks, relay_handler_name(set)),
            (plans, &sources),
            buffers,
        ))
    }

    fn assemble(
        node: &Node,
        set: &str,
        (ranks, handler): (Vec<(NodeAddr, u32)>, String),
        (plans, sources): (Vec<Vec<TransferPlan>>, &[RankLayout]),
        buffers: Vec<LocalLayout>,
    ) -> Subscriber {
        // The buffers hold the same tensors (checked by planning), so
        // share the same boxes with each source.
        let boxes = (sources.iter())
            .map(|source| shared_boxes(buffers[0].layout(), source))
            .collect();
        let locks: Vec<_> = (0..buffers.len())
            .map(|_| Arc::new(tokio::sync::RwLock::new(())))
            .collect();
        Subscriber {
            node: node.clone(),
            set: set.to_string(),
            ranks,
            handler,
            plans,
            buffers,
            readers: Readers {
                versions: locks.iter().map(|_| AtomicU64::new(NO_VERSION)).collect(),
                locks: locks.into(),
                active: Arc::new(AtomicUsize::new(0)),
                updated: Arc::new(tokio::sync::Notify::new()),
            },
            version: None,
            relay: None,
            boxes,
            verify: false,
        }
    }

    /// Whether each update also checks, per tensor, that the bytes this
    /// subscriber holds are those its sources held under its leases (off
    /// by default): each source hashes the boxes of elements it shares
    /// with this subscriber (XXH3-64, in the tensor's logical order), this
    /// subscriber the same boxes of its buffer, and an update whose sums
    /// differ fails [`WeightsError::ChecksumMismatch`], holding no
    /// version in that buffer. It costs each source a second read of what
    /// it served, and this subscriber one of what it received.
    pub fn verify_checksums(&mut self, on: bool) {
        self.verify = on;
    }

    /// Serves this subscriber's buffers on to other subscribers
    /// ([`Subscriber::from_relay`]): each version it holds whole, it leases
    /// to them as a publisher rank does, and its updates wait for their
    /// leases on the buffer they write (up to half the update's time; past
    /// it, the readers it overran fail and retry). Serving stops when the
    /// subscriber drops.
    pub fn serve_relay(&mut self) -> Result<(), WeightsError> {
        if self.relay.is_some() {
            return Ok(());
        }
        let relay = Relay::start(&self.node, &self.set, &self.buffers)?;
        for (b, served) in relay.buffers.iter().enumerate() {
            let version = self.readers.versions[b].load(Ordering::Acquire);
            if version != NO_VERSION {
                served.publish(version)?;
            }
        }
        self.relay = Some(relay);
        Ok(())
    }

    /// The version the subscriber holds, if any.
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// The buffer readers use: the one the last update filled.
    pub fn active(&self) -> usize {
        self.readers.active.load(Ordering::Acquire)
    }

    /// The readers' side of the fence, for the tasks that read the
    /// weights.
    pub fn readers(&self) -> Readers {
        self.readers.clone()
    }

    /// The buffers, in the order given.
    pub fn buffers(&self) -> &[LocalLayout] {
        &self.buffers
    }

    /// Moves the newest version complete on every publisher rank into this
    /// subscriber's memory, within `timeout`, unless it holds it already:
    /// leases it on every rank (a rank that moved on between the look and
    /// the lease is asked again until the deadline), pulls every byte
    /// through the plan, and releases the leases. When no version is
    /// complete on every rank now (one holds none, or is being written, or
    /// they differ), it fails at once with
    /// [`WeightsError::NoCompleteVersion`] and the subscriber keeps what
    /// it holds: call it again after the publishers' next step. A rank that overwrote
    /// the version meanwhile fails the update
    /// ([`WeightsError::Overwritten`]): the subscriber keeps its last
    /// version (double-buffered: readers saw nothing of it), and the next
    /// update takes the newest one.
    pub async fn update(&mut self, timeout: Duration) -> Result<Update, WeightsError> {
        let deadline = Instant::now() + timeout;
        loop {
            let version = self.newest_complete(deadline).await?;
            if self.version == Some(version) {
                return Ok(Update {
                    version,
                    changed: false,
                    buffer: self.active(),
                });
            }
            let Some((leases, source)) = self.lease(version, deadline).await? else {
                // Some rank moved on (or is writing): look again.
                if Instant::now() >= deadline {
                    return Err(WeightsError::NoCompleteVersion);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                continue;
            };
            let buffer = if self.plans.len() == 2 {
                1 - self.active()
            } else {
                0
            };
            // The buffer written is held by no reader meanwhile.
            let lock = self.readers.locks[buffer].clone();
            let written = match tokio::time::timeout_at(deadline, lock.write_owned()).await {
                Ok(written) => written,
                Err(_) => {
                    let _ = self.release(&leases, version).await;
                    return Err(WeightsError::ReadersHold { buffer });
                }
            };
            // Relaying, downstream readers let go of it too, or are overrun
            // past half the time left.
            let served = self.relay.as_ref().map(|r| r.buffers[buffer].clone());
            if let Some(served) = &served {
                let left = deadline.saturating_duration_since(Instant::now());
                served.take(Instant::now() + left / 2, &self.set).await;
            }
            // From here until it is filled whole, the buffer holds no
            // version: readers wait rather than read it.
            self.readers.versions[buffer].store(NO_VERSION, Ordering::Release);
            let left = deadline.saturating_duration_since(Instant::now());
            let moved = async {
                let plan = self.plans[buffer].get(source).ok_or_else(|| {
                    WeightsError::Protocol(format!("the source leased its buffer {source}"))
                })?;
                let xfer = plan.request(&[])?;
                // A request made here is never in progress already.
                xfer.post(left)
                    .map_err(|e| WeightsError::Protocol(e.to_string()))?;
                xfer.wait().await?;
                Ok::<(), WeightsError>(())
            }
            .await;
            let moved = match moved {
                Ok(()) if self.verify => {
                    self.check_sums(&leases, (source, buffer), version, deadline)
                        .await
                }
                moved => moved,
            };
            let intact = self.release(&leases, version).await;
            if moved.is_err() || intact.is_err() {
                if let Some(served) = &served {
                    served.abandon();
                }
                // What the buffer holds now is no version: with one buffer
                // the subscriber holds none.
                if self.plans.len() == 1 {
                    self.version = None;
                }
                // A rank that overwrote the version explains a mismatch.
                if let (Err(WeightsError::ChecksumMismatch { .. }), Err(overwritten)) =
                    (&moved, &intact)
                {
                    return Err(overwritten.clone());
                }
                moved?;
                intact?;
            }
            self.version = Some(version);
            if let Some(served) = &served
                && served.publish(version).is_err()
            {
                served.abandon();
            }
            self.readers.versions[buffer].store(version, Ordering::Release);
            self.readers.active.store(buffer, Ordering::Release);
            drop(written);
            self.readers.updated.notify_waiters();
            return Ok(Update {
                version,
                changed: true,
                buffer,
            });
        }
    }

    /// Updates until the subscriber holds `version` or a newer one, within
    /// `timeout`: what a subscriber behind a relay calls after the
    /// publishers' step, since the relay holds a version only once it has
    /// pulled it whole (before that, [`Subscriber::update`] finds the
    /// version it already holds, or none), and what any subscriber calls
    /// to wait for the publishers' next version. Between tries it waits
    /// for its sources to publish (each asked once, answering when they
    /// do), not polling them. Past the deadline,
    /// [`WeightsError::NoCompleteVersion`]; other errors at once.
    pub async fn update_to(
        &mut self,
        version: u64,
        timeout: Duration,
    ) -> Result<Update, WeightsError> {
        let deadline = Instant::now() + timeout;
        // The version every source must hold before the next try: the one
        // asked for, or a newer one some source already holds (the ranks
        // then differ until the others publish it too).
        let mut wanted = version;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.update(left).await {
                Ok(update) if update.version >= version => return Ok(update),
                Ok(_) | Err(WeightsError::NoCompleteVersion) => {}
                // A source that did not answer within what was left of
                // the deadline: the deadline passed, not the source.
                Err(WeightsError::PublisherLost { .. }) if Instant::now() >= deadline => {
                    return Err(WeightsError::NoCompleteVersion);
                }
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Err(WeightsError::NoCompleteVersion);
            }
            wanted = wanted.max(self.await_sources(wanted, deadline).await?);
            if Instant::now() >= deadline {
                return Err(WeightsError::NoCompleteVersion);
            }
        }
    }

    /// Waits until every source holds `version` or a newer one, or until
    /// `deadline`, asking each once ([`Ask::Await`]: the source answers
    /// when it publishes) rather than polling it. Returns the newest
    /// version a source holds.
    async fn await_sources(&self, version: u64, deadline: Instant) -> Result<u64, WeightsError> {
        let mut newest = 0;
        for rank in 0..self.ranks.len() {
            let wait = deadline.saturating_duration_since(Instant::now());
            let ask = Ask::Await {
                version,
                wait_ms: wait.as_millis().try_into().unwrap_or(u64::MAX),
            };
            // The call's own deadline leaves the source time to answer.
            let answer = self.ask(rank, &ask, deadline + AWAIT_SLACK).await?;
            match answer {
                Answer::State { version: held, .. } => newest = newest.max(held.unwrap_or(0)),
                other => return Err(WeightsError::Protocol(format!("{other:?}"))),
            }
        }
        Ok(newest)
    }

    async fn ask(&self, rank: usize, ask: &Ask, deadline: Instant) -> Result<Answer, WeightsError> {
        let (addr, id) = self.ranks[rank];
        let lost = |reason: String| WeightsError::PublisherLost { rank: id, reason };
        let left = deadline.saturating_duration_since(Instant::now());
        let body = Bytes::from(serde_json::to_vec(ask).expect("asks serialize"));
        let answer = self
            .node
            .call(addr, &self.handler, body, left)
            .await
            .map_err(|e| lost(e.to_string()))?;
        serde_json::from_slice(&answer).map_err(|e| WeightsError::Protocol(e.to_string()))
    }

    /// The newest version every rank holds now.
    async fn newest_complete(&self, deadline: Instant) -> Result<u64, WeightsError> {
        let mut common: Option<u64> = None;
        for rank in 0..self.ranks.len() {
            match self.ask(rank, &Ask::State, deadline).await? {
                Answer::State {
                    version: Some(v), ..
                } if common.is_none_or(|c| c == v) => common = Some(v),
                Answer::State { .. } => return Err(WeightsError::NoCompleteVersion),
                other => return Err(WeightsError::Protocol(format!("{other:?}"))),
            }
        }
        common.ok_or(WeightsError::NoCompleteVersion)
    }

    /// Leases `version` on every rank, with the buffer the (first) source
    /// leased; `None` (and the leases taken released) if some rank
    /// refuses.
    async fn lease(
        &self,
        version: u64,
        deadline: Instant,
    ) -> Result<Option<(Vec<u64>, usize)>, WeightsError> {
        let mut leases = Vec::with_capacity(self.ranks.len());
        let mut source = 0;
        for rank in 0..self.ranks.len() {
            match self.ask(rank, &Ask::Lease { version }, deadline).await {
                Ok(Answer::Leased { lease, buffer }) => {
                    if rank == 0 {
                        source = buffer;
                    }
                    leases.push(lease);
                }
                Ok(Answer::Refused { .. }) => {
                    let _ = self.release(&leases, version).await;
                    return Ok(None);
                }
                Ok(other) => return Err(WeightsError::Protocol(format!("{other:?}"))),
                Err(e) => {
                    let _ = self.release(&leases, version).await;
                    return Err(e);
                }
            }
        }
        Ok(Some((leases, source)))
    }

    /// Compares each source's checksums of the boxes it shares with this
    /// subscriber (under `leases`, `source` the relay buffer leased) with
    /// this subscriber's of `buffer`.
    async fn check_sums(
        &self,
        leases: &[u64],
        (source, buffer): (usize, usize),
        version: u64,
        deadline: Instant,
    ) -> Result<(), WeightsError> {
        let relayed = self.handler == relay_handler_name(&self.set);
        for (rank, &lease) in leases.iter().enumerate() {
            let boxes = &self.boxes[if relayed { source } else { rank }];
            if boxes.is_empty() {
                continue;
            }
            let ask = Ask::Checksums {
                lease,
                boxes: boxes.clone(),
            };
            let (memory, mine) = (self.buffers[buffer].clone(), boxes.clone());
            let local = tokio::task::spawn_blocking(move || checksums(&memory, &mine));
            let (theirs, local) = tokio::join!(self.ask(rank, &ask, deadline), local);
            let id = self.ranks[rank].1;
            let theirs = match theirs? {
                Answer::Checksums { sums } if sums.len() == boxes.len() => sums,
                // The lease ended or was overrun: release says which.
                Answer::Refused { .. } => {
                    return Err(WeightsError::Overwritten { rank: id, version });
                }
                other => return Err(WeightsError::Protocol(format!("{other:?}"))),
            };
            let local = local
                .map_err(|e| WeightsError::Protocol(format!("the checksum thread failed: {e}")))?
                .map_err(WeightsError::Protocol)?;
            if let Some(k) = (0..boxes.len()).find(|&k| theirs[k] != local[k]) {
                return Err(WeightsError::ChecksumMismatch {
                    tensor: boxes[k].tensor.clone(),
                    rank: id,
                    version,
                });
            }
        }
        Ok(())
    }

    /// Ends the leases; an error if a rank overwrote the version under one.
    async fn release(&self, leases: &[u64], version: u64) -> Result<(), WeightsError> {
        // Releases are owed even past the update's deadline.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut result = Ok(());
        for (rank, &lease) in leases.iter().enumerate() {
            match self.ask(rank, &Ask::Release { lease }, deadline).await {
                Ok(Answer::Released { intact: true }) => {}
                Ok(Answer::Released { intact: false }) => {
                    let rank = self.ranks[rank].1;
                    result = result.and(Err(WeightsError::Overwritten { rank, version }));
                }
                Ok(other) => {
                    result = result.and(Err(WeightsError::Protocol(format!("{other:?}"))));
                }
                Err(e) => result = result.and(Err(e)),
            }
        }
        result
    }
}

/// A subscriber takes one buffer or two.
fn check_buffers(buffers: &[LocalLayout]) -> Result<(), WeightsError> {
    if buffers.is_empty() || buffers.len() > 2 {
        return Err(WeightsError::Protocol(format!(
            "a subscriber takes one buffer or two, not {}",
            buffers.len()
        )));
    }
    Ok(())
}
