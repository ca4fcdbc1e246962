//! Safe RAII wrappers over the ibverbs C API: the only module of ferry that
//! calls into `rdma-sys` or holds raw verbs pointers. libibverbs itself is
//! loaded at run time ([`sys`]): a host without it has no RDMA device.
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
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use ferry_core::{Access, MemoryBlock};
use sys::*;

/// A verbs call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// `ibv_get_device_list` found nothing usable: the normal situation on a
    /// host without an RDMA NIC. Also where libibverbs is not installed
    /// (the reason then starts with `libibverbs not found`).
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
    sys::load().map_err(|why| VerbsError::NoDevice(format!("libibverbs not found ({why})")))?;
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

    /// Whether the device is software (soft-RoCE, siw) rather than a NIC:
    /// the host's own CPU then does the NIC's work, acknowledgements
    /// included. Told by where sysfs files it: under
    /// `/sys/devices/virtual`, not under a bus.
    pub fn is_software(&self) -> bool {
        is_software_device(Path::new(SYSFS_CLASS), &self.name)
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
        Self::register_with(pd, memory, flags)
    }

    /// Registers the whole block for this node's own work requests only
    /// (local write: receive buffers, SEND sources): no key a peer could
    /// name it with grants any remote access.
    pub fn register_local(
        pd: &Arc<ProtectionDomain>,
        memory: Arc<MemoryBlock>,
    ) -> Result<Self, VerbsError> {
        Self::register_with(pd, memory, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE)
    }

    fn register_with(
        pd: &Arc<ProtectionDomain>,
        memory: Arc<MemoryBlock>,
        flags: ibv_access_flags,
    ) -> Result<Self, VerbsError> {
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

mod cq;
mod events;
mod qp;
pub mod sys;

pub use cq::{Completion, CompletionChannel, CompletionQueue};
pub use events::DeviceEvent;
pub use qp::{PathConfig, PostBuffers, QpEndpoint, QpTiming, QueuePair, RdmaOpcode, WorkRequest};

/// Where the kernel lists RDMA devices, one entry per device name.
pub(crate) const SYSFS_CLASS: &str = "/sys/class/infiniband";

/// Whether the device `name` under the sysfs class folder `class` is a
/// software one. The kernel files a device with no hardware under it (rxe,
/// siw) in `/sys/devices/virtual`; a NIC's entry sits under its bus (PCI).
/// An entry that cannot be resolved counts as hardware: the default then
/// is what a NIC wants.
pub(crate) fn is_software_device(class: &Path, name: &str) -> bool {
    std::fs::canonicalize(class.join(name))
        .is_ok_and(|path| path.components().any(|c| c.as_os_str() == "virtual"))
}

#[cfg(test)]
mod tests {
    use super::is_software_device;

    #[test]
    fn a_device_filed_under_virtual_is_software_and_one_under_a_bus_is_not() {
        let root = std::env::temp_dir().join(format!("ferry-sysfs-{}", std::process::id()));
        let class = root.join("class/infiniband");
        let soft = root.join("devices/virtual/infiniband/rxe0");
        let nic = root.join("devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0");
        for dir in [&class, &soft, &nic] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::os::unix::fs::symlink(&soft, class.join("rxe0")).unwrap();
        std::os::unix::fs::symlink(&nic, class.join("mlx5_0")).unwrap();
        let answers = (
            is_software_device(&class, "rxe0"),
            is_software_device(&class, "mlx5_0"),
            is_software_device(&class, "missing0"),
        );
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(answers, (true, false, false));
    }
}
