//! `ferry bench --op register`: what registering memory costs with the
//! transports the node runs (`--transport` picks them), per block size:
//! registrations per second, GB/s registered, and each registration's
//! latency, its deregistration (the region dropped) included. The memory
//! is this process's, touched once beforehand, so the figures are the
//! transports' (an ibverbs registration pins and maps every page), not
//! the allocator's or the kernel's first touch. `--within` registers the
//! whole buffer first, so every measured registration is a view inside a
//! registered region.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::prelude::*;
use ferry::{MemoryBlock, RdmaTransportLevel};

use crate::Failure;
use crate::bench::{BenchArgs, Op};
use crate::rows::{Row, peak_rss, percentile};
use crate::verify::BenchError;

/// One row per block size; see the module docs.
pub(crate) async fn rows(args: &BenchArgs, node: &Node) -> Result<Vec<Row>, BenchError> {
    let transport = running(node);
    // One buffer, every page written: each registration takes a block of it.
    let buffer = Arc::new(Buffer::new(args.size as usize));
    // With --within, every block lies inside this registered region.
    let _outer = match args.within {
        true => Some(
            register(node, &buffer, 0, args.size)
                .await
                .map_err(|Failure(e)| BenchError::Setup(e))?,
        ),
        false => None,
    };
    let mut rows = Vec::new();
    for &block in &args.block {
        let failed = |error: Failure| BenchError::Run {
            op: Op::Register.name(),
            block,
            error: error.0,
        };
        let count = args.size / block.max(1);
        if count == 0 {
            return Err(BenchError::Setup(format!(
                "a block of {block} B is larger than --size {}",
                args.size
            )));
        }
        let mut next = 0;
        let mut one = async || {
            let at = (next % count) * block;
            next += 1;
            let t = Instant::now();
            let region = register(node, &buffer, at, block).await?;
            drop(region);
            Ok::<f64, Failure>(t.elapsed().as_secs_f64() * 1e6)
        };
        let mut first = None;
        for _ in 0..args.warmup {
            let took = one().await.map_err(failed)?;
            first.get_or_insert(took);
        }
        let started = Instant::now();
        let mut latencies = Vec::new();
        loop {
            latencies.push(one().await.map_err(failed)?);
            let done = match args.duration {
                Some(s) => started.elapsed() >= Duration::from_secs_f64(s),
                None => latencies.len() >= args.iters.max(1),
            };
            if done {
                break;
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let first_us = first.unwrap_or(latencies[0]);
        latencies.sort_by(f64::total_cmp);
        let n = latencies.len();
        let bytes = n as u64 * block;
        rows.push(Row {
            op: Op::Register,
            transport,
            via: args.via,
            workers: 1,
            streams: args.streams,
            block,
            batch: 1,
            notify: 0,
            submits: n,
            bytes,
            seconds,
            gbps: bytes as f64 / seconds / 1e9,
            mops: n as f64 / seconds / 1e6,
            lat_avg_us: latencies.iter().sum::<f64>() / n as f64,
            lat_p50_us: percentile(&latencies, 0.5),
            lat_p99_us: percentile(&latencies, 0.99),
            verified: false,
            prepared: false,
            first_us,
            est_us: None,
            est_method: None,
            peak_rss: peak_rss(),
            registered: args.size,
        });
    }
    Ok(rows)
}

/// `block` bytes of `buffer` at `at`, registered with every transport the
/// node runs.
async fn register(
    node: &Node,
    buffer: &Arc<Buffer>,
    at: u64,
    block: u64,
) -> Result<Region, Failure> {
    // SAFETY: `at + block` is within the buffer (at most `count - 1`
    // blocks in), so the offset stays inside its allocation.
    let ptr = unsafe { buffer.0.add(at as usize) };
    // SAFETY: the range is valid for reads and writes for as long as the
    // keep-alive, a clone of the buffer's Arc, lives, and this process
    // touches it only through raw pointers meanwhile.
    let memory = unsafe { MemoryBlock::from_raw(ptr, block, Box::new(buffer.clone())) }?;
    Ok(node.register(memory, Access::ReadWrite).await?)
}

/// Heap memory shared by the registrations of its blocks, reached only
/// through raw pointers (a peer may write it), freed when the last goes.
struct Buffer(NonNull<u8>, usize);

// SAFETY: plain heap memory with no thread affinity; see `Buffer`.
unsafe impl Send for Buffer {}
// SAFETY: as above; nothing reads it through a reference.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// `len` bytes, every page written once.
    fn new(len: usize) -> Self {
        let bytes = Box::into_raw(vec![1u8; len].into_boxed_slice());
        Buffer(
            NonNull::new(bytes.cast::<u8>()).expect("a box is never null"),
            len,
        )
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let bytes = std::ptr::slice_from_raw_parts_mut(self.0.as_ptr(), self.1);
        // SAFETY: made by `Box::into_raw` in `new` with this length, and
        // freed only here, once the last registration let go.
        drop(unsafe { Box::from_raw(bytes) });
    }
}

/// The transports a registration goes to here, e.g. "tcp+memory".
fn running(node: &Node) -> &'static str {
    let on = |level| node.unavailable(level).is_none();
    match (on(RdmaTransportLevel::Nic), on(RdmaTransportLevel::Memory)) {
        (true, true) => "tcp+ibverbs+memory",
        (true, false) => "tcp+ibverbs",
        (false, true) => "tcp+memory",
        (false, false) => "tcp",
    }
}
