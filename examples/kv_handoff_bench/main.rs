//! What a KV-cache hand-off planned from layouts costs, against the same
//! bytes moved as plain 1 MiB blocks, between two processes on this host.
//!
//! The workload (bench/peers/nixl_kv_handoff.py runs the same one through
//! NIXL, as vLLM's connector drives it): a model of 32 layers, 8 KV heads
//! of 128 two-byte elements, blocks of 16 tokens, HND, K and V apart, a
//! region per layer and tensor (64 per rank), 320 blocks per pool. A
//! prefill process holds the four ranks of tensor-parallel degree 4 and
//! publishes their layouts with its metadata; this process is decode rank
//! 0 of degree 2, plans once from the published layouts, and pulls
//! requests of 4,096 tokens (256 blocks, fresh random block tables on both
//! sides each time): 32,768 reads of 8 KiB, 256 MiB, from prefill ranks 0
//! and 1. Alternating with it, the baseline: one submit of the same 256
//! MiB as 256 reads of 1 MiB between the same two processes.
//!
//! Reported per request: GB/s (bytes over wall time, post to completion),
//! the caller thread's CPU time to make and post the request
//! (`TransferPlan::request` and `Xfer::post`; the runtime expands the
//! plan), and the whole process's CPU time per request (ferry's runtime
//! threads included). The first request's bytes are checked against the
//! layouts' own definition ([`TensorLayout::locate`]) on a sample of
//! elements.
//!
//! The references, measured in the same run: one thread, then two (this
//! machine's cores; ferry's same-host copies use a thread per core),
//! `memcpy`ing each request's descriptor pairs between buffers the size of
//! the two sides' regions, against the same bytes as 1 MiB `memcpy`s; and
//! over TCP, the same pairs sent by the prefill process from its regions
//! over four loopback connections with `writev` and received here with
//! `readv`, against 1 MiB pieces: the same two processes and kernel
//! copies as ferry's requests, without ferry's requests and framing.
//! Each planned request is also followed at once by its reference on the
//! same pairs (two threads' `memcpy` same host, `writev`/`readv` over
//! TCP), and the median of those per-request ratios is reported too: this
//! VM's speed drifts between the rounds' kinds, not within a pair.
//! Scattered 8 KiB copies are slower than 1 MiB ones in the memory system
//! itself (no prefetch across pieces, a TLB miss each); that ratio is the
//! most a planned request can reach against 1 MiB blocks on this machine.
//!
//! ```sh
//! cargo run --release --example kv_handoff_bench -- --transport tcp|memory [--rounds 5] [--requests 8]
//! ```

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use ferry::layout::{
    Direction, KvCache, KvPlacement, LayerPlacement, PlanOptions, RankLayout, TableRequest,
    TokenOrder,
};
use ferry::prelude::*;
use ferry::{LocalLayout, PeerLayout, TransferPlan};

mod reference;
mod tcp_reference;

use reference::{MemcpyReference, copy_pieces};

const LAYERS: u64 = 32;
const HEADS: u64 = 8;
const HEAD_DIM: u64 = 128;
const BLOCK_TOKENS: u64 = 16;
const POOL_BLOCKS: u64 = 320;
const TOKENS: u64 = 4096;
const PREFILL_TP: u64 = 4;
const DECODE_TP: u64 = 2;
const DEADLINE: Duration = Duration::from_secs(60);
/// The baseline's block.
const MIB: u64 = 1 << 20;

fn cache() -> KvCache {
    KvCache {
        layers: LAYERS,
        heads: HEADS,
        head_dim: HEAD_DIM,
        elem_size: 2,
        tokens: TOKENS,
        block_tokens: BLOCK_TOKENS,
        blocks: POOL_BLOCKS,
        order: TokenOrder::Hnd,
        kv: KvPlacement::Separate,
        layer_regions: LayerPlacement::RegionPerLayer,
        table: "kv".into(),
    }
}

/// The byte a prefill rank's region holds at `offset`: a byte moved to
/// the wrong place, or not at all, shows.
fn pattern(rank: u32, region: u32, offset: u64) -> u8 {
    let seed = u64::from(rank) << 40 | u64::from(region) << 32;
    ((offset ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
}

/// Thread and process CPU time so far.
fn cpu_times() -> (Duration, Duration) {
    let clock = |id| {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
        let rc = unsafe { libc::clock_gettime(id, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime");
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    };
    (
        clock(libc::CLOCK_THREAD_CPUTIME_ID),
        clock(libc::CLOCK_PROCESS_CPUTIME_ID),
    )
}

/// `count` distinct blocks of the pool, shuffled.
fn table(rng: &mut fastrand::Rng) -> Vec<u64> {
    let mut all: Vec<u64> = (0..POOL_BLOCKS).collect();
    rng.shuffle(&mut all);
    all.truncate(TOKENS.div_ceil(BLOCK_TOKENS) as usize);
    all
}

/// The prefill process: four ranks' regions, filled and published; the
/// endpoint on stdout; gone when stdin closes.
async fn prefill() -> Result<(), String> {
    let node = Node::builder()
        .name("prefill")
        .ibverbs(false)
        .spawn()
        .await
        .map_err(|e| e.to_string())?;
    let c = cache();
    let mut keep = Vec::new();
    for rank in 0..PREFILL_TP as u32 {
        let layout = c.rank(rank, PREFILL_TP).map_err(|e| e.to_string())?;
        let mut regions = Vec::new();
        for (i, &len) in layout.region_lens.iter().enumerate() {
            let region = node
                .alloc(len, Access::ReadWrite)
                .await
                .map_err(|e| e.to_string())?;
            let bytes: Vec<u8> = (0..len).map(|o| pattern(rank, i as u32, o)).collect();
            region.write_at(0, &bytes).map_err(|e| e.to_string())?;
            regions.push(region);
        }
        let local = LocalLayout::new(layout, regions).map_err(|e| e.to_string())?;
        node.publish_layout(&format!("kv{rank}"), &local)
            .map_err(|e| e.to_string())?;
        keep.push(local);
    }
    println!("ENDPOINT {}", node.addr().endpoint);
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Serve until the decode side closes our stdin, on which its TCP
    // reference asks for pieces of these regions.
    let keep = tokio::task::spawn_blocking(move || {
        tcp_reference::serve(&mut std::io::stdin().lock(), &keep).map(|()| keep)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("TCP reference: {e}"))?;
    drop(keep);
    node.shutdown().await;
    Ok(())
}

/// Checks `samples` random elements of decode rank 0's first request
/// against the prefill ranks' layouts: the byte each element's bytes came
/// from.
fn check(
    local: &LocalLayout,
    peers: &[PeerLayout],
    tables: (&[u64], &[u64]),
    rng: &mut fastrand::Rng,
) -> Result<(), String> {
    let mut wrong = 0;
    let samples = 20_000;
    for _ in 0..samples {
        let t = &local.layout().tensors[rng.usize(..local.layout().tensors.len())];
        let x: Vec<u64> = (0..t.tensor.axes.len())
            .map(|d| {
                let r = t.range(d).expect("axis");
                rng.u64(0..r.end - r.start)
            })
            .collect();
        let global: Vec<u64> = x
            .iter()
            .enumerate()
            .map(|(d, i)| t.range(d).expect("axis").start + i)
            .collect();
        let (region, offset) = t.locate(&x, Some(tables.0)).ok_or("no decode element")?;
        // The prefill rank holding this element, and where.
        let (rank, p_region, p_offset) = peers
            .iter()
            .find_map(|p| {
                let pt = p
                    .layout()
                    .tensors
                    .iter()
                    .find(|pt| pt.tensor.name == t.tensor.name)?;
                let px: Option<Vec<u64>> = global
                    .iter()
                    .enumerate()
                    .map(|(d, g)| {
                        let r = pt.range(d)?;
                        r.contains(g).then(|| g - r.start)
                    })
                    .collect();
                let (reg, off) = pt.locate(&px?, Some(tables.1))?;
                Some((p.layout().rank, reg, off))
            })
            .ok_or("no prefill rank holds an element")?;
        let mut got = [0u8; 2];
        local.regions()[region as usize]
            .read_at(offset, &mut got)
            .map_err(|e| e.to_string())?;
        for (b, &g) in got.iter().enumerate() {
            wrong += usize::from(g != pattern(rank, p_region, p_offset + b as u64));
        }
    }
    match wrong {
        0 => Ok(()),
        n => Err(format!("{n} bytes of {samples} sampled elements differ")),
    }
}

/// One layout request: (GB/s, caller CPU, process CPU).
async fn layout_request(
    plan: &TransferPlan,
    tables: (&[u64], &[u64]),
) -> Result<(f64, Duration, Duration), String> {
    let request = [TableRequest {
        table: "kv",
        range: 0..TOKENS,
        local: tables.0,
        remote: tables.1,
    }];
    let (thread0, process0) = cpu_times();
    let start = Instant::now();
    let xfer = plan.request(&request).map_err(|e| e.to_string())?;
    xfer.post(DEADLINE).map_err(|e| e.to_string())?;
    let (thread1, _) = cpu_times();
    tokio::time::timeout(DEADLINE, xfer.wait())
        .await
        .map_err(|_| "a request did not finish within its deadline")?
        .map_err(|e| e.to_string())?;
    let wall = start.elapsed();
    let (_, process1) = cpu_times();
    let gbps = xfer.bytes() as f64 / wall.as_secs_f64() / 1e9;
    Ok((gbps, thread1 - thread0, process1 - process0))
}

/// The baseline: the same byte count as reads of 1 MiB, one submit.
async fn contiguous_request(
    node: &Node,
    local: &LocalLayout,
    peers: &[PeerLayout],
    bytes: u64,
) -> Result<(f64, Duration, Duration), String> {
    let mut remote = Vec::new();
    for p in peers.iter().filter(|p| p.layout().rank < 2) {
        for r in p.regions() {
            for at in (0..r.len() / MIB).map(|i| i * MIB) {
                remote.push(r.slice(at..at + MIB).map_err(|e| e.to_string())?);
            }
        }
    }
    let mut ops = Vec::new();
    let mut slots = local
        .regions()
        .iter()
        .flat_map(|r| (0..r.len() / MIB).map(move |i| (r, i * MIB)));
    for remote in remote.into_iter().take((bytes / MIB) as usize) {
        let (region, at) = slots.next().ok_or("decode regions too small")?;
        let local = region.slice(at..at + MIB).map_err(|e| e.to_string())?;
        ops.push(RdmaOp::read(local, remote));
    }
    if (ops.len() as u64) * MIB != bytes {
        return Err(format!(
            "baseline has {} MiB, not {}",
            ops.len(),
            bytes / MIB
        ));
    }
    let (thread0, process0) = cpu_times();
    let start = Instant::now();
    node.submit(ops, DEADLINE)
        .await
        .map_err(|e| e.to_string())?;
    let wall = start.elapsed();
    let (thread1, process1) = cpu_times();
    let gbps = bytes as f64 / wall.as_secs_f64() / 1e9;
    Ok((gbps, thread1 - thread0, process1 - process0))
}

/// How a reference moves a request's pairs.
#[derive(Clone, Copy)]
enum Reference {
    /// `memcpy` on this many threads, in this process.
    Memcpy(usize),
    /// `writev` in the prefill process, `readv` here, over loopback TCP.
    Sockets,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn decode(memory: bool, rounds: usize, requests: usize) -> Result<(), String> {
    let mut child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .arg("--prefill")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the prefill process: {e}"))?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    lines
        .read_line(&mut line)
        .map_err(|e| format!("prefill process: {e}"))?;
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("ENDPOINT ")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("prefill process said {line:?}, not its endpoint"))?;

    let node = Node::builder()
        .ibverbs(false)
        .memory(memory)
        .spawn()
        .await
        .map_err(|e| e.to_string())?;
    let (name, _) = node
        .fetch_metadata(addr, DEADLINE)
        .await
        .map_err(|e| e.to_string())?;
    let peers: Vec<PeerLayout> = (0..PREFILL_TP)
        .map(|r| node.peer_layout(&name, &format!("kv{r}")))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let layout: RankLayout = cache().rank(0, DECODE_TP).map_err(|e| e.to_string())?;
    let mut regions = Vec::new();
    for &len in &layout.region_lens {
        regions.push(
            node.alloc(len, Access::ReadWrite)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let local = LocalLayout::new(layout, regions).map_err(|e| e.to_string())?;
    let options = PlanOptions {
        direction: Direction::Pull,
        ..Default::default()
    };
    let compile = Instant::now();
    let plan = node
        .plan_transfer(&local, &peers, options, DEADLINE)
        .await
        .map_err(|e| e.to_string())?;
    let compiled = compile.elapsed();

    let mut rng = fastrand::Rng::with_seed(56);
    let (l, r) = (table(&mut rng), table(&mut rng));
    let expansion = plan
        .expand(&[TableRequest {
            table: "kv",
            range: 0..TOKENS,
            local: &l,
            remote: &r,
        }])
        .map_err(|e| e.to_string())?;
    let descriptors = expansion.len();
    let bytes: u64 = expansion.local().iter().map(|d| d.len).sum();
    layout_request(&plan, (&l, &r)).await?;
    check(&local, &peers, (&l, &r), &mut rng)?;
    let transport = if memory { "memory" } else { "tcp" };
    println!(
        "kv_handoff_bench: {transport}: plan compiled (and prepared) in {:.1} ms; \
         {descriptors} descriptors, {} MiB per request, from prefill ranks {:?}; \
         first request checked on 20,000 sampled elements",
        compiled.as_secs_f64() * 1e3,
        bytes / MIB,
        plan.plan().remote_ranks().collect::<Vec<_>>(),
    );
    println!(
        "{:<10} {:>5} {:>9} {:>16} {:>17}",
        "request", "round", "GB/s", "caller CPU us", "process CPU us"
    );
    let mut reference = MemcpyReference::new(&plan, &local, &peers);
    let mut summary: [Vec<(f64, f64, f64)>; 8] = Default::default();
    // Each layouts request's GB/s over its reference's on the same pairs,
    // run right after it: drift between the rounds' kinds cancels out.
    let mut paired = Vec::new();
    for round in 0..rounds {
        for (kind, rows) in summary.iter_mut().enumerate() {
            // Gathered TCP is the reference over TCP only.
            if kind >= 6 && memory {
                continue;
            }
            let mut gb = Vec::new();
            let mut caller = Vec::new();
            let mut process = Vec::new();
            for _ in 0..requests {
                let (l, r) = (table(&mut rng), table(&mut rng));
                let request = [TableRequest {
                    table: "kv",
                    range: 0..TOKENS,
                    local: &l,
                    remote: &r,
                }];
                // A reference's GB/s on this request's pairs.
                let mut same_pairs = |how| -> Result<f64, String> {
                    let pairs = plan.expand(&request).map_err(|e| e.to_string())?;
                    let pieces = reference.pairs(&pairs);
                    match how {
                        Reference::Memcpy(threads) => Ok(copy_pieces(&pieces, threads)),
                        Reference::Sockets => {
                            let child = child.stdin.as_mut().expect("piped");
                            (tcp_reference::receive(child, &reference, &pieces))
                                .map_err(|e| format!("TCP reference: {e}"))
                        }
                    }
                };
                let (g, c, p) = match kind {
                    0 => {
                        let row = layout_request(&plan, (&l, &r)).await?;
                        let how = match memory {
                            true => Reference::Memcpy(2),
                            false => Reference::Sockets,
                        };
                        paired.push(row.0 / same_pairs(how)?);
                        row
                    }
                    1 => contiguous_request(&node, &local, &peers, bytes).await?,
                    2 | 4 | 6 => {
                        let how = match kind {
                            2 => Reference::Memcpy(1),
                            4 => Reference::Memcpy(2),
                            _ => Reference::Sockets,
                        };
                        (same_pairs(how)?, Duration::ZERO, Duration::ZERO)
                    }
                    _ => {
                        let pieces = reference.blocks(bytes);
                        let gbps = match kind {
                            3 => copy_pieces(&pieces, 1),
                            5 => copy_pieces(&pieces, 2),
                            _ => {
                                let child = child.stdin.as_mut().expect("piped");
                                (tcp_reference::receive(child, &reference, &pieces))
                                    .map_err(|e| format!("TCP reference: {e}"))?
                            }
                        };
                        (gbps, Duration::ZERO, Duration::ZERO)
                    }
                };
                gb.push(g);
                caller.push(c.as_secs_f64() * 1e6);
                process.push(p.as_secs_f64() * 1e6);
            }
            let row = (median(gb), median(caller), median(process));
            println!(
                "{:<10} {:>5} {:>9.3} {:>16.0} {:>17.0}",
                [
                    "layouts",
                    "1MiB",
                    "memcpy8K",
                    "memcpy1MiB",
                    "2memcpy8K",
                    "2memcpy1MiB",
                    "tcp8K",
                    "tcp1MiB"
                ][kind],
                round,
                row.0,
                row.1,
                row.2
            );
            rows.push(row);
        }
    }
    let med = |rows: &[(f64, f64, f64)], f: fn(&(f64, f64, f64)) -> f64| {
        median(rows.iter().map(f).collect())
    };
    let [
        lay,
        flat,
        pairs,
        blocks,
        pairs2,
        blocks2,
        tcp_pairs,
        tcp_blocks,
    ] = &summary;
    println!(
        "kv_handoff_bench: {transport}: layouts {:.3} GB/s, 1 MiB blocks {:.3} GB/s: ratio {:.2} \
         (median of {rounds} rounds of {requests} requests); caller CPU {:.0} us per request \
         ({:.1} ns per descriptor), process CPU {:.0} us",
        med(lay, |r| r.0),
        med(flat, |r| r.0),
        med(lay, |r| r.0) / med(flat, |r| r.0),
        med(lay, |r| r.1),
        med(lay, |r| r.1) * 1e3 / descriptors as f64,
        med(lay, |r| r.2),
    );
    for (threads, pairs, blocks) in [
        ("one thread", pairs, blocks),
        ("two threads", pairs2, blocks2),
    ] {
        println!(
            "kv_handoff_bench: memcpy on {threads}: the same pairs {:.3} GB/s, 1 MiB blocks \
             {:.3} GB/s: ratio {:.2}",
            med(pairs, |r| r.0),
            med(blocks, |r| r.0),
            med(pairs, |r| r.0) / med(blocks, |r| r.0),
        );
    }
    // Same host, memory bandwidth bounds the copy; over TCP the kernel's
    // copies into and out of its buffers do, from and to the same
    // scattered pieces.
    if memory {
        println!(
            "kv_handoff_bench: memory: layouts against two threads' memcpy of the same pairs: \
             {:.2}",
            med(lay, |r| r.0) / med(pairs2, |r| r.0),
        );
    } else {
        println!(
            "kv_handoff_bench: TCP writev/readv over loopback: the same pairs {:.3} GB/s, 1 MiB \
             blocks {:.3} GB/s: ratio {:.2}",
            med(tcp_pairs, |r| r.0),
            med(tcp_blocks, |r| r.0),
            med(tcp_pairs, |r| r.0) / med(tcp_blocks, |r| r.0),
        );
        println!(
            "kv_handoff_bench: tcp: layouts against writev/readv of the same pairs: {:.2}",
            med(lay, |r| r.0) / med(tcp_pairs, |r| r.0),
        );
    }
    let (low, high) = paired
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let count = paired.len();
    println!(
        "kv_handoff_bench: {transport}: layouts against the same pairs' reference run right after \
         each request: median {:.2} ({low:.2}-{high:.2}, {count} requests)",
        median(paired),
    );
    drop(child.stdin.take());
    let _ = child.wait();
    node.shutdown().await;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let result = if args.iter().any(|a| a == "--prefill") {
        prefill().await
    } else {
        let memory = match value("--transport").as_deref() {
            None | Some("tcp") => false,
            Some("memory") => true,
            Some(other) => {
                eprintln!("kv_handoff_bench: --transport tcp|memory, not {other}");
                return ExitCode::from(2);
            }
        };
        let number = |flag, default| value(flag).and_then(|v| v.parse().ok()).unwrap_or(default);
        decode(memory, number("--rounds", 5), number("--requests", 8)).await
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_handoff_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
