//! Reliable-connected queue pairs: state changes and posting.

use std::io;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::sys::*;

use super::{CompletionQueue, ProtectionDomain, VerbsError, call_error, check_rc};

/// What a peer needs to connect its RC QP to ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    /// The queue pair's number.
    pub qpn: u32,
    /// The packet sequence number it starts sending with (random per
    /// connection).
    pub psn: u32,
    /// Its port's GID, in network byte order.
    pub gid: [u8; 16],
    /// Its port's LID (0 on RoCE).
    pub lid: u16,
}

/// Path parameters for bringing a QP to RTR and RTS.
#[derive(Clone, Copy, Debug)]
pub struct PathConfig {
    /// The local port, numbered from 1.
    pub port: u8,
    /// Index of the local (source) GID in the port's table.
    pub gid_index: u32,
    /// `ibv_mtu` value.
    pub mtu: u32,
    /// Retransmission timers.
    pub timing: QpTiming,
}

/// How a reliable-connected QP retries, in the verbs' own encodings.
///
/// The defaults are perftest's, and sane on real NICs: a lost packet is
/// resent after about 67 ms, and a peer that acknowledges nothing for
/// about half a second (7 tries) fails the work request, which ferry
/// reports as `ConnectionLost`. Soft-RoCE (rxe) treats a retry count of 7
/// as "retry forever", like the RNR retry of 7 everywhere; there only the
/// control session's peer timeout (see docs/operating.md, "Liveness") ends a
/// dead peer's transfers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpTiming {
    /// Local ACK timeout: 4.096 µs × 2^`ack_timeout` (14: 67 ms; 0 means
    /// wait forever). Lower resends sooner on a lossy path, but a value
    /// under the path's round trip resends packets that were not lost.
    pub ack_timeout: u8,
    /// Resends of an unacknowledged packet before the work request fails
    /// (0 to 7).
    pub retry_count: u8,
    /// Resends after the peer said it had no receive buffer ready (0 to 7;
    /// 7: forever). Ferry's notifications are credited, so these are rare.
    pub rnr_retry: u8,
    /// The wait this QP asks of a sender it turns away for lack of a
    /// receive buffer, encoded (12: 0.64 ms).
    pub min_rnr_timer: u8,
}

impl Default for QpTiming {
    fn default() -> Self {
        QpTiming {
            ack_timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    raw: NonNull<ibv_qp>,
    _pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    max_send_wr: u32,
}

// SAFETY: QPs are thread safe for posting and state changes; freed only in Drop.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

/// What a work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOpcode {
    /// `IBV_WR_RDMA_READ`: remote bytes into local memory.
    Read,
    /// `IBV_WR_RDMA_WRITE`: local bytes into remote memory.
    Write,
    /// `IBV_WR_SEND`: local bytes into the buffer of the peer's next posted
    /// receive (the remote address and key are unused).
    Send,
}

/// One work request, as ferry posts it.
#[derive(Clone, Copy, Debug)]
pub struct WorkRequest {
    /// Returned in the request's [`Completion`](super::Completion).
    pub wr_id: u64,
    /// Read or write.
    pub opcode: RdmaOpcode,
    /// Virtual address of the local bytes.
    pub local_addr: u64,
    /// Bytes to move, at most the port's maximum message size.
    pub len: u32,
    /// Key of the memory region holding the local bytes.
    pub lkey: u32,
    /// Virtual address of the remote bytes in the peer's process.
    pub remote_addr: u64,
    /// Key of the peer's memory region holding them.
    pub rkey: u32,
    /// Whether the request gets a completion of its own; an unsignaled one
    /// is retired by the next signaled request on the queue pair.
    pub signaled: bool,
    /// `IBV_SEND_FENCE`: the request starts only once every RDMA READ
    /// posted before it on this queue pair has completed.
    pub fence: bool,
}

impl WorkRequest {
    /// A signaled, zero-length RDMA WRITE: it names no memory at either
    /// end (posted without a gather entry), so it needs no key. Its
    /// completion says the path to the peer works (a probe), or, on a queue
    /// pair in the error state, that everything posted before it flushed.
    pub fn empty_write(wr_id: u64) -> WorkRequest {
        WorkRequest {
            wr_id,
            opcode: RdmaOpcode::Write,
            local_addr: 0,
            len: 0,
            lkey: 0,
            remote_addr: 0,
            rkey: 0,
            signaled: true,
            fence: false,
        }
    }
}

/// Space for [`QueuePair::post`] to build its linked list in, reused from
/// post to post so that posting does not allocate.
#[derive(Default)]
pub struct PostBuffers {
    sges: Vec<ibv_sge>,
    chain: Vec<ibv_send_wr>,
}

// SAFETY: the pointers in `chain` point into these same buffers and are only
// read by the provider during `post`, which holds `&mut self`; between posts
// they are stale and nothing reads them.
unsafe impl Send for PostBuffers {}

impl QueuePair {
    /// Creates an RC QP whose send and receive completions go to `cq`, with
    /// room for `max_send_wr` outstanding sends and `max_recv_wr` posted
    /// receives.
    pub fn new_rc(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        max_send_wr: u32,
        max_recv_wr: u32,
    ) -> Result<Self, VerbsError> {
        // SAFETY: ibv_qp_init_attr is plain data; all-zero is a valid value.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw.as_ptr();
        init.recv_cq = cq.raw.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_send_wr;
        init.cap.max_recv_wr = max_recv_wr.max(1);
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: the PD and CQ are alive and held by the QP.
        let raw = unsafe { ibv_create_qp(pd.raw.as_ptr(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_create_qp"))?;
        // The provider writes the real capacity back into `init.cap`.
        Ok(QueuePair {
            raw,
            _pd: pd.clone(),
            cq: cq.clone(),
            max_send_wr: init.cap.max_send_wr,
        })
    }

    /// The queue pair number a peer connects to.
    pub fn qpn(&self) -> u32 {
        // SAFETY: the QP is alive until Drop.
        unsafe { self.raw.as_ref().qp_num }
    }

    /// Send-queue depth as the provider granted it (at least what was asked).
    pub fn max_send_wr(&self) -> u32 {
        self.max_send_wr
    }

    /// The queue its send and receive completions go to.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    /// The raw `ibv_qp*`.
    ///
    /// # Safety
    ///
    /// Valid while this QP lives; the caller must not destroy it, and must
    /// keep the memory of anything it posts registered until completion.
    pub unsafe fn raw(&self) -> *mut ibv_qp {
        self.raw.as_ptr()
    }

    fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        call: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: the QP is alive; `attr` is valid for the fields in `mask`.
        check_rc(call, unsafe {
            ibv_modify_qp(self.raw.as_ptr(), attr, mask.0 as i32)
        })
    }

    /// RESET -> INIT, allowing remote reads and writes (each MR still
    /// decides what it allows).
    pub fn to_init(&self, port: u8) -> Result<(), VerbsError> {
        // SAFETY: ibv_qp_attr is plain data; all-zero is a valid value.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.port_num = port;
        attr.qp_access_flags = (ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, mask, "ibv_modify_qp(INIT)")
    }

    /// INIT -> RTR: ready to receive from `remote`.
    pub fn to_rtr(&self, remote: &QpEndpoint, path: &PathConfig) -> Result<(), VerbsError> {
        // SAFETY: as in `to_init`.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path.mtu;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 16;
        attr.min_rnr_timer = path.timing.min_rnr_timer;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = path.port;
        attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
        attr.ah_attr.grh.sgid_index = path.gid_index as u8;
        attr.ah_attr.grh.hop_limit = 64;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTR)")
    }

    /// RTR -> RTS: ready to send, starting at packet sequence number `psn`,
    /// retrying as `timing` says.
    pub fn to_rts(&self, psn: u32, timing: &QpTiming) -> Result<(), VerbsError> {
        // SAFETY: as in `to_init`.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = psn;
        attr.timeout = timing.ack_timeout;
        attr.retry_cnt = timing.retry_count;
        attr.rnr_retry = timing.rnr_retry;
        attr.max_rd_atomic = 16;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTS)")
    }

    /// Moves the QP to the error state: outstanding work requests complete
    /// with flush errors, after which the NIC no longer touches their memory.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        // SAFETY: as in `to_init`.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        )
    }

    /// Posts `wrs` as one linked list (one doorbell).
    ///
    /// On failure returns the index of the first request the provider
    /// refused; requests before it were posted.
    ///
    /// # Safety
    ///
    /// Each request's local range must lie in a memory region registered with
    /// this QP's protection domain, and that region (and its memory) must stay
    /// alive until the request's completion — or, for unsignaled requests, a
    /// later signaled one on this QP — has been polled, or until the QP is
    /// destroyed.
    pub unsafe fn post(
        &self,
        wrs: &[WorkRequest],
        buffers: &mut PostBuffers,
    ) -> Result<(), (usize, VerbsError)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let PostBuffers { sges, chain } = buffers;
        sges.clear();
        sges.extend(wrs.iter().map(|wr| ibv_sge {
            addr: wr.local_addr,
            length: wr.len,
            lkey: wr.lkey,
        }));
        chain.clear();
        chain.extend(wrs.iter().map(|wr| {
            // SAFETY: ibv_send_wr is plain data; all-zero is a valid value.
            let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
            w.wr_id = wr.wr_id;
            // A zero-length request carries no gather entry: some providers
            // read an entry of length 0 as 2 GiB.
            w.num_sge = i32::from(wr.len > 0);
            w.opcode = match wr.opcode {
                RdmaOpcode::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                RdmaOpcode::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                RdmaOpcode::Send => ibv_wr_opcode::IBV_WR_SEND,
            };
            if wr.signaled {
                w.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if wr.fence {
                w.send_flags |= ibv_send_flags::IBV_SEND_FENCE.0;
            }
            w.wr.rdma = rdma_t {
                remote_addr: wr.remote_addr,
                rkey: wr.rkey,
            };
            w
        }));
        // All pointers into `sges` and `chain` derive from one base pointer
        // each, taken after both are complete, so none invalidates another
        // and neither moves before the post.
        let sge_base = sges.as_mut_ptr();
        let n = chain.len();
        let base = chain.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < len (and i + 1 < len for `next`), so every pointer
            // stays within its buffer; writes go through `base`, so they
            // invalidate no other pointer.
            unsafe {
                let w = base.add(i);
                (*w).sg_list = sge_base.add(i);
                if i + 1 < n {
                    (*w).next = base.add(i + 1);
                }
            }
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: `chain` and `sges` outlive the call (the provider copies
        // them into the send queue); memory validity is the caller's contract.
        let rc = unsafe { ibv_post_send(self.raw.as_ptr(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: on failure `bad` points into `chain` (or is null).
        let index = if bad.is_null() {
            0
        } else {
            unsafe { bad.offset_from(base) }.max(0) as usize
        };
        Err((
            index,
            VerbsError::Call {
                call: "ibv_post_send",
                source: io::Error::from_raw_os_error(rc),
            },
        ))
    }
}

impl QueuePair {
    /// Posts one receive of up to `len` bytes at `addr` (in the memory
    /// region of `lkey`); its completion carries `wr_id`.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must lie in a memory region of this QP's
    /// protection domain registered with local write, and that memory must
    /// stay alive, and not be read or written by anything else, until the
    /// receive's completion has been polled or the QP is destroyed.
    pub unsafe fn post_recv(
        &self,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
    ) -> Result<(), VerbsError> {
        let mut sge = ibv_sge {
            addr,
            length: len,
            lkey,
        };
        // SAFETY: ibv_recv_wr is plain data; all-zero is a valid value.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: `wr` and `sge` outlive the call (the provider copies them
        // into the receive queue); memory validity is the caller's contract.
        check_rc("ibv_post_recv", unsafe {
            ibv_post_recv(self.raw.as_ptr(), &mut wr, &mut bad)
        })
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new_rc`, destroyed once. After this returns the
        // NIC no longer processes this QP's work requests.
        unsafe { ibv_destroy_qp(self.raw.as_ptr()) };
    }
}
