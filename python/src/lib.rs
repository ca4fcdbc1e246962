//! The native half of the `ferry` Python package (`ferry._ferry`).
//!
//! The public API is the Python package (`python/ferry/`): typed, documented
//! Python classes over the few native ones here. This module owns the
//! process's tokio runtime, on which every node runs, and the one way Python
//! waits for ferry: with the GIL released, in slices that let Ctrl-C through.

use std::future::Future;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pyo3::prelude::*;

mod errors;
mod layout;
mod memory;
mod node;
mod talk;
mod weights;
mod xfer;

/// How often a blocking wait looks for a signal (Ctrl-C) to deliver. A wait
/// that ends sooner never wakes for it; an idle node never wakes at all.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// The process's runtime: one worker drives every node's connections; a
/// blocking call runs its own future on the calling thread. One, not more:
/// a connection that polls its socket (`TcpConfig::busy_poll`) keeps waking
/// a runtime's idle workers, and those wake-ups take the core from the
/// thread that polls (an 8-byte TCP write's p50 was 60-100 µs with two
/// workers, 23 µs with one, on a 2-core VM).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ferry")
            .enable_all()
            .build()
            .expect("a tokio runtime: threads and an epoll instance")
    })
}

/// Runs `future` to completion with the GIL released. Every
/// [`SIGNAL_CHECK`] it takes the GIL to run Python's signal handlers: a
/// KeyboardInterrupt drops the future (cancelling what it was doing, as a
/// timeout would) and is raised.
fn block_on<F>(py: Python<'_>, future: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let mut future = std::pin::pin!(future);
    loop {
        let step = py.detach(|| {
            runtime().block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut future).await })
        });
        match step {
            Ok(output) => return Ok(output),
            Err(_elapsed) => py.check_signals()?,
        }
    }
}

/// Set at interpreter exit (`atexit`): from then on no runtime thread
/// calls into Python. A thread that takes the GIL while the interpreter
/// finalizes is made to exit by CPython, which Rust frames cannot survive.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Whether a runtime thread may still call into Python.
fn python_alive() -> bool {
    !EXITING.load(Ordering::Acquire)
}

/// Called by the package's `atexit` hook, after it closed every node.
#[pyfunction]
fn at_exit() {
    EXITING.store(true, Ordering::Release);
}

/// A timeout in seconds, as Python passes it.
fn seconds(timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout).map_err(|_| {
        errors::invalid(format!("timeout {timeout} is not a duration in seconds")).into()
    })
}

#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // ferry's one version (the workspace's): `ferry.__version__`.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(at_exit, m)?)?;
    m.add_class::<node::NativeNode>()?;
    m.add_class::<memory::NativeRegion>()?;
    m.add_class::<memory::NativeRemote>()?;
    m.add_class::<xfer::NativeLocalDescs>()?;
    m.add_class::<xfer::NativeRemoteDescs>()?;
    m.add_class::<xfer::NativePrepared>()?;
    m.add_class::<xfer::NativeXfer>()?;
    m.add_class::<layout::NativePlan>()?;
    m.add_class::<layout::NativeLayoutPlan>()?;
    m.add_class::<weights::NativePublisher>()?;
    m.add_class::<weights::NativeWriteGuard>()?;
    m.add_class::<weights::NativeSubscriber>()?;
    m.add_class::<weights::NativeReadGuard>()?;
    m.add_function(wrap_pyfunction!(layout::plan_layouts, m)?)?;
    m.add_function(wrap_pyfunction!(layout::rank_layout_json, m)?)?;
    Ok(())
}
