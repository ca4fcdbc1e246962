//! `ferry serve`: a node that registers one region and serves it to bench
//! clients until SIGTERM or Ctrl-C (or, with `--stdin`, until stdin
//! closes), taking every message and notification its inbox receives
//! (counted in the log). Named, it can publish the region by name and
//! itself in etcd; stopping withdraws its key.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use ferry::prelude::*;

use crate::discovery::EtcdArgs;
use crate::{Failure, export_metrics, parse_size};

/// How long `serve` waits for its first publication in etcd before it
/// reports ready (metrics listener up) anyway, with a warning.
const PUBLISH_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Arguments of `ferry serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks one; 0.0.0.0 needs --advertise).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
    /// Address peers reach this node at, carried by its handles: IP or
    /// IP:PORT (without a port, the one bound). Needed with an unspecified
    /// --listen address; FERRY_ADVERTISE is used when this is not given.
    #[arg(long, value_parser = parse_advertise)]
    pub advertise: Option<std::net::SocketAddr>,
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
    /// requests served per transport and op kind, and the sizes of the
    /// node's per-peer tables (`ferry_peer_table_entries`). It listens once the node
    /// is up and published, so it doubles as a readiness check.
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
    /// The node's name: peers find it by this name (in etcd, or in its
    /// metadata).
    #[arg(long)]
    pub name: Option<String>,
    /// Publish the served region under this name (e.g. kv-cache).
    #[arg(long, value_name = "REGION_NAME")]
    pub publish: Option<String>,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Seconds the node's key outlives it in etcd when it dies (the lease
    /// TTL; keep-alives go out every third of it).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_ttl: u64,
    /// Seconds a peer may acknowledge nothing on its control session before
    /// it is declared lost (see `ferry info`, and docs/operating.md, "Liveness").
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub peer_timeout: Option<u64>,
    /// Seconds RDMA transfers under way may go on, while they keep
    /// completing, after their peer's control session went silent.
    #[arg(long)]
    pub silent_grace: Option<u64>,
    /// Also stop when stdin closes (for a parent process that pipes it).
    #[arg(long)]
    pub stdin: bool,
    /// Microseconds each TCP data connection polls for the next request
    /// before its task sleeps (0: never poll; default 100).
    #[arg(long)]
    pub busy_poll_us: Option<u64>,
    /// Worker threads of this process's runtime (see docs/operating.md,
    /// "Threads").
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Milliseconds the owner waits, after notifications that rode RDMA,
    /// before it looks for more instead of waking on each
    /// (`IbvConfig::notify_coalesce`; by default 0 on a NIC, which then
    /// wakes the owner on each, and a few on a software device).
    #[arg(long)]
    pub notify_coalesce_ms: Option<u64>,
    /// The RDMA rails to use, e.g. `mlx5_0:1,mlx5_1` (a device alone: all
    /// its active ports); by default every active port of every device,
    /// or what FERRY_IBV_RAILS names.
    #[arg(long)]
    pub rails: Option<String>,
    #[command(flatten)]
    pub secret: crate::secret::SecretArgs,
}

fn parse_advertise(text: &str) -> Result<std::net::SocketAddr, String> {
    text.parse::<std::net::SocketAddr>()
        .or_else(|_| {
            text.parse::<std::net::IpAddr>()
                .map(|ip| std::net::SocketAddr::new(ip, 0))
        })
        .map_err(|_| format!("'{text}' is not an IP address or IP:PORT"))
}

/// Runs `ferry serve`.
pub async fn serve(args: ServeArgs) -> Result<(), Failure> {
    if args.etcd.etcd.is_some() && args.name.is_none() {
        return Err(Failure(
            "--etcd: a node publishes there under its --name".into(),
        ));
    }
    let mut builder = Node::builder()
        .listen(args.listen)
        .ibverbs(!args.no_ibverbs);
    if let Some(secs) = args.peer_timeout {
        builder = builder.peer_timeout(std::time::Duration::from_secs(secs));
    }
    if let Some(secs) = args.silent_grace {
        builder = builder.silent_grace(std::time::Duration::from_secs(secs));
    }
    if let Some(advertise) = args.advertise {
        builder = builder.advertise(advertise);
    }
    if let Some(name) = &args.name {
        builder = builder.name(name.clone());
    }
    if let Some(us) = args.busy_poll_us {
        builder = builder.tcp_busy_poll(std::time::Duration::from_micros(us));
    }
    builder = args.secret.apply(builder)?;
    let mut ibverbs = ferry::ibverbs::IbvConfig::default();
    if let Some(ms) = args.notify_coalesce_ms {
        ibverbs.notify_coalesce = Some(std::time::Duration::from_millis(ms));
    }
    if let Some(list) = &args.rails {
        ibverbs.rails = Some(ferry::ibverbs::RailName::parse_list(list).map_err(Failure)?);
    }
    builder = builder.ibverbs_config(ibverbs);
    let lease_ttl = std::time::Duration::from_secs(args.lease_ttl);
    let builder = args.etcd.apply(builder, Some(lease_ttl))?;
    let node = builder.spawn().await?;
    let region = node.alloc(args.size, Access::ReadWrite).await?;
    // Every page touched now, as NIXL's and Mooncake's benchmarks populate
    // theirs: a client's first transfer then measures the transport, not
    // the kernel's first touch of each page.
    let zeros = vec![0u8; 1 << 20];
    for at in (0..args.size).step_by(zeros.len()) {
        let n = (args.size - at).min(zeros.len() as u64) as usize;
        region.write_at(at, &zeros[..n])?;
    }
    if let Some(name) = &args.publish {
        node.publish(name.clone(), &region)?;
    }
    if node.published_in_etcd(PUBLISH_WAIT).await == Some(false) {
        tracing::warn!("not published in etcd yet; retrying in the background");
    }
    if let Some(addr) = args.metrics {
        export_metrics(addr)?;
        tokio::spawn(table_gauges(node.clone()));
    }
    // Listening before the handle goes out: a parent that stops this
    // process as soon as it has the handle gets a clean exit, not death by
    // the signal's default action.
    let stop = Stop::listen(args.stdin)?;
    let handle = serde_json::to_string(&region.remote())?;
    // Ready before the handle goes out: a client may call or send at once.
    // `bench --op rpc` calls this.
    node.serve_rpc(crate::submitter::ECHO_RPC, |request| async move {
        Ok(request.body)
    })?;
    // Take what arrives, so that senders (e.g. `bench --notify`) are never
    // held back by a full inbox, and log each (count and size) at debug
    // level under `ferry::inbox`: a line per notification would cost the
    // owner more CPU than receiving it (RUST_LOG=ferry::inbox=debug shows
    // them).
    let mut inbox = node.inbox().map_err(|e| Failure(format!("inbox: {e}")))?;
    tokio::spawn(async move {
        let mut count = 0u64;
        while let Some(delivery) = inbox.recv().await {
            count += 1;
            tracing::debug!(
                target: "ferry::inbox",
                count,
                bytes = delivery.body.len(),
                kind = ?delivery.kind,
                from = %delivery.from.endpoint,
                "inbox: delivery taken"
            );
        }
    });
    match &args.handle_file {
        // Mode 0600: the handle carries the region's token, which opens
        // the region to whoever holds it.
        Some(path) => {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)
                .and_then(|mut file| writeln!(file, "{handle}"))
                .map_err(|e| Failure(format!("cannot write {}: {e}", path.display())))?
        }
        None => {
            let mut out = std::io::stdout();
            writeln!(out, "{handle}")?;
            out.flush()?;
        }
    }
    eprintln!(
        "ferry serve: {} bytes registered at {}{}; stop with Ctrl-C or SIGTERM{}",
        args.size,
        node.addr().endpoint,
        args.name
            .as_ref()
            .map(|n| format!(" as {n:?}"))
            .unwrap_or_default(),
        if args.stdin {
            " or by closing stdin"
        } else {
            ""
        },
    );
    stop.wait().await;
    // Withdraws the etcd key, so peers stop finding the node at once.
    node.shutdown().await;
    drop(region);
    Ok(())
}

/// How often the per-peer table gauges are refreshed.
const TABLE_GAUGES_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Exports the sizes of the node's per-peer tables as
/// `ferry_peer_table_entries{table=...}`, refreshed every second: a table
/// that keeps growing while peers come and go is a leak to see here.
async fn table_gauges(node: Node) {
    let mut every = tokio::time::interval(TABLE_GAUGES_EVERY);
    loop {
        every.tick().await;
        for (table, entries) in node.peer_tables().entries() {
            metrics::gauge!("ferry_peer_table_entries", "table" => table).set(entries as f64);
        }
    }
}

/// What stops `serve`: SIGTERM, SIGINT, or (with `--stdin`) the end of
/// stdin (how `bench --loopback` stops its child).
struct Stop {
    term: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    stdin_closed: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Stop {
    /// Starts listening: a signal that arrives from now on is one to stop
    /// on, not one that kills the process.
    fn listen(stdin: bool) -> Result<Self, Failure> {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate())?;
        let interrupt = signal(SignalKind::interrupt())?;
        let stdin_closed = stdin.then(|| {
            let (closed, stdin_closed) = tokio::sync::oneshot::channel();
            // A thread of its own, not `spawn_blocking`: the runtime's
            // shutdown waits for its blocking tasks, and a read of a stdin
            // that stays open never returns, so a signal could not stop
            // the process. This one goes with the process.
            std::thread::spawn(move || {
                let mut sink = Vec::new();
                let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
                let _ = closed.send(());
            });
            stdin_closed
        });
        Ok(Stop {
            term,
            interrupt,
            stdin_closed,
        })
    }

    /// Until one of them happens.
    async fn wait(mut self) {
        let closed = async {
            match self.stdin_closed {
                Some(closed) => {
                    let _ = closed.await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.interrupt.recv() => {}
            () = closed => {}
        }
    }
}
