//! Two ferry nodes in two OS processes moving (and optionally verifying) data
//! over same-host memory and over TCP, with throughput, the transport each
//! row took, and memory use per block size.
//!
//! ```text
//! cargo run --release --example demo -- --verify
//! cargo run --release --example demo -- --help
//! ```
//!
//! The program re-executes itself with `--serve` to start the *target*: a node
//! that allocates one region, prints a `RemoteBuffer` for it as one JSON line
//! on stdout, and then answers one-line commands on stdin (`fill`, `check`,
//! `reset`, `stats`) until stdin closes. The *initiator* (this process) writes
//! and reads the whole remote region in ops of `--block` bytes and prints one
//! row per (op, block size, streams).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferry::TransportPath;
use ferry::prelude::*;

mod target;

use target::{Target, serve};

const USAGE: &str = "\
usage: demo [options]

  --size SIZE        bytes in the region on each side           [128M]
  --block LIST       op size(s), comma separated                [64K,1M,16M]
  --op LIST          write, read or write,read                  [write,read]
  --transport LIST   memory (same host), tcp, or memory,tcp     [memory,tcp]
  --streams LIST     TCP connections per peer, comma separated  [4]
  --batch N          ops per Submit                             [all ops of the region]
  --iters N          passes over the region per row             [16]
  --seconds S        instead of --iters: repeat passes for S seconds
  --chunk SIZE       TCP chunk size (library default 1M)
  --timeout S        deadline of each Submit, in seconds        [60]
  --verify           fill with a pattern and check every byte after each row
  --json             one JSON object per row on stdout instead of the table

SIZE takes K, M, G suffixes (binary: 1M = 1048576 bytes). GB/s is 1e9 bytes/s.
Peak RSS is VmHWM, reset before each row; \"over regions\" is peak RSS minus the
bytes registered as regions in that process.";

const MIB: f64 = (1 << 20) as f64;

#[derive(Clone, Debug)]
struct Args {
    serve: bool,
    /// Bytes; every length in ferry's API is `u64`.
    size: u64,
    blocks: Vec<u64>,
    ops: Vec<OpKind>,
    streams: Vec<usize>,
    /// Same-host memory, TCP or both, in this order.
    transports: Vec<RdmaTransportLevel>,
    batch: Option<usize>,
    iters: u32,
    seconds: Option<f64>,
    chunk: Option<u64>,
    timeout: Duration,
    verify: bool,
    json: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs (RUST_LOG=info or debug) go to stderr: the target's stdout is
    // its protocol. Warnings only by default, in both processes: the table
    // is a newcomer's first screen.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("demo: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = if args.serve {
        serve(args).await
    } else {
        initiate(args).await
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

// ------------------------------------------------------------- initiator side

/// One measured (op, block, streams) combination.
struct Row {
    /// The transport the ops took, as the node routed them.
    via: String,
    op: OpKind,
    block: u64,
    streams: usize,
    bytes: u64,
    secs: f64,
    rss: [u64; 2],
    /// What `--verify` confirmed, if it ran.
    verified: Option<String>,
}

async fn initiate(args: Args) -> Result<(), String> {
    let (mut target, remote) = Target::spawn(args.size).await?;
    let size = args.size;
    let reset = reset_peak_rss() && target.ask("reset").await? == "OK true";
    let passes = match args.seconds {
        Some(s) => format!("passes over the whole remote region for {s} s"),
        None => format!("{} passes over the whole remote region", args.iters),
    };
    let batch = match args.batch {
        Some(n) => format!("{n} ops per Submit"),
        None => "one Submit per pass".to_string(),
    };
    let rss = match reset {
        true => "peak resident memory during the row (VmHWM)",
        false => "peak resident memory since start (VmHWM; could not reset it)",
    };
    let intro = format!(
        "ferry demo: initiator pid {} -> target pid {} at {}, {} region on each side\n\
         each row: {passes}, in ops of `block` bytes, {batch}\n\
         RSS: {rss}; over regs: RSS minus the {} registered in that process",
        std::process::id(),
        target.child.id().unwrap_or(0),
        remote.owner().endpoint,
        size_str(size),
        size_str(size),
    );
    if args.json {
        eprintln!("{intro}");
    } else {
        println!("{intro}\n");
        println!(
            "{:<9} {:<6} {:>8} {:>7} {:>7} {:>9} | {:>14} {:>14} | {:>14} {:>14}",
            "via",
            "op",
            "block",
            "streams",
            "GB/s",
            "GiB",
            "initiator RSS",
            "target RSS",
            "init over regs",
            "tgt over regs"
        );
    }
    let mut seed = 0u64;
    // Same host first (ferry's fastest path between two processes of one
    // host), then TCP for each --streams (the network path; the memory
    // transport is turned off so that it cannot take over).
    let runs = args.transports.iter().flat_map(|&level| match level {
        RdmaTransportLevel::Tcp => args.streams.iter().map(|&s| (level, s)).collect(),
        _ => vec![(level, args.streams[0])],
    });
    for (level, streams) in runs {
        let memory = level == RdmaTransportLevel::Memory;
        let mut builder = Node::builder().memory(memory).tcp_connections(streams);
        if let Some(chunk) = args.chunk {
            builder = builder.tcp_chunk_size(chunk);
        }
        let node = builder.spawn().await.map_err(|e| e.to_string())?;
        let local = alloc(&node, size).await?;
        // Open every connection before anything is timed: one small op per stream.
        let warmup = (0..(streams as u64).min(size)).map(|i| {
            RdmaOp::read(
                local.slice(i..i + 1).unwrap(),
                remote.slice(i..i + 1).unwrap(),
            )
        });
        node.submit(warmup.collect(), args.timeout)
            .await
            .map_err(|e| format!("warm-up: {e}"))?;
        for &op in &args.ops {
            for &block in &args.blocks {
                seed += 1;
                let row = run_row(
                    &args,
                    &node,
                    &local,
                    &remote,
                    &mut target,
                    op,
                    block,
                    streams,
                    seed,
                )
                .await?;
                print_row(&args, &row);
            }
        }
        drop(local);
        node.shutdown().await;
    }
    let target_peak = target.finish().await?;
    if !args.json {
        println!(
            "\ntarget exited cleanly (its RSS peaked at {:.1} MiB since the last row began)",
            target_peak as f64 / MIB
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn run_row(
    args: &Args,
    node: &Node,
    local: &Region,
    remote: &RemoteBuffer,
    target: &mut Target,
    op: OpKind,
    block: u64,
    streams: usize,
    seed: u64,
) -> Result<Row, String> {
    let size = args.size;
    // Fresh contents on the side being copied from, and something else on the
    // side being copied to, so that a transfer that did nothing is caught.
    match op {
        OpKind::Write => fill(local, seed),
        OpKind::Read => {
            target.ask(&format!("fill {seed}")).await?;
            fill(local, !seed);
        }
    }
    // `block` is at most `size`, the length of a region this process holds,
    // so it fits usize.
    let ops: Vec<RdmaOp> = (0..size)
        .step_by(block as usize)
        .map(|at| {
            let end = (at + block).min(size);
            let local = local.slice(at..end).unwrap();
            let remote = remote.slice(at..end).unwrap();
            match op {
                OpKind::Write => RdmaOp::write(local, remote),
                OpKind::Read => RdmaOp::read(local, remote),
            }
        })
        .collect();
    let batch = args.batch.unwrap_or(ops.len()).max(1);
    let via = match node.path(&ops[0]) {
        Some(TransportPath::Memory(_)) => "memory".to_string(),
        Some(TransportPath::Tcp) => "tcp".to_string(),
        Some(TransportPath::Nic(_)) => "ibverbs".to_string(),
        None => return Err("no transport reaches the target".into()),
    };

    reset_peak_rss();
    target.ask("reset").await?;
    let start = Instant::now();
    let mut passes = 0u64;
    loop {
        for group in ops.chunks(batch) {
            let submitted = node.submit(group.to_vec(), args.timeout).await;
            submitted.map_err(|e| format!("{} of {} blocks: {e}", op_name(op), size_str(block)))?;
        }
        passes += 1;
        let done = match args.seconds {
            Some(s) => start.elapsed().as_secs_f64() >= s,
            None => passes >= args.iters as u64,
        };
        if done {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rss = [peak_rss(), target.peak_rss().await?];

    let mut verified = None;
    if args.verify {
        let what = format!(
            "{} of {} in {} blocks",
            op_name(op),
            size_str(size),
            size_str(block)
        );
        match op {
            OpKind::Write => match target.ask(&format!("check {seed}")).await?.as_str() {
                "OK" => {}
                other => return Err(format!("{what}: target region differs: {other}")),
            },
            OpKind::Read => {
                if let Some(at) = mismatch(local, seed) {
                    return Err(format!("{what}: local copy differs at byte {at}"));
                }
            }
        }
        verified = Some(match op {
            OpKind::Write => format!("verified: {what}: the target checked every byte"),
            OpKind::Read => format!("verified: {what}: every byte read back matches"),
        });
    }
    Ok(Row {
        via,
        op,
        block,
        streams,
        bytes: passes * size,
        secs,
        rss,
        verified,
    })
}

fn print_row(args: &Args, row: &Row) {
    let gbps = row.bytes as f64 / 1e9 / row.secs;
    let registered = args.size;
    let over = row.rss.map(|r| r as i64 - registered as i64);
    let op = op_name(row.op);
    if args.json {
        let json = serde_json::json!({
            "via": row.via,
            "op": op,
            "block": row.block,
            "streams": row.streams,
            "bytes": row.bytes,
            "seconds": row.secs,
            "gbps": gbps,
            "initiator_peak_rss": row.rss[0],
            "target_peak_rss": row.rss[1],
            "registered_per_process": registered,
            "initiator_rss_above_regions": over[0],
            "target_rss_above_regions": over[1],
            "verified": row.verified.is_some(),
        });
        println!("{json}");
        // Keep stdout pure JSON.
        if let Some(line) = &row.verified {
            eprintln!("{line}");
        }
    } else {
        let mib = |b: i64| format!("{:.1} MiB", b as f64 / MIB);
        // Streams are TCP connections: a same-host row has none.
        let streams = match row.via.as_str() {
            "tcp" => row.streams.to_string(),
            _ => "-".to_string(),
        };
        println!(
            "{:<9} {op:<6} {:>8} {:>7} {gbps:>7.2} {:>9.2} | {:>14} {:>14} | {:>14} {:>14}",
            row.via,
            size_str(row.block),
            streams,
            row.bytes as f64 / (1u64 << 30) as f64,
            mib(row.rss[0] as i64),
            mib(row.rss[1] as i64),
            mib(over[0]),
            mib(over[1]),
        );
        if let Some(line) = &row.verified {
            println!("       {line}");
        }
    }
}

fn op_name(op: OpKind) -> &'static str {
    match op {
        OpKind::Write => "write",
        OpKind::Read => "read",
    }
}

// ------------------------------------------------------------- shared helpers

async fn alloc(node: &Node, size: u64) -> Result<Region, String> {
    let region = node.alloc(size, Access::ReadWrite).await;
    region.map_err(|e| format!("allocating {}: {e}", size_str(size)))
}

/// Regions are filled and checked a piece at a time, so verification adds
/// at most this much to a process's memory.
const PIECE: u64 = 1 << 20;

/// The pattern's bytes at `start..start + buf.len()`; `start` is a multiple of 8.
fn pattern_at(seed: u64, start: u64, buf: &mut [u8]) {
    for (i, word) in buf.chunks_mut(8).enumerate() {
        let n = start / 8 + i as u64;
        let v = (n ^ seed.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed;
        word.copy_from_slice(&v.to_le_bytes()[..word.len()]);
    }
}

fn fill(region: &Region, seed: u64) {
    let mut buf = vec![0; PIECE as usize];
    for at in (0..region.len()).step_by(PIECE as usize) {
        let piece = &mut buf[..PIECE.min(region.len() - at) as usize];
        pattern_at(seed, at, piece);
        region.write_at(at, piece).unwrap();
    }
}

/// Offset of the first byte that differs from `seed`'s pattern.
fn mismatch(region: &Region, seed: u64) -> Option<u64> {
    let (mut have, mut want) = (vec![0; PIECE as usize], vec![0; PIECE as usize]);
    for at in (0..region.len()).step_by(PIECE as usize) {
        let n = PIECE.min(region.len() - at) as usize;
        region.read_at(at, &mut have[..n]).unwrap();
        pattern_at(seed, at, &mut want[..n]);
        if let Some(i) = (0..n).find(|&i| have[i] != want[i]) {
            return Some(at + i as u64);
        }
    }
    None
}

/// This process's peak resident set (VmHWM) in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with("VmHWM:"));
    let kib = line.and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok());
    kib.unwrap_or(0) * 1024
}

/// Restarts VmHWM from the current RSS (Linux >= 4.0). False if refused.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

// ------------------------------------------------------------------ arguments

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        serve: false,
        size: 128 << 20,
        blocks: vec![64 << 10, 1 << 20, 16 << 20],
        ops: vec![OpKind::Write, OpKind::Read],
        streams: vec![4],
        transports: vec![RdmaTransportLevel::Memory, RdmaTransportLevel::Tcp],
        batch: None,
        iters: 16,
        seconds: None,
        chunk: None,
        timeout: Duration::from_secs(60),
        verify: false,
        json: false,
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--serve" => args.serve = true,
            "--verify" => args.verify = true,
            "--json" => args.json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--size" => args.size = parse_size(&value()?)?,
            "--block" => args.blocks = list(&value()?, parse_size)?,
            "--streams" => args.streams = list(&value()?, parse_num)?,
            "--transport" => {
                args.transports = list(&value()?, |s| match s {
                    "memory" => Ok(RdmaTransportLevel::Memory),
                    "tcp" => Ok(RdmaTransportLevel::Tcp),
                    _ => Err(format!("unknown transport {s:?} (memory or tcp)")),
                })?
            }
            "--batch" => args.batch = Some(parse_num(&value()?)?),
            "--iters" => args.iters = parse_num(&value()?)? as u32,
            "--chunk" => args.chunk = Some(parse_size(&value()?)?),
            "--seconds" => args.seconds = Some(parse_secs(&value()?)?),
            "--timeout" => args.timeout = Duration::from_secs_f64(parse_secs(&value()?)?),
            "--op" => {
                args.ops = list(&value()?, |s| match s {
                    "write" => Ok(OpKind::Write),
                    "read" => Ok(OpKind::Read),
                    "both" => Err("use write,read".into()),
                    _ => Err(format!("unknown op {s:?}")),
                })?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !args.serve && args.blocks.iter().any(|&b| b > args.size) {
        return Err("a --block is larger than --size".into());
    }
    Ok(args)
}

fn list<T>(s: &str, parse: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    s.split(',').map(|v| parse(v.trim())).collect()
}

fn parse_num(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("expected a positive number, got {s:?}")),
    }
}

fn parse_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("expected positive seconds, got {s:?}")),
    }
}

/// `4096`, `64K`, `1M`, `2G` (also `KiB`, `MiB`, `GiB`), binary units.
fn parse_size(s: &str) -> Result<u64, String> {
    let lower = s.to_ascii_lowercase();
    let digits = lower.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match &lower[digits.len()..] {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return Err(format!("unknown unit in {s:?}")),
    };
    let n = parse_num(digits)? as u64;
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .ok_or(format!("{s:?} is too large"))
}

fn size_str(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}
