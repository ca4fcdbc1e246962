//! The node: spawn, memory, one-shot transfers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ferry::{Bytes, Node, NodeAddr, NodeId, RdmaOp};
use pyo3::prelude::*;

use crate::errors::{self, Raise};
use crate::memory::{NativeRegion, NativeRemote, access, external_block};
use crate::talk::Deliveries;
use crate::{block_on, runtime, seconds};

/// A node address as Python holds it: (endpoint, 32-digit hex id).
pub type AddrTuple = (String, String);

/// `addr` as Python holds it.
pub fn addr_tuple(addr: NodeAddr) -> AddrTuple {
    (addr.endpoint.to_string(), addr.id.to_string())
}

/// A node address from Python's tuple.
pub fn node_addr((endpoint, id): &AddrTuple) -> PyResult<NodeAddr> {
    let endpoint: SocketAddr = endpoint
        .parse()
        .map_err(|_| errors::invalid(format!("{endpoint:?} is not an ip:port address")))?;
    let id = u128::from_str_radix(id, 16)
        .map_err(|_| errors::invalid(format!("{id:?} is not a node id (32 hex digits)")))?;
    Ok(NodeAddr {
        id: NodeId(id),
        endpoint,
    })
}

/// One op of a one-shot submit, as the Python layer passes it: (is_write,
/// local region, local offset, length, remote handle, remote offset).
type OpTuple = (bool, Py<NativeRegion>, u64, u64, Py<NativeRemote>, u64);

/// A ferry node running on the extension's runtime.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeNode {
    pub(crate) node: Node,
    pub(crate) deliveries: Arc<Deliveries>,
    closed: AtomicBool,
}

impl NativeNode {
    /// The batch's ops; an op whose range leaves its region fails with its
    /// index, before anything moves.
    fn ops(ops: Vec<OpTuple>) -> PyResult<Vec<RdmaOp>> {
        ops.into_iter()
            .enumerate()
            .map(
                |(index, (write, region, offset, len, remote, remote_offset))| {
                    let range = |start: u64| match start.checked_add(len) {
                        Some(end) => Ok(start..end),
                        None => {
                            Err(errors::invalid(format!("op {index}: the range overflows"))
                                .at(index))
                        }
                    };
                    let local = region.get().region()?;
                    let local = local
                        .slice(range(offset)?)
                        .map_err(|e| errors::op(&e).at(index))?;
                    let remote = remote
                        .get()
                        .0
                        .slice(range(remote_offset)?)
                        .map_err(|e| errors::op(&e).at(index))?;
                    Ok(if write {
                        RdmaOp::write(local, remote)
                    } else {
                        RdmaOp::read(local, remote)
                    })
                },
            )
            .collect()
    }
}

#[pymethods]
impl NativeNode {
    /// Spawns a node. `memory`/`ibverbs`: run those transports (when the
    /// host has them); `tcp`: move region bytes over TCP
    /// (`NodeBuilder::tcp`).
    #[new]
    #[pyo3(signature = (name, listen, advertise, memory, ibverbs, tcp_connections, etcd=None, cluster=None, cluster_secret=None, tcp=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: Option<String>,
        listen: &str,
        advertise: Option<&str>,
        memory: bool,
        ibverbs: bool,
        tcp_connections: Option<usize>,
        etcd: Option<String>,
        cluster: Option<String>,
        cluster_secret: Option<Vec<u8>>,
        tcp: bool,
    ) -> PyResult<Self> {
        let parse = |text: &str| {
            text.parse::<SocketAddr>()
                .map_err(|_| errors::invalid(format!("{text:?} is not an ip:port address")))
        };
        let mut builder = Node::builder()
            .listen(parse(listen)?)
            .memory(memory)
            .ibverbs(ibverbs)
            .tcp(tcp);
        if let Some(advertise) = advertise {
            builder = builder.advertise(parse(advertise)?);
        }
        if let Some(name) = name {
            builder = builder.name(name);
        }
        if let Some(n) = tcp_connections {
            builder = builder.tcp_connections(n);
        }
        if let Some(secret) = cluster_secret {
            let secret =
                ferry::ClusterSecret::new(secret).map_err(|e| errors::invalid(e.to_string()))?;
            builder = builder.cluster_secret(secret);
        }
        if let Some(endpoint) = etcd {
            let mut config = ferry::EtcdConfig::new(endpoint);
            if let Some(cluster) = cluster {
                config = config.cluster(cluster);
            }
            builder = builder.etcd(config);
        }
        let _guard = runtime().enter();
        let node = block_on(py, builder.spawn())?
            .map_err(|e| Raise::new("FerryError", format!("the node did not start: {e}")))?;
        let deliveries = Deliveries::start(&node)?;
        Ok(NativeNode {
            node,
            deliveries,
            closed: AtomicBool::new(false),
        })
    }

    /// (endpoint, node id).
    #[getter]
    fn addr(&self) -> AddrTuple {
        addr_tuple(self.node.addr())
    }

    /// The transports running, fastest first: "memory", "ibverbs", "tcp".
    fn transports(&self) -> Vec<String> {
        self.node
            .transports()
            .iter()
            .filter(|t| t.is_running())
            .map(|t| t.level.to_string())
            .collect()
    }

    /// Every transport, fastest first: (name, running, what it runs on or
    /// why it could not start).
    fn transport_status(&self) -> Vec<(String, bool, String)> {
        self.node
            .transports()
            .iter()
            .map(|t| {
                let detail = match &t.state {
                    ferry::TransportState::Running { detail } => detail.clone(),
                    ferry::TransportState::Unavailable { reason } => reason.clone(),
                };
                (t.level.to_string(), t.is_running(), detail)
            })
            .collect()
    }

    /// Shuts the node down: every later call fails with `ShutDown`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.closed.store(true, Ordering::Release);
        block_on(py, self.node.shutdown())
    }

    /// Whether `close` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Allocates and registers `len` zeroed bytes.
    fn alloc(&self, py: Python<'_>, len: u64, access_text: &str) -> PyResult<NativeRegion> {
        let access = access(access_text)?;
        let region =
            block_on(py, self.node.alloc(len, access))?.map_err(|e| errors::register(&e))?;
        Ok(NativeRegion::new(region, true))
    }

    /// Registers `len` bytes at `addr`, which `keep_alive` (a buffer export
    /// the Python layer made) pins. The private half of `Node.register`:
    /// the Python layer guarantees the address.
    fn register(
        &self,
        py: Python<'_>,
        addr: u64,
        len: u64,
        access_text: &str,
        keep_alive: Py<PyAny>,
    ) -> PyResult<NativeRegion> {
        let access = access(access_text)?;
        // SAFETY: `Node.register` passes the address and length of a
        // writable, C-contiguous buffer, and as `keep_alive` the object
        // holding its export: the memory stays put while it lives.
        let block = unsafe { external_block(addr, len, keep_alive)? };
        let region =
            block_on(py, self.node.register(block, access))?.map_err(|e| errors::register(&e))?;
        Ok(NativeRegion::new(region, false))
    }

    /// Runs the ops within `timeout` seconds; with `notification`, sends it
    /// to each owner once its ops are done.
    #[pyo3(signature = (ops, timeout, notification=None))]
    fn submit(
        &self,
        py: Python<'_>,
        ops: Vec<OpTuple>,
        timeout: f64,
        notification: Option<Vec<u8>>,
    ) -> PyResult<()> {
        let ops = Self::ops(ops)?;
        let timeout = seconds(timeout)?;
        let node = &self.node;
        let _guard = runtime().enter();
        match notification {
            None => block_on(py, node.submit(ops, timeout))?.map_err(|e| errors::submit(&e).into()),
            Some(body) => block_on(py, node.submit_with_notification(ops, timeout, body))?
                .map_err(|e| errors::notify(&e).into()),
        }
    }

    /// As `submit`, without waiting: `callback(error_or_None)` is called
    /// from one of the runtime's threads when it is done.
    #[pyo3(signature = (ops, timeout, callback, notification=None))]
    fn submit_then(
        &self,
        ops: Vec<OpTuple>,
        timeout: f64,
        callback: Py<PyAny>,
        notification: Option<Vec<u8>>,
    ) -> PyResult<()> {
        let ops = Self::ops(ops)?;
        let timeout = seconds(timeout)?;
        let node = self.node.clone();
        runtime().spawn(async move {
            let result: Result<(), Raise> = match notification {
                None => node
                    .submit(ops, timeout)
                    .await
                    .map_err(|e| errors::submit(&e)),
                Some(body) => node
                    .submit_with_notification(ops, timeout, Bytes::from(body))
                    .await
                    .map_err(|e| errors::notify(&e)),
            };
            settle(callback, result);
        });
        Ok(())
    }

    /// Connects to `peer` on every transport it will take, within
    /// `timeout` seconds (NIXL's `make_connection`).
    fn connect(&self, py: Python<'_>, peer: AddrTuple, timeout: f64) -> PyResult<()> {
        let peer = node_addr(&peer)?;
        let timeout = seconds(timeout)?;
        let _guard = runtime().enter();
        block_on(py, self.node.connect(peer, timeout))?
            .map(|_| ())
            .map_err(|e| errors::prepare(&e).into())
    }
}

/// Calls `callback(None)` or `callback(exception)` with the GIL.
pub fn settle(callback: Py<PyAny>, result: Result<(), Raise>) {
    call_back(callback, |py| match result {
        Ok(()) => py.None(),
        Err(raise) => raise.into_value(py),
    });
}

/// Calls `callback(argument(py))` from a runtime thread, with the GIL;
/// nothing once the interpreter exits.
pub fn call_back(callback: Py<PyAny>, argument: impl FnOnce(Python<'_>) -> Py<PyAny>) {
    if !crate::python_alive() {
        return;
    }
    Python::attach(|py| {
        let argument = argument(py);
        if let Err(error) = callback.call1(py, (argument,)) {
            // The callback is the Python layer's own: it settles a future.
            // An error there has nowhere else to go.
            error.write_unraisable(py, None);
        }
    });
}
