//! The child processes of `weights_bench`: publisher ranks and subscribers,
//! each a node of its own, spoken to by lines on stdin and stdout; the
//! workload's layouts, values and checks.

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ferry::LocalLayout;
use ferry::layout::{Part, RankLayout, Tensor, TensorLayout};
use ferry::prelude::*;
use ferry::weights::{Publisher, Subscriber};
use tokio::io::AsyncBufReadExt;

pub(crate) const SET: &str = "weights_bench";
pub(crate) const MATRICES: u64 = 8;
pub(crate) const COLS: u64 = 4096;
pub(crate) const ELEM: u64 = 2;
pub(crate) const ROW_BYTES: u64 = COLS * ELEM;
pub(crate) const RANKS: u32 = 2;
pub(crate) const PAGE: u64 = 4096;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const DEADLINE: Duration = Duration::from_secs(120);

/// Rows of each matrix for `mib` MiB per version.
pub(crate) fn rows(mib: u64) -> u64 {
    mib * MIB / MATRICES / ROW_BYTES
}

pub(crate) fn tensor(t: u64, rows: u64) -> Tensor {
    Tensor::new(
        format!("m{t}"),
        ELEM as u32,
        &[("row", rows), ("col", COLS)],
    )
}

/// Bytes of one matrix a publisher rank holds.
pub(crate) fn piece(rows: u64) -> u64 {
    rows / u64::from(RANKS) * ROW_BYTES
}

/// Publisher rank `rank`: its rows of every matrix, one after the other
/// in one region.
pub(crate) fn publisher_layout(rank: u32, rows: u64) -> Result<RankLayout, String> {
    let mut tensors = Vec::new();
    for t in 0..MATRICES {
        let part = vec![
            Part::Split {
                parts: u64::from(RANKS),
                index: u64::from(rank),
            },
            Part::Full,
        ];
        let layout =
            TensorLayout::contiguous(tensor(t, rows), part, &["row", "col"], 0, t * piece(rows));
        tensors.push(layout.map_err(|e| e.to_string())?);
    }
    Ok(RankLayout {
        rank,
        region_lens: vec![piece(rows) * MATRICES],
        tensors,
    })
}

/// A subscriber: every matrix whole, one after the other in one region.
pub(crate) fn subscriber_layout(rows: u64) -> Result<RankLayout, String> {
    let mut tensors = Vec::new();
    for t in 0..MATRICES {
        let part = vec![Part::Full, Part::Full];
        let at = t * rows * ROW_BYTES;
        let layout = TensorLayout::contiguous(tensor(t, rows), part, &["row", "col"], 0, at);
        tensors.push(layout.map_err(|e| e.to_string())?);
    }
    Ok(RankLayout {
        rank: 0,
        region_lens: vec![rows * ROW_BYTES * MATRICES],
        tensors,
    })
}

/// The first 8 bytes of page `page` of matrix `t` in version `v` (the
/// last 8 are its complement; the rest is the byte `v`).
pub(crate) fn tag(v: u64, t: u64, page: u64) -> u64 {
    v.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (t << 56) ^ page
}

/// Writes publisher rank `rank`'s pieces of version `v`.
pub(crate) fn fill(region: &Region, rank: u32, rows: u64, v: u64) -> Result<(), String> {
    let piece = piece(rows);
    let mut chunk = vec![0u8; MIB.min(piece) as usize];
    for t in 0..MATRICES {
        // Where the rank's piece starts in the whole matrix.
        let global = u64::from(rank) * piece;
        let mut at = 0;
        while at < piece {
            let len = (piece - at).min(chunk.len() as u64) as usize;
            let buf = &mut chunk[..len];
            buf.fill(v as u8);
            for (i, page) in buf.chunks_exact_mut(PAGE as usize).enumerate() {
                let tag = tag(v, t, (global + at) / PAGE + i as u64);
                page[..8].copy_from_slice(&tag.to_le_bytes());
                page[PAGE as usize - 8..].copy_from_slice(&(!tag).to_le_bytes());
            }
            region
                .write_at(t * piece + at, buf)
                .map_err(|e| e.to_string())?;
            at += len as u64;
        }
    }
    Ok(())
}

/// Pages of a subscriber's buffer that do not hold version `v`: the
/// first and last 8 bytes and the middle byte of every page.
pub(crate) fn check(region: &Region, rows: u64, v: u64) -> Result<u64, String> {
    let matrix = rows * ROW_BYTES;
    let mut wrong = 0;
    let (mut first, mut last, mut middle) = ([0u8; 8], [0u8; 8], [0u8; 1]);
    for t in 0..MATRICES {
        for page in 0..matrix / PAGE {
            let at = t * matrix + page * PAGE;
            let read = |offset, buf: &mut [u8]| region.read_at(offset, buf);
            read(at, &mut first).map_err(|e| e.to_string())?;
            read(at + PAGE - 8, &mut last).map_err(|e| e.to_string())?;
            read(at + PAGE / 2, &mut middle).map_err(|e| e.to_string())?;
            let tag = tag(v, t, page);
            let ok = u64::from_le_bytes(first) == tag
                && u64::from_le_bytes(last) == !tag
                && middle[0] == v as u8;
            wrong += u64::from(!ok);
        }
    }
    Ok(wrong)
}

/// Clock `id` in nanoseconds.
pub(crate) fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC: the same clock in every process of the host.
pub(crate) fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// This process's CPU time (all its threads, user and system).
pub(crate) fn process_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// (resident, shared) bytes of this process, and its mapping count.
pub(crate) fn footprint() -> (u64, u64, usize) {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: Vec<u64> = statm
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let maps = std::fs::read_to_string("/proc/self/maps").map_or(0, |m| m.lines().count());
    (
        pages.get(1).copied().unwrap_or(0) * page,
        pages.get(2).copied().unwrap_or(0) * page,
        maps,
    )
}

pub(crate) async fn spawn_node(memory: bool) -> Result<Node, String> {
    Node::builder()
        .ibverbs(false)
        .memory(memory)
        .spawn()
        .await
        .map_err(|e| e.to_string())
}

pub(crate) fn say(line: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())
}

/// A publisher rank: its endpoint on stdout, then `PUBLISH v` lines on
/// stdin, each answered `PUBLISHED v <ns> <write ms> <overrun> <regions>
/// <cpu ns>` once the version is published, and `CPU` lines with `CPU
/// <cpu ns>` (the process's CPU time so far); gone when stdin closes.
pub(crate) async fn publisher(rank: u32, memory: bool, mib: u64) -> Result<(), String> {
    let node = spawn_node(memory).await?;
    let rows = rows(mib);
    let layout = publisher_layout(rank, rows)?;
    let region = node
        .alloc(layout.region_lens[0], Access::ReadWrite)
        .await
        .map_err(|e| e.to_string())?;
    let local = LocalLayout::new(layout, vec![region.clone()]).map_err(|e| e.to_string())?;
    let publisher = Publisher::start(&node, SET, local).map_err(|e| e.to_string())?;
    say(&format!("ENDPOINT {}", node.addr().endpoint))?;
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
        if line == "CPU" {
            say(&format!("CPU {}", process_cpu_ns()))?;
            continue;
        }
        let v: u64 = (line.strip_prefix("PUBLISH ").and_then(|v| v.parse().ok()))
            .ok_or_else(|| format!("publisher {rank}: {line:?}"))?;
        let start = Instant::now();
        let (guard, overrun) = publisher.write(DEADLINE).await;
        tokio::task::block_in_place(|| fill(&region, rank, rows, v))?;
        guard.publish(v).map_err(|e| e.to_string())?;
        let at = monotonic_ns();
        let regions = node.registered_regions().await.len();
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let cpu = process_cpu_ns();
        say(&format!(
            "PUBLISHED {v} {at} {ms:.1} {overrun} {regions} {cpu}"
        ))?;
    }
    drop(publisher);
    node.shutdown().await;
    Ok(())
}

/// A subscriber: plans against the publishers, says `READY`, then
/// answers each `UPDATE v` with `UPDATED v <start ns> <end ns>
/// <mismatched pages> <resident> <shared> <maps> <regions> <update CPU
/// ns>`; gone when stdin closes.
pub(crate) async fn subscriber(
    memory: bool,
    mib: u64,
    (buffers, verify): (usize, bool),
    publishers: Vec<SocketAddr>,
) -> Result<(), String> {
    let node = spawn_node(memory).await?;
    let rows = rows(mib);
    let mut locals = Vec::new();
    for _ in 0..buffers {
        let layout = subscriber_layout(rows)?;
        let region = node
            .alloc(layout.region_lens[0], Access::ReadWrite)
            .await
            .map_err(|e| e.to_string())?;
        // Faulted in now, not during the first update.
        let zeros = vec![0u8; MIB as usize];
        for at in (0..region.len()).step_by(MIB as usize) {
            let len = (region.len() - at).min(MIB) as usize;
            region
                .write_at(at, &zeros[..len])
                .map_err(|e| e.to_string())?;
        }
        locals.push(LocalLayout::new(layout, vec![region]).map_err(|e| e.to_string())?);
    }
    let mut sub = Subscriber::new(&node, SET, &publishers, locals, DEADLINE)
        .await
        .map_err(|e| e.to_string())?;
    sub.verify_checksums(verify);
    say("READY")?;
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
        let v: u64 = (line.strip_prefix("UPDATE ").and_then(|v| v.parse().ok()))
            .ok_or_else(|| format!("subscriber: {line:?}"))?;
        let (start, cpu) = (monotonic_ns(), process_cpu_ns());
        let update = sub.update(DEADLINE).await.map_err(|e| e.to_string())?;
        let (end, cpu) = (monotonic_ns(), process_cpu_ns() - cpu);
        if (update.version, update.changed) != (v, true) {
            return Err(format!("asked for version {v}, updated to {update:?}"));
        }
        let region = &sub.buffers()[update.buffer].regions()[0];
        let wrong = tokio::task::block_in_place(|| check(region, rows, v))?;
        let (resident, shared, maps) = footprint();
        let regions = node.registered_regions().await.len();
        say(&format!(
            "UPDATED {v} {start} {end} {wrong} {resident} {shared} {maps} {regions} {cpu}"
        ))?;
    }
    drop(sub);
    node.shutdown().await;
    Ok(())
}
