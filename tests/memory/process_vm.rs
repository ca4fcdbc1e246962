//! Memory ferry did not allocate (`MemoryBlock::from_raw`) between two
//! processes: over `process_vm_readv`/`process_vm_writev` byte for byte,
//! saying so; read-only and stale handles refused with typed errors; no
//! write landing once the owner closed the region (`Region::close`: its
//! memory released); and, where the kernel
//! refuses (another uid), over TCP, saying so.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry::prelude::*;
use ferry::{DISABLE_MEMORY_ENV, MemoryBlock, MemoryPath, TransportPath};

use crate::common::{PeerProcess, digest, forge, pattern};
use crate::{DEADLINE, assert_op_error, node, sharing_peer};

const PROCESS_VM: Option<TransportPath> = Some(TransportPath::Memory(MemoryPath::ProcessVm));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_raw_regions_go_over_process_vm_byte_for_byte() {
    regions_byte_for_byte().await;
}

/// On a current-thread runtime (the NIXL plugin's) a batch's first share
/// is copied on the runtime's thread, a step at a time, beside the copy
/// threads: the same bytes land.
#[tokio::test(flavor = "current_thread")]
async fn from_raw_regions_go_over_process_vm_byte_for_byte_on_a_current_thread_runtime() {
    regions_byte_for_byte().await;
}

async fn regions_byte_for_byte() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    // Across one piece (1 MiB) and several, at an offset into the region.
    let sizes = [1, 8, 4095, 4096, 65537, 1 << 20, (3 << 20) + 5, 16 << 20];
    let margin = 24;
    for (i, &len) in sizes.iter().enumerate() {
        let seed = i as u8;
        let target = peer
            .alloc_raw(len + 2 * margin, Access::ReadWrite, seed)
            .await;
        assert!(
            target.handle.transports().memory.unwrap().process_vm,
            "the handle says process_vm"
        );
        let remote = target
            .handle
            .slice(margin as u64..(margin + len) as u64)
            .unwrap();
        let data = pattern(len, seed.wrapping_add(50));
        let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
        src.write_at(0, &data).unwrap();
        let op = RdmaOp::write(src.whole(), remote.clone());
        assert_eq!(node.path(&op), PROCESS_VM, "{len} B: says which");
        assert_eq!(node.route(&op), Some(RdmaTransportLevel::Memory));
        node.submit(vec![op], DEADLINE).await.unwrap();
        let mut expected = target.original();
        expected[margin..margin + len].copy_from_slice(&data);
        assert_eq!(
            peer.digest(&target).await,
            digest(&expected),
            "{len} B write landed, margins untouched"
        );
        let back = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
        node.submit(vec![RdmaOp::read(back.whole(), remote)], DEADLINE)
            .await
            .unwrap();
        assert!(back.to_vec() == data, "{len} B read back differs");
        peer.drop_region(&target).await;
    }
    // Memory ferry allocated still goes through a mapping, and says so;
    // its bytes too, over several copy steps.
    let len = (3 << 20) + 5;
    let shared = peer.alloc(len, Access::ReadWrite, 1).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let op = RdmaOp::read(local.whole(), shared.handle.clone());
    assert_eq!(
        node.path(&op),
        Some(TransportPath::Memory(MemoryPath::Mapped))
    );
    node.submit(vec![op], DEADLINE).await.unwrap();
    assert_eq!(digest(&local.to_vec()), digest(&shared.original()));
    assert_eq!(peer.panics().await, 0);
}

/// Many small ops through one grant go in vectored calls, a group at a
/// time (at most 1,024 iovecs a side and 1 MiB each), adjacent blocks
/// sharing iovecs: batches of 150 to 3,000 blocks of 1 B to 8 KiB, inline
/// (under 1 MiB) and on copy threads (over it), written and read back
/// byte for byte. The blocks are posted shuffled (adjacent on neither
/// side), in order (adjacent on both), and packed here but scattered in
/// the owner (adjacent on one side only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_small_ops_over_process_vm_land_byte_for_byte() {
    many_small_ops_byte_for_byte().await;
}

/// As above, on a current-thread runtime: blocks split across copy steps.
#[tokio::test(flavor = "current_thread")]
async fn many_small_ops_over_process_vm_land_byte_for_byte_on_a_current_thread_runtime() {
    many_small_ops_byte_for_byte().await;
}

/// How a round lays its blocks out.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Block k at the same offset on both sides, posted in shuffled order.
    Shuffled,
    /// Block k at the same offset on both sides, posted in order.
    InOrder,
    /// Posted in shuffled order, packed here in that order.
    PackedHere,
}

async fn many_small_ops_byte_for_byte() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    for (round, count, max, layout) in [
        (0u8, 150usize, 8192, Layout::Shuffled),
        (1, 700, 8192, Layout::Shuffled),
        (2, 3000, 1024, Layout::InOrder),
        (3, 3000, 1024, Layout::PackedHere),
    ] {
        let mut rng = fastrand::Rng::with_seed(u64::from(round) + 7);
        let lens: Vec<usize> = (0..count).map(|_| rng.usize(1..=max)).collect();
        let total: usize = lens.iter().sum();
        let target = peer.alloc_raw(total + 64, Access::ReadWrite, round).await;
        let data = pattern(total, round.wrapping_add(90));
        let src = node.alloc(total as u64, Access::ReadWrite).await.unwrap();
        src.write_at(0, &data).unwrap();
        let back = node.alloc(total as u64, Access::ReadWrite).await.unwrap();
        // (offset here, offset in the owner, length), in posting order.
        let mut at = 0u64;
        let mut blocks: Vec<(u64, u64, u64)> = lens
            .iter()
            .map(|&len| {
                let block = (at, at, len as u64);
                at += len as u64;
                block
            })
            .collect();
        if !matches!(layout, Layout::InOrder) {
            rng.shuffle(&mut blocks);
        }
        if matches!(layout, Layout::PackedHere) {
            let mut here = 0;
            for block in &mut blocks {
                block.0 = here;
                here += block.2;
            }
        }
        let local = |region: &Region, b: &(u64, u64, u64)| region.slice(b.0..b.0 + b.2).unwrap();
        let remote = |b: &(u64, u64, u64)| target.handle.slice(b.1..b.1 + b.2).unwrap();
        let writes = blocks
            .iter()
            .map(|b| RdmaOp::write(local(&src, b), remote(b)))
            .collect();
        node.submit(writes, DEADLINE).await.unwrap();
        let mut expected = target.original();
        for &(here, there, len) in &blocks {
            let (here, there, len) = (here as usize, there as usize, len as usize);
            expected[there..there + len].copy_from_slice(&data[here..here + len]);
        }
        assert_eq!(
            peer.digest(&target).await,
            digest(&expected),
            "{count} writes, {layout:?}"
        );
        let reads = blocks
            .iter()
            .map(|b| RdmaOp::read(local(&back, b), remote(b)))
            .collect();
        node.submit(reads, DEADLINE).await.unwrap();
        assert!(
            back.to_vec() == data,
            "{count} reads back differ, {layout:?}"
        );
        peer.drop_region(&target).await;
    }
    assert_eq!(peer.panics().await, 0);
}

/// One batch whose ops alternate between a region the owner shares as a
/// memfd (mapped) and one it cannot (`process_vm`): each run of the latter
/// goes in a vectored call of its own, which ends where a mapped op
/// begins, and every byte lands in the right region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_mixing_mapped_and_process_vm_ops_lands_byte_for_byte() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let len = 64 * 1024;
    let raw = peer.alloc_raw(len, Access::ReadWrite, 11).await;
    let shared = peer.alloc(len, Access::ReadWrite, 12).await;
    let data = pattern(len, 13);
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    // 4 KiB blocks at the same offsets on both sides: two adjacent ones
    // through process_vm, then one mapped, and so on.
    let block = 4096;
    let mapped = |k: usize| k % 3 == 2;
    let writes: Vec<RdmaOp> = (0..len / block)
        .map(|k| {
            let at = (k * block) as u64;
            let target = if mapped(k) { &shared } else { &raw };
            let remote = target.handle.slice(at..at + block as u64).unwrap();
            RdmaOp::write(src.slice(at..at + block as u64).unwrap(), remote)
        })
        .collect();
    assert_eq!(node.path(&writes[0]), PROCESS_VM);
    assert_eq!(
        node.path(&writes[2]),
        Some(TransportPath::Memory(MemoryPath::Mapped))
    );
    node.submit(writes, DEADLINE).await.unwrap();
    let (mut in_raw, mut in_shared) = (raw.original(), shared.original());
    for k in 0..len / block {
        let into = if mapped(k) {
            &mut in_shared
        } else {
            &mut in_raw
        };
        into[k * block..(k + 1) * block].copy_from_slice(&data[k * block..(k + 1) * block]);
    }
    assert_eq!(
        peer.digest(&raw).await,
        digest(&in_raw),
        "process_vm region"
    );
    assert_eq!(
        peer.digest(&shared).await,
        digest(&in_shared),
        "mapped region"
    );
    assert_eq!(peer.panics().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_raw_memory_in_this_process_goes_over_process_vm_too() {
    let (owner, node) = (node().await, node().await);
    let buffer = vec![0x5Au8; 8192].into_boxed_slice();
    let ptr = std::ptr::NonNull::new(buffer.as_ptr() as *mut u8).unwrap();
    // SAFETY: the boxed slice is kept alive by the block's guard.
    let block = unsafe { MemoryBlock::from_raw(ptr, 8192, Box::new(buffer)) }.unwrap();
    let raw = owner.register(block, Access::ReadWrite).await.unwrap();
    let local = node.alloc(8192, Access::ReadWrite).await.unwrap();
    let op = RdmaOp::read(local.whole(), raw.remote());
    assert_eq!(node.path(&op), PROCESS_VM, "says which");
    node.submit(vec![op], DEADLINE).await.unwrap();
    assert!(local.to_vec().iter().all(|&b| b == 0x5A));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_from_raw_region_refuses_a_forged_write() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let len = 3 << 20;
    let ro = peer.alloc_raw(len, Access::ReadOnly, 3).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    local.write_at(0, &pattern(len, 0xEE)).unwrap();
    let forged_rw = forge(&ro.handle, |j| j["access"] = "ReadWrite".into());
    let write = vec![RdmaOp::write(local.whole(), forged_rw.clone())];
    assert_eq!(node.path(&write[0]), PROCESS_VM);
    // Refused before any grant, and again after a read cached one.
    assert_op_error(node.submit(write.clone(), DEADLINE).await, |e| {
        *e == OpError::ReadOnly
    });
    let back = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), forged_rw)], DEADLINE)
        .await
        .unwrap();
    assert!(back.to_vec() == ro.original(), "reading it is fine");
    assert_op_error(node.submit(write, DEADLINE).await, |e| {
        *e == OpError::ReadOnly
    });
    assert_eq!(
        peer.digest(&ro).await,
        digest(&ro.original()),
        "the read-only region changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_and_reregistered_from_raw_region_is_stale() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let len = 64 * 1024;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let rw = peer.alloc_raw(len, Access::ReadWrite, 4).await;
    // Granted and cached here (one read), then dropped and its slot reused.
    node.submit(
        vec![RdmaOp::read(local.whole(), rw.handle.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    peer.drop_region(&rw).await;
    let reused = peer.alloc_raw(len, Access::ReadWrite, 5).await;
    assert_eq!(reused.handle.region(), rw.handle.region(), "slot reused");
    let stale = |e: &OpError| {
        matches!(e, OpError::StaleGeneration { handle, current }
            if *handle == rw.handle.generation() && *current == reused.handle.generation())
    };
    local.write_at(0, &pattern(len, 0xEE)).unwrap();
    let write = RdmaOp::write(local.whole(), rw.handle.clone());
    assert_op_error(node.submit(vec![write], DEADLINE).await, stale);
    let read = RdmaOp::read(local.whole(), rw.handle.clone());
    assert_op_error(node.submit(vec![read], DEADLINE).await, stale);
    assert_eq!(
        peer.digest(&reused).await,
        digest(&reused.original()),
        "a stale write landed"
    );
    assert!(local.to_vec() == pattern(len, 0xEE), "a stale read landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_process_vm_write_lands_once_the_owner_closed_the_region() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let len = 4 << 20;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 0x11)).unwrap();
    for round in 0..10 {
        let target = peer.alloc_raw(len, Access::ReadWrite, round).await;
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        // Writers in a loop, several pieces each, until told to stop.
        let writers: Vec<_> = (0..3)
            .map(|_| {
                let (node, stop, ok) = (node.clone(), stop.clone(), ok.clone());
                let op = RdmaOp::write(src.whole(), target.handle.clone());
                tokio::spawn(async move {
                    let mut errors = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        match node.submit(vec![op.clone()], DEADLINE).await {
                            Ok(()) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(SubmitError::Op { error, .. }) => errors.push(error),
                            Err(other) => panic!("round {round}: {other}"),
                        }
                    }
                    errors
                })
            })
            .collect();
        // Writes are landing when the owner closes the region.
        let start = Instant::now();
        while ok.load(Ordering::Relaxed) < 4 + round as usize {
            assert!(
                start.elapsed() < DEADLINE,
                "round {round}: writes do not land"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let verdict = peer
            .close_and_scribble(&target, Duration::from_millis(300))
            .await;
        stop.store(true, Ordering::Relaxed);
        assert_eq!(
            verdict, "intact",
            "round {round}: a write landed once the memory was released"
        );
        let mut refused = 0;
        for writer in writers {
            let errors = writer.await.unwrap();
            refused += errors.len();
            for error in errors {
                assert!(
                    matches!(
                        error,
                        OpError::UnknownRegion | OpError::StaleGeneration { .. }
                    ),
                    "round {round}: {error:?}"
                );
            }
        }
        eprintln!(
            "round {round}: {} writes landed before the close, {refused} refused after",
            ok.load(Ordering::Relaxed)
        );
    }
    assert_eq!(peer.panics().await, 0);
}

/// Whether this process runs as root (and may start a child as another
/// user).
fn root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective uid.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_the_kernel_refuses_process_vm_raw_memory_goes_over_tcp_and_says_so() {
    if !root() {
        eprintln!(
            "SKIPPED: needs root to start a peer as another user (root can always \
             process_vm any process, so only a uid mismatch gives a real EPERM)"
        );
        return;
    }
    // This process (root) owns the memory; the initiator runs as nobody,
    // which the kernel does not let reach a root process.
    let owner = node().await;
    let len = (2 << 20) + 3;
    let memory = Arc::new(std::sync::Mutex::new(vec![0u8; len].into_boxed_slice()));
    let ptr = std::ptr::NonNull::new(memory.lock().unwrap().as_mut_ptr()).unwrap();
    // SAFETY: the boxed slice lives while the guard (an Arc of it) does, and
    // is never resized; this test reads it only after transfers completed.
    let block =
        unsafe { MemoryBlock::from_raw(ptr, len as u64, Box::new(memory.clone())) }.unwrap();
    let raw = owner.register(block, Access::ReadWrite).await.unwrap();
    let mapped = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    let mut nobody = PeerProcess::spawn_as(65534, &[(DISABLE_MEMORY_ENV, "0")]).await;
    assert_eq!(
        nobody.path_to(&raw.remote()).await,
        "Some(Tcp)",
        "says which"
    );
    assert_eq!(
        nobody.path_to(&mapped.remote()).await,
        "Some(Memory(Mapped))",
        "a memfd region still goes through a mapping"
    );
    let local = nobody.alloc(len, Access::ReadWrite, 9).await;
    let started = Instant::now();
    nobody.write_to(&local, &raw.remote()).await.unwrap();
    assert!(
        raw.to_vec() == local.original(),
        "the write landed over TCP"
    );
    raw.write_at(0, &pattern(len, 10)).unwrap();
    nobody.read_from(&local, &raw.remote()).await.unwrap();
    assert_eq!(nobody.digest(&local).await, digest(&pattern(len, 10)));
    eprintln!("fallback write + read took {:?}", started.elapsed());
    assert_eq!(nobody.panics().await, 0);
}

/// Rough numbers, not asserted: `process_vm` against a mapped memfd, by
/// size and direction. Run with `--nocapture` to see them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_vm_and_mapped_throughput() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    for len in [1usize << 20, 16 << 20] {
        let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
        let raw = peer.alloc_raw(len, Access::ReadWrite, 1).await;
        let mapped = peer.alloc(len, Access::ReadWrite, 2).await;
        let rounds = (256 << 20) / len;
        for (name, target) in [("process_vm", &raw), ("memfd", &mapped)] {
            for write in [false, true] {
                let op = if write {
                    RdmaOp::write(local.whole(), target.handle.clone())
                } else {
                    RdmaOp::read(local.whole(), target.handle.clone())
                };
                // Once untimed: grants, mappings, first touches.
                node.submit(vec![op.clone()], DEADLINE).await.unwrap();
                let start = Instant::now();
                for _ in 0..rounds {
                    node.submit(vec![op.clone()], DEADLINE).await.unwrap();
                }
                let secs = start.elapsed().as_secs_f64();
                let gbps = (rounds * len) as f64 / secs / 1e9;
                eprintln!(
                    "{name:>10} {:>5} {:>3} MiB: {gbps:6.2} GB/s ({:.0} µs per op)",
                    if write { "write" } else { "read" },
                    len >> 20,
                    secs * 1e6 / rounds as f64
                );
            }
        }
    }
}
