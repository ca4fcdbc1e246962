//! Fan-out of weight versions through relays, over TCP, behind a slow
//! publisher link: what `Subscriber::serve_relay` is for.
//!
//! One publisher node (one rank, the whole set: one matrix of `--mib` MiB,
//! default 256) and S subscriber nodes, each holding the whole set in one
//! buffer, all in this process over loopback TCP. With `--relays`,
//! subscriber 0 pulls from the publisher and every other subscriber i
//! pulls from subscriber (i - 1) / 2 (a binary tree; every subscriber with
//! children serves them); without, every subscriber pulls from the
//! publisher. Per version (`--versions`, default 3) the publisher writes
//! and publishes, then every subscriber updates at once (`update_to` the
//! version: a relayed one waits for its relay); the update time is from
//! the publish to the last subscriber holding the version. Every
//! subscriber's buffer is then checked (8 bytes at each MiB's start and
//! end). `--subscribers 1,2,4,8` (the default) runs each count; the
//! summary gives each count's median update time and its ratio to S = 1.
//!
//! The publisher listens on `--port` (default 0: any). `scripts/bench-relays.sh`
//! runs this in a network namespace of its own whose loopback rate-limits
//! only the traffic from that port (`tc`), so that the publisher's link is
//! the bottleneck, and measures that link with `iperf3 -R` beside it.
//!
//! ```sh
//! cargo run --release --example relay_bench -- [--relays] [--mib 256] [--versions 3] [--subscribers 1,2,4,8] [--port 0]
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferry::LocalLayout;
use ferry::layout::{Part, RankLayout, Tensor, TensorLayout};
use ferry::prelude::*;
use ferry::weights::{Publisher, Subscriber};

const SET: &str = "relay_bench";
const COLS: u64 = 4096;
const MIB: u64 = 1 << 20;
const DEADLINE: Duration = Duration::from_secs(300);

struct Config {
    relays: bool,
    mib: u64,
    versions: u64,
    counts: Vec<usize>,
    port: u16,
}

/// The whole set, rank 0: one `mib` MiB matrix of bytes, row major.
fn layout(mib: u64) -> Result<RankLayout, String> {
    let rows = mib * MIB / COLS;
    let tensor = Tensor::new("w", 1, &[("row", rows), ("col", COLS)]);
    let w = TensorLayout::contiguous(tensor, vec![Part::Full; 2], &["row", "col"], 0, 0)
        .map_err(|e| e.to_string())?;
    Ok(RankLayout {
        rank: 0,
        region_lens: vec![mib * MIB],
        tensors: vec![w],
    })
}

async fn node(listen: SocketAddr) -> Result<Node, String> {
    Node::builder()
        .listen(listen)
        .ibverbs(false)
        .memory(false)
        .spawn()
        .await
        .map_err(|e| e.to_string())
}

async fn memory(node: &Node, mib: u64) -> Result<LocalLayout, String> {
    let region = node
        .alloc(mib * MIB, Access::ReadWrite)
        .await
        .map_err(|e| e.to_string())?;
    LocalLayout::new(layout(mib)?, vec![region]).map_err(|e| e.to_string())
}

/// Version `v`'s bytes: `v` everywhere.
fn fill(local: &LocalLayout, mib: u64, v: u64) -> Result<(), String> {
    let chunk = vec![v as u8; MIB as usize];
    for m in 0..mib {
        (local.regions()[0].write_at(m * MIB, &chunk)).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Whether `local` holds version `v`, sampled at each MiB's ends.
fn check(local: &LocalLayout, mib: u64, v: u64) -> Result<(), String> {
    let mut word = [0u8; 8];
    for m in 0..mib {
        for at in [m * MIB, (m + 1) * MIB - 8] {
            (local.regions()[0].read_at(at, &mut word)).map_err(|e| e.to_string())?;
            if word != [v as u8; 8] {
                return Err(format!("version {v}: byte {at} holds {word:?}"));
            }
        }
    }
    Ok(())
}

/// The publisher, kept across runs (its port stays the one `tc` limits).
struct Source {
    node: Node,
    publisher: Publisher,
    memory: LocalLayout,
    /// The last version published.
    version: u64,
}

impl Source {
    async fn start(config: &Config) -> Result<Source, String> {
        let node = node(SocketAddr::from(([127, 0, 0, 1], config.port))).await?;
        let memory = memory(&node, config.mib).await?;
        let publisher = Publisher::start(&node, SET, memory.clone()).map_err(|e| e.to_string())?;
        Ok(Source {
            node,
            publisher,
            memory,
            version: 0,
        })
    }

    /// Writes and publishes the next version.
    async fn publish(&mut self, mib: u64) -> Result<u64, String> {
        let v = self.version + 1;
        let (guard, overrun) = self.publisher.write(DEADLINE).await;
        if overrun > 0 {
            return Err(format!("version {v}: {overrun} readers overrun"));
        }
        fill(&self.memory, mib, v)?;
        guard.publish(v).map_err(|e| e.to_string())?;
        self.version = v;
        Ok(v)
    }
}

/// One run with `s` subscribers: the update time of each version, in s.
async fn run(config: &Config, source: &mut Source, s: usize) -> Result<Vec<f64>, String> {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    source.publish(config.mib).await?;
    let mut nodes: Vec<Node> = Vec::new();
    let mut subscribers: Vec<Subscriber> = Vec::new();
    for i in 0..s {
        let n = node(any).await?;
        let buffers = vec![memory(&n, config.mib).await?];
        let sub = if config.relays && i > 0 {
            let relay = nodes[(i - 1) / 2].addr().endpoint;
            Subscriber::from_relay(&n, SET, relay, buffers, DEADLINE).await
        } else {
            let addr = source.node.addr().endpoint;
            Subscriber::new(&n, SET, &[addr], buffers, DEADLINE).await
        };
        let mut sub = sub.map_err(|e| e.to_string())?;
        // Those with children serve them (a tree: i's parent is (i-1)/2).
        if config.relays && 2 * i + 1 < s {
            sub.serve_relay().map_err(|e| e.to_string())?;
        }
        nodes.push(n);
        subscribers.push(sub);
    }
    let mut times = Vec::new();
    for round in 1..=config.versions {
        let v = if round > 1 {
            source.publish(config.mib).await?
        } else {
            source.version
        };
        let start = Instant::now();
        let tasks: Vec<_> = subscribers
            .drain(..)
            .map(|mut sub| {
                tokio::spawn(async move {
                    let r = sub.update_to(v, DEADLINE).await;
                    (sub, r)
                })
            })
            .collect();
        let mut updates = Vec::new();
        for task in tasks {
            let (sub, updated) = task.await.map_err(|e| e.to_string())?;
            updates.push(updated.map_err(|e| format!("version {v}: {e}"))?);
            subscribers.push(sub);
        }
        let took = start.elapsed().as_secs_f64();
        for (sub, update) in subscribers.iter().zip(&updates) {
            check(&sub.buffers()[update.buffer], config.mib, v)?;
        }
        times.push(took);
        println!(
            "relay_bench: relays {}, S {s}, version {v} (round {round}): {:.1} ms",
            config.relays,
            took * 1e3
        );
    }
    drop(subscribers);
    for n in nodes {
        n.shutdown().await;
    }
    Ok(times)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn driver(config: Config) -> Result<(), String> {
    let mut source = Source::start(&config).await?;
    let mut rows = Vec::new();
    for &s in &config.counts {
        let times = run(&config, &mut source, s).await?;
        // Round 1 faults the buffers in; the rest are the steady state.
        let steady = if times.len() > 1 {
            &times[1..]
        } else {
            &times[..]
        };
        rows.push((s, median(steady.to_vec())));
    }
    drop(source.publisher);
    source.node.shutdown().await;
    let base = rows[0].1;
    for (s, t) in &rows {
        println!(
            "relay_bench: relays {}: S {s}: {:.1} ms per update of {} MiB, {:.2}x S={}",
            config.relays,
            t * 1e3,
            config.mib,
            t / base,
            rows[0].0
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        let at = args.iter().position(|a| a == flag)?;
        args.get(at + 1).cloned()
    };
    let number =
        |flag: &str, default: u64| value(flag).and_then(|v| v.parse().ok()).unwrap_or(default);
    let counts: Result<Vec<usize>, _> = value("--subscribers")
        .unwrap_or_else(|| "1,2,4,8".into())
        .split(',')
        .map(str::parse)
        .collect();
    let counts = match counts {
        Ok(c) if !c.is_empty() && c.iter().all(|&s| s > 0) => c,
        _ => {
            eprintln!("relay_bench: --subscribers takes counts, as 1,2,4,8");
            return ExitCode::FAILURE;
        }
    };
    let config = Config {
        relays: args.iter().any(|a| a == "--relays"),
        mib: number("--mib", 256).max(1),
        versions: number("--versions", 3).max(1),
        counts,
        port: number("--port", 0) as u16,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("relay_bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(driver(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("relay_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
