//! Giving registered memory back to its caller.
//!
//! Dropping a [`Region`](crate::Region) never blocks: registrations stop
//! new remote access at once, but a peer may be in the middle of writing
//! into the memory (a `process_vm` step of a stopped process, a TCP chunk
//! still arriving). A backend that may still write after its registration
//! dropped keeps the bytes with a [`MemoryHold`], which says who writes;
//! the block itself, and with it `MemoryBlock::from_raw`'s `keep_alive`,
//! goes only once the last handle and the last hold are gone. [`Closing`]
//! waits for that moment, and says who still holds the memory if it does
//! not come by a deadline.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::{MemoryBlock, NodeId};

/// Who keeps a region's memory from going back to its caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryHolder {
    /// Clones of the [`Region`](crate::Region) itself: kept by the caller,
    /// or by this node's own transfers in flight (each holds one until its
    /// transport has given the local bytes up).
    Handles {
        /// Clones alive.
        count: usize,
    },
    /// A same-host peer process is inside a `process_vm` copy into the
    /// memory, which no one can cancel: usually for microseconds, for as
    /// long as it likes if it is stopped (`SIGSTOP`, a debugger). The
    /// memory is held until that step returns or the process exits.
    ProcessVmPeer {
        /// The peer process, as the kernel named it.
        pid: i32,
    },
    /// A TCP connection from a peer is serving a chunk into or out of the
    /// memory. A write's chunk arrives from the peer: held until its last
    /// byte has arrived or the connection closes.
    TcpPeer {
        /// The node the connection says it comes from.
        node: NodeId,
        /// Where the connection comes from.
        remote: SocketAddr,
    },
    /// References that no backend named (e.g. an `Arc<MemoryBlock>` the
    /// caller cloned from [`Region::memory`](crate::Region::memory)).
    Unattributed {
        /// How many.
        references: usize,
    },
}

impl fmt::Display for MemoryHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryHolder::Handles { count } => write!(f, "{count} region handle(s)"),
            MemoryHolder::ProcessVmPeer { pid } => {
                write!(f, "process {pid} inside a process_vm copy")
            }
            MemoryHolder::TcpPeer { node, remote } => {
                write!(f, "a TCP chunk from node {node} at {remote}")
            }
            MemoryHolder::Unattributed { references } => {
                write!(f, "{references} other reference(s) to the memory")
            }
        }
    }
}

/// Why [`Closing::wait`] (or [`Region::close`](crate::Region::close))
/// returned before the memory was the caller's again.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CloseError {
    /// The deadline passed with the memory still held; nothing was given up
    /// and nothing lost: the memory goes back by itself once the holders
    /// let go, and [`Closing::wait`] may be called again.
    #[error("the region's memory is still held: {}", list(holders))]
    Held {
        /// Who held it at the deadline.
        holders: Vec<MemoryHolder>,
    },
}

fn list(holders: &[MemoryHolder]) -> String {
    let names: Vec<String> = holders.iter().map(ToString::to_string).collect();
    names.join(", ")
}

/// A block's end of life, shared with whoever waits for it.
pub(crate) struct Release {
    /// Set once the block is gone (its memory freed or its `keep_alive`
    /// dropped).
    released: AtomicBool,
    notify: tokio::sync::Notify,
    /// Backends' holds now, by key.
    holds: Mutex<Vec<(u64, MemoryHolder)>>,
    next: AtomicU64,
}

impl Release {
    pub(crate) fn new() -> Arc<Release> {
        Arc::new(Release {
            released: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
            holds: Mutex::default(),
            next: AtomicU64::new(0),
        })
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, Vec<(u64, MemoryHolder)>> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Called by the block's drop, after the memory went back.
    pub(crate) fn fire(&self) {
        self.released.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

/// A backend's hold on a block after its registration dropped (or while
/// it serves one access): the bytes stay valid, and the caller's
/// `keep_alive` stays held, until it drops. Made by
/// [`MemoryBlock::hold`].
pub struct MemoryHold {
    memory: Arc<MemoryBlock>,
    key: u64,
}

impl MemoryHold {
    pub(crate) fn new(memory: Arc<MemoryBlock>, holder: MemoryHolder) -> MemoryHold {
        let release = memory.release();
        let key = release.next.fetch_add(1, Ordering::Relaxed);
        release.holds().push((key, holder));
        MemoryHold { memory, key }
    }

    /// The held block.
    pub fn memory(&self) -> &Arc<MemoryBlock> {
        &self.memory
    }
}

impl Drop for MemoryHold {
    fn drop(&mut self) {
        let mut holds = self.memory.release().holds();
        if let Some(at) = holds.iter().position(|(k, _)| *k == self.key) {
            holds.swap_remove(at);
        }
    }
}

impl fmt::Debug for MemoryHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryHold")
            .field("memory", &self.memory)
            .finish()
    }
}

/// A region on its way back to its caller, from
/// [`Region::closing`](crate::Region::closing): its handle is dropped, and
/// this says when the memory is the caller's again.
pub struct Closing {
    /// The region's other clones (held as `dyn Any` so this module need not
    /// know the region's insides).
    region: Weak<dyn std::any::Any + Send + Sync>,
    memory: Weak<MemoryBlock>,
    release: Arc<Release>,
}

impl Closing {
    pub(crate) fn new(
        region: Weak<dyn std::any::Any + Send + Sync>,
        memory: &Arc<MemoryBlock>,
    ) -> Closing {
        Closing {
            region,
            memory: Arc::downgrade(memory),
            release: memory.release().clone(),
        }
    }

    /// Whether the memory is the caller's again: every handle and every
    /// backend's hold is gone, and with them the block (for
    /// `MemoryBlock::from_raw`, its `keep_alive` has been dropped), so no
    /// transport can write into it any more.
    pub fn is_released(&self) -> bool {
        self.release.released.load(Ordering::Acquire)
    }

    /// Who holds the memory now; empty once it is released.
    pub fn holders(&self) -> Vec<MemoryHolder> {
        if self.is_released() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let handles = self.region.strong_count();
        if handles > 0 {
            out.push(MemoryHolder::Handles { count: handles });
        }
        let held: Vec<MemoryHolder> = self
            .release
            .holds()
            .iter()
            .map(|(_, h)| h.clone())
            .collect();
        let attributed = held.len();
        out.extend(held);
        // While handles live, the region and its registrations hold the
        // block too; only once they are gone is a surplus someone else's.
        let references = self.memory.strong_count();
        if handles == 0 && references > attributed {
            out.push(MemoryHolder::Unattributed {
                references: references - attributed,
            });
        }
        out
    }

    /// Waits until the memory is the caller's again (see
    /// [`is_released`](Self::is_released)), or `deadline`: then
    /// [`CloseError::Held`] names who holds it, and waiting again is fine.
    pub async fn wait(&self, deadline: tokio::time::Instant) -> Result<(), CloseError> {
        loop {
            let mut notified = std::pin::pin!(self.release.notify.notified());
            // Registered before the check, so a release in between wakes it.
            notified.as_mut().enable();
            if self.is_released() {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                if self.is_released() {
                    return Ok(());
                }
                return Err(CloseError::Held {
                    holders: self.holders(),
                });
            }
        }
    }
}

impl fmt::Debug for Closing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Closing")
            .field("released", &self.is_released())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::ptr::NonNull;
    use std::time::Duration;

    use super::*;
    use crate::memory::tests::region_of;

    /// Caller memory whose guard says when it is dropped.
    struct Guard(Arc<AtomicBool>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn close_waits_for_every_hold_and_names_the_holders() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut bytes = vec![0u8; 64].into_boxed_slice();
            let ptr = NonNull::new(bytes.as_mut_ptr()).unwrap();
            let dropped = Arc::new(AtomicBool::new(false));
            let guard = (bytes, Guard(dropped.clone()));
            // SAFETY: the boxed slice lives in the guard, never resized.
            let block = unsafe { MemoryBlock::from_raw(ptr, 64, Box::new(guard)) }.unwrap();
            let region = region_of(block);
            let clone = region.clone();
            let pid = MemoryHolder::ProcessVmPeer { pid: 42 };
            let hold = region.memory().hold(pid.clone());
            let closing = region.closing();
            let soon = || tokio::time::Instant::now() + Duration::from_millis(20);
            assert_eq!(
                closing.wait(soon()).await,
                Err(CloseError::Held {
                    holders: vec![MemoryHolder::Handles { count: 1 }, pid.clone()]
                })
            );
            drop(clone);
            let err = closing.wait(soon()).await.unwrap_err();
            assert_eq!(err, CloseError::Held { holders: vec![pid] });
            assert_eq!(
                err.to_string(),
                "the region's memory is still held: process 42 inside a process_vm copy"
            );
            assert!(
                !dropped.load(Ordering::SeqCst),
                "keep_alive dropped while held"
            );
            let waiter = async {
                closing
                    .wait(tokio::time::Instant::now() + Duration::from_secs(10))
                    .await
            };
            let release = async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(hold);
            };
            let (waited, ()) = tokio::join!(waiter, release);
            assert_eq!(waited, Ok(()));
            assert!(
                dropped.load(Ordering::SeqCst),
                "released before keep_alive dropped"
            );
            assert!(closing.is_released() && closing.holders().is_empty());
        });
    }
}
