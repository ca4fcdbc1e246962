//! Safe RAII wrappers over the ibverbs C API: the only module of ferry that
//! calls into `rdma-sys` or holds raw verbs pointers.
//!
//! Lifetimes follow the verbs object hierarchy and are enforced with `Arc`s:
//! a queue pair holds its completion queue and protection domain, a memory
//! region holds its protection domain *and the memory it maps*, and both the
//! protection domain and the completion queue hold the device context. So no
//! object is destroyed while one created from it is alive, and no registered
//! byte is freed while its memory region exists.
//!
//! libibverbs is thread safe: every object may be used from any thread.

use std::ffi::CStr;
use std::io;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use ferry_core::{Access, MemoryBlock};
use rdma_sys::*;

/// A verbs call failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// `ibv_get_device_list` found nothing usable: the normal situation on a
    /// host without an RDMA NIC.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// Devices exist, but none has the name asked for.
    #[error("RDMA device {0} not found")]
    DeviceNotFound(String),
    /// A verbs call failed, or a device, port or GID turned out unusable.
    #[error("{call} failed: {source}")]
    Call {
        /// The call (or check) that failed, e.g. `ibv_reg_mr`.
        call: &'static str,
        /// Its errno, or what was wrong.
        source: io::Error,
    },
    /// The port has no IPv4-mapped GID to pick by default (an InfiniBand or
    /// IPv6-only port): name a GID index explicitly.
    #[error("port {port} has no IPv4-mapped (RoCE v2) GID")]
    NoIpv4Gid {
        /// The port, numbered from 1.
        port: u8,
    },
}

/// `IBV_LINK_LAYER_ETHERNET` from an anonymous enum in `<infiniband/verbs.h>`
/// (UNSPECIFIED = 0, INFINIBAND = 1, ETHERNET = 2), which rdma-sys does not bind.
const LINK_LAYER_ETHERNET: u8 = 2;

fn call_error(call: &'static str) -> VerbsError {
    VerbsError::Call {
        call,
        source: io::Error::last_os_error(),
    }
}

/// Verbs calls that return an errno value (not -1 with errno set).
fn check_rc(call: &'static str, rc: i32) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc => Err(VerbsError::Call {
            call,
            source: io::Error::from_raw_os_error(rc.abs()),
        }),
    }
}

/// Runs `f` over this host's devices, as (name, device) pairs. The device
/// pointers are valid only during `f`: the list is freed right after.
fn with_devices<R>(f: impl FnOnce(&[(String, *mut ibv_device)]) -> R) -> Result<R, VerbsError> {
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { ibv_get_device_list(&mut count) };
    if list.is_null() {
        // A host without /sys/class/infiniband reports ENOSYS here.
        return Err(VerbsError::NoDevice(format!(
            "ibv_get_device_list: {}",
            io::Error::last_os_error()
        )));
    }
    let devices: Vec<(String, *mut ibv_device)> = (0..count.max(0) as usize)
        .map(|i| {
            // SAFETY: `list` holds `count` valid device pointers; the name is a
            // NUL-terminated string owned by the device, copied out here.
            unsafe {
                let device = *list.add(i);
                let name = CStr::from_ptr(ibv_get_device_name(device))
                    .to_string_lossy()
                    .into_owned();
                (name, device)
            }
        })
        .collect();
    let result = f(&devices);
    // SAFETY: `list` came from ibv_get_device_list and is freed exactly once;
    // no device pointer from it outlives `f`.
    unsafe { ibv_free_device_list(list) };
    Ok(result)
}

/// Names of the RDMA devices on this host.
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    with_devices(|devices| devices.iter().map(|(name, _)| name.clone()).collect())
}

/// An open device.
pub struct Context {
    raw: NonNull<ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread safe; the pointer is only freed in Drop.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

/// The device limits ferry sizes its queues by.
#[derive(Clone, Copy, Debug)]
pub struct DeviceLimits {
    /// Most work requests one queue of a queue pair can hold.
    pub max_qp_wr: u32,
    /// Most entries one completion queue can hold.
    pub max_cqe: u32,
    /// Most scatter/gather entries one work request can carry.
    pub max_sge: u32,
    /// Longest memory region, in bytes.
    pub max_mr_size: u64,
    /// Number of ports, numbered from 1.
    pub ports: u8,
}

/// The state of one port.
#[derive(Clone, Copy, Debug)]
pub struct PortInfo {
    /// Whether the port is up (`IBV_PORT_ACTIVE`); queue pairs cannot use it
    /// otherwise.
    pub active: bool,
    /// `ibv_mtu` value (1 = 256 B ... 5 = 4096 B).
    pub active_mtu: u32,
    /// Largest message one work request may carry, in bytes.
    pub max_msg_size: u32,
    /// The port's LID (0 on RoCE, which addresses by GID).
    pub lid: u16,
    /// Entries in the GID table, unused (all-zero) ones included.
    pub gid_table_len: u32,
    /// Whether the link layer is Ethernet (RoCE) rather than InfiniBand.
    pub ethernet: bool,
}

impl PortInfo {
    /// The active MTU in bytes.
    pub fn active_mtu_bytes(&self) -> u32 {
        128 << self.active_mtu
    }
}

impl Context {
    /// Opens the named device, or the first one when `name` is `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Context>, VerbsError> {
        with_devices(|devices| {
            if devices.is_empty() {
                return Err(VerbsError::NoDevice(
                    "ibv_get_device_list: no devices".into(),
                ));
            }
            let (dev_name, device) = devices
                .iter()
                .find(|(dev_name, _)| name.is_none_or(|n| n == dev_name))
                .ok_or_else(|| VerbsError::DeviceNotFound(name.unwrap_or("(any)").to_string()))?;
            // SAFETY: `device` is valid while `with_devices` runs `f`; the
            // context returned stays valid after the list is freed (documented
            // by libibverbs).
            let raw = unsafe { ibv_open_device(*device) };
            NonNull::new(raw)
                .map(|raw| {
                    Arc::new(Context {
                        raw,
                        name: dev_name.clone(),
                    })
                })
                .ok_or_else(|| call_error("ibv_open_device"))
        })?
    }

    /// The device's name, e.g. `rxe0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw context, for code that posts work itself (e.g. a GPU kernel).
    ///
    /// # Safety
    ///
    /// Valid while this `Context` lives; the caller must not close it.
    pub unsafe fn raw(&self) -> *mut ibv_context {
        self.raw.as_ptr()
    }

    /// The device's limits (`ibv_query_device`).
    pub fn limits(&self) -> Result<DeviceLimits, VerbsError> {
        // SAFETY: ibv_device_attr is plain data; all-zero is a valid value.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        check_rc("ibv_query_device", unsafe {
            ibv_query_device(self.raw.as_ptr(), &mut attr)
        })?;
        Ok(DeviceLimits {
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_cqe: attr.max_cqe.max(0) as u32,
            max_sge: attr.max_sge.max(0) as u32,
            max_mr_size: attr.max_mr_size,
            ports: attr.phys_port_cnt,
        })
    }

    /// The state of `port`, numbered from 1 (`ibv_query_port`).
    pub fn port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        // SAFETY: ibv_port_attr is plain data; all-zero is a valid value.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer of the
        // size the provider is told.
        check_rc("ibv_query_port", unsafe {
            ___ibv_query_port(self.raw.as_ptr(), port, &mut attr)
        })?;
        Ok(PortInfo {
            active: attr.state == ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: attr.active_mtu,
            max_msg_size: attr.max_msg_sz,
            lid: attr.lid,
            gid_table_len: attr.gid_tbl_len.max(0) as u32,
            ethernet: attr.link_layer == LINK_LAYER_ETHERNET,
        })
    }

    /// Entry `index` of `port`'s GID table, in network byte order; all zeros
    /// for an unused entry.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        // SAFETY: ibv_gid is 16 plain bytes.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` is a valid out-pointer.
        check_rc("ibv_query_gid", unsafe {
            ibv_query_gid(self.raw.as_ptr(), port, index as i32, &mut gid)
        })?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { gid.raw })
    }

    /// The first IPv4-mapped GID (`::ffff:a.b.c.d`) of `port`: the RoCE v2
    /// address ferry uses by default.
    pub fn ipv4_gid(&self, port: u8) -> Result<(u32, [u8; 16]), VerbsError> {
        const V4_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
        for index in 0..self.port(port)?.gid_table_len {
            match self.gid(port, index) {
                Ok(gid) if gid[..12] == V4_PREFIX => return Ok((index, gid)),
                _ => continue,
            }
        }
        Err(VerbsError::NoIpv4Gid { port })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object created from this context holds an Arc to it,
        // so none is left when this runs.
        unsafe { ibv_close_device(self.raw.as_ptr()) };
    }
}

/// A protection domain: memory regions and queue pairs work together only
/// within one. Keeps its context open.
pub struct ProtectionDomain {
    raw: NonNull<ibv_pd>,
    context: Arc<Context>,
}

// SAFETY: protection domains are thread safe; freed only in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a domain on `context` (`ibv_alloc_pd`).
    pub fn new(context: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open.
        let raw = unsafe { ibv_alloc_pd(context.raw.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_alloc_pd"))?;
        Ok(Arc::new(ProtectionDomain {
            raw,
            context: context.clone(),
        }))
    }

    /// The device the domain belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The raw `ibv_pd*`.
    ///
    /// # Safety
    ///
    /// Valid while this domain lives; the caller must not deallocate it.
    pub unsafe fn raw(&self) -> *mut ibv_pd {
        self.raw.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this domain holds an Arc to it.
        unsafe { ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}

/// A registration of a `MemoryBlock` with a protection domain. It keeps the
/// block alive: the NIC may access the bytes for as long as the MR exists.
pub struct MemoryRegion {
    raw: NonNull<ibv_mr>,
    _pd: Arc<ProtectionDomain>,
    memory: Arc<MemoryBlock>,
}

// SAFETY: an MR is immutable after registration; freed only in Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers the whole block. Local write and remote read are always
    /// granted; remote write only for `Access::ReadWrite`, so the NIC itself
    /// refuses writes through a read-only region's key.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        memory: Arc<MemoryBlock>,
        access: Access,
    ) -> Result<Self, VerbsError> {
        let mut flags =
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        if access.allows_write() {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: the block's range is valid memory for as long as `memory`
        // lives, and this MR holds `memory` until it is deregistered.
        let raw = unsafe {
            ibv_reg_mr(
                pd.raw.as_ptr(),
                memory.as_ptr().cast(),
                // A block's length always fits usize (MemoryBlock checks).
                memory.len() as usize,
                flags.0 as i32,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_reg_mr"))?;
        Ok(MemoryRegion {
            raw,
            _pd: pd.clone(),
            memory,
        })
    }

    /// The key this node's work requests name the memory with.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until Drop.
        unsafe { self.raw.as_ref().lkey }
    }

    /// The key peers' work requests name the memory with; handles carry it.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { self.raw.as_ref().rkey }
    }

    /// The registered bytes, kept alive by this MR.
    pub fn memory(&self) -> &Arc<MemoryBlock> {
        &self.memory
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered exactly once. The
        // memory (held in `self.memory`) is released only after this.
        unsafe { ibv_dereg_mr(self.raw.as_ptr()) };
    }
}

/// A completion event channel: a file descriptor that becomes readable when
/// an armed completion queue gets a completion.
pub struct CompletionChannel {
    raw: NonNull<ibv_comp_channel>,
    _context: Arc<Context>,
}

// SAFETY: completion channels are thread safe; freed only in Drop.
unsafe impl Send for CompletionChannel {}
// SAFETY: as above.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    /// Creates a channel on `context` (`ibv_create_comp_channel`).
    pub fn new(context: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open.
        let raw = unsafe { ibv_create_comp_channel(context.raw.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_create_comp_channel"))?;
        Ok(Arc::new(CompletionChannel {
            raw,
            _context: context.clone(),
        }))
    }

    /// The file descriptor to wait on; owned by the channel, do not close it.
    pub fn fd(&self) -> i32 {
        // SAFETY: the channel is alive until Drop.
        unsafe { self.raw.as_ref().fd }
    }

    /// Makes `take_event` return instead of blocking when no event is pending,
    /// so the fd can be driven by an async reactor.
    pub fn set_nonblocking(&self) -> Result<(), VerbsError> {
        let fd = self.fd();
        // SAFETY: fcntl on a file descriptor this channel owns; only the
        // O_NONBLOCK status flag is changed.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            Err(call_error("fcntl(O_NONBLOCK)"))
        } else {
            Ok(())
        }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc to it.
        unsafe { ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// One work completion, decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` the work request was posted with.
    pub wr_id: u64,
    /// `ibv_wc_status` value; 0 is success.
    pub status: u32,
    /// Number of the local queue pair the request was posted on.
    pub qp_num: u32,
}

impl Completion {
    /// Whether the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The peer's NIC refused the access: a wrong rkey, a range outside the
    /// memory region, or an access its registration does not grant.
    pub fn is_remote_access_error(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }

    /// The request was flushed because its queue pair went to the error
    /// state; it may have run partly, and its memory is no longer touched.
    pub fn is_flush(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    /// The peer stopped answering (transport or RNR retries exhausted).
    pub fn is_retry_exceeded(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_RETRY_EXC_ERR
            || self.status == ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR
    }

    /// The status as libibverbs describes it, for error messages.
    pub fn status_str(&self) -> String {
        // SAFETY: returns a static NUL-terminated string for any status.
        unsafe { CStr::from_ptr(ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A completion queue, optionally raising events on a
/// [`CompletionChannel`]. Keeps its context and channel alive.
pub struct CompletionQueue {
    raw: NonNull<ibv_cq>,
    _context: Arc<Context>,
    channel: Option<Arc<CompletionChannel>>,
    entries: u32,
}

// SAFETY: CQs are thread safe; freed only in Drop.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Creates a queue with room for at least `entries` completions; an armed
    /// queue signals `channel`, if given.
    pub fn new(
        context: &Arc<Context>,
        entries: u32,
        channel: Option<Arc<CompletionChannel>>,
    ) -> Result<Arc<Self>, VerbsError> {
        let channel_ptr = channel.as_ref().map_or(ptr::null_mut(), |c| c.raw.as_ptr());
        // SAFETY: the context is open; the channel (if any) is held by the CQ.
        let raw = unsafe {
            ibv_create_cq(
                context.raw.as_ptr(),
                entries as i32,
                ptr::null_mut(),
                channel_ptr,
                0,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_create_cq"))?;
        // SAFETY: the CQ was just created; `cqe` is the real capacity.
        let entries = unsafe { raw.as_ref().cqe }.max(0) as u32;
        Ok(Arc::new(CompletionQueue {
            raw,
            _context: context.clone(),
            channel,
            entries,
        }))
    }

    /// Real capacity (at least what was asked for).
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The channel its events go to, if it was created with one.
    pub fn channel(&self) -> Option<&Arc<CompletionChannel>> {
        self.channel.as_ref()
    }

    /// The raw `ibv_cq*`.
    ///
    /// # Safety
    ///
    /// Valid while this CQ lives; the caller must not destroy it.
    pub unsafe fn raw(&self) -> *mut ibv_cq {
        self.raw.as_ptr()
    }

    /// Fills `out` with up to `out.len()` completions; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        // Not zeroed: this runs in busy-poll loops, and the provider writes
        // every entry it reports.
        let mut wcs = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; BATCH];
        let mut total = 0;
        while total < out.len() {
            let want = (out.len() - total).min(BATCH);
            // SAFETY: `wcs` has room for `want` entries; the CQ is alive.
            let n = unsafe { ibv_poll_cq(self.raw.as_ptr(), want as i32, wcs[0].as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::Call {
                    call: "ibv_poll_cq",
                    source: io::Error::from_raw_os_error(-n),
                });
            }
            let n = n as usize;
            for (slot, wc) in out[total..total + n].iter_mut().zip(&wcs) {
                // SAFETY: ibv_poll_cq filled the first `n` entries.
                let wc = unsafe { wc.assume_init_ref() };
                *slot = Completion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    qp_num: wc.qp_num,
                };
            }
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    /// Asks for an event on the channel at the next completion.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is alive.
        check_rc("ibv_req_notify_cq", unsafe {
            ibv_req_notify_cq(self.raw.as_ptr(), 0)
        })
    }

    /// Consumes one pending event from the channel (non-blocking when the
    /// channel fd is non-blocking) and acknowledges it. Returns whether there
    /// was one.
    pub fn take_event(&self) -> Result<bool, VerbsError> {
        let Some(channel) = &self.channel else {
            return Ok(false);
        };
        let mut cq = ptr::null_mut();
        let mut context = ptr::null_mut();
        // SAFETY: the channel is alive; out-pointers are valid.
        let rc = unsafe { ibv_get_cq_event(channel.raw.as_ptr(), &mut cq, &mut context) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(false),
                _ => Err(VerbsError::Call {
                    call: "ibv_get_cq_event",
                    source: e,
                }),
            };
        }
        // SAFETY: `cq` is the CQ the event was for (this one, as the channel is
        // used by this CQ only); one event is acknowledged.
        unsafe { ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it.
        unsafe { ibv_destroy_cq(self.raw.as_ptr()) };
    }
}

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

/// Path parameters for bringing a QP to RTR.
#[derive(Clone, Copy, Debug)]
pub struct PathConfig {
    /// The local port, numbered from 1.
    pub port: u8,
    /// Index of the local (source) GID in the port's table.
    pub gid_index: u32,
    /// `ibv_mtu` value.
    pub mtu: u32,
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

/// Direction of a one-sided work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOpcode {
    /// `IBV_WR_RDMA_READ`: remote bytes into local memory.
    Read,
    /// `IBV_WR_RDMA_WRITE`: local bytes into remote memory.
    Write,
}

/// One one-sided work request, as ferry posts it.
#[derive(Clone, Copy, Debug)]
pub struct WorkRequest {
    /// Returned in the request's [`Completion`].
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
    /// Creates an RC QP whose send and receive completions go to `cq`.
    pub fn new_rc(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        max_send_wr: u32,
    ) -> Result<Self, VerbsError> {
        // SAFETY: ibv_qp_init_attr is plain data; all-zero is a valid value.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw.as_ptr();
        init.recv_cq = cq.raw.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_send_wr;
        init.cap.max_recv_wr = 1;
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
        attr.min_rnr_timer = 12;
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

    /// RTR -> RTS: ready to send, starting at packet sequence number `psn`.
    pub fn to_rts(&self, psn: u32) -> Result<(), VerbsError> {
        // SAFETY: as in `to_init`.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = psn;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
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
            w.num_sge = 1;
            w.opcode = match wr.opcode {
                RdmaOpcode::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                RdmaOpcode::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            };
            w.send_flags = if wr.signaled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
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

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new_rc`, destroyed once. After this returns the
        // NIC no longer processes this QP's work requests.
        unsafe { ibv_destroy_qp(self.raw.as_ptr()) };
    }
}
