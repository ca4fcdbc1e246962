//! The backend's raw verbs handles, for code (a GPU kernel, say) that posts
//! RDMA itself on ferry's device, protection domain and queue pairs.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::{Generation, NodeAddr, RailKeys, RegionId};

#[cfg(doc)]
use crate::FOREIGN_WR_ID_BIT;
use crate::connection::PeerQp;
use crate::device::{Fabric, Rail};
use crate::placement::RailSet;

/// A queue pair as a GPU kernel (or other code posting its own work) needs it.
#[derive(Clone, Debug)]
pub struct IbvQpHandle {
    /// The node at the other end.
    pub peer: NodeAddr,
    /// The local queue pair number.
    pub qpn: u32,
    /// The rail (index into [`IbvTransportInfo::rails`]) it is on.
    pub rail: u8,
    /// The peer's rail at the other end (an index on the peer's node).
    pub remote_rail: u8,
    /// The path MTU in bytes: the smaller of both ends' ports'.
    pub mtu: u32,
    qp: usize,
    cq: usize,
}

impl IbvQpHandle {
    /// The raw `ibv_qp*`. Valid while the `IbvTransportInfo` it came from
    /// lives; do not destroy or modify it.
    pub fn qp(&self) -> *mut rdma_sys::ibv_qp {
        self.qp as *mut _
    }

    /// The raw `ibv_cq*` its send completions go to. Same validity.
    pub fn cq(&self) -> *mut rdma_sys::ibv_cq {
        self.cq as *mut _
    }
}

/// Keys of one registered region, on each rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IbvRegionKeys {
    /// The region's slot on this node.
    pub id: RegionId,
    /// The region's generation.
    pub generation: Generation,
    /// The keys local work requests use for the region's memory, by rail.
    pub lkeys: RailKeys,
    /// The keys peers' work requests use, by rail; handles carry them.
    pub rkeys: RailKeys,
    /// The NUMA node of the region's memory, where the kernel said and
    /// the node has several rails to place it on.
    pub numa_node: Option<u32>,
    /// The rails its ops may take: every rail, or those it was pinned to
    /// ([`crate::IbvBackend::pin_rails`]).
    pub allowed: RailSet,
    /// The rails among those its ops take first (see [`crate::Placement`]).
    pub preferred: RailSet,
}

/// One rail: a port of an RDMA device this node moves bytes on.
pub struct IbvRailInfo {
    /// Its index: handles carry its key at this place.
    pub index: u8,
    /// The device's name, e.g. `mlx5_0` or `rxe0`.
    pub device: String,
    /// The port, numbered from 1.
    pub port: u8,
    /// The GID its queue pairs use, in network byte order.
    pub gid: [u8; 16],
    /// The GID's index in the port's table.
    pub gid_index: u32,
    /// The port's LID (0 on RoCE, which addresses by GID).
    pub lid: u16,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: &'static str,
    /// The port's active MTU in bytes.
    pub mtu: u32,
    /// The port's rate as the kernel words it, e.g. `100 Gb/sec (4X EDR)`.
    pub rate: String,
    /// The device's NUMA node, where the platform says.
    pub numa_node: Option<u32>,
    /// The netdev behind the GID (RoCE), e.g. `eth2`.
    pub netdev: Option<String>,
    /// Work requests posted on this rail since the node started.
    pub posted_wrs: u64,
    /// Bytes those work requests moved (or were to move).
    pub posted_bytes: u64,
    /// Whether its port reported its link down and not up since: its
    /// pairs are then failed where a peer has other pairs, and not
    /// repaired until it is up.
    pub down: bool,
    rail_ref: Arc<Rail>,
}

impl IbvRailInfo {
    /// The raw `ibv_context*` of the rail's device.
    pub fn context(&self) -> *mut rdma_sys::ibv_context {
        // SAFETY: only reads the pointer; `rail_ref` keeps it valid.
        unsafe { self.rail_ref.context.raw() }
    }

    /// The raw `ibv_pd*` every ferry memory region on this rail's device
    /// is registered with.
    pub fn pd(&self) -> *mut rdma_sys::ibv_pd {
        // SAFETY: as above.
        unsafe { self.rail_ref.pd.raw() }
    }
}

impl std::fmt::Debug for IbvRailInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvRailInfo")
            .field("index", &self.index)
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("link_layer", &self.link_layer)
            .field("mtu", &self.mtu)
            .field("rate", &self.rate)
            .field("numa_node", &self.numa_node)
            .field("netdev", &self.netdev)
            .field("posted_wrs", &self.posted_wrs)
            .field("posted_bytes", &self.posted_bytes)
            .finish()
    }
}

/// The backend's rails and raw verbs handles, for reading (`ferry info`,
/// metrics) and for code that posts RDMA itself.
///
/// Every pointer stays valid for as long as this value lives: it holds
/// references that keep each device context, protection domain and listed
/// queue pair (and its completion queue) alive.
///
/// The queue pairs listed are ferry's own, for reading: code that posts
/// itself takes queue pairs of its own with
/// [`IbvBackend::lease`](crate::IbvBackend::lease), which ferry neither
/// posts on nor polls. Posting on these anyway: give every work request a
/// `wr_id` with [`FOREIGN_WR_ID_BIT`] set (ferry's poller skips such
/// completions), post only where ferry is idle (send-queue slots are not
/// coordinated), RDMA READ and WRITE only, with the keys of the QP's rails
/// (`lkeys[qp.rail]`, the handle's `rkeys[qp.remote_rail]`), and keep the
/// memory registered (hold its `Region`) until the work has completed.
pub struct IbvTransportInfo {
    /// Every rail, in rail order.
    pub rails: Vec<IbvRailInfo>,
    /// The queue pairs this node connected to peers, one per rail pair in
    /// use, except broken ones.
    pub qps: Vec<IbvQpHandle>,
    /// Queue pairs this node keeps for peers that connected to it, one per
    /// peer's control session and rail pair.
    pub passive_qps: usize,
    /// Keys of the regions registered when this was taken.
    pub regions: Vec<IbvRegionKeys>,
    _qp_refs: Vec<Arc<PeerQp>>,
}

impl IbvTransportInfo {
    /// Takes the rails' details and a handle per queue pair in `qps`,
    /// keeping each alive for as long as this value lives.
    pub(crate) fn new(
        fabric: &Arc<Fabric>,
        qps: Vec<Arc<PeerQp>>,
        passive_qps: usize,
        regions: Vec<IbvRegionKeys>,
    ) -> Self {
        IbvTransportInfo {
            rails: fabric
                .rails
                .iter()
                .map(|r| IbvRailInfo {
                    index: r.index,
                    device: r.context.name().to_string(),
                    port: r.port,
                    gid: r.gid,
                    gid_index: r.gid_index,
                    lid: r.lid,
                    link_layer: if r.ethernet { "Ethernet" } else { "InfiniBand" },
                    mtu: 128 << r.mtu,
                    rate: r.rate.clone(),
                    numa_node: r.numa_node,
                    netdev: r.netdev.clone(),
                    posted_wrs: r.posted_wrs.load(Ordering::Relaxed),
                    posted_bytes: r.posted_bytes.load(Ordering::Relaxed),
                    down: r.is_down(),
                    rail_ref: r.clone(),
                })
                .collect(),
            qps: qps
                .iter()
                .map(|q| IbvQpHandle {
                    peer: q.peer(),
                    qpn: q.qpn(),
                    rail: q.rail().index,
                    remote_rail: q.remote_rail(),
                    mtu: 128 << q.mtu(),
                    // SAFETY: only the pointer values are read; `_qp_refs`
                    // keeps the objects alive.
                    qp: unsafe { q.qp().raw() } as usize,
                    cq: unsafe { q.qp().cq().raw() } as usize,
                })
                .collect(),
            passive_qps,
            regions,
            _qp_refs: qps,
        }
    }
}

// SAFETY: the raw pointers are handles to thread-safe verbs objects, kept
// alive by the Arcs held alongside them.
unsafe impl Send for IbvTransportInfo {}

impl std::fmt::Debug for IbvTransportInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvTransportInfo")
            .field("rails", &self.rails)
            .field("qps", &self.qps)
            .field("passive_qps", &self.passive_qps)
            .finish()
    }
}
