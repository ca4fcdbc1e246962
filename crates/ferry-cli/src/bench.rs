//! `ferry serve` and `ferry bench`: a target node, and an initiator that
//! measures transfers against it, in the style of perftest and nixlbench.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferry::prelude::*;
use serde::Serialize;

/// Deadline of any single submit.
const SUBMIT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `--loopback` waits for the server it started to print its handle.
const SERVE_START: Duration = Duration::from_secs(30);

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
    /// Bytes to register for bench clients (K, M, G suffixes: powers of 1024).
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    pub size: u64,
    /// Write the region's handle (JSON) to this file instead of stdout.
    #[arg(long)]
    pub handle_file: Option<PathBuf>,
    /// Run TCP only, even where an RDMA device exists.
    #[arg(long)]
    pub no_ibverbs: bool,
    /// Serve Prometheus metrics on this address (GET /metrics): bytes and
    /// requests served per transport and op kind.
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The fastest transport both ends share.
    Auto,
    Tcp,
    Ibverbs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Write,
    Read,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Handle file written by `ferry serve`.
    #[arg(
        long,
        required_unless_present = "loopback",
        conflicts_with = "loopback"
    )]
    pub handle: Option<PathBuf>,
    /// Start a `ferry serve` process on 127.0.0.1 and measure against it.
    #[arg(long)]
    pub loopback: bool,
    /// Region size for `--loopback` (K, M, G suffixes).
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    pub size: u64,
    /// Block sizes to sweep, comma separated (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "4K,64K,1M,16M,64M")]
    pub block: Vec<u64>,
    #[arg(long, value_enum, default_value = "write")]
    pub op: Op,
    /// Ops per submit (default: as many blocks as fit in the region).
    #[arg(long)]
    pub batch: Option<usize>,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Measured submits per block size.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Measure for this many seconds per block size instead of --iters.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Unmeasured submits before each block size.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: Transport,
    /// Check every byte after each block size.
    #[arg(long)]
    pub verify: bool,
    /// One JSON object per block size instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Serve Prometheus metrics on this address while the bench runs: bytes,
    /// ops and errors per transport and op kind, submit latency histogram.
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
}

/// Installs the Prometheus recorder with its HTTP listener on `addr`.
pub fn export_metrics(addr: std::net::SocketAddr) -> Result<(), Failure> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| Failure(format!("cannot serve metrics on {addr}: {e}")))
}

/// A user-facing failure: printed as one line, exit status 1.
#[derive(Debug)]
pub struct Failure(pub String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

/// A size in bytes, as `u64` like every length in ferry's API.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 10),
        Some((i, 'M' | 'm')) => (&text[..i], 20),
        Some((i, 'G' | 'g')) => (&text[..i], 30),
        _ => (text, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a size (e.g. 4096, 64K, 1M)"))?;
    let bytes = n
        .checked_shl(shift)
        .filter(|b| b >> shift == n)
        .ok_or(format!("'{text}' is too large"))?;
    if bytes == 0 {
        return Err("a size must be at least 1 byte".into());
    }
    Ok(bytes)
}

pub async fn serve(args: ServeArgs) -> Result<(), Failure> {
    if let Some(addr) = args.metrics {
        export_metrics(addr)?;
    }
    let node = Node::builder()
        .listen(args.listen)
        .ibverbs(!args.no_ibverbs)
        .spawn()
        .await?;
    let region = node.alloc(args.size, Access::ReadWrite).await?;
    let handle = serde_json::to_string(&region.remote())?;
    match &args.handle_file {
        Some(path) => std::fs::write(path, format!("{handle}\n"))
            .map_err(|e| Failure(format!("cannot write {}: {e}", path.display())))?,
        None => {
            let mut out = std::io::stdout();
            writeln!(out, "{handle}")?;
            out.flush()?;
        }
    }
    eprintln!(
        "ferry serve: {} bytes registered at {}; stop with Ctrl-C or by closing stdin",
        args.size,
        node.addr().endpoint
    );
    // Serve until stdin closes (how `--loopback` stops its child) or the
    // process is killed.
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    })
    .await?;
    drop(region);
    Ok(())
}

/// A `ferry serve` child; closing its stdin (on drop) stops it.
struct Server {
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(args: &BenchArgs) -> Result<(Server, RemoteBuffer), Failure> {
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--size",
        &args.size.to_string(),
    ]);
    if args.transport == Transport::Tcp {
        command.arg("--no-ibverbs");
    }
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let server = Server { child };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = tx.send(BufReader::new(stdout).read_line(&mut line).map(|_| line));
    });
    let line = rx
        .recv_timeout(SERVE_START)
        .map_err(|_| Failure("the loopback server did not start in time".into()))??;
    let handle = serde_json::from_str(&line)
        .map_err(|e| Failure(format!("loopback server: bad handle: {e}")))?;
    Ok((server, handle))
}

#[derive(Serialize)]
pub struct Row {
    pub op: Op,
    pub transport: &'static str,
    /// TCP connections per peer (`--streams`).
    pub streams: usize,
    pub block: u64,
    pub batch: usize,
    pub submits: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub mops: f64,
    pub lat_avg_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub verified: bool,
    /// Peak resident memory of this process so far (VmHWM), and the bytes it
    /// has registered: their difference is what the transfer cost in memory.
    pub peak_rss: u64,
    pub registered: u64,
}

/// This process's peak resident set size, from /proc (0 where unavailable).
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

/// Pieces in which regions are filled and compared, so the bench never holds
/// a copy of the payload (which would distort its memory figures).
const PIECE: u64 = 1 << 20;

/// The bytes `at..at + len` of the test pattern for `seed`.
fn pattern(at: u64, len: u64, seed: u8) -> Vec<u8> {
    (at..at + len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(29)
                .wrapping_add(seed ^ (i >> 16) as u8)
        })
        .collect()
}

/// Writes the pattern (or zeros) into `region[..len]`, a piece at a time.
fn fill(region: &Region, len: u64, seed: Option<u8>) -> Result<(), Failure> {
    for at in (0..len).step_by(PIECE as usize) {
        let n = PIECE.min(len - at);
        let bytes = match seed {
            Some(seed) => pattern(at, n, seed),
            None => vec![0; n as usize],
        };
        region.write_at(at, &bytes)?;
    }
    Ok(())
}

/// The first offset where `region[..len]` differs from the pattern.
fn first_difference(region: &Region, len: u64, seed: u8) -> Result<Option<u64>, Failure> {
    let mut got = vec![0; PIECE.min(len) as usize];
    for at in (0..len).step_by(PIECE as usize) {
        let n = PIECE.min(len - at) as usize;
        region.read_at(at, &mut got[..n])?;
        if let Some(i) = got[..n]
            .iter()
            .zip(pattern(at, n as u64, seed))
            .position(|(a, b)| *a != b)
        {
            return Ok(Some(at + i as u64));
        }
    }
    Ok(None)
}

pub async fn bench(args: BenchArgs) -> Result<Vec<Row>, Failure> {
    if let Some(addr) = args.metrics {
        export_metrics(addr)?;
    }
    let (_server, remote) = match &args.handle {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Failure(format!("cannot read handle file {}: {e}", path.display())))?;
            let handle = serde_json::from_str(text.trim())
                .map_err(|e| Failure(format!("{} is not a ferry handle: {e}", path.display())))?;
            (None, handle)
        }
        None => {
            let (server, handle) = start_server(&args)?;
            (Some(server), handle)
        }
    };
    let node = Node::builder()
        .tcp_connections(args.streams)
        .ibverbs(args.transport != Transport::Tcp)
        .spawn()
        .await?;
    let size = remote.len();
    let local = node.alloc(size, Access::ReadWrite).await?;
    let probe = RdmaOp::write(local.slice(0..1)?, remote.slice(0..1)?);
    let level = node
        .route(&probe)
        .ok_or_else(|| Failure("no transport shared with the target".into()))?;
    let transport = match level {
        RdmaTransportLevel::Nic => "ibverbs",
        _ => "tcp",
    };
    if args.transport == Transport::Ibverbs && transport != "ibverbs" {
        let why = node
            .ibverbs_unavailable()
            .unwrap_or("the target has no RDMA device");
        return Err(Failure(format!(
            "--transport ibverbs: not available here: {why}"
        )));
    }

    let progress = progress_bar(&args);
    let mut rows = Vec::new();
    for &block in &args.block {
        progress.set_message(format!("{} {block} B blocks", args.op.name()));
        if block > size {
            return Err(Failure(format!(
                "block {block} B is larger than the {size}-byte target region"
            )));
        }
        // Fits usize: at most the length of `local`, which this process holds.
        let blocks = (size / block) as usize;
        let batch = args.batch.unwrap_or(blocks).clamp(1, blocks);
        let seed = block as u8;
        // Bytes one submit covers.
        let span = batch as u64 * block;
        fill(&local, span, Some(seed))?;
        let ops = |kind: Op| -> Result<Vec<RdmaOp>, Failure> {
            (0..batch)
                .map(|i| {
                    let at = i as u64 * block;
                    let l = local.slice(at..at + block)?;
                    let r = remote.slice(at..at + block)?;
                    Ok(match kind {
                        Op::Write => RdmaOp::write(l, r),
                        Op::Read => RdmaOp::read(l, r),
                    })
                })
                .collect()
        };
        if args.op == Op::Read && args.verify {
            // Put known bytes there first, so the reads have something to check.
            node.submit(ops(Op::Write)?, SUBMIT_TIMEOUT).await?;
            fill(&local, span, None)?;
        }
        for _ in 0..args.warmup {
            node.submit(ops(args.op)?, SUBMIT_TIMEOUT).await?;
        }
        let mut latencies = Vec::new();
        let started = Instant::now();
        loop {
            let batch_ops = ops(args.op)?;
            let t = Instant::now();
            node.submit(batch_ops, SUBMIT_TIMEOUT).await?;
            latencies.push(t.elapsed().as_secs_f64() * 1e6);
            progress.inc(1);
            let done = match args.duration {
                Some(s) => started.elapsed().as_secs_f64() >= s,
                None => latencies.len() >= args.iters.max(1),
            };
            if done {
                break;
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let verified =
            args.verify && verify(&node, &local, &remote, seed, args.op, batch, block).await?;
        let submits = latencies.len();
        let bytes = submits as u64 * span;
        latencies.sort_by(f64::total_cmp);
        rows.push(Row {
            op: args.op,
            transport,
            streams: args.streams,
            block,
            batch,
            submits,
            bytes,
            seconds,
            gbps: bytes as f64 / seconds / 1e9,
            mops: (submits * batch) as f64 / seconds / 1e6,
            lat_avg_us: latencies.iter().sum::<f64>() / submits as f64,
            lat_p50_us: percentile(&latencies, 0.5),
            lat_p99_us: percentile(&latencies, 0.99),
            verified,
            peak_rss: peak_rss(),
            // The local region, plus the read-back region of a verified write.
            registered: size
                + if verified && args.op == Op::Write {
                    span
                } else {
                    0
                },
        });
    }
    progress.finish_and_clear();
    Ok(rows)
}

/// A bar over all measured submits, for a person at a terminal only: never
/// with `--json` (output for programs, which may share the terminal, as on a
/// VM's serial console), when stderr is piped, or under CI.
fn progress_bar(args: &BenchArgs) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if args.json || !std::io::stderr().is_terminal() || std::env::var_os("CI").is_some() {
        return indicatif::ProgressBar::hidden();
    }
    let total = match args.duration {
        Some(_) => None,
        None => Some((args.iters.max(1) * args.block.len()) as u64),
    };
    let bar =
        indicatif::ProgressBar::with_draw_target(total, indicatif::ProgressDrawTarget::stderr());
    let style =
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} submits")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// After writes: reads the target back into a second region and compares
/// with what was written. After reads: compares what arrived.
async fn verify(
    node: &Node,
    local: &Region,
    remote: &RemoteBuffer,
    seed: u8,
    op: Op,
    batch: usize,
    block: u64,
) -> Result<bool, Failure> {
    let len = batch as u64 * block;
    let difference = match op {
        Op::Read => first_difference(local, len, seed)?,
        Op::Write => {
            let back = node.alloc(len, Access::ReadWrite).await?;
            let read = RdmaOp::read(back.whole(), remote.slice(0..len)?);
            node.submit(vec![read], SUBMIT_TIMEOUT).await?;
            first_difference(&back, len, seed)?
        }
    };
    match difference {
        None => Ok(true),
        Some(at) => Err(Failure(format!(
            "verify failed: byte {at} of the {block}-byte-block run differs"
        ))),
    }
}

pub fn print_table(rows: &[Row]) {
    println!(
        "{:<6} {:<8} {:>10} {:>6} {:>9} {:>9} {:>10} {:>10} {:>10}",
        "op", "via", "block", "batch", "GB/s", "Mops/s", "lat avg", "p50 us", "p99 us"
    );
    for r in rows {
        println!(
            "{:<6} {:<8} {:>10} {:>6} {:>9.3} {:>9.4} {:>10.1} {:>10.1} {:>10.1}{}",
            r.op.name(),
            r.transport,
            r.block,
            r.batch,
            r.gbps,
            r.mops,
            r.lat_avg_us,
            r.lat_p50_us,
            r.lat_p99_us,
            if r.verified { "  verified" } else { "" }
        );
    }
}
