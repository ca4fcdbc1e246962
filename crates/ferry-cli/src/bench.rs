//! `ferry bench`: an initiator that measures transfers against a served
//! region, in the style of perftest and nixlbench: per block size, GB/s,
//! Mops/s and submit latency, from one or several concurrent workers that
//! submit either through the node's actor or by calling the node.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, ValueEnum};
use ferry::prelude::*;
use ferry::{Descs, LocalDescList, PreparedRemote, RemoteDescList};
use serde::Serialize;

use crate::discovery::EtcdArgs;
pub use crate::rows::{Row, print_table};
use crate::rows::{peak_rss, percentile};
use crate::submitter::Submitter;
use crate::target::{Target, setup};
use crate::verify::{BenchError, VERIFY_PIECE, VerifyError, prepare, verify};
use crate::{Failure, parse_size};

/// Deadline of any single submit.
pub(crate) const SUBMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Which transport `bench` insists on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The fastest transport both ends share.
    Auto,
    /// TCP only (this node starts without ibverbs).
    Tcp,
    /// ibverbs only: fails if it is not shared with the target.
    Ibverbs,
    /// Same-host memory only: fails unless the target is on this host.
    Memory,
}

/// The op every submit of a run carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Local bytes into the target.
    Write,
    /// The target's bytes into local memory.
    Read,
    /// A call of the target's `echo` RPC handler with --block bytes, which
    /// answers them back (checked with --verify).
    Rpc,
    /// A --block-byte message into the target's inbox.
    Message,
    /// No transfer: register (and drop) --block bytes of memory this
    /// process already holds, with every transport the node runs
    /// (`--transport` picks them): registrations per second and GB/s
    /// registered.
    Register,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
            Op::Rpc => "rpc",
            Op::Message => "message",
            Op::Register => "register",
        }
    }
}

/// How the workers' submits reach the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// `Node::submit`, called in each worker's task.
    Node,
    /// `Submit` messages to the node's actor, as worker actors send them.
    Actor,
    /// No transfer: each submit is an empty message to an actor that does
    /// nothing, on the same runtime. Its latency is the mailbox round trip
    /// alone, kameo's floor under `--via actor` (nothing is verified).
    Echo,
}

/// Arguments of `ferry bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Handle file written by `ferry serve`.
    #[arg(
        long,
        required_unless_present_any = ["loopback", "peer"],
        conflicts_with_all = ["loopback", "peer"]
    )]
    pub handle: Option<PathBuf>,
    /// The node to measure against: its name (found through --etcd), or
    /// HOST:PORT (its metadata fetched from it directly). With --region.
    #[arg(long, requires = "region", conflicts_with = "loopback")]
    pub peer: Option<String>,
    /// The name the --peer published its region under (`serve --publish`).
    #[arg(long, value_name = "REGION_NAME", requires = "peer")]
    pub region: Option<String>,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub secret: crate::secret::SecretArgs,
    /// Start a `ferry serve` process on 127.0.0.1 and measure against it.
    #[arg(long)]
    pub loopback: bool,
    /// Region size for `--loopback` (K, M, G suffixes).
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    pub size: u64,
    /// Block sizes to sweep, comma separated (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "4K,64K,1M,16M,64M")]
    pub block: Vec<u64>,
    /// The op of every submit.
    #[arg(long, value_enum, default_value = "write")]
    pub op: Op,
    /// Ops per submit (default: as many blocks as fit in a worker's share of
    /// the region).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Transfer requests on prepared descriptor lists instead of submits:
    /// one list of --block descriptors over each side's region, prepared
    /// once per block size; each unit of work makes a request of --descs
    /// of them (`make_xfer`), posts it and waits, as KV-cache connectors do.
    #[arg(long)]
    pub prepared: bool,
    /// Descriptors per request with --prepared (the same as --batch).
    #[arg(long, requires = "prepared", conflicts_with = "batch")]
    pub descs: Option<usize>,
    /// With --prepared: both lists in the strided form (four numbers each),
    /// not one entry per descriptor.
    #[arg(long, requires = "prepared")]
    pub strided: bool,
    /// With --op register: register the whole --size buffer first, so that
    /// every measured registration is a view inside a registered region (a
    /// KV pool and its blocks), which ibverbs serves from the outer MR.
    #[arg(long)]
    pub within: bool,
    /// Connect to the target (`Node::connect`) before the first transfer,
    /// so that the first unit of work (`first_us`) pays no set-up.
    #[arg(long)]
    pub connect: bool,
    /// Concurrent workers, each submitting over its own share of the region.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// How submits reach the node: its actor, or direct calls.
    #[arg(long, value_enum, default_value = "node")]
    pub via: Via,
    /// Attach a notification of this many bytes to every submit: the
    /// target's inbox receives it once the submit's ops have completed
    /// (`submit_with_notification`).
    #[arg(long, value_parser = parse_size)]
    pub notify: Option<u64>,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// TCP bytes in flight per connection (K, M suffixes; default 8M).
    #[arg(long, value_parser = parse_size)]
    pub window: Option<u64>,
    /// Microseconds each TCP data connection polls for answers before its
    /// task sleeps (0: never poll; default 100); `--loopback` gives its
    /// server the same.
    #[arg(long)]
    pub busy_poll_us: Option<u64>,
    /// Worker threads of this process's runtime (see docs/operating.md,
    /// "Threads"); `--loopback` gives its server the same.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Measured submits per block size and worker.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Measure for this many seconds per block size instead of --iters.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Unmeasured submits per worker before each block size.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// The transport to insist on.
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

/// Writes the pattern (or zeros) into `region[range]`, a piece at a time.
fn fill(region: &Region, range: std::ops::Range<u64>, seed: Option<u8>) -> Result<(), Failure> {
    for at in range.clone().step_by(PIECE as usize) {
        let n = PIECE.min(range.end - at);
        let bytes = match seed {
            Some(seed) => pattern(at, n, seed),
            None => vec![0; n as usize],
        };
        region.write_at(at, &bytes)?;
    }
    Ok(())
}

/// The first offset in `range` where `region` (holding `range` at `base`)
/// differs from the pattern.
pub(crate) fn first_difference(
    region: &Region,
    base: u64,
    range: std::ops::Range<u64>,
    seed: u8,
) -> Result<Option<u64>, Failure> {
    let mut got = vec![0; PIECE.min(range.end - range.start) as usize];
    for at in range.clone().step_by(PIECE as usize) {
        let n = PIECE.min(range.end - at) as usize;
        region.read_at(at - base, &mut got[..n])?;
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

/// One worker's share of a block size's run: `batch` blocks from `first`.
#[derive(Clone)]
pub(crate) struct Share {
    pub local: Region,
    pub remote: RemoteBuffer,
    first: u64,
    batch: usize,
    /// What an RPC or message run sends: --block bytes (else empty).
    pub payload: Bytes,
    block: u64,
    /// With --prepared: each side's list of every block, prepared once.
    pub prepared: Option<(LocalDescList, PreparedRemote)>,
}

impl Share {
    /// The target's bytes this share covers.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.first..self.first + self.batch as u64 * self.block
    }

    /// The descriptors of the prepared lists this share's requests use.
    pub fn descs(&self) -> std::ops::Range<usize> {
        let first = (self.first / self.block) as usize;
        first..first + self.batch
    }

    pub fn ops(&self, kind: Op) -> Result<Vec<RdmaOp>, Failure> {
        (0..self.batch as u64)
            .map(|i| {
                let at = self.first + i * self.block;
                let l = self.local.slice(at..at + self.block)?;
                let r = self.remote.slice(at..at + self.block)?;
                match kind {
                    Op::Write => Ok(RdmaOp::write(l, r)),
                    Op::Read => Ok(RdmaOp::read(l, r)),
                    Op::Rpc | Op::Message | Op::Register => Err(Failure("not a transfer".into())),
                }
            })
            .collect()
    }
}

/// When a worker stops measuring.
#[derive(Clone, Copy)]
enum Until {
    Submits(usize),
    /// After this long, counted from the common start.
    Time(Duration),
}

/// Runs one worker: warm-up, then (once every worker has warmed up, at
/// `start`) measured submits; returns its latencies in microseconds.
async fn work(
    submitter: Submitter,
    share: Share,
    op: Op,
    warmup: usize,
    until: Until,
    start: std::sync::Arc<tokio::sync::Barrier>,
    progress: indicatif::ProgressBar,
) -> Result<(f64, Vec<f64>), Failure> {
    let warm = async {
        let mut first = None;
        for _ in 0..warmup {
            let t = Instant::now();
            submitter.run(&share, op).await?;
            first.get_or_insert(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok::<_, Failure>(first)
    }
    .await;
    // Every worker reaches the start, failed or not, so none waits forever.
    start.wait().await;
    // Without a warm-up, the first measured unit is the first.
    let first = warm?;
    let started = Instant::now();
    let mut latencies = Vec::new();
    loop {
        let t = Instant::now();
        submitter.run(&share, op).await?;
        latencies.push(t.elapsed().as_secs_f64() * 1e6);
        progress.inc(1);
        let done = match until {
            Until::Submits(n) => latencies.len() >= n,
            Until::Time(limit) => started.elapsed() >= limit,
        };
        if done {
            return Ok((first.unwrap_or(latencies[0]), latencies));
        }
    }
}

/// Runs `ferry bench`: one row per block size. A failure says whether it
/// came from the setup, a measured run, or a verification.
pub async fn bench(args: BenchArgs) -> Result<Vec<Row>, BenchError> {
    let Target {
        node,
        server: _server,
        remote,
        local,
        size,
        transport,
        transfers,
        submitter,
    } = setup(&args).await?;
    let workers = args.workers.max(1);
    if args.op == Op::Register {
        return crate::register::rows(&args, &node).await;
    }
    if args.connect {
        node.connect(remote.owner(), SUBMIT_TIMEOUT)
            .await
            .map_err(|e| BenchError::Setup(format!("cannot connect to the target: {e}")))?;
    }

    let progress = progress_bar(&args);
    let mut rows = Vec::new();
    for &block in &args.block {
        progress.set_message(format!("{} {block} B blocks", args.op.name()));
        // Fits usize: at most the length of `local`, which this process holds.
        let per_worker = (size / block) as usize / workers;
        if per_worker == 0 {
            return Err(BenchError::Setup(format!(
                "{workers} worker(s) need {workers} blocks of {block} B, more than the \
                 {size}-byte target region holds"
            )));
        }
        // A call or a message is one unit of work.
        let batch = match transfers {
            true => args
                .batch
                .or(args.descs)
                .unwrap_or(per_worker)
                .clamp(1, per_worker),
            false => 1,
        };
        let seed = block as u8;
        let run_failed = |error: String| BenchError::Run {
            op: args.op.name(),
            block,
            error,
        };
        let verify_failed = |error: VerifyError| BenchError::Verify {
            op: args.op.name(),
            block,
            error,
        };
        let payload = match args.op {
            // Fits usize: a block of the region this process allocated.
            Op::Rpc | Op::Message => Bytes::from(vec![seed; block as usize]),
            Op::Write | Op::Read | Op::Register => Bytes::new(),
        };
        let prepared = match args.prepared && transfers {
            true => Some(
                prepare_lists(&node, &local, &remote, block, args.strided)
                    .await
                    .map_err(|Failure(e)| BenchError::Setup(e))?,
            ),
            false => None,
        };
        let shares: Vec<Share> = (0..workers)
            .map(|w| Share {
                local: local.clone(),
                remote: remote.clone(),
                first: (w * per_worker) as u64 * block,
                batch,
                payload: payload.clone(),
                block,
                prepared: prepared.clone(),
            })
            .collect();
        for share in &shares {
            fill(&local, share.range(), Some(seed))?;
        }
        if args.op == Op::Read && args.verify {
            // Put known bytes there first, so the reads have something to check.
            for share in &shares {
                prepare(&node, share).await.map_err(verify_failed)?;
                fill(&local, share.range(), None)?;
            }
        }
        let until = match args.duration {
            Some(s) => Until::Time(Duration::from_secs_f64(s)),
            None => Until::Submits(args.iters.max(1)),
        };
        // Warm-ups are not measured: the clock starts when all are done.
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(workers + 1));
        let tasks: Vec<_> = shares
            .iter()
            .map(|share| {
                tokio::spawn(work(
                    submitter.clone(),
                    share.clone(),
                    args.op,
                    args.warmup,
                    until,
                    start.clone(),
                    progress.clone(),
                ))
            })
            .collect();
        let warmups = SUBMIT_TIMEOUT * (args.warmup as u32 + 1);
        if tokio::time::timeout(warmups, start.wait()).await.is_err() {
            return Err(run_failed(format!(
                "the warm-up did not finish within {warmups:?}"
            )));
        }
        let started = Instant::now();
        // What the node expects one request to take, now that the warm-up
        // taught it.
        let estimate = match &shares[0].prepared {
            Some((l, r)) => {
                let xfer = node
                    .make_xfer(OpKind::Write, l, shares[0].descs(), r, shares[0].descs())
                    .map_err(|e| run_failed(e.to_string()))?;
                Some(node.estimate(&xfer))
            }
            None => None,
        };
        let mut latencies = Vec::new();
        let mut first_us = 0.0;
        for task in tasks {
            match task.await {
                Ok(Ok((first, measured))) => {
                    first_us = f64::max(first_us, first);
                    latencies.extend(measured)
                }
                Ok(Err(Failure(e))) => return Err(run_failed(e)),
                Err(e) => return Err(run_failed(e.to_string())),
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let verified = match (args.via, args.op) {
            (Via::Echo, _) | (_, Op::Message) => false,
            // Every answer was compared with what was sent.
            (_, Op::Rpc) => true,
            _ if args.verify => {
                verify(&node, &shares, seed, args.op)
                    .await
                    .map_err(verify_failed)?;
                true
            }
            _ => false,
        };
        let submits = latencies.len();
        let bytes = submits as u64 * batch as u64 * block;
        latencies.sort_by(f64::total_cmp);
        rows.push(Row {
            op: args.op,
            transport,
            via: args.via,
            workers,
            streams: args.streams,
            block,
            batch,
            notify: args.notify.unwrap_or(0),
            submits,
            bytes,
            seconds,
            gbps: bytes as f64 / seconds / 1e9,
            mops: (submits * batch) as f64 / seconds / 1e6,
            lat_avg_us: latencies.iter().sum::<f64>() / submits as f64,
            lat_p50_us: percentile(&latencies, 0.5),
            lat_p99_us: percentile(&latencies, 0.99),
            verified,
            prepared: prepared.is_some(),
            first_us,
            est_us: estimate.map(|e| e.duration.as_secs_f64() * 1e6),
            est_method: estimate.map(|e| match e.method {
                ferry::EstimateMethod::Measured { .. } => "measured",
                ferry::EstimateMethod::Configured => "configured",
            }),
            peak_rss: peak_rss(),
            // The local region, plus the piece-sized read-back region of a
            // verified write.
            registered: size
                + if verified && args.op == Op::Write {
                    let longest = shares.iter().map(|s| s.range().end - s.range().start);
                    longest.max().unwrap_or(0).min(VERIFY_PIECE)
                } else {
                    0
                },
        });
    }
    progress.finish_and_clear();
    Ok(rows)
}

/// Each side's list of every `block`-sized block of its region, the remote
/// one prepared: strided (four numbers) or one entry per block.
async fn prepare_lists(
    node: &Node,
    local: &Region,
    remote: &RemoteBuffer,
    block: u64,
    strided: bool,
) -> Result<(LocalDescList, PreparedRemote), Failure> {
    let count = u32::try_from(remote.len() / block)
        .map_err(|_| Failure(format!("over {} blocks of {block} B", u32::MAX)))?;
    let descs = || match strided {
        true => Descs::strided(0, 0, block, block, count),
        false => {
            let mut descs = Descs::with_capacity(count as usize);
            for i in 0..u64::from(count) {
                descs.push(0, i * block, block);
            }
            descs
        }
    };
    let locals = LocalDescList::new(vec![local.clone()], descs())?;
    let remotes = RemoteDescList::new(vec![remote.clone()], descs())?;
    let prepared = node.prepare_remote(remotes, SUBMIT_TIMEOUT).await?;
    Ok((locals, prepared))
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
        None => Some((args.iters.max(1) * args.workers.max(1) * args.block.len()) as u64),
    };
    let bar =
        indicatif::ProgressBar::with_draw_target(total, indicatif::ProgressDrawTarget::stderr());
    let style =
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} submits")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}
