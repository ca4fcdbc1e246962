//! Giving `MemoryBlock::from_raw` memory back while a peer process writes
//! into it over `process_vm` (issue 24): dropping the region never blocks
//! the dropping thread, even with the writer stopped (`SIGSTOP`) inside a
//! copy; `Region::closing` names that process while it holds the memory,
//! and says the memory is the caller's once it is not; and nothing lands
//! in the memory once it is. (Over TCP: `tests/tcp/raw_drop.rs`.)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry::prelude::*;
use ferry::{CloseError, MemoryHolder};

use crate::common::raw::{RawMemory, raw_region, scribble_and_watch, watch_unchanged};
use crate::common::{pattern, signal, stop};
use crate::{DEADLINE, node, sharing_peer};

/// Waits until the peer's writes (of `pattern(_, seed)`) land in `memory`.
async fn landing(memory: &RawMemory, seed: u8) {
    let want = pattern(4096, seed);
    let start = Instant::now();
    while memory.snapshot()[..4096] != want[..] {
        assert!(start.elapsed() < DEADLINE, "the peer's writes do not land");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Stops the peer `pid` while it writes into `region` in a loop, and gives
/// the region back (from another thread, so that a drop that waits for the
/// stopped peer fails the test instead of hanging it). If the memory is
/// released at once, it is the caller's: it is scribbled on before the peer
/// goes on. Otherwise `holders` must name who holds it; the peer goes on,
/// and the memory must come back. Either way nothing may land once it is
/// back. Says whether the peer held the memory.
async fn give_back_while_stopped(
    pid: u32,
    raw: (Region, Arc<RawMemory>, Arc<AtomicBool>),
    holders_ok: impl Fn(&[MemoryHolder]) -> bool,
    what: &str,
) -> bool {
    let (region, memory, released) = raw;
    stop(pid).await;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(region.closing());
    });
    let Ok(closing) = rx.recv_timeout(Duration::from_secs(5)) else {
        signal(pid, "CONT");
        panic!("{what}: dropping the region blocked on the stopped peer");
    };
    let held = closing
        .wait(tokio::time::Instant::now() + Duration::from_millis(300))
        .await;
    match held {
        Ok(()) => {
            // Nothing held it: the memory is ours even though the peer has
            // not gone on yet, and it must not write into it when it does.
            assert!(
                released.load(Ordering::SeqCst),
                "{what}: released, keep_alive not dropped"
            );
            memory.fill(&vec![0xA5; memory.snapshot().len()]);
            signal(pid, "CONT");
        }
        Err(CloseError::Held { holders }) => {
            assert!(holders_ok(&holders), "{what}: held by {holders:?}");
            assert!(
                !released.load(Ordering::SeqCst),
                "{what}: keep_alive dropped while the peer may still write"
            );
            signal(pid, "CONT");
            closing
                .wait(tokio::time::Instant::now() + DEADLINE)
                .await
                .unwrap_or_else(|e| panic!("{what}: after SIGCONT: {e}"));
            assert!(
                released.load(Ordering::SeqCst),
                "{what}: released, keep_alive not dropped"
            );
            assert_eq!(
                scribble_and_watch(&memory, Duration::from_millis(300)).await,
                None,
                "{what}: a write landed once the memory was released"
            );
            return true;
        }
        Err(other) => panic!("{what}: {other}"),
    }
    assert_eq!(
        watch_unchanged(&memory, Duration::from_millis(300)).await,
        None,
        "{what}: a write landed once the memory was released"
    );
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_region_never_waits_for_a_peer_stopped_inside_a_copy() {
    let owner = node().await;
    let mut peer = sharing_peer().await;
    let pid = peer.pid().unwrap();
    let len = 16 << 20;
    let mut caught = 0;
    for attempt in 0..30u8 {
        let raw = raw_region(&owner, len).await;
        if attempt == 0 {
            let path = peer.path_to(&raw.0.remote()).await;
            if path != "Some(Memory(ProcessVm))" {
                eprintln!(
                    "SKIPPED: the kernel does not let the peer process_vm this process ({path})"
                );
                return;
            }
        }
        let seed = attempt.wrapping_add(1);
        let local = peer.alloc(len, Access::ReadWrite, seed).await;
        peer.write_loop(&local, &raw.0.remote()).await;
        landing(&raw.1, seed).await;
        let stepping = [MemoryHolder::ProcessVmPeer { pid: pid as i32 }];
        let what = format!("attempt {attempt}");
        if give_back_while_stopped(pid, raw, |h| h == stepping, &what).await {
            caught += 1;
        }
        peer.drop_region(&local).await;
        if caught >= 2 {
            eprintln!(
                "caught the peer inside a copy {caught} times in {} attempts",
                attempt + 1
            );
            break;
        }
    }
    assert!(caught > 0, "the peer was never stopped inside a copy");
    assert_eq!(peer.panics().await, 0);
}
