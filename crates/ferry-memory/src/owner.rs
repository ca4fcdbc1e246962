//! The owner's side: the regions it shares, and the socket on which
//! same-host peers ask for them.
//!
//! A peer presents a handle's credentials (slot, generation, token) and the
//! access it wants; the owner checks them against the region as registered
//! and answers with the memfd, opened read-only unless the region allows
//! writes and the peer asked to write. The kernel then enforces the access:
//! a read-only descriptor cannot be mapped writable. (A process of the same
//! user could still reopen it through `/proc`, or ptrace the owner: the
//! memory transport protects against mistakes and forged handles, not
//! against a hostile process of the same user, which no transport can.)

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::{Access, Generation, MemoryBlock, RegionId, tokens_equal};
use tracing::{debug, warn};

use crate::shared::{alive, mapping_of};
use crate::socket::{Listener, Packets};
use crate::wire::{Answer, Refusal, Reply, Request};

/// A region shared with same-host peers.
struct Export {
    generation: Generation,
    token: u128,
    access: Access,
    memory: Arc<MemoryBlock>,
}

/// The regions this node shares, by slot.
#[derive(Default)]
pub(crate) struct Exports(Mutex<HashMap<RegionId, Export>>);

impl Exports {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RegionId, Export>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shares `memory` (a shared block) as slot `id` of `generation`, and
    /// marks it alive for peers.
    pub fn insert(
        self: &Arc<Self>,
        id: RegionId,
        generation: Generation,
        access: Access,
        memory: Arc<MemoryBlock>,
        token: u128,
    ) -> Option<MemRegistration> {
        let mapping = mapping_of(&memory)?;
        mapping
            .liveness()
            .store(alive(generation), Ordering::Release);
        self.lock().insert(
            id,
            Export {
                generation,
                token,
                access,
                memory: memory.clone(),
            },
        );
        Some(MemRegistration {
            exports: self.clone(),
            id,
            generation,
            memory,
        })
    }

    /// The answer to `request`, with the descriptor to attach.
    fn answer(&self, request: &Request) -> (Reply, Option<OwnedFd>) {
        let exports = self.lock();
        let Some(export) = exports.get(&request.region) else {
            return (Reply::Refused(Refusal::UnknownRegion), None);
        };
        if export.generation != request.generation {
            let refusal = if request.generation < export.generation {
                Refusal::StaleGeneration {
                    current: export.generation,
                }
            } else {
                Refusal::UnknownRegion
            };
            return (Reply::Refused(refusal), None);
        }
        if !tokens_equal(export.token, request.token) {
            return (Reply::Refused(Refusal::AccessDenied), None);
        }
        let Some(mapping) = mapping_of(&export.memory) else {
            return (Reply::Refused(Refusal::UnknownRegion), None);
        };
        // Deregistration clears the word before it takes this table's
        // lock: a region on its way out is not handed out again.
        if mapping.liveness().load(Ordering::SeqCst) != alive(export.generation) {
            return (Reply::Refused(Refusal::UnknownRegion), None);
        }
        if request.write && !export.access.allows_write() {
            return (Reply::Refused(Refusal::ReadOnly), None);
        }
        // A fresh open file description with just the access granted: a
        // read-only one cannot be mapped writable by whoever holds it.
        let flags = if request.write {
            libc::O_RDWR
        } else {
            libc::O_RDONLY
        };
        let path = format!("/proc/self/fd/{}\0", mapping.fd().as_raw_fd());
        // SAFETY: a NUL-terminated path; failure is -1.
        let raw = unsafe { libc::open(path.as_ptr().cast(), flags | libc::O_CLOEXEC) };
        if raw < 0 {
            warn!(
                "memory transport: cannot reopen a region's memfd: {}",
                std::io::Error::last_os_error()
            );
            return (Reply::Refused(Refusal::UnknownRegion), None);
        }
        // SAFETY: open just returned it; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let reply = Reply::Granted {
            base: export.memory.addr(),
            len: export.memory.len(),
            data_len: mapping.data_len() as u64,
        };
        (reply, Some(fd))
    }
}

/// The memory transport's half of a region's registration. Dropping it
/// marks the region dead in its liveness word, so peers' copies through
/// mappings they already hold are refused with `StaleGeneration`, and
/// stops handing the region out.
pub struct MemRegistration {
    exports: Arc<Exports>,
    id: RegionId,
    generation: Generation,
    memory: Arc<MemoryBlock>,
}

impl Drop for MemRegistration {
    fn drop(&mut self) {
        // SeqCst, paired with the fence after a peer's copy: a copy whose
        // second look at the word still saw it alive was complete before
        // this store (see the invariant in peer.rs).
        if let Some(mapping) = mapping_of(&self.memory) {
            mapping.liveness().store(0, Ordering::SeqCst);
        }
        let mut exports = self.exports.lock();
        if exports
            .get(&self.id)
            .is_some_and(|e| e.generation == self.generation)
        {
            exports.remove(&self.id);
        }
    }
}

/// Same-host peers one node answers at once (one task and one socket
/// each); more are turned away, and their ops fail with a typed error.
const MAX_PEERS: usize = 1024;

/// Answers peers on `listener` until the task is aborted.
/// The peers' tasks belong to it: aborting it (the node stopping) ends
/// them too. `served` counts the peers answered now: each one's task is
/// reaped, and its count released, as soon as its socket closes.
pub(crate) async fn serve(listener: Listener, exports: Arc<Exports>, served: Arc<AtomicUsize>) {
    let mut peers = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = peers.join_next(), if !peers.is_empty() => {
                served.store(peers.len(), Ordering::Relaxed);
                continue;
            }
        };
        match accepted {
            Ok(peer) => {
                if peers.len() >= MAX_PEERS {
                    warn!("memory transport: {MAX_PEERS} same-host peers already; one turned away");
                    continue;
                }
                debug!(pid = ?peer.peer_pid(), "memory transport: a same-host peer connected");
                peers.spawn(answer_peer(peer, exports.clone()));
                served.store(peers.len(), Ordering::Relaxed);
            }
            Err(e) => {
                // E.g. out of descriptors: back off instead of spinning.
                warn!("memory transport: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer_peer(peer: Packets, exports: Arc<Exports>) {
    let mut buf = [0u8; Request::LEN];
    loop {
        let (answer, fd) = match peer.recv(&mut buf).await {
            Ok((0, _)) | Err(_) => return,
            Ok((n, _ignored_fd)) => match Request::decode(&buf[..n]) {
                Some(request) => {
                    let (reply, fd) = exports.answer(&request);
                    (Answer::to(&request, reply), fd)
                }
                // Not a request: nothing to answer to; the peer broke.
                None => return,
            },
        };
        use std::os::fd::AsFd;
        if peer
            .send(&answer.encode(), fd.as_ref().map(|f| f.as_fd()))
            .await
            .is_err()
        {
            return;
        }
    }
}
