//! What the node reports through the `metrics` facade, per transport:
//! `ferry_ops_total` and `ferry_bytes_total` (by op kind) count the ops of
//! completed submits, `ferry_errors_total` failed submits (by op kind and
//! error), and `ferry_submit_seconds` is the submit latency histogram.
//!
//! The `transport` label is the backend (`tcp`, `ibverbs`, `memory`):
//! `memory` counts mapped copies and `process_vm` alike, since one memory
//! batch may mix the two. Which one an op takes is [`crate::Node::path`]'s
//! answer, per op.
//!
//! The counters and the histogram are registered once, when the node spawns,
//! not looked up on every submit: install a recorder before spawning a node
//! (as `metrics` advises), or the node's handles stay no-ops.

use std::time::{Duration, Instant};

use ferry_core::{OpKind, RdmaBackend, RdmaOp, SubmitError};
use metrics::{Counter, Histogram};

/// The handles of one transport.
pub(crate) struct Meters {
    transport: &'static str,
    /// Indexed by `kind_index`.
    ops: [Counter; 2],
    bytes: [Counter; 2],
    submit_seconds: Histogram,
}

const KINDS: [&str; 2] = ["read", "write"];

fn kind_index(kind: OpKind) -> usize {
    match kind {
        OpKind::Read => 0,
        OpKind::Write => 1,
    }
}

impl Meters {
    pub fn new(transport: &'static str) -> Self {
        let counter = |name: &'static str, op: &'static str| metrics::counter!(name, "transport" => transport, "op" => op);
        Meters {
            transport,
            ops: KINDS.map(|op| counter("ferry_ops_total", op)),
            bytes: KINDS.map(|op| counter("ferry_bytes_total", op)),
            submit_seconds: metrics::histogram!("ferry_submit_seconds", "transport" => transport),
        }
    }

    /// Runs `ops` on `backend`, counting them and timing the submit.
    pub async fn submit<B: RdmaBackend>(
        &self,
        backend: &B,
        ops: Vec<RdmaOp>,
        timeout: Duration,
    ) -> Result<(), SubmitError> {
        let submitted = Submitted::new(&ops);
        let result = backend.submit(ops, timeout).await;
        submitted.finish(self, &result);
        result
    }
}

/// One backend's share of a batch, in flight.
pub(crate) struct Submitted {
    /// (ops, bytes) per op kind.
    counts: [(u64, u64); 2],
    kinds: Vec<OpKind>,
    started: Instant,
}

impl Submitted {
    /// Takes what `ops` will move, before they are handed to the backend.
    pub fn new(ops: &[RdmaOp]) -> Self {
        let mut counts = [(0u64, 0u64); 2];
        for op in ops {
            let slot = &mut counts[kind_index(op.kind)];
            slot.0 += 1;
            slot.1 += op.len();
        }
        // Which op failed is known only by index: keep the kinds for mixed
        // batches (the only ones where the index is needed to tell).
        let kinds = if counts.iter().all(|c| c.0 > 0) {
            ops.iter().map(|op| op.kind).collect()
        } else {
            Vec::new()
        };
        Submitted {
            counts,
            kinds,
            started: Instant::now(),
        }
    }

    /// Takes what `count` ops of one `kind`, `bytes` in all, will move.
    pub fn uniform(kind: OpKind, count: usize, bytes: u64) -> Self {
        let mut counts = [(0u64, 0u64); 2];
        counts[kind_index(kind)] = (count as u64, bytes);
        Submitted {
            counts,
            kinds: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Counts the outcome on the transport's `meters`.
    pub fn finish(self, m: &Meters, result: &Result<(), SubmitError>) {
        m.submit_seconds
            .record(self.started.elapsed().as_secs_f64());
        match result {
            Ok(()) => {
                for (kind, (ops, bytes)) in self.counts.into_iter().enumerate() {
                    if ops > 0 {
                        m.ops[kind].increment(ops);
                        m.bytes[kind].increment(bytes);
                    }
                }
            }
            Err(e) => {
                let (op, error) = match e {
                    SubmitError::Op { index, .. } => {
                        let kind = match self.kinds.get(*index) {
                            Some(kind) => kind_index(*kind),
                            // A batch of one kind.
                            None if self.counts[0].0 > 0 => 0,
                            None => 1,
                        };
                        (KINDS[kind], "op")
                    }
                    SubmitError::Timeout { .. } => ("batch", "timeout"),
                    SubmitError::BackendStopped => ("batch", "backend_stopped"),
                    SubmitError::ShutDown => ("batch", "shut_down"),
                    _ => ("batch", "other"),
                };
                metrics::counter!("ferry_errors_total", "transport" => m.transport, "op" => op, "error" => error)
                    .increment(1);
            }
        }
    }
}
