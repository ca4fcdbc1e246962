//! `ferry`: what this host's transports can do (`info`), a target node for
//! benchmarks (`serve`), and the benchmark itself (`bench`).

mod bench;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ferry::ibverbs::{DeviceReport, IbvConfig, IbvDevice, describe_devices};
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
    /// Show this host's RDMA devices and which transports can start here
    /// (and, for those that cannot, why).
    Info {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Register a region and serve it to bench clients; prints its handle.
    Serve(bench::ServeArgs),
    /// Measure writes or reads against a served region, per block size.
    Bench(bench::BenchArgs),
}

#[derive(Serialize)]
struct Transport {
    name: &'static str,
    available: bool,
    /// The device a transport would use, or why it cannot start.
    detail: String,
}

#[derive(Serialize)]
struct Info {
    transports: Vec<Transport>,
    devices: Vec<DeviceReport>,
}

/// The same checks a node makes when it starts.
fn info() -> Info {
    let tcp = match std::net::TcpListener::bind(("127.0.0.1", 0)) {
        Ok(_) => Transport {
            name: "tcp",
            available: true,
            detail: "kernel TCP sockets".into(),
        },
        Err(e) => Transport {
            name: "tcp",
            available: false,
            detail: format!("cannot listen: {e}"),
        },
    };
    let disabled = std::env::var(ferry::DISABLE_IBVERBS_ENV).is_ok_and(|v| v == "1");
    let ibverbs = if disabled {
        Transport {
            name: "ibverbs",
            available: false,
            detail: format!("disabled by {}=1", ferry::DISABLE_IBVERBS_ENV),
        }
    } else {
        match IbvDevice::open(&IbvConfig::default()) {
            Ok(device) => Transport {
                name: "ibverbs",
                available: true,
                detail: device.describe(),
            },
            Err(e) => Transport {
                name: "ibverbs",
                available: false,
                detail: e.to_string(),
            },
        }
    };
    Info {
        transports: vec![ibverbs, tcp],
        devices: describe_devices().unwrap_or_default(),
    }
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
    if info.devices.is_empty() {
        println!("RDMA devices: none");
    }
    for device in &info.devices {
        for port in &device.ports {
            let state = if port.active { "active" } else { "down" };
            println!(
                "{} port {}: {state}, {}, MTU {}, max message {} B",
                device.name, port.port, port.link_layer, port.active_mtu, port.max_message
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

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let result = runtime()
                .map_err(bench::Failure::from)
                .and_then(|rt| rt.block_on(bench::serve(args)));
            if let Err(bench::Failure(e)) = result {
                return fail(e);
            }
        }
        Command::Bench(args) => {
            let json = args.json;
            let result = runtime()
                .map_err(bench::Failure::from)
                .and_then(|rt| rt.block_on(bench::bench(args)));
            match result {
                Ok(rows) if json => {
                    for row in &rows {
                        match serde_json::to_string(row) {
                            Ok(line) => println!("{line}"),
                            Err(e) => return fail(e),
                        }
                    }
                }
                Ok(rows) => bench::print_table(&rows),
                Err(bench::Failure(e)) => return fail(e),
            }
        }
        Command::Info { json } => {
            let info = info();
            if json {
                match serde_json::to_string_pretty(&info) {
                    Ok(text) => println!("{text}"),
                    Err(e) => {
                        eprintln!("ferry: error: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print_info(&info);
            }
        }
    }
    ExitCode::SUCCESS
}
