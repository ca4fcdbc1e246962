//! The initiator's queue pairs, one per peer, connected on first use and
//! released once broken and drained.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ferry_control::Endpoint;
use ferry_core::{NodeAddr, OpError};
use tokio::time::Instant;

use crate::connection::PeerQp;
use crate::device::Device;
use crate::exchange;

/// The queue pair to one peer, once connected, and a lock that makes
/// concurrent first submits share one connection attempt.
#[derive(Default)]
struct PeerSlot {
    connected: Option<Arc<PeerQp>>,
    connecting: Arc<tokio::sync::Mutex<()>>,
}

/// Queue pairs to peers, one per peer, connected on first use. A B-tree:
/// looked up for every submit, and small maps need no hashing.
///
/// A slot whose connection attempt failed goes with its last waiter. A
/// slot holding a queue pair goes once that queue pair is broken (its
/// peer left, or an op failed) and drained, unless a new one replaced it
/// meanwhile: destroying a queue pair whose flush completions are still
/// pending would free memory they may touch (see `connection`).
#[derive(Default)]
pub(crate) struct Peers(Arc<Mutex<BTreeMap<NodeAddr, PeerSlot>>>);

impl Peers {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeAddr, PeerSlot>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The usable QP to `peer`, if there is one.
    pub(crate) fn connected(&self, peer: NodeAddr) -> Option<Arc<PeerQp>> {
        let qp = self.lock().get(&peer)?.connected.clone()?;
        // A broken QP drains on its own, a retiring one finishes the work
        // it has; the next op gets a fresh one.
        qp.is_usable().then_some(qp)
    }

    /// The QP to `peer`, connected (by `deadline`) if there is none.
    pub(crate) async fn get(
        &self,
        device: &Arc<Device>,
        endpoint: &Endpoint,
        peer: NodeAddr,
        deadline: Instant,
    ) -> Result<Arc<PeerQp>, OpError> {
        match self.connected(peer) {
            Some(qp) => Ok(qp),
            // Boxed: connecting happens once per peer, and its large state
            // would otherwise be part of (and copied with) every submit's
            // future.
            None => Box::pin(self.connect(device, endpoint, peer, deadline)).await,
        }
    }

    async fn connect(
        &self,
        device: &Arc<Device>,
        endpoint: &Endpoint,
        peer: NodeAddr,
        deadline: Instant,
    ) -> Result<Arc<PeerQp>, OpError> {
        let connecting = self.lock().entry(peer).or_default().connecting.clone();
        let connected = async {
            let _turn = connecting.lock().await;
            // Another submit may have connected while this one waited.
            if let Some(qp) = self.connected(peer) {
                return Ok(qp);
            }
            let qp = exchange::connect(device, endpoint, peer, deadline).await?;
            self.lock().entry(peer).or_default().connected = Some(qp.clone());
            self.release_when_drained(peer, &qp);
            Ok(qp)
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

    /// Empties `peer`'s slot once `qp` is broken and drained, if the slot
    /// still holds it, and removes the slot unless a connection attempt is
    /// under way in it.
    fn release_when_drained(&self, peer: NodeAddr, qp: &Arc<PeerQp>) {
        let table = Arc::downgrade(&self.0);
        let drained = qp.drained().clone();
        let qp = Arc::downgrade(qp);
        tokio::spawn(async move {
            drained.cancelled().await;
            let Some(table) = table.upgrade() else { return };
            let mut peers = table.lock().unwrap_or_else(|e| e.into_inner());
            let Some(slot) = peers.get_mut(&peer) else {
                return;
            };
            if slot
                .connected
                .as_ref()
                .is_some_and(|held| std::ptr::eq(Arc::as_ptr(held), qp.as_ptr()))
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

    pub(crate) fn all(&self) -> Vec<Arc<PeerQp>> {
        self.lock()
            .values()
            .filter_map(|slot| slot.connected.clone())
            .collect()
    }
}
