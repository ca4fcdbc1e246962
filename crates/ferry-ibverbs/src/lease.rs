//! Queue pairs leased to code that posts RDMA itself (a GPU kernel, a
//! proxy thread): connected to one peer on the rail pairs ferry found
//! working, each with a completion queue of its own, on which ferry never
//! posts and which it never polls. Ferry keeps watching the peer: when its
//! control session ends (the peer died, or went silent past the peer
//! timeout), the lease is marked broken and its queue pairs are moved to
//! the error state, so work posted on them completes (flushed) instead of
//! retrying forever. Dropping the lease moves them to the error state,
//! waits for what was posted to flush (a marker request posted behind it
//! completes last), and then destroys them; the owner is told to let its
//! ends go.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry_control::{Service, Session};
use ferry_core::NodeAddr;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::connection::FOREIGN_WR_ID_BIT;
use crate::device::Rail;
use crate::exchange::Connected;
use crate::verbs::{Completion, CompletionQueue, QueuePair, WorkRequest};
use crate::wire::encode_release;

/// How long dropping a lease waits for its queue pairs' work to flush
/// before it destroys them anyway (destroying a queue pair stops the
/// device's access through it either way).
const DRAIN_DEADLINE: Duration = Duration::from_secs(1);
/// The `wr_id` of the marker a dropped lease posts behind the holder's work.
const DRAIN_MARKER: u64 = FOREIGN_WR_ID_BIT | 0x004c_4541_5345;

/// One leased queue pair: connected from this node's rail `rail` to the
/// peer's rail `remote_rail`. Its raw handles are valid for as long as the
/// [`IbvLease`] lives.
pub struct LeasedQp {
    /// This node's rail (index into `IbvTransportInfo::rails`): use
    /// `IbvRegionKeys::lkeys[rail]` for local memory.
    pub rail: u8,
    /// The peer's rail: use its handles' `rkeys[remote_rail]`.
    pub remote_rail: u8,
    /// The path MTU in bytes.
    pub mtu: u32,
    /// The local queue pair number.
    pub qpn: u32,
    /// Send-queue depth: at most this many requests outstanding; the
    /// completion queue holds one completion per request.
    pub depth: u32,
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    rail_ref: Arc<Rail>,
}

impl LeasedQp {
    /// The raw `ibv_qp*`: post RDMA READ and WRITE only (no SEND: the
    /// owner posts no receive buffers for a leased pair). Do not destroy
    /// or modify it.
    pub fn qp(&self) -> *mut rdma_sys::ibv_qp {
        // SAFETY: only reads the pointer; the lease keeps the QP alive.
        unsafe { self.qp.raw() }
    }

    /// The raw `ibv_cq*` its completions go to; nothing else polls it.
    pub fn cq(&self) -> *mut rdma_sys::ibv_cq {
        // SAFETY: as above.
        unsafe { self.cq.raw() }
    }

    /// The raw `ibv_pd*` of its rail's device: memory registered by ferry
    /// on that device belongs to it.
    pub fn pd(&self) -> *mut rdma_sys::ibv_pd {
        // SAFETY: as above; the rail keeps its PD alive.
        unsafe { self.rail_ref.pd.raw() }
    }
}

impl std::fmt::Debug for LeasedQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeasedQp")
            .field("rail", &self.rail)
            .field("remote_rail", &self.remote_rail)
            .field("mtu", &self.mtu)
            .field("qpn", &self.qpn)
            .field("depth", &self.depth)
            .finish()
    }
}

struct Inner {
    pairs: Vec<LeasedQp>,
    broken: AtomicBool,
}

/// Queue pairs to one peer leased to code that posts itself (see the
/// module docs). Made by [`IbvBackend::lease`](crate::IbvBackend::lease).
pub struct IbvLease {
    peer: NodeAddr,
    inner: Option<Arc<Inner>>,
    slot: u16,
    session: Session,
    watching: CancellationToken,
}

impl IbvLease {
    pub(crate) fn new(
        peer: NodeAddr,
        slot: u16,
        session: Session,
        pairs: Vec<Connected>,
        depth: u32,
    ) -> IbvLease {
        let inner = Arc::new(Inner {
            pairs: pairs
                .into_iter()
                .map(|c| LeasedQp {
                    rail: c.rail.index,
                    remote_rail: c.owner_rail,
                    mtu: 128 << c.mtu,
                    qpn: c.qp.qpn(),
                    depth: c.qp.max_send_wr().min(depth),
                    qp: c.qp,
                    cq: c.cq,
                    rail_ref: c.rail,
                })
                .collect(),
            broken: AtomicBool::new(false),
        });
        let watching = CancellationToken::new();
        tokio::spawn(watch(
            Arc::downgrade(&inner),
            session.clone(),
            watching.clone(),
        ));
        IbvLease {
            peer,
            inner: Some(inner),
            slot,
            session,
            watching,
        }
    }

    fn inner(&self) -> &Inner {
        self.inner.as_ref().expect("present until drop")
    }

    /// The peer the queue pairs are connected to.
    pub fn peer(&self) -> NodeAddr {
        self.peer
    }

    /// The leased queue pairs, one per rail pair, in rail order.
    pub fn pairs(&self) -> &[LeasedQp] {
        &self.inner().pairs
    }

    /// Whether the peer is gone: its control session ended. The queue
    /// pairs are then in the error state; work posted on them flushes.
    pub fn is_broken(&self) -> bool {
        self.inner().broken.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for IbvLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvLease")
            .field("peer", &self.peer)
            .field("pairs", &self.pairs())
            .field("broken", &self.is_broken())
            .finish()
    }
}

/// Marks the lease broken, and its queue pairs failed, once `session` ends.
async fn watch(inner: Weak<Inner>, session: Session, watching: CancellationToken) {
    tokio::select! {
        _ = watching.cancelled() => {}
        _ = session.closed() => {
            if let Some(inner) = inner.upgrade() {
                debug!(peer = %session.peer().endpoint, "a leased peer is gone: the lease is broken");
                inner.broken.store(true, Ordering::Release);
                for pair in &inner.pairs {
                    let _ = pair.qp.to_error();
                }
            }
        }
    }
}

impl Drop for IbvLease {
    fn drop(&mut self) {
        self.watching.cancel();
        let Some(inner) = self.inner.take() else {
            return;
        };
        // The watcher holds only a weak reference: this is the last one.
        let Ok(inner) = Arc::try_unwrap(inner) else {
            return;
        };
        let pairs = inner.pairs;
        for pair in &pairs {
            let _ = pair.qp.to_error();
        }
        // Draining polls; a thread of its own keeps it off the caller's
        // (and the runtime's) path.
        std::thread::spawn(move || drain(pairs));
        // The owner lets its ends go; nothing waits for the answer.
        let (session, slot) = (self.session.clone(), self.slot);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let body = Bytes::copy_from_slice(&encode_release(slot));
                let _ = session
                    .request(Service::IBVERBS_CONNECT, body, Duration::from_secs(5))
                    .await;
            });
        }
    }
}

/// Waits until everything posted on `pairs` (in the error state) has
/// flushed, or [`DRAIN_DEADLINE`], then destroys them.
fn drain(pairs: Vec<LeasedQp>) {
    let marker = WorkRequest::empty_write(DRAIN_MARKER);
    let until = Instant::now() + DRAIN_DEADLINE;
    for pair in &pairs {
        let mut buffers = Default::default();
        // SAFETY: a zero-length request carries no gather entry and
        // reaches no memory; in the error state it completes (flushed)
        // after every request posted before it.
        if unsafe { pair.qp.post(&[marker], &mut buffers) }.is_err() {
            continue;
        }
        let mut wcs = [Completion::default(); 16];
        'drain: while Instant::now() < until {
            match pair.cq.poll(&mut wcs) {
                Ok(n) if wcs[..n].iter().any(|wc| wc.wr_id == DRAIN_MARKER) => break 'drain,
                Ok(0) => std::thread::sleep(Duration::from_millis(1)),
                Ok(_) => {}
                Err(_) => break 'drain,
            }
        }
    }
    drop(pairs);
}
