//! The initiator's queue pairs to each peer, one per rail pair that works
//! (a link), connected on first use and released once all are broken and
//! drained.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ferry_control::Endpoint;
use ferry_core::{NodeAddr, OpError};
use tokio::time::Instant;

use crate::connection::PeerQp;
use crate::device::Fabric;
use crate::exchange;

/// The queue pairs to one peer: one per rail pair that worked at connect,
/// in rail order.
pub(crate) struct Link {
    pub pairs: Vec<Arc<PeerQp>>,
}

impl Link {
    /// Whether new submits may use it: some pair is neither broken nor
    /// retiring.
    pub fn is_usable(&self) -> bool {
        self.pairs.iter().any(|qp| qp.is_usable())
    }

    /// The pairs new submits may use.
    pub fn usable(&self) -> impl Iterator<Item = &Arc<PeerQp>> {
        self.pairs.iter().filter(|qp| qp.is_usable())
    }
}

/// The link to one peer, once connected, and a lock that makes concurrent
/// first submits share one connection attempt.
#[derive(Default)]
struct PeerSlot {
    connected: Option<Arc<Link>>,
    connecting: Arc<tokio::sync::Mutex<()>>,
}

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
pub(crate) struct Peers(Arc<Mutex<BTreeMap<NodeAddr, PeerSlot>>>);

impl Peers {
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
            // Another submit may have connected while this one waited.
            if let Some(link) = self.connected(peer) {
                return Ok(link);
            }
            let pairs = exchange::connect(fabric, endpoint, peer, deadline).await?;
            let link = Arc::new(Link { pairs });
            self.lock().entry(peer).or_default().connected = Some(link.clone());
            self.release_when_drained(peer, &link);
            Ok(link)
        }
        .await;
        // A slot that never got a queue pair (the peer could not be reached)
        // goes with its last waiter: the lock is dropped under the table's
        // lock, so of two waiters leaving at once the second removes it.
        // Slots holding a queue pair stay (see `Peers`).
        let mut peers = self.lock();
        drop(connecting);
        if peers.get(&peer).is_some_and(|slot| {
            slot.connected.is_none() && Arc::strong_count(&slot.connecting) == 1
        }) {
            peers.remove(&peer);
        }
        connected
    }

    /// Empties `peer`'s slot once every QP of `link` is broken and
    /// drained, if the slot still holds it, and removes the slot unless a
    /// connection attempt is under way in it.
    fn release_when_drained(&self, peer: NodeAddr, link: &Arc<Link>) {
        let table = Arc::downgrade(&self.0);
        let drained: Vec<_> = link.pairs.iter().map(|qp| qp.drained().clone()).collect();
        let link = Arc::downgrade(link);
        tokio::spawn(async move {
            for pair in drained {
                pair.cancelled().await;
            }
            let Some(table) = table.upgrade() else { return };
            let mut peers = table.lock().unwrap_or_else(|e| e.into_inner());
            let Some(slot) = peers.get_mut(&peer) else {
                return;
            };
            if slot
                .connected
                .as_ref()
                .is_some_and(|held| std::ptr::eq(Arc::as_ptr(held), link.as_ptr()))
            {
                slot.connected = None;
                if Arc::strong_count(&slot.connecting) == 1 {
                    peers.remove(&peer);
                }
            }
        });
    }

    /// Peers with a slot: a queue pair (usable or broken), or a connection
    /// attempt under way.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Every queue pair of every link.
    pub(crate) fn all(&self) -> Vec<Arc<PeerQp>> {
        self.lock()
            .values()
            .filter_map(|slot| slot.connected.as_ref())
            .flat_map(|link| link.pairs.iter().cloned())
            .collect()
    }
}
