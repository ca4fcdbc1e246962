//! Layouts and plans: the Python layer builds each rank's layout (from numpy
//! arrays) and passes it here as the JSON that `ferry_layout::RankLayout`'s
//! serde form is, the one a peer process receives too. Plans are made,
//! checked and expanded here, in Rust; block tables cross as little-endian
//! `u64` bytes (one copy, no Python object per block), descriptor lists and
//! NIXL index arrays come back the same way.

use std::ops::Range;
use std::sync::Arc;

use ferry::layout::{
    Direction, Expansion, NixlIndices, NixlShape, Plan, PlanOptions, RankLayout, TableRequest,
};
use ferry::{Descs, LocalLayout, PeerLayout, PlanError, TransferPlan};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{self, Raise};
use crate::memory::{NativeRegion, NativeRemote};
use crate::node::NativeNode;
use crate::xfer::NativeXfer;
use crate::{block_on, runtime, seconds};

/// One block table of a request, as the Python layer passes it: (table,
/// start, end, local block ids, remote block ids), the ids as
/// little-endian `u64` bytes.
type TableTuple = (String, u64, u64, Py<PyBytes>, Py<PyBytes>);

/// A peer as the Python layer passes it: its layout (JSON) and handles to
/// its regions, in the layout's order.
type PeerTuple = (String, Vec<Py<NativeRemote>>);

/// A rank's layout from its JSON; a `MetadataError` when it is not one.
fn rank_layout(json: &str) -> PyResult<RankLayout> {
    serde_json::from_str(json)
        .map_err(|e| Raise::new("MetadataError", format!("not a rank layout: {e}")).into())
}

/// `RankLayout` JSON read and written back by serde: the Python layer's
/// check that what it parsed from a peer is a layout Rust reads the same
/// way, in the one spelling both sides write.
#[pyfunction]
pub fn rank_layout_json(json: &str) -> PyResult<String> {
    let layout = rank_layout(json)?;
    serde_json::to_string(&layout)
        .map_err(|e| Raise::new("FerryError", format!("serializing a layout: {e}")).into())
}

/// Block ids from little-endian `u64` bytes.
fn ids(bytes: &[u8]) -> PyResult<Vec<u64>> {
    if !bytes.len().is_multiple_of(8) {
        return Err(errors::invalid("a block table is not u64 values").into());
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect())
}

/// A request's block tables, owned: `requests` borrows them.
struct Tables {
    names: Vec<String>,
    ranges: Vec<Range<u64>>,
    local: Vec<Vec<u64>>,
    remote: Vec<Vec<u64>>,
}

impl Tables {
    fn new(py: Python<'_>, tables: Vec<TableTuple>) -> PyResult<Self> {
        let mut out = Tables {
            names: Vec::with_capacity(tables.len()),
            ranges: Vec::with_capacity(tables.len()),
            local: Vec::with_capacity(tables.len()),
            remote: Vec::with_capacity(tables.len()),
        };
        for (name, start, end, local, remote) in tables {
            out.names.push(name);
            out.ranges.push(start..end);
            out.local.push(ids(local.as_bytes(py))?);
            out.remote.push(ids(remote.as_bytes(py))?);
        }
        Ok(out)
    }

    fn requests(&self) -> Vec<TableRequest<'_>> {
        (0..self.names.len())
            .map(|i| TableRequest {
                table: &self.names[i],
                range: self.ranges[i].clone(),
                local: &self.local[i],
                remote: &self.remote[i],
            })
            .collect()
    }
}

/// Descriptors as N×3 little-endian `u64` bytes: (region, offset, length).
fn rows<'py>(py: Python<'py>, descs: &Descs) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(descs.len() * 24);
    for d in descs.iter() {
        out.extend_from_slice(&u64::from(d.region).to_le_bytes());
        out.extend_from_slice(&d.offset.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
    }
    PyBytes::new(py, &out)
}

/// `u64` values as little-endian bytes.
fn u64_bytes<'py>(py: Python<'py>, values: &[u64]) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(values.len() * 8);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    PyBytes::new(py, &out)
}

fn direction(push: bool) -> Direction {
    if push {
        Direction::Push
    } else {
        Direction::Pull
    }
}

/// Expands `tables` over `plan`: (local rows, remote rows, per remote rank
/// its (rank, first, end) descriptors).
type Expanded<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Vec<(u32, usize, usize)>,
);

fn expanded<'py>(py: Python<'py>, expansion: &Expansion) -> Expanded<'py> {
    let ranks = expansion
        .ranks()
        .iter()
        .map(|g| (g.rank, g.descs.start, g.descs.end))
        .collect();
    (
        rows(py, expansion.local()),
        rows(py, expansion.remote()),
        ranks,
    )
}

/// A plan compiled by a node over prepared memory (`TransferPlan`).
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativePlan {
    plan: TransferPlan,
    node: ferry::Node,
}

#[pymethods]
impl NativeNode {
    /// Compiles the plan between `local` (this rank's layout, JSON, over
    /// `local_regions`) and `peers`, and prepares the peers' memory within
    /// `timeout` seconds.
    #[pyo3(signature = (local, local_regions, peers, push, every_remote_tensor, local_peers, timeout))]
    #[allow(clippy::too_many_arguments)]
    fn plan_transfer(
        &self,
        py: Python<'_>,
        local: &str,
        local_regions: Vec<Py<NativeRegion>>,
        peers: Vec<PeerTuple>,
        push: bool,
        every_remote_tensor: bool,
        local_peers: Vec<String>,
        timeout: f64,
    ) -> PyResult<NativePlan> {
        let timeout = seconds(timeout)?;
        let local = local_layout(local, &local_regions)?;
        let peers = peer_layouts(peers)?;
        let local_peers = local_peers
            .iter()
            .map(|json| rank_layout(json))
            .collect::<PyResult<Vec<_>>>()?;
        let options = PlanOptions {
            direction: direction(push),
            every_remote_tensor,
            local_peers: &local_peers,
            ..PlanOptions::default()
        };
        let node = &self.node;
        let _guard = runtime().enter();
        let plan = block_on(py, node.plan_transfer(&local, &peers, options, timeout))?
            .map_err(|e| errors::plan(&e))?;
        Ok(NativePlan {
            plan,
            node: self.node.clone(),
        })
    }
}

/// This rank's layout (JSON) over its regions, as a node plans it.
pub(crate) fn local_layout(json: &str, regions: &[Py<NativeRegion>]) -> PyResult<LocalLayout> {
    let regions = regions
        .iter()
        .map(|r| r.get().region())
        .collect::<PyResult<Vec<_>>>()?;
    LocalLayout::new(rank_layout(json)?, regions).map_err(|e| errors::plan(&e).into())
}

fn peer_layouts(peers: Vec<PeerTuple>) -> PyResult<Vec<PeerLayout>> {
    peers
        .into_iter()
        .map(|(json, handles)| {
            let handles = handles.iter().map(|h| h.get().0.clone()).collect();
            PeerLayout::new(rank_layout(&json)?, handles).map_err(|e| errors::plan(&e).into())
        })
        .collect()
}

#[pymethods]
impl NativePlan {
    /// The request for `tables`, ready to post; with `notification`, every
    /// rank it moves bytes with gets it once.
    #[pyo3(signature = (tables, notification=None))]
    fn request(
        &self,
        py: Python<'_>,
        tables: Vec<TableTuple>,
        notification: Option<&[u8]>,
    ) -> PyResult<NativeXfer> {
        let tables = Tables::new(py, tables)?;
        let xfer = self
            .plan
            .request(&tables.requests())
            .map_err(|e| errors::plan(&e))?;
        let xfer = match notification {
            Some(body) => xfer.with_notification(ferry::Bytes::copy_from_slice(body)),
            None => xfer,
        };
        Ok(NativeXfer::new(Arc::new(xfer), self.node.clone()))
    }

    /// The descriptors a request for `tables` moves, without making it:
    /// (local rows, remote rows, per remote rank (rank, first, end)); the
    /// rows' regions index `local_regions` and `remote_regions`.
    fn expand<'py>(&self, py: Python<'py>, tables: Vec<TableTuple>) -> PyResult<Expanded<'py>> {
        let tables = Tables::new(py, tables)?;
        let expansion = self
            .plan
            .expand(&tables.requests())
            .map_err(|e| errors::plan(&e))?;
        Ok(expanded(py, &expansion))
    }

    /// Descriptors a request for `tables` moves.
    fn count(&self, py: Python<'_>, tables: Vec<TableTuple>) -> PyResult<usize> {
        let tables = Tables::new(py, tables)?;
        let expansion = self
            .plan
            .expand(&tables.requests())
            .map_err(|e| errors::plan(&e))?;
        Ok(expansion.len())
    }

    /// Whether the plan still matches `peers` as they are now.
    fn check_current(&self, peers: Vec<PeerTuple>) -> PyResult<()> {
        let peers = peer_layouts(peers)?;
        self.plan
            .check_current(&peers)
            .map_err(|e| errors::plan(&e).into())
    }

    #[getter]
    fn write(&self) -> bool {
        self.plan.kind() == ferry::OpKind::Write
    }

    #[getter]
    fn remote_ranks(&self) -> Vec<u32> {
        self.plan.plan().remote_ranks().collect()
    }

    #[getter]
    fn tables(&self) -> Vec<String> {
        self.plan.plan().tables().map(str::to_owned).collect()
    }

    #[getter]
    fn local_regions(&self) -> Vec<u32> {
        self.plan.plan().local_regions().to_vec()
    }

    #[getter]
    fn remote_regions(&self) -> Vec<(u32, u32)> {
        remote_regions(self.plan.plan())
    }

    #[getter]
    fn segments(&self) -> usize {
        self.plan.plan().segment_count()
    }

    #[getter]
    fn heap_bytes(&self) -> usize {
        self.plan.plan().heap_bytes()
    }
}

fn remote_regions(plan: &Plan) -> Vec<(u32, u32)> {
    plan.remote_regions()
        .iter()
        .map(|r| (r.rank, r.region))
        .collect()
}

/// One remote rank's NIXL index arrays: (rank, local rows, remote rows),
/// the rows as little-endian `u64` bytes.
type RankIndices<'py> = (u32, Bound<'py, PyBytes>, Bound<'py, PyBytes>);

/// A plan made without a node (`ferry_layout::plan`): for NIXL's prepared
/// lists ([`NixlShape`]) and for inspecting what a request would move.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeLayoutPlan {
    plan: Plan,
}

/// Plans `local` (JSON) against `peers` (JSON each), as a node would,
/// without one.
#[pyfunction]
#[pyo3(signature = (local, peers, push, every_remote_tensor, local_peers))]
pub fn plan_layouts(
    local: &str,
    peers: Vec<String>,
    push: bool,
    every_remote_tensor: bool,
    local_peers: Vec<String>,
) -> PyResult<NativeLayoutPlan> {
    let local = rank_layout(local)?;
    let parse = |list: &[String]| {
        list.iter()
            .map(|json| rank_layout(json))
            .collect::<PyResult<Vec<_>>>()
    };
    let peers = parse(&peers)?;
    let local_peers = parse(&local_peers)?;
    let mut ranks: Vec<u32> = peers.iter().map(|p| p.rank).collect();
    ranks.sort_unstable();
    if let Some(pair) = ranks.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(errors::plan(&PlanError::DuplicateRank(pair[0])).into());
    }
    let options = PlanOptions {
        direction: direction(push),
        every_remote_tensor,
        local_peers: &local_peers,
        ..PlanOptions::default()
    };
    let plan = ferry::layout::plan(&local, &peers, options).map_err(|e| errors::layout(&e))?;
    Ok(NativeLayoutPlan { plan })
}

#[pymethods]
impl NativeLayoutPlan {
    #[getter]
    fn write(&self) -> bool {
        self.plan.direction() == Direction::Push
    }

    #[getter]
    fn remote_ranks(&self) -> Vec<u32> {
        self.plan.remote_ranks().collect()
    }

    #[getter]
    fn tables(&self) -> Vec<String> {
        self.plan.tables().map(str::to_owned).collect()
    }

    #[getter]
    fn local_regions(&self) -> Vec<u32> {
        self.plan.local_regions().to_vec()
    }

    #[getter]
    fn remote_regions(&self) -> Vec<(u32, u32)> {
        remote_regions(&self.plan)
    }

    #[getter]
    fn segments(&self) -> usize {
        self.plan.segment_count()
    }

    /// As `NativePlan.expand`; `merge=False`: one descriptor per run per
    /// block, as connectors without a planner issue them.
    #[pyo3(signature = (tables, merge=true))]
    fn expand<'py>(
        &self,
        py: Python<'py>,
        tables: Vec<TableTuple>,
        merge: bool,
    ) -> PyResult<Expanded<'py>> {
        let tables = Tables::new(py, tables)?;
        let mut expansion = if merge {
            Expansion::new()
        } else {
            Expansion::without_merging()
        };
        self.plan
            .expand(&tables.requests(), &mut expansion)
            .map_err(|e| errors::request(&e))?;
        Ok(expanded(py, &expansion))
    }

    /// NIXL's local prepared list: N×3 `u64` rows (region, offset,
    /// length), regions indexing `local_regions`.
    fn nixl_local<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        rows(py, &NixlShape::new(&self.plan).local_list())
    }

    /// Remote rank `rank`'s prepared list, regions indexing
    /// `remote_regions`.
    fn nixl_remote<'py>(&self, py: Python<'py>, rank: u32) -> Bound<'py, PyBytes> {
        rows(py, &NixlShape::new(&self.plan).remote_list(rank))
    }

    /// One request's index arrays: per remote rank (rank, local rows,
    /// remote rows), the rows as little-endian `u64` bytes.
    fn nixl_indices<'py>(
        &self,
        py: Python<'py>,
        tables: Vec<TableTuple>,
    ) -> PyResult<Vec<RankIndices<'py>>> {
        let tables = Tables::new(py, tables)?;
        let mut out: Vec<NixlIndices> = Vec::new();
        NixlShape::new(&self.plan)
            .indices(&tables.requests(), &mut out)
            .map_err(|e| errors::request(&e))?;
        Ok(out
            .iter()
            .map(|g| (g.rank, u64_bytes(py, &g.local), u64_bytes(py, &g.remote)))
            .collect())
    }
}
