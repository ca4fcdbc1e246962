//! `ferry`: what this host's transports can do (`info`), a node serving a
//! region (`serve`), the benchmark against one (`bench`), the nodes
//! published in etcd (`ls`), and the NIXL plugin's install (`nixl`).
//!
//! A library with one entry, [`main`], which the `ferry` binary calls: the
//! Python extension's workspace (python/Cargo.toml) can then depend on this
//! crate, so that the wheel's build (scripts/wheel.sh) compiles the command
//! there, with the extension's features and lock file, sharing one
//! compilation of ferry (cargo ignores a dependency without a library).

#![warn(missing_docs)]

mod bench;
mod discovery;
mod loopback;
mod nixl;
mod register;
mod rows;
mod secret;
mod serve;
mod submitter;
mod target;
mod verify;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ferry::ibverbs::{DeviceReport, describe_devices};
use ferry::{ConnectionLimits, Node, TransportState};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "ferry: one-sided RDMA and TCP transfers between processes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show this host's RDMA devices and which transports a node starts here
    /// (and, for those that cannot start, why).
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Register a region and serve it to bench clients (optionally named,
    /// published by name, and in etcd); prints its handle.
    Serve(serve::ServeArgs),
    /// Measure writes or reads against a served region, per block size.
    Bench(bench::BenchArgs),
    /// List the nodes published in etcd: transports, regions, lease left
    /// (read from etcd alone: no node is reached, no cluster secret needed).
    Ls(discovery::LsArgs),
    /// ferry as a NIXL backend: install the FERRY plugin into a Python
    /// environment's NIXL.
    #[command(subcommand)]
    Nixl(nixl::NixlCommand),
}

/// A user-facing failure: printed as one line, exit status 1.
#[derive(Debug)]
pub struct Failure(pub String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

/// Installs the Prometheus recorder with its HTTP listener on `addr`.
pub fn export_metrics(addr: std::net::SocketAddr) -> Result<(), Failure> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| Failure(format!("cannot serve metrics on {addr}: {e}")))
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

#[derive(Serialize)]
struct Transport {
    name: &'static str,
    available: bool,
    /// The device a transport would use, or why it cannot start.
    detail: String,
}

#[derive(Serialize)]
struct Limits {
    max_connections: usize,
    max_per_address: usize,
    hello_timeout_s: f64,
    /// An accepted data connection with no request in flight this long is
    /// closed; at a bound, the least recently used idle one makes room.
    idle_timeout_s: f64,
    /// A connection whose peer went silent in the middle of a frame this
    /// long is closed; while it waits it is evictable like an idle one.
    frame_timeout_s: f64,
    /// A control session that received nothing this long, with nothing in
    /// flight, may make room at a bound (after idle data connections).
    session_evictable_after_s: f64,
}

/// How a node tells a dead peer from a slow one (docs/operating.md, "Liveness").
#[derive(Serialize)]
struct Liveness {
    /// A peer that acknowledges nothing on its control session for this
    /// long is declared lost (`serve --peer-timeout`).
    peer_timeout_s: f64,
    /// Keepalive probes of an idle control connection, this far apart.
    keepalive_interval_s: f64,
    /// After a control session went silent, RDMA transfers under way may
    /// go on this long while they keep completing (`serve --silent-grace`).
    silent_grace_s: f64,
}

#[derive(Serialize)]
struct Info {
    /// Fastest first.
    transports: Vec<Transport>,
    /// Bounds a node's endpoint puts on the connections it accepts here.
    connection_limits: Limits,
    liveness: Liveness,
    /// Whether a node started here requires a cluster secret of its
    /// peers (`FERRY_CLUSTER_SECRET` or `FERRY_CLUSTER_SECRET_FILE` set).
    cluster_secret: bool,
    devices: Vec<DeviceReport>,
}

/// What a node starts here: one is spawned on loopback and asked.
async fn info() -> Result<Info, Failure> {
    let node = secret::SecretArgs::default()
        .apply(Node::builder())?
        .spawn()
        .await?;
    let transports = node
        .transports()
        .iter()
        .map(|t| {
            let (available, detail) = match &t.state {
                TransportState::Running { detail } => (true, detail.clone()),
                TransportState::Unavailable { reason } => (false, reason.clone()),
            };
            Transport {
                name: t.level.backend(),
                available,
                detail,
            }
        })
        .collect();
    let cluster_secret = node.has_cluster_secret();
    node.shutdown().await;
    let limits = ConnectionLimits::default();
    Ok(Info {
        transports,
        connection_limits: Limits {
            max_connections: limits.max_connections,
            max_per_address: limits.max_per_address,
            hello_timeout_s: limits.hello_timeout.as_secs_f64(),
            idle_timeout_s: limits.idle_timeout.as_secs_f64(),
            frame_timeout_s: limits.frame_timeout.as_secs_f64(),
            session_evictable_after_s: limits.session_evictable_after.as_secs_f64(),
        },
        liveness: Liveness {
            peer_timeout_s: ferry::DEFAULT_PEER_TIMEOUT.as_secs_f64(),
            keepalive_interval_s: (ferry::DEFAULT_PEER_TIMEOUT.as_secs() / 5).max(1) as f64,
            silent_grace_s: ferry::DEFAULT_SILENT_GRACE.as_secs_f64(),
        },
        cluster_secret,
        devices: describe_devices().unwrap_or_default(),
    })
}

fn print_info(info: &Info) {
    println!("transports:");
    for t in &info.transports {
        let state = if t.available {
            "available"
        } else {
            "unavailable"
        };
        println!("  {:<8} {state}: {}", t.name, t.detail);
    }
    let limits = &info.connection_limits;
    println!(
        "endpoint: at most {} accepted connections, {} per remote address, hello within {} s; \
         data connections idle for {} s, and connections silent for {} s in the middle of \
         a frame, are closed, and at a bound the least recently used idle one makes room \
         (control sessions once idle for {} s)",
        limits.max_connections,
        limits.max_per_address,
        limits.hello_timeout_s,
        limits.idle_timeout_s,
        limits.frame_timeout_s,
        limits.session_evictable_after_s
    );
    let liveness = &info.liveness;
    println!(
        "liveness: a peer silent for {} s is lost (keepalive probes every {} s when idle); \
         a peer process that dies is seen at once; RDMA transfers still completing go on \
         for up to {} s after that",
        liveness.peer_timeout_s, liveness.keepalive_interval_s, liveness.silent_grace_s
    );
    println!(
        "cluster secret: {}",
        if info.cluster_secret {
            "set: every peer must prove it (docs/security.md)"
        } else {
            "none: any process that reaches the port is taken at its word"
        }
    );
    if info.devices.is_empty() {
        println!("RDMA devices: none");
    } else {
        let active: Vec<String> = info
            .devices
            .iter()
            .flat_map(|d| {
                d.ports
                    .iter()
                    .filter(|p| p.active)
                    .map(move |p| format!("{}:{}", d.name, p.port))
            })
            .collect();
        println!(
            "rails: a node uses every active port ({}) unless {} names others",
            active.join(", "),
            ferry::ibverbs::RAILS_ENV
        );
    }
    for device in &info.devices {
        for port in &device.ports {
            let state = if port.active { "active" } else { "down" };
            let kind = if device.software { ", software" } else { "" };
            let numa = device
                .numa_node
                .map_or("NUMA node unknown".to_string(), |n| {
                    format!("NUMA node {n}")
                });
            println!(
                "{} port {}: {state}, {}{kind}, {}, MTU {}, max message {} B, {numa}, netdev {}",
                device.name,
                port.port,
                port.link_layer,
                if port.rate.is_empty() {
                    "rate unknown"
                } else {
                    &port.rate
                },
                port.active_mtu,
                port.max_message,
                port.netdev.as_deref().unwrap_or("-"),
            );
            for gid in &port.gids {
                let kind = if gid.kind.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", gid.kind)
                };
                println!("  GID {:>3} {}{kind}", gid.index, gid.gid);
            }
        }
    }
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("ferry: error: {message}");
    ExitCode::FAILURE
}

/// The process's runtime, with `threads` workers.
///
/// `serve` and `bench` take one by default: what they run is I/O, and a
/// connection that polls (`--busy-poll-us`) on a runtime with idle workers
/// keeps waking them, which on a small host takes the core from the thread
/// that polls. `--threads` raises it where more cores carry more traffic.
fn runtime(threads: u16) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(usize::from(threads))
        .enable_all()
        .build()
}

/// Logs go to stderr (stdout carries handles and results): `RUST_LOG` if
/// set, else warnings, and for `serve` (a server) its lifecycle too.
fn init_logging(command: &Command) {
    let default = match command {
        Command::Serve(_) => "warn,ferry=info,ferry_control=info,ferry_tcp=info,ferry_ibverbs=info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// The `ferry` command: parses the process's arguments, runs the
/// subcommand, and says how it went. Call it first thing in `main`, before
/// any thread starts (it takes the cluster secret out of the environment).
pub fn main() -> ExitCode {
    // SAFETY: no thread runs yet: the runtime starts below.
    if let Err(Failure(e)) = unsafe { secret::take_from_env() } {
        return fail(e);
    }
    let cli = Cli::parse();
    init_logging(&cli.command);
    let threads = match &cli.command {
        Command::Serve(args) => args.threads,
        Command::Bench(args) => args.threads,
        Command::Info { .. } | Command::Ls(_) | Command::Nixl(_) => 1,
    };
    let rt = match runtime(threads) {
        Ok(rt) => rt,
        Err(e) => return fail(e),
    };
    match cli.command {
        Command::Nixl(command) => {
            if let Err(Failure(e)) = nixl::run(command) {
                return fail(e);
            }
        }
        Command::Serve(args) => {
            if let Err(Failure(e)) = rt.block_on(serve::serve(args)) {
                return fail(e);
            }
        }
        Command::Bench(args) => {
            let json = args.json;
            match rt.block_on(bench::bench(args)) {
                Ok(rows) if json => {
                    for row in &rows {
                        match serde_json::to_string(row) {
                            Ok(line) => println!("{line}"),
                            Err(e) => return fail(e),
                        }
                    }
                }
                Ok(rows) => bench::print_table(&rows),
                Err(e) => return fail(e),
            }
        }
        Command::Ls(args) => match rt.block_on(discovery::ls(&args)) {
            Ok(rows) if args.json => match serde_json::to_string_pretty(&rows) {
                Ok(text) => println!("{text}"),
                Err(e) => return fail(e),
            },
            Ok(rows) => discovery::print_ls(&rows),
            Err(Failure(e)) => return fail(e),
        },
        Command::Info { json } => {
            let info = match rt.block_on(info()) {
                Ok(info) => info,
                Err(Failure(e)) => return fail(e),
            };
            if json {
                match serde_json::to_string_pretty(&info) {
                    Ok(text) => println!("{text}"),
                    Err(e) => return fail(e),
                }
            } else {
                print_info(&info);
            }
        }
    }
    ExitCode::SUCCESS
}
