//! Regions and their handles.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry::{Access, MemoryBlock, Region, RemoteBuffer};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{self, Raise};
use crate::{block_on, seconds};

/// `"r"` or `"rw"`, as the Python layer spells access.
pub fn access(text: &str) -> PyResult<Access> {
    match text {
        "r" => Ok(Access::ReadOnly),
        "rw" => Ok(Access::ReadWrite),
        other => {
            Err(errors::invalid(format!("access {other:?} is neither \"r\" nor \"rw\"")).into())
        }
    }
}

fn access_text(access: Access) -> &'static str {
    match access {
        Access::ReadOnly => "r",
        Access::ReadWrite => "rw",
    }
}

/// A registered region. `close` deregisters it; the bytes stay valid for
/// as long as this object lives (the Python `Region` and every view of it
/// hold it), so no Python view can outlive the memory behind it.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeRegion {
    region: Mutex<Option<Region>>,
    /// What keeps the bytes valid after `close`, for memory ferry
    /// allocated (registered Python memory is kept by the Python object).
    _memory: Option<Arc<MemoryBlock>>,
    addr: u64,
    len: u64,
    access: Access,
    remote: RemoteBuffer,
}

impl NativeRegion {
    /// Wraps a region; `owns_memory`: ferry allocated it.
    pub fn new(region: Region, owns_memory: bool) -> Self {
        NativeRegion {
            _memory: owns_memory.then(|| region.memory().clone()),
            addr: region.memory().addr(),
            len: region.len(),
            access: region.access(),
            remote: region.remote(),
            region: Mutex::new(Some(region)),
        }
    }

    /// The region, unless closed.
    pub fn region(&self) -> PyResult<Region> {
        self.region
            .lock()
            .expect("a region's lock is never held across a panic")
            .clone()
            .ok_or_else(|| Raise::new("RegionGone", "the region was closed").into())
    }
}

#[pymethods]
impl NativeRegion {
    /// Address of the first byte.
    #[getter]
    fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    #[getter]
    fn len(&self) -> u64 {
        self.len
    }

    /// `"r"` or `"rw"`: the most a remote handle allows.
    #[getter]
    fn access(&self) -> &'static str {
        access_text(self.access)
    }

    /// Whether `close` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.region.lock().expect("never poisoned").is_none()
    }

    /// A handle to the whole region.
    fn remote(&self) -> NativeRemote {
        NativeRemote(self.remote.clone())
    }

    /// Deregisters the region and waits, up to `timeout` seconds, until no
    /// transfer can touch its memory any more. Returns whether that moment
    /// came; if not, it comes by itself. Closing twice does nothing.
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let deadline = Instant::now() + seconds(timeout)?;
        let taken = self.region.lock().expect("never poisoned").take();
        let Some(region) = taken else {
            return Ok(true);
        };
        if self._memory.is_some() {
            // ferry's own memory: this object keeps it; once the region is
            // dropped no peer reaches it.
            drop(region);
            return Ok(true);
        }
        let closed = block_on(py, region.close(deadline.into()))?;
        Ok(closed.is_ok())
    }
}

/// A handle to a region of some node: serializable, sliceable.
#[pyclass(module = "ferry._ferry", frozen)]
#[derive(Clone)]
pub struct NativeRemote(pub RemoteBuffer);

#[pymethods]
impl NativeRemote {
    /// The handle as bytes (JSON), for another process.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let json = serde_json::to_vec(&self.0)
            .map_err(|e| Raise::new("FerryError", format!("serializing a handle: {e}")))?;
        Ok(PyBytes::new(py, &json))
    }

    /// A handle from `to_bytes`'s bytes.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        serde_json::from_slice(data)
            .map(NativeRemote)
            .map_err(|e| Raise::new("MetadataError", format!("not a region handle: {e}")).into())
    }

    /// Length in bytes.
    #[getter]
    fn len(&self) -> u64 {
        self.0.len()
    }

    /// `"r"` or `"rw"`.
    #[getter]
    fn access(&self) -> &'static str {
        access_text(self.0.access())
    }

    /// The owner: (endpoint, node id).
    #[getter]
    fn owner(&self) -> (String, String) {
        crate::node::addr_tuple(self.0.owner())
    }

    /// The bytes `start..stop` of the region.
    fn slice(&self, start: u64, stop: u64) -> PyResult<Self> {
        self.0
            .slice(start..stop)
            .map(NativeRemote)
            .map_err(|e| errors::op(&e).into())
    }

    /// The same bytes, for reads only.
    fn read_only(&self) -> Self {
        NativeRemote(self.0.read_only())
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn __repr__(&self) -> String {
        format!(
            "RemoteRegion({} bytes, {}, region {} generation {} of {})",
            self.0.len(),
            access_text(self.0.access()),
            self.0.region(),
            self.0.generation(),
            self.0.owner()
        )
    }
}

/// Wraps `len` bytes at `addr` that `keep_alive` (a Python object holding a
/// buffer export on them) keeps valid.
///
/// # Safety
///
/// `addr..addr+len` must stay valid for reads and writes for as long as
/// `keep_alive` lives: the Python layer passes the address of a writable,
/// C-contiguous buffer and, as `keep_alive`, the export that pins it.
pub unsafe fn external_block(addr: u64, len: u64, keep_alive: Py<PyAny>) -> PyResult<MemoryBlock> {
    let ptr = std::ptr::NonNull::new(addr as *mut u8)
        .ok_or_else(|| errors::invalid("a buffer at address 0"))?;
    // SAFETY: the caller's contract (above) is `from_raw`'s: the memory stays
    // valid until `keep_alive` drops, and ferry drops it only after the last
    // transfer that touches the memory.
    unsafe { MemoryBlock::from_raw(ptr, len, Box::new(keep_alive)) }
        .map_err(|e| errors::register(&e).into())
}
