//! Messages, notifications, RPC and names.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry::{Bytes, Delivery, DeliveryKind, Node, RpcRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes};
use tokio::sync::Notify;

use crate::errors::{self, Raise};
use crate::memory::{NativeRegion, NativeRemote};
use crate::node::{AddrTuple, NativeNode, addr_tuple, call_back, node_addr};
use crate::{block_on, runtime, seconds};

/// Deliveries the node's inbox handed over, waiting for Python to take
/// them. At most `capacity` wait here; beyond that the pump stops taking
/// from the inbox, whose own bound then holds senders back, as in Rust.
pub struct Deliveries {
    queue: Mutex<VecDeque<Delivery>>,
    capacity: usize,
    arrived: Notify,
    space: Notify,
    closed: AtomicBool,
}

/// A delivery as Python gets it: (sender, "message" or "notification",
/// body).
type DeliveryTuple = (AddrTuple, &'static str, Py<PyBytes>);

const WAITING_DELIVERIES: usize = 1024;

impl Deliveries {
    /// Takes the node's inbox and pumps it until the node stops.
    pub fn start(node: &Node) -> PyResult<Arc<Self>> {
        let mut inbox = node
            .inbox()
            .map_err(|e| Raise::new("FerryError", format!("the node's inbox: {e}")))?;
        let deliveries = Arc::new(Deliveries {
            queue: Mutex::new(VecDeque::new()),
            capacity: WAITING_DELIVERIES,
            arrived: Notify::new(),
            space: Notify::new(),
            closed: AtomicBool::new(false),
        });
        let pump = deliveries.clone();
        runtime().spawn(async move {
            while let Some(delivery) = inbox.recv().await {
                pump.push(delivery).await;
            }
            pump.closed.store(true, Ordering::Release);
            pump.arrived.notify_waiters();
        });
        Ok(deliveries)
    }

    async fn push(&self, delivery: Delivery) {
        let mut delivery = Some(delivery);
        loop {
            let space = self.space.notified();
            let mut space = std::pin::pin!(space);
            space.as_mut().enable();
            {
                let mut queue = self.queue.lock().expect("never poisoned");
                if queue.len() < self.capacity {
                    queue.extend(delivery.take());
                    break;
                }
            }
            space.await;
        }
        self.arrived.notify_waiters();
    }

    /// Up to `max` deliveries that have arrived; never waits.
    fn drain(&self, max: usize) -> Vec<Delivery> {
        let taken: Vec<Delivery> = {
            let mut queue = self.queue.lock().expect("never poisoned");
            let n = max.min(queue.len());
            queue.drain(..n).collect()
        };
        if !taken.is_empty() {
            self.space.notify_waiters();
        }
        taken
    }

    /// Once a delivery waits: `true`; `false` once the node has stopped
    /// and none waits.
    async fn waiting(&self) -> bool {
        loop {
            let arrived = self.arrived.notified();
            let mut arrived = std::pin::pin!(arrived);
            arrived.as_mut().enable();
            if !self.queue.lock().expect("never poisoned").is_empty() {
                return true;
            }
            if self.closed.load(Ordering::Acquire) {
                return false;
            }
            arrived.await;
        }
    }

    /// The next delivery; `None` once the node has stopped.
    async fn next(&self) -> Option<Delivery> {
        while self.waiting().await {
            // Another waiter may have taken it first: wait again.
            if let Some(delivery) = self.drain(1).pop() {
                return Some(delivery);
            }
        }
        None
    }
}

fn delivery_tuple(py: Python<'_>, delivery: Delivery) -> DeliveryTuple {
    let kind = match delivery.kind {
        DeliveryKind::Message => "message",
        DeliveryKind::Notification => "notification",
    };
    (
        addr_tuple(delivery.from),
        kind,
        PyBytes::new(py, &delivery.body).unbind(),
    )
}

#[pymethods]
impl NativeNode {
    /// Up to `max` deliveries that have arrived, oldest first; never waits.
    fn drain_deliveries(&self, py: Python<'_>, max: usize) -> Vec<DeliveryTuple> {
        self.deliveries
            .drain(max)
            .into_iter()
            .map(|d| delivery_tuple(py, d))
            .collect()
    }

    /// The next delivery within `timeout` seconds; None if none came.
    /// Raises ShutDown once the node has stopped.
    fn next_delivery(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<DeliveryTuple>> {
        let timeout = seconds(timeout)?;
        let deliveries = self.deliveries.clone();
        let next = block_on(py, async move {
            tokio::time::timeout(timeout, deliveries.next()).await
        })?;
        match next {
            Ok(Some(delivery)) => Ok(Some(delivery_tuple(py, delivery))),
            Ok(None) => Err(Raise::new("ShutDown", "the node was closed").into()),
            Err(_elapsed) => Ok(None),
        }
    }

    /// Calls `callback(True)` from a runtime thread once a delivery is
    /// waiting (at once if one is), or `callback(False)` once the node has
    /// stopped; takes nothing, so an abandoned wait loses no delivery.
    fn when_delivery_waits(&self, callback: Py<PyAny>) {
        let deliveries = self.deliveries.clone();
        runtime().spawn(async move {
            let waiting = deliveries.waiting().await;
            call_back(callback, |py| {
                PyBool::new(py, waiting).to_owned().into_any().unbind()
            });
        });
    }

    /// Sends `body` to `peer`'s inbox within `timeout` seconds.
    fn send_message(
        &self,
        py: Python<'_>,
        peer: AddrTuple,
        body: &[u8],
        timeout: f64,
    ) -> PyResult<()> {
        let peer = node_addr(&peer)?;
        let timeout = seconds(timeout)?;
        let body = Bytes::copy_from_slice(body);
        let _guard = runtime().enter();
        block_on(py, self.node.send_message(peer, body, timeout))?
            .map_err(|e| errors::message(&e).into())
    }

    /// Answers peers' calls of `name` with `handler(sender, body,
    /// seconds_left) -> bytes`, run on a blocking thread with the GIL. An
    /// exception fails that call with its text.
    fn serve_rpc(&self, name: &str, handler: Py<PyAny>) -> PyResult<()> {
        let handler = Arc::new(handler);
        self.node
            .serve_rpc(name, move |request: RpcRequest| {
                let handler = handler.clone();
                async move {
                    let left = request
                        .deadline
                        .saturating_duration_since(tokio::time::Instant::now())
                        .as_secs_f64();
                    let from = addr_tuple(request.from);
                    let answer = tokio::task::spawn_blocking(move || {
                        if !crate::python_alive() {
                            return Err("the serving process is exiting".to_string());
                        }
                        Python::attach(|py| {
                            let body = PyBytes::new(py, &request.body);
                            handler
                                .call1(py, (from, body, left))
                                .and_then(|answer| {
                                    let answer = answer.bind(py).cast::<PyBytes>()?;
                                    Ok(Bytes::copy_from_slice(answer.as_bytes()))
                                })
                                .map_err(|error| error.to_string())
                        })
                    })
                    .await;
                    answer.unwrap_or_else(|_| Err("the handler panicked".to_string()))
                }
            })
            .map_err(|e| errors::rpc(&e).into())
    }

    /// Stops serving `name`; returns whether it was served.
    fn unserve_rpc(&self, name: &str) -> bool {
        self.node.unserve_rpc(name)
    }

    /// Calls `peer`'s handler `name` with `body`; its answer within
    /// `timeout` seconds.
    fn call<'py>(
        &self,
        py: Python<'py>,
        peer: AddrTuple,
        name: &str,
        body: &[u8],
        timeout: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let peer = node_addr(&peer)?;
        let timeout = seconds(timeout)?;
        let body = Bytes::copy_from_slice(body);
        let _guard = runtime().enter();
        let answer = block_on(py, self.node.call(peer, name, body, timeout))?
            .map_err(|e| errors::rpc(&e))?;
        Ok(PyBytes::new(py, &answer))
    }

    /// As `call`, without waiting: `callback(answer_or_exception)` is
    /// called from a runtime thread.
    fn call_then(
        &self,
        peer: AddrTuple,
        name: String,
        body: &[u8],
        timeout: f64,
        callback: Py<PyAny>,
    ) -> PyResult<()> {
        let peer = node_addr(&peer)?;
        let timeout = seconds(timeout)?;
        let body = Bytes::copy_from_slice(body);
        let node = self.node.clone();
        runtime().spawn(async move {
            let answer = node.call(peer, &name, body, timeout).await;
            call_back(callback, |py| match answer {
                Ok(answer) => PyBytes::new(py, &answer).into_any().unbind(),
                Err(error) => errors::rpc(&error).into_value(py),
            });
        });
        Ok(())
    }

    /// Sends `body` as a standalone notification to `peer` within
    /// `timeout` seconds (a notified batch of no ops).
    fn notify(&self, py: Python<'_>, peer: AddrTuple, body: &[u8], timeout: f64) -> PyResult<()> {
        let peer = node_addr(&peer)?;
        let timeout = seconds(timeout)?;
        let body = Bytes::copy_from_slice(body);
        let _guard = runtime().enter();
        block_on(py, self.node.notify(peer, body, timeout))?.map_err(|e| errors::message(&e).into())
    }

    /// Publishes `region` under `name` in this node's metadata.
    fn publish(&self, name: &str, region: &NativeRegion) -> PyResult<()> {
        self.node
            .publish(name, &region.region()?)
            .map_err(|e| Raise::new("InvalidArgument", e).into())
    }

    /// Withdraws `name`; returns whether it was published.
    fn unpublish(&self, name: &str) -> bool {
        self.node.unpublish(name)
    }

    /// This node's metadata blob (its address and published regions).
    fn export_metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.node.export_metadata(None))
    }

    /// Loads a peer's metadata blob; returns the name it is known by.
    fn load_metadata(&self, blob: &[u8]) -> PyResult<String> {
        let metadata = ferry::NodeMetadata::decode(blob).map_err(|e| errors::metadata(&e))?;
        self.node
            .load_metadata(blob)
            .map_err(|e| errors::metadata(&e))?;
        Ok(ferry::discovery::key_of(&metadata))
    }

    /// Fetches the metadata of the node at `endpoint` within `timeout`
    /// seconds; returns the name it is known by.
    fn fetch_metadata(&self, py: Python<'_>, endpoint: &str, timeout: f64) -> PyResult<String> {
        let address = endpoint
            .parse()
            .map_err(|_| errors::invalid(format!("{endpoint:?} is not an ip:port address")))?;
        let timeout = seconds(timeout)?;
        let _guard = runtime().enter();
        let (key, _loaded) =
            block_on(py, self.node.fetch_metadata(address, timeout))?.map_err(|e| discovery(&e))?;
        Ok(key)
    }

    /// The handle of the region `peer` published as `region`.
    fn remote_region(&self, peer: &str, region: &str) -> PyResult<NativeRemote> {
        self.node
            .remote_region(peer, region)
            .map(NativeRemote)
            .map_err(|e| errors::lookup(&e).into())
    }
}

#[pymethods]
impl NativeNode {
    /// The handle of the region `peer` published as `region`: from
    /// metadata loaded here, or looked up in etcd (waiting up to `timeout`
    /// seconds for the peer and the region to be published).
    fn lookup_region(
        &self,
        py: Python<'_>,
        peer: &str,
        region: &str,
        timeout: f64,
    ) -> PyResult<NativeRemote> {
        let timeout = seconds(timeout)?;
        let _guard = runtime().enter();
        block_on(py, self.node.lookup_region(peer, region, timeout))?
            .map(NativeRemote)
            .map_err(|e| discovery(&e).into())
    }
}

/// A discovery error's class.
fn discovery(error: &ferry::DiscoveryError) -> Raise {
    match error {
        ferry::DiscoveryError::Timeout { .. } => Raise::new("Timeout", error),
        ferry::DiscoveryError::Metadata(inner) => errors::metadata(inner),
        ferry::DiscoveryError::Lookup(inner) => errors::lookup(inner),
        ferry::DiscoveryError::Control(_) | ferry::DiscoveryError::Impostor { .. } => {
            Raise::new("PeerUnreachable", error)
        }
        ferry::DiscoveryError::Etcd(_) => Raise::new("DiscoveryError", error),
        _ => Raise::new("FerryError", error),
    }
}
