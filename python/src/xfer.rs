//! Descriptor lists, prepared remote lists and transfer requests.
//!
//! Lists and index arrays cross from Python as little-endian bytes (an
//! N×3 `u64` array's `tobytes()`, a `u32` index array's): one call and one
//! copy for 100,000 descriptors, no Python object per descriptor.

use std::sync::Arc;

use ferry::{
    Descs, EstimateMethod, Indices, LocalDescList, OpKind, PreparedRemote, RemoteDescList, Xfer,
    XferStatus,
};
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::errors::{self, Raise};
use crate::memory::{NativeRegion, NativeRemote};
use crate::node::NativeNode;
use crate::{block_on, runtime, seconds};

/// Descriptors from `rows` (N×3 little-endian `u64`: region, offset,
/// length) or, with `strided` = (region, base, stride, length, count), the
/// strided form.
fn descs(rows: Option<&[u8]>, strided: Option<(u32, u64, u64, u64, u32)>) -> PyResult<Descs> {
    match (rows, strided) {
        (Some(rows), None) => {
            if rows.len() % 24 != 0 {
                return Err(errors::invalid("descriptor rows are not N×3 u64 values").into());
            }
            let triples: Vec<[u64; 3]> = rows
                .chunks_exact(24)
                .map(|row| {
                    let word = |i: usize| {
                        u64::from_le_bytes(row[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
                    };
                    [word(0), word(1), word(2)]
                })
                .collect();
            Descs::from_triples(&triples).map_err(|e| errors::desc(&e).into())
        }
        (None, Some((region, base, stride, len, count))) => {
            Ok(Descs::strided(region, base, stride, len, count))
        }
        _ => Err(errors::invalid("give descriptor rows or a strided form, not both").into()),
    }
}

/// A descriptor list over this node's regions.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeLocalDescs(LocalDescList);

#[pymethods]
impl NativeLocalDescs {
    /// Descriptors over `regions`: `rows` or `strided` (see `descs`).
    /// Every descriptor is checked against its region now.
    #[new]
    #[pyo3(signature = (regions, rows=None, strided=None))]
    fn new(
        regions: Vec<Py<NativeRegion>>,
        rows: Option<&[u8]>,
        strided: Option<(u32, u64, u64, u64, u32)>,
    ) -> PyResult<Self> {
        let regions = regions
            .iter()
            .map(|r| r.get().region())
            .collect::<PyResult<Vec<_>>>()?;
        LocalDescList::new(regions, descs(rows, strided)?)
            .map(NativeLocalDescs)
            .map_err(|e| errors::desc(&e).into())
    }

    fn __len__(&self) -> usize {
        self.0.descs().len()
    }
}

/// A descriptor list over regions of other nodes (handles).
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeRemoteDescs(RemoteDescList);

#[pymethods]
impl NativeRemoteDescs {
    /// Descriptors over `regions` (handles): `rows` or `strided`.
    #[new]
    #[pyo3(signature = (regions, rows=None, strided=None))]
    fn new(
        regions: Vec<Py<NativeRemote>>,
        rows: Option<&[u8]>,
        strided: Option<(u32, u64, u64, u64, u32)>,
    ) -> PyResult<Self> {
        let regions = regions.iter().map(|r| r.get().0.clone()).collect();
        RemoteDescList::new(regions, descs(rows, strided)?)
            .map(NativeRemoteDescs)
            .map_err(|e| errors::desc(&e).into())
    }

    fn __len__(&self) -> usize {
        self.0.descs().len()
    }

    /// The list as bytes (JSON; a strided list stays a few numbers).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let json = serde_json::to_vec(&self.0)
            .map_err(|e| Raise::new("FerryError", format!("serializing a list: {e}")))?;
        Ok(PyBytes::new(py, &json))
    }

    /// A list from `to_bytes`'s bytes; checked as `new` checks, and refused
    /// as `new` refuses: bytes that are not a list are a `MetadataError`,
    /// a list whose descriptors leave their handles (a `count` raised, an
    /// offset moved) the same error `new` raises for it (`OutOfBounds`).
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        // The list's fields before its checks, so that a failed check keeps
        // its type instead of becoming a deserializer's message.
        let not_a_list = |e: serde_json::Error| {
            Raise::new("MetadataError", format!("not a descriptor list: {e}"))
        };
        let mut fields: serde_json::Value = serde_json::from_slice(data).map_err(not_a_list)?;
        // `get_mut`, not indexing: indexing a JSON value that is not an
        // object panics.
        let mut field = |name| {
            fields
                .get_mut(name)
                .map(serde_json::Value::take)
                .unwrap_or_default()
        };
        let regions: Vec<ferry::RemoteBuffer> =
            serde_json::from_value(field("regions")).map_err(not_a_list)?;
        let descs: ferry::Descs = serde_json::from_value(field("descs")).map_err(not_a_list)?;
        RemoteDescList::new(regions, descs)
            .map(NativeRemoteDescs)
            .map_err(|e| errors::desc(&e).into())
    }
}

/// A remote list prepared for requests (`NativeNode.prepare_remote`).
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativePrepared(PreparedRemote);

#[pymethods]
impl NativePrepared {
    fn __len__(&self) -> usize {
        self.0.list().descs().len()
    }

    /// Each region's transport.
    fn transports(&self) -> Vec<String> {
        self.0.levels().iter().map(|l| l.to_string()).collect()
    }
}

/// Indices from Python: `(start, count)` for a range, or little-endian
/// `u32` bytes.
fn indices(value: &Bound<'_, PyAny>) -> PyResult<Indices> {
    if let Ok(bytes) = value.cast::<PyBytes>() {
        let bytes = bytes.as_bytes();
        if bytes.len() % 4 != 0 {
            return Err(errors::invalid("an index array is not u32 values").into());
        }
        let list: Arc<[u32]> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        return Ok(Indices::List(list));
    }
    if let Ok(tuple) = value.cast::<PyTuple>() {
        let (start, count): (u64, usize) = tuple.extract()?;
        return Ok(Indices::Range { start, count });
    }
    Err(errors::invalid("indices are (start, count) or u32 bytes").into())
}

#[pymethods]
impl NativeNode {
    /// Prepares `list` within `timeout` seconds: routes and connects once.
    fn prepare_remote(
        &self,
        py: Python<'_>,
        list: &NativeRemoteDescs,
        timeout: f64,
    ) -> PyResult<NativePrepared> {
        let timeout = seconds(timeout)?;
        let list = list.0.clone();
        let _guard = runtime().enter();
        block_on(py, self.node.prepare_remote(list, timeout))?
            .map(NativePrepared)
            .map_err(|e| errors::prepare(&e).into())
    }

    /// A request of `local[local_idx[k]]` ↔ `remote[remote_idx[k]]`; every
    /// index and pair checked now.
    #[pyo3(signature = (write, local, local_idx, remote, remote_idx, notification=None))]
    fn make_xfer(
        &self,
        write: bool,
        local: &NativeLocalDescs,
        local_idx: &Bound<'_, PyAny>,
        remote: &NativePrepared,
        remote_idx: &Bound<'_, PyAny>,
        notification: Option<&[u8]>,
    ) -> PyResult<NativeXfer> {
        let kind = if write { OpKind::Write } else { OpKind::Read };
        let xfer = self
            .node
            .make_xfer(
                kind,
                &local.0,
                indices(local_idx)?,
                &remote.0,
                indices(remote_idx)?,
            )
            .map_err(|e| errors::desc(&e))?;
        let xfer = match notification {
            Some(body) => xfer.with_notification(ferry::Bytes::copy_from_slice(body)),
            None => xfer,
        };
        Ok(NativeXfer {
            xfer: Arc::new(xfer),
            node: self.node.clone(),
        })
    }
}

/// A transfer request.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeXfer {
    xfer: Arc<Xfer>,
    node: ferry::Node,
}

impl NativeXfer {
    /// `xfer`, made by `node` (which estimates it).
    pub fn new(xfer: Arc<Xfer>, node: ferry::Node) -> Self {
        NativeXfer { xfer, node }
    }
}

#[pymethods]
impl NativeXfer {
    /// Posts the request with a deadline of `timeout` seconds; returns at
    /// once.
    fn post(&self, timeout: f64) -> PyResult<()> {
        self.xfer
            .post(seconds(timeout)?)
            .map_err(|e| errors::post(&e).into())
    }

    /// ("ready" | "in_progress" | "done" | "failed", the exception or
    /// None); never waits.
    fn status(&self, py: Python<'_>) -> (&'static str, Py<PyAny>) {
        match self.xfer.status() {
            XferStatus::Ready => ("ready", py.None()),
            XferStatus::InProgress => ("in_progress", py.None()),
            XferStatus::Done => ("done", py.None()),
            XferStatus::Failed(error) => ("failed", errors::xfer(&error).into_value(py)),
        }
    }

    /// Waits up to `timeout` seconds (None: the post's own deadline) for
    /// the request to settle: True once done, False if still in progress,
    /// its error raised if it failed. A KeyboardInterrupt cancels it.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let limit = timeout.map(seconds).transpose()?;
        let xfer = self.xfer.clone();
        let waited = block_on(py, async move {
            match limit {
                Some(limit) => tokio::time::timeout(limit, xfer.wait()).await.ok(),
                None => Some(xfer.wait().await),
            }
        });
        match waited {
            Ok(Some(Ok(()))) => Ok(true),
            Ok(Some(Err(error))) => Err(errors::xfer(&error).into()),
            Ok(None) => Ok(false),
            Err(interrupt) => {
                if interrupt.is_instance_of::<PyKeyboardInterrupt>(py) {
                    self.xfer.cancel();
                }
                Err(interrupt)
            }
        }
    }

    /// Calls `callback(None)` or `callback(exception)` from a runtime
    /// thread once the request settles.
    fn wait_then(&self, callback: Py<PyAny>) {
        let xfer = self.xfer.clone();
        runtime().spawn(async move {
            let result = xfer.wait().await.map_err(|e| errors::xfer(&e));
            crate::node::settle(callback, result);
        });
    }

    /// Stops posting; what is in flight (one window at most) finishes.
    fn cancel(&self) {
        self.xfer.cancel();
    }

    /// Ops of the current post that completed.
    #[getter]
    fn completed(&self) -> usize {
        self.xfer.completed()
    }

    /// Bytes the request moves.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.xfer.bytes()
    }

    fn __len__(&self) -> usize {
        self.xfer.len()
    }

    /// (seconds, margin in seconds, "measured" | "configured", samples,
    /// transport).
    fn estimate(&self) -> (f64, f64, &'static str, u64, String) {
        let estimate = self.node.estimate(&self.xfer);
        let (method, samples) = match estimate.method {
            EstimateMethod::Measured { samples } => ("measured", samples),
            EstimateMethod::Configured => ("configured", 0),
        };
        (
            estimate.duration.as_secs_f64(),
            estimate.margin.as_secs_f64(),
            method,
            samples,
            estimate.transport.to_string(),
        )
    }
}
