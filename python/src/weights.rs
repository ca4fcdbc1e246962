//! Weight publication (`ferry::weights`) for the Python layer: a publisher
//! rank, its write guard, a subscriber and its readers' guard.
//!
//! Rust's `WriteGuard` borrows its `Publisher`, which a Python object
//! cannot hold; so a write runs as a task on the runtime that owns a
//! handle to the publisher and the guard, and the Python guard only tells
//! it to publish, or drops its side of the channel to abandon the write.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferry::weights::{Publisher, ReadGuard, Readers, Subscriber, WeightsError};
use pyo3::prelude::*;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::errors::{self, Raise};
use crate::layout::local_layout;
use crate::memory::NativeRegion;
use crate::node::NativeNode;
use crate::{block_on, runtime, seconds};

/// A buffer as the Python layer passes it: its layout (JSON) and regions.
type BufferTuple = (String, Vec<Py<NativeRegion>>);

/// What the Python guard sends the write's task: the version to publish,
/// and where the answer goes.
type Publish = (u64, oneshot::Sender<Result<(), WeightsError>>);

/// How long publishing or abandoning a write waits for its task: a step
/// with no I/O, bounded all the same.
const LET_GO: Duration = Duration::from_secs(5);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn closed(what: &str) -> Raise {
    Raise::new("ShutDown", format!("the {what} was closed"))
}

/// One publisher rank. `close` stops serving (once an open write ends).
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativePublisher {
    publisher: Mutex<Option<Arc<Publisher>>>,
    rank: u32,
}

/// A write in progress: the rank's memory is the caller's until
/// `publish` or `abort`.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeWriteGuard {
    publish: Mutex<Option<oneshot::Sender<Publish>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    overrun: usize,
}

#[pymethods]
impl NativeNode {
    /// Starts rank `layout.rank` of weight set `set` over `regions`.
    fn start_publisher(
        &self,
        set: &str,
        layout: &str,
        regions: Vec<Py<NativeRegion>>,
    ) -> PyResult<NativePublisher> {
        let local = local_layout(layout, &regions)?;
        let rank = local.layout().rank;
        let _guard = runtime().enter();
        let publisher = Publisher::start(&self.node, set, local).map_err(|e| match e {
            // All `start` reports as Protocol is a name in use on this node.
            WeightsError::Protocol(text) => errors::invalid(format!(
                "weight set {set:?} cannot be published on this node: {text}"
            )),
            other => errors::weights(&other),
        })?;
        Ok(NativePublisher {
            publisher: Mutex::new(Some(Arc::new(publisher))),
            rank,
        })
    }

    /// A subscriber of `set` at `publishers` (ip:port each), or at the
    /// relaying subscriber `relay` (ip:port), into one or two buffers,
    /// planned within `timeout` seconds.
    #[pyo3(signature = (set, publishers, buffers, timeout, relay = None))]
    fn subscribe(
        &self,
        py: Python<'_>,
        set: &str,
        publishers: Vec<String>,
        buffers: Vec<BufferTuple>,
        timeout: f64,
        relay: Option<String>,
    ) -> PyResult<NativeSubscriber> {
        let timeout = seconds(timeout)?;
        if buffers.is_empty() || buffers.len() > 2 {
            return Err(errors::invalid(format!(
                "a subscriber takes one buffer or two, not {}",
                buffers.len()
            ))
            .into());
        }
        let parse = |text: &String| {
            text.parse::<SocketAddr>()
                .map_err(|_| errors::invalid(format!("{text:?} is not an ip:port address")))
        };
        // Addresses, or else node names (looked up through the node's
        // names), not a mix.
        let addresses: Vec<SocketAddr> = publishers.iter().filter_map(|p| p.parse().ok()).collect();
        let names: Vec<&str> = match addresses.len() {
            n if n == publishers.len() => Vec::new(),
            0 => publishers.iter().map(String::as_str).collect(),
            _ => {
                return Err(errors::invalid(
                    "publishers are all ip:port addresses or all node names, not a mix",
                )
                .into());
            }
        };
        let relay = relay.as_ref().map(parse).transpose()?;
        let locals = buffers
            .iter()
            .map(|(json, regions)| local_layout(json, regions))
            .collect::<PyResult<Vec<_>>>()?;
        let count = locals.len();
        let _guard = runtime().enter();
        let subscriber = block_on(py, async {
            match relay {
                Some(relay) => {
                    Subscriber::from_relay(&self.node, set, relay, locals, timeout).await
                }
                None if names.is_empty() => {
                    Subscriber::new(&self.node, set, &addresses, locals, timeout).await
                }
                None => Subscriber::by_names(&self.node, set, &names, locals, timeout).await,
            }
        })?
        .map_err(|e| errors::weights(&e))?;
        Ok(NativeSubscriber {
            readers: subscriber.readers(),
            state: Mutex::new((subscriber.version(), subscriber.active())),
            subscriber: tokio::sync::Mutex::new(Some(subscriber)),
            buffers: count,
        })
    }
}

impl NativePublisher {
    fn publisher(&self) -> PyResult<Arc<Publisher>> {
        lock(&self.publisher)
            .clone()
            .ok_or_else(|| closed("publisher").into())
    }
}

#[pymethods]
impl NativePublisher {
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// The version the rank's memory holds; None while written, closed,
    /// or before the first publish.
    #[getter]
    fn version(&self) -> Option<u64> {
        lock(&self.publisher).as_ref().and_then(|p| p.version())
    }

    #[getter]
    fn closed(&self) -> bool {
        lock(&self.publisher).is_none()
    }

    /// Takes the rank's memory for writing, waiting up to `timeout`
    /// seconds for its readers (then overrunning them).
    fn write(&self, py: Python<'_>, timeout: f64) -> PyResult<NativeWriteGuard> {
        let timeout = seconds(timeout)?;
        let publisher = self.publisher()?;
        let (taken, taken_rx) = oneshot::channel::<usize>();
        let (publish, publish_rx) = oneshot::channel::<Publish>();
        let task = runtime().spawn(async move {
            let (guard, overrun) = publisher.write(timeout).await;
            // The caller stopped waiting (Ctrl-C): the guard drops here,
            // leaving the rank with no version, as an abandoned write does.
            if taken.send(overrun).is_err() {
                return;
            }
            if let Ok((version, answer)) = publish_rx.await {
                let _ = answer.send(guard.publish(version));
            }
        });
        let overrun = block_on(py, taken_rx)?
            .map_err(|_| Raise::new("FerryError", "the write's task ended before it began"))?;
        Ok(NativeWriteGuard {
            publish: Mutex::new(Some(publish)),
            task: Mutex::new(Some(task)),
            overrun,
        })
    }

    /// Stops serving the set. A write still open keeps the rank served
    /// until it ends (the Python layer abandons it first).
    fn close(&self) {
        let _guard = runtime().enter();
        drop(lock(&self.publisher).take());
    }
}

impl NativeWriteGuard {
    /// Waits (bounded) for the write's task to end: its guard dropped or
    /// published.
    fn join(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(task) = lock(&self.task).take() {
            let _guard = runtime().enter();
            let _ = block_on(py, tokio::time::timeout(LET_GO, task))?;
        }
        Ok(())
    }
}

#[pymethods]
impl NativeWriteGuard {
    /// Readers whose leases this write overran.
    #[getter]
    fn overrun(&self) -> usize {
        self.overrun
    }

    /// Whether `publish` or `abort` ran.
    #[getter]
    fn done(&self) -> bool {
        lock(&self.publish).is_none()
    }

    /// The memory holds `version`: readers may lease it.
    fn publish(&self, py: Python<'_>, version: u64) -> PyResult<()> {
        let sender = lock(&self.publish)
            .take()
            .ok_or_else(|| errors::invalid("this write was published or abandoned already"))?;
        let (answer, answer_rx) = oneshot::channel();
        sender
            .send((version, answer))
            .map_err(|_| Raise::new("FerryError", "the write's task ended"))?;
        let _guard = runtime().enter();
        let answer = block_on(py, tokio::time::timeout(LET_GO, answer_rx))?;
        self.join(py)?;
        match answer {
            Ok(Ok(result)) => result.map_err(|e| errors::weights(&e).into()),
            _ => Err(Raise::new("FerryError", "the write's task did not answer").into()),
        }
    }

    /// Abandons the write: the rank holds no version until the next one.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        drop(lock(&self.publish).take());
        self.join(py)
    }
}

/// A subscriber of a weight set.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeSubscriber {
    /// None once closed; locked by the update that runs.
    subscriber: tokio::sync::Mutex<Option<Subscriber>>,
    readers: Readers,
    buffers: usize,
    /// (version, active buffer) after the last update: readable while
    /// another one runs.
    state: Mutex<(Option<u64>, usize)>,
}

/// A buffer held for reading.
#[pyclass(module = "ferry._ferry", frozen)]
pub struct NativeReadGuard {
    guard: Mutex<Option<ReadGuard>>,
    buffer: usize,
    version: u64,
}

#[pymethods]
impl NativeSubscriber {
    #[getter]
    fn version(&self) -> Option<u64> {
        lock(&self.state).0
    }

    #[getter]
    fn active(&self) -> usize {
        lock(&self.state).1
    }

    #[getter]
    fn buffers(&self) -> usize {
        self.buffers
    }

    /// Moves the newest complete version in, within `timeout` seconds:
    /// (version, changed, buffer); with `at_least`, updates until it holds
    /// that version or a newer one; with `verify`, checks checksums.
    #[pyo3(signature = (timeout, at_least = None, verify = false))]
    fn update(
        &self,
        py: Python<'_>,
        timeout: f64,
        at_least: Option<u64>,
        verify: bool,
    ) -> PyResult<(u64, bool, usize)> {
        let deadline = Instant::now() + seconds(timeout)?;
        let _guard = runtime().enter();
        let update = block_on(py, async {
            let mut held = tokio::time::timeout_at(deadline, self.subscriber.lock())
                .await
                .map_err(|_| {
                    Raise::new(
                        "Timeout",
                        "another update of this subscriber ran until the deadline",
                    )
                })?;
            let subscriber = held.as_mut().ok_or_else(|| closed("subscriber"))?;
            let left = deadline.saturating_duration_since(Instant::now());
            subscriber.verify_checksums(verify);
            let result = match at_least {
                Some(version) => subscriber.update_to(version, left).await,
                None => subscriber.update(left).await,
            };
            *lock(&self.state) = (subscriber.version(), subscriber.active());
            result.map_err(|e| errors::weights(&e))
        })??;
        Ok((update.version, update.changed, update.buffer))
    }

    /// Holds the buffer that holds the newest complete version, waiting up
    /// to `timeout` seconds (for an update writing the only buffer, or for
    /// a complete version where there is none).
    fn read(&self, py: Python<'_>, timeout: f64) -> PyResult<NativeReadGuard> {
        let timeout = seconds(timeout)?;
        let _guard = runtime().enter();
        let guard =
            block_on(py, tokio::time::timeout(timeout, self.readers.read()))?.map_err(|_| {
                Raise::new(
                    "Timeout",
                    "no buffer held a complete version before the deadline",
                )
            })?;
        Ok(NativeReadGuard {
            buffer: guard.buffer(),
            version: guard.version(),
            guard: Mutex::new(Some(guard)),
        })
    }

    /// Serves this subscriber's buffers on to subscribers made with
    /// `relay` naming this node.
    fn serve_relay(&self, py: Python<'_>) -> PyResult<()> {
        let _guard = runtime().enter();
        block_on(py, async {
            let mut held = self.subscriber.lock().await;
            let subscriber = held.as_mut().ok_or_else(|| closed("subscriber"))?;
            subscriber.serve_relay().map_err(|e| errors::weights(&e))
        })??;
        Ok(())
    }

    /// Drops the subscriber (its plans and the buffers' registrations it
    /// held), once an update under way ends, waiting up to `timeout`.
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        let _guard = runtime().enter();
        let taken = block_on(py, async {
            let mut held = tokio::time::timeout(timeout, self.subscriber.lock()).await?;
            Ok::<_, tokio::time::error::Elapsed>(held.take())
        })?
        .map_err(|_| Raise::new("Timeout", "an update ran until the close's deadline"))?;
        drop(taken);
        Ok(())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.subscriber.try_lock().is_ok_and(|held| held.is_none())
    }
}

#[pymethods]
impl NativeReadGuard {
    #[getter]
    fn buffer(&self) -> usize {
        self.buffer
    }

    #[getter]
    fn version(&self) -> u64 {
        self.version
    }

    /// Lets the buffer go: an update may write it again.
    fn release(&self) {
        drop(lock(&self.guard).take());
    }

    #[getter]
    fn released(&self) -> bool {
        lock(&self.guard).is_none()
    }
}
