//! Giving `MemoryBlock::from_raw` memory back while a peer process writes
//! into it (issue 24): dropping the region never blocks the dropping
//! thread, even with the writer stopped (`SIGSTOP`) inside a `process_vm`
//! copy; `Region::closing` names that process while it holds the memory,
//! and says the memory is the caller's once it is not; and over TCP too,
//! no byte lands once `Region::close` returned.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry::prelude::*;
use ferry::{CloseError, MemoryBlock, MemoryHolder};

use crate::common::raw::RawMemory;
use crate::common::{PeerProcess, pattern};
use crate::{DEADLINE, node, sharing_peer};

/// Says when the caller's `keep_alive` is dropped.
struct Released(Arc<AtomicBool>);

impl Drop for Released {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// `len` bytes of this process's own memory registered with `node` through
/// `from_raw`: the region, the memory (which this test keeps, so it can
/// watch it after the region is gone), and whether `keep_alive` dropped.
async fn raw_region(node: &Node, len: usize) -> (Region, Arc<RawMemory>, Arc<AtomicBool>) {
    let memory = RawMemory::new(len);
    let released = Arc::new(AtomicBool::new(false));
    let keep_alive = (memory.clone(), Released(released.clone()));
    // SAFETY: the allocation lives while the guard (an Arc of it) does.
    let block = unsafe { MemoryBlock::from_raw(memory.ptr(), len as u64, Box::new(keep_alive)) }
        .unwrap();
    let region = node.register(block, Access::ReadWrite).await.unwrap();
    (region, memory, released)
}

/// Waits until the peer's writes (of `pattern(_, seed)`) land in `memory`.
async fn landing(memory: &RawMemory, seed: u8) {
    let want = pattern(4096, seed);
    let start = Instant::now();
    while memory.snapshot()[..4096] != want[..] {
        assert!(start.elapsed() < DEADLINE, "the peer's writes do not land");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Fills `memory` with 0xA5 and watches it for `watch`: `None` if it stays
/// so, else where a byte changed.
async fn scribble_and_watch(memory: &RawMemory, watch: Duration) -> Option<usize> {
    let len = memory.snapshot().len();
    let fill = vec![0xA5; len];
    memory.fill(&fill);
    let until = Instant::now() + watch;
    while Instant::now() < until {
        if let Some(at) = memory.snapshot().iter().position(|&b| b != 0xA5) {
            return Some(at);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let sent = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill(1)");
    assert!(sent.success(), "kill -{signal} {pid}");
}

/// Whether every thread of process `pid` is stopped.
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let state = stat.rsplit_once(") ")?.1.chars().next()?;
                Some(state == 'T' || state == 't')
            })
            .unwrap_or(false)
    })
}

/// Stops `pid` and waits until all its threads are.
async fn stop(pid: u32) {
    signal(pid, "STOP");
    let start = Instant::now();
    while !stopped(pid) {
        assert!(start.elapsed() < DEADLINE, "the peer does not stop");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_region_never_waits_for_a_peer_stopped_inside_a_copy() {
    let owner = node().await;
    let mut peer = sharing_peer().await;
    let pid = peer.pid().unwrap();
    let len = 16 << 20;
    let mut caught = 0;
    for attempt in 0..30u8 {
        let (region, memory, released) = raw_region(&owner, len).await;
        if attempt == 0 {
            let path = peer.path_to(&region.remote()).await;
            if path != "Some(Memory(ProcessVm))" {
                eprintln!("SKIPPED: the kernel does not let the peer process_vm this process ({path})");
                return;
            }
        }
        let seed = attempt.wrapping_add(1);
        let local = peer.alloc(len, Access::ReadWrite, seed).await;
        peer.write_loop(&local, &region.remote()).await;
        landing(&memory, seed).await;
        stop(pid).await;
        // The drop runs on a thread of its own, so that a drop that waits
        // for the stopped peer fails this test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(region.closing());
        });
        let closing = rx.recv_timeout(Duration::from_secs(5));
        let Ok(closing) = closing else {
            signal(pid, "CONT");
            panic!("attempt {attempt}: dropping the region blocked on the stopped peer");
        };
        let held = closing
            .wait(tokio::time::Instant::now() + Duration::from_millis(300))
            .await;
        match held {
            // Stopped between two steps: nothing held the memory.
            Ok(()) => {}
            Err(CloseError::Held { holders }) => {
                assert_eq!(
                    holders,
                    vec![MemoryHolder::ProcessVmPeer { pid: pid as i32 }],
                    "attempt {attempt}: the stopped peer, and only it, holds the memory"
                );
                assert!(
                    !released.load(Ordering::SeqCst),
                    "attempt {attempt}: keep_alive dropped while the peer may still write"
                );
                caught += 1;
            }
        }
        signal(pid, "CONT");
        closing
            .wait(tokio::time::Instant::now() + DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: after SIGCONT: {e}"));
        assert!(released.load(Ordering::SeqCst), "released, keep_alive not dropped");
        assert_eq!(
            scribble_and_watch(&memory, Duration::from_millis(200)).await,
            None,
            "attempt {attempt}: a write landed once the memory was released"
        );
        peer.drop_region(&local).await;
        if caught >= 2 {
            eprintln!("caught the peer inside a copy {caught} times in {} attempts", attempt + 1);
            break;
        }
    }
    assert!(caught > 0, "the peer was never stopped inside a copy");
    assert_eq!(peer.panics().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tcp_write_lands_once_close_returned() {
    let owner = node().await;
    // A peer without the memory transport: its writes go over TCP.
    let mut peer = PeerProcess::spawn().await;
    let len = 4 << 20;
    for round in 0..9u8 {
        let (region, memory, released) = raw_region(&owner, len).await;
        assert_eq!(peer.path_to(&region.remote()).await, "Some(Tcp)");
        let seed = round.wrapping_add(1);
        let local = peer.alloc(len, Access::ReadWrite, seed).await;
        peer.write_loop(&local, &region.remote()).await;
        landing(&memory, seed).await;
        region
            .close(tokio::time::Instant::now() + DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(released.load(Ordering::SeqCst), "closed, keep_alive not dropped");
        assert_eq!(
            scribble_and_watch(&memory, Duration::from_millis(300)).await,
            None,
            "round {round}: a write landed after close returned"
        );
        peer.drop_region(&local).await;
    }
    assert_eq!(peer.panics().await, 0);
}
