//! Memory ferry did not allocate (`MemoryBlock::from_raw`) in a peer
//! process: peer commands and the harness calls that send them. The memory
//! stays the peer's after its region is dropped, so a test can check that
//! nothing lands in it afterwards.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ferry::MemoryBlock;
use ferry::prelude::*;

use super::{PeerProcess, PeerRegion, pattern};

/// Caller-owned memory: page aligned, zeroed, freed with its last `Arc`.
pub struct RawMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: plain heap memory, only accessed through raw pointers.
unsafe impl Send for RawMemory {}
// SAFETY: as for Send.
unsafe impl Sync for RawMemory {}

#[allow(dead_code)] // not every suite that shares common.rs uses these
impl RawMemory {
    pub fn new(len: usize) -> Arc<RawMemory> {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: a non-zero size (the tests never ask for 0 bytes).
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).expect("memory");
        Arc::new(RawMemory { ptr, layout })
    }

    /// Copies out the bytes (another process may be writing them).
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0; self.layout.size()];
        // SAFETY: the allocation is `size` bytes and lives while self does.
        unsafe { std::ptr::copy(self.ptr.as_ptr(), out.as_mut_ptr(), out.len()) };
        out
    }

    pub fn fill(&self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.layout.size());
        // SAFETY: as above.
        unsafe { std::ptr::copy(bytes.as_ptr(), self.ptr.as_ptr(), bytes.len()) };
    }
}

impl Drop for RawMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the last reference.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Says when a `from_raw` region's `keep_alive` is dropped.
struct Released(Arc<AtomicBool>);

impl Drop for Released {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// `len` bytes of this process's own memory (zeroed) registered with
/// `node` through `from_raw`: the region; the memory, which the caller
/// keeps, so it can watch it after the region is gone; and whether the
/// region's `keep_alive` has been dropped.
#[allow(dead_code)] // not every suite that shares common.rs uses these
pub async fn raw_region(node: &Node, len: usize) -> (Region, Arc<RawMemory>, Arc<AtomicBool>) {
    let memory = RawMemory::new(len);
    let released = Arc::new(AtomicBool::new(false));
    let keep_alive = (memory.clone(), Released(released.clone()));
    // SAFETY: the allocation lives while the guard (an Arc of it) does.
    let block =
        unsafe { MemoryBlock::from_raw(memory.ptr, len as u64, Box::new(keep_alive)) }.unwrap();
    let region = node.register(block, Access::ReadWrite).await.unwrap();
    (region, memory, released)
}

/// Fills `memory` with 0xA5 and watches it for `watch`: `None` if it stays
/// so, else where the first byte changed.
#[allow(dead_code)] // not every suite that shares common.rs uses these
pub async fn scribble_and_watch(memory: &RawMemory, watch: Duration) -> Option<usize> {
    memory.fill(&vec![0xA5; memory.layout.size()]);
    watch_unchanged(memory, watch).await
}

/// Watches `memory` (all 0xA5) for `watch`: `None` if it stays so, else
/// where the first byte changed.
#[allow(dead_code)] // not every suite that shares common.rs uses these
pub async fn watch_unchanged(memory: &RawMemory, watch: Duration) -> Option<usize> {
    let until = Instant::now() + watch;
    while Instant::now() < until {
        if let Some(at) = memory.snapshot().iter().position(|&b| b != 0xA5) {
            return Some(at);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The peer's raw memory, by region index: kept after the region drops.
#[derive(Default)]
pub struct Raws(HashMap<usize, Arc<RawMemory>>);

/// Runs a raw-memory command in the peer; `None` for a command it does not
/// know.
pub async fn command(
    node: &Node,
    regions: &mut Vec<Option<Region>>,
    raws: &mut Raws,
    words: &[&str],
    line: &str,
) -> Option<String> {
    Some(match words {
        // Like `alloc`, but memory the peer owns, wrapped with `from_raw`.
        ["alloc-raw", len, access, seed] => {
            let access = if *access == "ro" {
                Access::ReadOnly
            } else {
                Access::ReadWrite
            };
            let len: usize = len.parse().unwrap();
            let raw = RawMemory::new(len);
            raw.fill(&pattern(len, seed.parse().unwrap()));
            // SAFETY: the guard (an Arc of the allocation) keeps it valid.
            let block =
                unsafe { MemoryBlock::from_raw(raw.ptr, len as u64, Box::new(raw.clone())) }
                    .unwrap();
            let region = node.register(block, access).await.expect("register");
            let json = serde_json::to_string(&region.remote()).unwrap();
            regions.push(Some(region));
            raws.0.insert(regions.len() - 1, raw);
            format!("{} {json}", regions.len() - 1)
        }
        // Closes the region (waits until its memory is released: no write
        // can land any more); the moment that returns, fills its memory
        // with 0xA5 and watches it for `ms` milliseconds.
        ["close-scribble", index, ms] => {
            let index: usize = index.parse().unwrap();
            let region = regions[index].take().expect("live region");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            if let Err(e) = region.close(deadline).await {
                return Some(format!("not released: {e}"));
            }
            let raw = raws.0.get(&index).expect("a raw region");
            let fill = vec![0xA5; raw.layout.size()];
            raw.fill(&fill);
            let until = Instant::now() + Duration::from_millis(ms.parse().unwrap());
            loop {
                let now = raw.snapshot();
                if let Some(at) = now.iter().zip(&fill).position(|(a, b)| a != b) {
                    break format!("changed at byte {at}");
                }
                if Instant::now() >= until {
                    break "intact".to_string();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        // Writes the whole region `index` to the handle, again and again in
        // the background, until a write fails.
        ["write-loop", index, _, ..] => {
            let index: usize = index.parse().unwrap();
            let handle = line.trim().splitn(3, ' ').nth(2).unwrap();
            let remote: RemoteBuffer = serde_json::from_str(handle).expect("handle JSON");
            let local = regions[index].clone().expect("live region");
            let node = node.clone();
            tokio::spawn(async move {
                let op = RdmaOp::write(local.whole(), remote);
                while node
                    .submit(vec![op.clone()], Duration::from_secs(30))
                    .await
                    .is_ok()
                {}
            });
            "looping".to_string()
        }
        // How this node would carry a read of the handle.
        ["path", _, ..] => {
            let handle = line.trim().split_once(' ').unwrap().1;
            let remote: RemoteBuffer = serde_json::from_str(handle).expect("handle JSON");
            let local = node.alloc(remote.len(), Access::ReadWrite).await.unwrap();
            format!("{:?}", node.path(&RdmaOp::read(local.whole(), remote)))
        }
        _ => return None,
    })
}

#[allow(dead_code)] // not every suite that shares common.rs uses these
impl PeerProcess {
    /// A peer process running as user `uid` (this process must be root).
    pub async fn spawn_as(uid: u32, env: &[(&str, &str)]) -> PeerProcess {
        let exe = std::env::current_exe().expect("test binary path");
        let mut command = tokio::process::Command::new(exe);
        command.uid(uid);
        Self::start(command, env)
    }

    /// Like [`PeerProcess::alloc`], with memory the peer owns, registered
    /// with `MemoryBlock::from_raw`.
    pub async fn alloc_raw(&mut self, len: usize, access: Access, seed: u8) -> PeerRegion {
        let access = match access {
            Access::ReadOnly => "ro",
            Access::ReadWrite => "rw",
        };
        let reply = self
            .command(&format!("alloc-raw {len} {access} {seed}"))
            .await;
        let (index, json) = reply.split_once(' ').expect("index and handle");
        PeerRegion {
            index: index.parse().unwrap(),
            handle: serde_json::from_str(json).unwrap(),
            seed,
        }
    }

    /// Closes the peer's raw region (`Region::close`), then at once fills
    /// its memory with 0xA5 and watches it for `watch`: `"intact"`, where a
    /// byte changed, or why the memory was not released.
    pub async fn close_and_scribble(&mut self, region: &PeerRegion, watch: Duration) -> String {
        self.command(&format!(
            "close-scribble {} {}",
            region.index,
            watch.as_millis()
        ))
        .await
    }

    /// Has the peer write its whole region `local` to `remote` again and
    /// again, in the background, until a write fails.
    pub async fn write_loop(&mut self, local: &PeerRegion, remote: &RemoteBuffer) {
        let json = serde_json::to_string(remote).unwrap();
        let reply = self
            .command(&format!("write-loop {} {json}", local.index))
            .await;
        assert_eq!(reply, "looping");
    }

    /// How the peer's node would carry a read of `remote` (`Debug` of
    /// `Node::path`).
    pub async fn path_to(&mut self, remote: &RemoteBuffer) -> String {
        let json = serde_json::to_string(remote).unwrap();
        self.command(&format!("path {json}")).await
    }
}
