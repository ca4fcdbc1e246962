//! `ferry serve`: a node that registers one region and serves it to bench
//! clients until stdin closes, taking every message and notification its
//! inbox receives (counted in the log).

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use ferry::prelude::*;

use crate::{Failure, export_metrics, parse_size};

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
    /// requests served per transport and op kind.
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
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
    if let Some(addr) = args.metrics {
        export_metrics(addr)?;
    }
    let mut builder = Node::builder()
        .listen(args.listen)
        .ibverbs(!args.no_ibverbs);
    if let Some(advertise) = args.advertise {
        builder = builder.advertise(advertise);
    }
    let node = builder.spawn().await?;
    let region = node.alloc(args.size, Access::ReadWrite).await?;
    let handle = serde_json::to_string(&region.remote())?;
    // Ready before the handle goes out: a client may call or send at once.
    // `bench --op rpc` calls this.
    node.serve_rpc(crate::submitter::ECHO_RPC, |request| async move {
        Ok(request.body)
    })?;
    // Take what arrives, so that senders (e.g. `bench --notify`) are never
    // held back by a full inbox, and log each (count and size).
    let mut inbox = node.inbox().map_err(|e| Failure(format!("inbox: {e}")))?;
    tokio::spawn(async move {
        let mut count = 0u64;
        while let Some(delivery) = inbox.recv().await {
            count += 1;
            tracing::info!(
                count,
                bytes = delivery.body.len(),
                kind = ?delivery.kind,
                from = %delivery.from.endpoint,
                "inbox: delivery taken"
            );
        }
    });
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
