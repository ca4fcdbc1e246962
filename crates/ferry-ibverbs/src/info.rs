//! The backend's raw verbs handles, for code (a GPU kernel, say) that posts
//! RDMA itself on ferry's device, protection domain and queue pairs.

use std::sync::Arc;

use ferry_core::{Generation, NodeAddr, RegionId};

#[cfg(doc)]
use crate::FOREIGN_WR_ID_BIT;
use crate::connection::PeerQp;
use crate::device::Device;

/// A queue pair as a GPU kernel (or other code posting its own work) needs it.
#[derive(Clone, Debug)]
pub struct IbvQpHandle {
    /// The node at the other end.
    pub peer: NodeAddr,
    /// The local queue pair number.
    pub qpn: u32,
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

/// Keys of one registered region on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IbvRegionKeys {
    /// The region's slot on this node.
    pub id: RegionId,
    /// The region's generation.
    pub generation: Generation,
    /// The key local work requests use for the region's memory.
    pub lkey: u32,
    /// The key peers' work requests use; handles carry it.
    pub rkey: u32,
}

/// The backend's raw verbs handles, for code that posts RDMA itself.
///
/// Every pointer stays valid for as long as this value lives: it holds
/// references that keep the device context, the protection domain and each
/// listed queue pair (and its completion queue) alive.
///
/// Rules for posting through them: give every work request a `wr_id` with
/// [`FOREIGN_WR_ID_BIT`] set (ferry's poller skips such completions — it also
/// polls the CQ, so do not rely on seeing them yourself; signal nothing, or
/// check the remote result); post only on a QP ferry is idle on, since send
/// queue slots are not coordinated; post RDMA READ and WRITE only (a SEND
/// would land in a receive buffer the peer posted for ferry's
/// notifications, and be delivered to its inbox as one); and keep the
/// memory you post registered (hold its `Region`) until the work has
/// completed.
pub struct IbvTransportInfo {
    /// The device's name, e.g. `rxe0`.
    pub device: String,
    /// The port used, numbered from 1.
    pub port: u8,
    /// The GID this node's queue pairs use, in network byte order.
    pub gid: [u8; 16],
    /// The GID's index in the port's table.
    pub gid_index: u32,
    /// The port's LID (0 on RoCE, which addresses by GID).
    pub lid: u16,
    /// `ibv_mtu` value of the port.
    pub mtu: u32,
    /// The queue pairs this node connected to peers, except broken ones.
    pub qps: Vec<IbvQpHandle>,
    /// Queue pairs this node keeps for peers that connected to it, one per
    /// peer's control session.
    pub passive_qps: usize,
    /// Keys of the regions registered when this was taken.
    pub regions: Vec<IbvRegionKeys>,
    device_ref: Arc<Device>,
    _qp_refs: Vec<Arc<PeerQp>>,
}

impl IbvTransportInfo {
    /// Takes the device's details and a handle per queue pair in `qps`,
    /// keeping each alive for as long as this value lives.
    pub(crate) fn new(
        device: &Arc<Device>,
        qps: Vec<Arc<PeerQp>>,
        passive_qps: usize,
        regions: Vec<IbvRegionKeys>,
    ) -> Self {
        IbvTransportInfo {
            device: device.context.name().to_string(),
            port: device.port,
            gid: device.gid,
            gid_index: device.gid_index,
            lid: device.lid,
            mtu: device.mtu,
            qps: qps
                .iter()
                .map(|q| IbvQpHandle {
                    peer: q.peer(),
                    qpn: q.qpn(),
                    // SAFETY: only the pointer values are read; `_qp_refs`
                    // keeps the objects alive.
                    qp: unsafe { q.qp().raw() } as usize,
                    cq: unsafe { q.qp().cq().raw() } as usize,
                })
                .collect(),
            passive_qps,
            regions,
            device_ref: device.clone(),
            _qp_refs: qps,
        }
    }

    /// The raw `ibv_context*`.
    pub fn context(&self) -> *mut rdma_sys::ibv_context {
        // SAFETY: only reads the pointer; `device_ref` keeps it valid.
        unsafe { self.device_ref.context.raw() }
    }

    /// The raw `ibv_pd*` every ferry memory region is registered with.
    pub fn pd(&self) -> *mut rdma_sys::ibv_pd {
        // SAFETY: as above.
        unsafe { self.device_ref.pd.raw() }
    }
}

// SAFETY: the raw pointers are handles to thread-safe verbs objects, kept
// alive by the Arcs held alongside them.
unsafe impl Send for IbvTransportInfo {}

impl std::fmt::Debug for IbvTransportInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvTransportInfo")
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("mtu", &self.mtu)
            .field("qps", &self.qps)
            .field("passive_qps", &self.passive_qps)
            .finish()
    }
}
