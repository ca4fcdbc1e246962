//! `ferry bench`'s output: one row per block size, as JSON or a table,
//! with the figures every kind of run shares.

use serde::Serialize;

use crate::bench::{Op, Via};

/// One block size's results.
#[derive(Serialize)]
pub struct Row {
    /// The op.
    pub op: Op,
    /// The transport the ops took.
    pub transport: &'static str,
    /// How submits reached the node.
    pub via: Via,
    /// Concurrent workers.
    pub workers: usize,
    /// TCP connections per peer (`--streams`).
    pub streams: usize,
    /// Bytes per op.
    pub block: u64,
    /// Ops per submit.
    pub batch: usize,
    /// Bytes of the notification attached to each submit (0: none).
    pub notify: u64,
    /// Measured submits, all workers together.
    pub submits: usize,
    /// Bytes moved by them.
    pub bytes: u64,
    /// Wall time of the measurement.
    pub seconds: f64,
    /// Aggregate GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// Aggregate millions of ops per second.
    pub mops: f64,
    /// Mean submit latency, microseconds.
    pub lat_avg_us: f64,
    /// Median submit latency.
    pub lat_p50_us: f64,
    /// 99th percentile submit latency.
    pub lat_p99_us: f64,
    /// Whether every byte was checked.
    pub verified: bool,
    /// Transfer requests on prepared lists (`--prepared`), not submits.
    pub prepared: bool,
    /// The first unit of work of this block size (the first warm-up, or
    /// the first measured one without), in microseconds: on the first row, with whatever set-up the first
    /// transfer to the target pays (none after `--connect`).
    pub first_us: f64,
    /// With --prepared: the node's estimate for one request, made after
    /// the warm-up, in microseconds, to hold against `lat_p50_us`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub est_us: Option<f64>,
    /// How the estimate was made: "measured" or "configured".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub est_method: Option<&'static str>,
    /// Peak resident memory of this process so far (VmHWM), and the bytes it
    /// has registered: their difference is what the transfer cost in memory.
    pub peak_rss: u64,
    /// Bytes this process registered.
    pub registered: u64,
}

/// This process's peak resident set size, from /proc (0 where unavailable).
pub(crate) fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

/// Prints rows as a table.
pub fn print_table(rows: &[Row]) {
    println!(
        "{:<6} {:<9} {:<5} {:>7} {:>10} {:>6} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "op",
        "transport",
        "via",
        "workers",
        "block",
        "batch",
        "GB/s",
        "Mops/s",
        "lat avg",
        "p50 us",
        "p99 us",
        "first us",
        "est us"
    );
    for r in rows {
        let via = match r.via {
            Via::Node => "node",
            Via::Actor => "actor",
            Via::Echo => "echo",
        };
        let est = match (r.est_us, r.est_method) {
            (Some(us), Some("configured")) => format!("{us:.1}*"),
            (Some(us), _) => format!("{us:.1}"),
            _ => "-".into(),
        };
        println!(
            "{:<6} {:<9} {:<5} {:>7} {:>10} {:>6} {:>9.3} {:>9.4} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10}{}{}",
            r.op.name(),
            r.transport,
            via,
            r.workers,
            r.block,
            r.batch,
            r.gbps,
            r.mops,
            r.lat_avg_us,
            r.lat_p50_us,
            r.lat_p99_us,
            r.first_us,
            est,
            if r.prepared { "  prepared" } else { "" },
            if r.verified { "  verified" } else { "" }
        );
    }
}
