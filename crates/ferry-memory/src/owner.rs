//! The owner's side: the regions it shares, and the socket on which
//! same-host peers ask for them.
//!
//! A peer presents a handle's credentials (slot, generation, token, and the
//! scopes a narrowed token was derived for) and the access it wants; the
//! owner checks them first (so that a stranger learns nothing of which
//! slots exist: `ferry_core::Departed`), then against the region as
//! registered, and answers with the memfd, opened read-only unless the
//! region and the credentials allow writes and the peer asked to write.
//! Credentials narrowed to part of a memfd region get no memfd, which would
//! open all of it: they are refused (`AccessDenied`), and an honest peer
//! never asks (such handles carry no same-host credentials; they go over
//! another transport, which checks their range). The kernel then enforces the access:
//! a read-only descriptor cannot be mapped writable. (A process of the same
//! user could still reopen it through `/proc`, or ptrace the owner: the
//! memory transport protects against mistakes and forged handles, not
//! against a hostile process of the same user, which no transport can.)
//!
//! Memory that is not a memfd (`MemoryBlock::from_raw`) is granted over
//! `process_vm` instead: the answer is the address and length the
//! credentials open in this process (the region's, or a scope's), its gate and the peer's lane in the gate table (whose
//! memfd comes with it), and writes only if the region allows them and the
//! peer asked. The kernel checks whether the peer may reach this process at
//! all (ptrace rules), not the region's access: a peer granted read-only is
//! trusted to refuse its own writes, as the memory transport's peers are
//! trusted not to reopen a read-only memfd through `/proc`. A process the
//! kernel lets `process_vm_writev` here could ptrace this process anyway,
//! so this grants nothing the kernel has not.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::{Access, Departed, Generation, MemoryBlock, RegionId, Scope, SlotRefusal};
use tracing::{debug, warn};

use crate::auth::{self, SocketAuth};
use crate::gate::{Gate, Gates, Pidfd};
use crate::lane::{OwnerLanes, serve_lane};
use crate::places::{Closed, Place, Places};
use crate::shared::{alive, mapping_of};
use crate::socket::{Listener, Packets};
use crate::wire::{Answer, LaneAck, LaneOpen, Refusal, Reply, Request};
use ferry_control::auth::Refusals;

/// A region shared with same-host peers.
struct Export {
    generation: Generation,
    token: u128,
    access: Access,
    how: Shared,
}

/// How a region is shared.
enum Shared {
    /// As its memfd.
    Memfd(Arc<MemoryBlock>),
    /// Over `process_vm`, through gate `gate` (open while it holds
    /// `stamp`).
    ProcessVm {
        base: u64,
        len: u64,
        gate: u32,
        stamp: u64,
    },
}

impl Export {
    /// The region's range in this process, and its access.
    fn range(&self) -> Scope {
        let (addr, len) = match &self.how {
            Shared::Memfd(memory) => (memory.addr(), memory.len()),
            &Shared::ProcessVm { base, len, .. } => (base, len),
        };
        Scope {
            addr,
            len,
            access: self.access,
        }
    }
}

/// The regions this node shares, by slot, and its gate table (none where
/// the kernel cannot give one: then only memfd regions are shared).
pub(crate) struct Exports {
    regions: Mutex<Slots>,
    gates: Option<Arc<Gates>>,
}

/// The regions shared now, and the tokens of those that left lately.
#[derive(Default)]
struct Slots {
    live: HashMap<RegionId, Export>,
    departed: Departed,
}

impl Exports {
    pub fn new(gates: Option<Arc<Gates>>) -> Self {
        Exports {
            regions: Mutex::default(),
            gates,
        }
    }

    /// Whether regions that are not memfds are shared over `process_vm`.
    pub fn process_vm(&self) -> bool {
        self.gates.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shares `memory` as slot `id` of `generation`: a shared block as its
    /// memfd, marked alive for peers; other memory over `process_vm`,
    /// through a fresh gate. `None` when neither can be had; the second
    /// value says whether it goes over `process_vm`.
    pub fn insert(
        self: &Arc<Self>,
        id: RegionId,
        generation: Generation,
        access: Access,
        memory: Arc<MemoryBlock>,
        token: u128,
    ) -> Option<(MemRegistration, bool)> {
        let (how, held) = match mapping_of(&memory) {
            Some(mapping) => {
                mapping
                    .liveness()
                    .store(alive(generation), Ordering::Release);
                (Shared::Memfd(memory.clone()), Held::Memfd(memory))
            }
            None => {
                let gate = self.gates.as_ref()?.open(memory.clone())?;
                let how = Shared::ProcessVm {
                    base: memory.addr(),
                    len: memory.len(),
                    gate: gate.index(),
                    stamp: gate.stamp(),
                };
                (how, Held::Gate(gate))
            }
        };
        let process_vm = matches!(held, Held::Gate(_));
        self.lock().live.insert(
            id,
            Export {
                generation,
                token,
                access,
                how,
            },
        );
        let registration = MemRegistration {
            exports: self.clone(),
            id,
            generation,
            held,
        };
        Some((registration, process_vm))
    }

    /// Marks every region shared dead and stops sharing them (the node is
    /// shutting down): their liveness words and gates are cleared, as a
    /// registration's drop does, without waiting for steps in flight
    /// (that wait stays with each registration's drop, which still comes).
    pub fn revoke_all(&self) {
        let revoked: Vec<Export> = self.lock().live.drain().map(|(_, e)| e).collect();
        for export in revoked {
            match export.how {
                // SeqCst, as in the registration's drop.
                Shared::Memfd(memory) => {
                    if let Some(mapping) = mapping_of(&memory) {
                        mapping.liveness().store(0, Ordering::SeqCst);
                    }
                }
                Shared::ProcessVm { gate, stamp, .. } => {
                    if let Some(gates) = &self.gates {
                        // Only if it still holds this region's stamp.
                        let _ = gates.table().live(gate).compare_exchange(
                            stamp,
                            0,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                    }
                }
            }
        }
    }

    /// The answer to `request` from `asker`, with the descriptor to attach.
    fn answer(&self, request: &Request, asker: &mut Asker) -> (Reply, Option<OwnedFd>) {
        let exports = self.lock();
        let export = exports.live.get(&request.region);
        let live = export.map(|e| (e.generation, e.token, e.range()));
        let checked = exports.departed.check(
            live,
            request.region,
            request.generation,
            request.token,
            &request.scopes,
        );
        let (export, opened) = match (export, checked) {
            (Some(export), Ok(opened)) => (export, opened),
            (_, Err(refusal)) => {
                let refusal = match refusal {
                    SlotRefusal::UnknownRegion => Refusal::UnknownRegion,
                    SlotRefusal::StaleGeneration { current } => {
                        Refusal::StaleGeneration { current }
                    }
                    _ => Refusal::AccessDenied,
                };
                return (Reply::Refused(refusal), None);
            }
            (None, Ok(_)) => return (Reply::Refused(Refusal::UnknownRegion), None),
        };
        let read_only = !(export.access.allows_write() && opened.access.allows_write());
        let memory = match &export.how {
            Shared::Memfd(memory) => memory,
            &Shared::ProcessVm { gate, stamp, .. } => {
                let Some(gates) = &self.gates else {
                    return (Reply::Refused(Refusal::UnknownRegion), None);
                };
                // A peer that cannot read the grant, or a region whose
                // gate is shutting: not handed out.
                if !request.process_vm || gates.table().live(gate).load(Ordering::SeqCst) != stamp {
                    return (Reply::Refused(Refusal::UnknownRegion), None);
                }
                if request.write && read_only {
                    return (Reply::Refused(Refusal::ReadOnly), None);
                }
                let Some(lane) = asker.lane(gates) else {
                    return (Reply::Refused(Refusal::NoLane), None);
                };
                let Ok(fd) = gates.fd().try_clone_to_owned() else {
                    return (Reply::Refused(Refusal::UnknownRegion), None);
                };
                // The range the credentials open: the peer's copies stay
                // inside it (`pvm::Grant::locate`).
                let reply = Reply::ProcessVm {
                    base: opened.addr,
                    len: opened.len,
                    gate,
                    lane,
                    stamp,
                };
                return (reply, Some(fd));
            }
        };
        // Its memfd would open the whole region: only for credentials
        // that do.
        if (opened.addr, opened.len) != (memory.addr(), memory.len()) {
            return (Reply::Refused(Refusal::AccessDenied), None);
        }
        let Some(mapping) = mapping_of(memory) else {
            return (Reply::Refused(Refusal::UnknownRegion), None);
        };
        // Deregistration clears the word before it takes this table's
        // lock: a region on its way out is not handed out again.
        if mapping.liveness().load(Ordering::SeqCst) != alive(export.generation) {
            return (Reply::Refused(Refusal::UnknownRegion), None);
        }
        if request.write && read_only {
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
            base: memory.addr(),
            len: memory.len(),
            data_len: mapping.data_len() as u64,
        };
        (reply, Some(fd))
    }
}

/// The peer process asking on one socket, as the kernel names it; its
/// lane in the gate table is looked up at its first `process_vm` request.
struct Asker<'a> {
    socket: &'a Packets,
    lane: Option<u16>,
}

impl Asker<'_> {
    fn lane(&mut self, gates: &Gates) -> Option<u16> {
        if self.lane.is_none() {
            let pid = self.socket.peer_pid();
            let pidfd = Pidfd::of_peer(self.socket.fd(), pid)?;
            self.lane = gates.lane(pid.unwrap_or(0), pidfd);
        }
        self.lane
    }
}

/// What a registration holds on to.
enum Held {
    /// The block of a memfd region.
    Memfd(Arc<MemoryBlock>),
    /// The gate of a `process_vm` region.
    Gate(Gate),
}

/// The memory transport's half of a region's registration. Dropping it
/// marks the region dead (its memfd's liveness word, or its gate), so
/// peers' copies are refused with `StaleGeneration`, and stops handing the
/// region out. It never waits for a peer: for a `process_vm` region, the
/// gate keeps the memory (and `from_raw`'s `keep_alive`) until no peer's
/// write can land in it any more (the invariant in `gate.rs`), which a
/// peer stopped inside a copy may delay past the drop;
/// `Region::close` waits for that and names such a peer.
pub struct MemRegistration {
    exports: Arc<Exports>,
    id: RegionId,
    generation: Generation,
    held: Held,
}

impl Drop for MemRegistration {
    fn drop(&mut self) {
        match &mut self.held {
            // SeqCst, paired with the fence after a peer's copy: a copy
            // whose second look at the word still saw it alive was
            // complete before this store (see the invariant in peer.rs).
            Held::Memfd(memory) => {
                if let Some(mapping) = mapping_of(memory) {
                    mapping.liveness().store(0, Ordering::SeqCst);
                }
            }
            // No new step copies from here on; the gate waits out the
            // steps in flight when `held` drops, after this, off this
            // thread if it must (`drain.rs`).
            Held::Gate(gate) => gate.close(),
        }
        let mut exports = self.exports.lock();
        let Slots { live, departed } = &mut *exports;
        if live
            .get(&self.id)
            .is_some_and(|e| e.generation == self.generation)
            && let Some(export) = live.remove(&self.id)
        {
            // Its holders hear that it is gone; nobody else does.
            departed.remember(self.id, self.generation, export.token);
        }
    }
}

/// Answers peers on `listener` until the task is aborted, each socket
/// under a place of `places` (see `places.rs`: one socket that cannot have
/// one is closed at once).
/// The peers' tasks belong to it: aborting it (the node stopping) ends
/// them too. `served` counts the sockets answered now: each one's task is
/// reaped, and its count released, as soon as its socket closes (a
/// lane's, once its ring is delivered). Peers' notification lanes are
/// served on their sockets too (`lanes`).
pub(crate) async fn serve(
    listener: Listener,
    exports: Arc<Exports>,
    served: Arc<AtomicUsize>,
    places: Arc<Places>,
    lanes: Arc<OwnerLanes>,
    auth: Arc<SocketAuth>,
    refusals: Arc<Refusals>,
) {
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
                let Some(place) = places.admit() else {
                    continue;
                };
                debug!(pid = ?peer.peer_pid(), "memory transport: a same-host peer connected");
                peers.spawn(answer_peer(
                    peer,
                    place,
                    exports.clone(),
                    lanes.clone(),
                    auth.clone(),
                    refusals.clone(),
                ));
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

/// Answers one peer's socket: region requests, until it asks for a
/// notification lane, which the socket then carries (`lane.rs`). Where this
/// node has a cluster secret, the peer proves it first (`auth.rs`), and a
/// lane it opens must name the node it proved it is. Every wait for the
/// peer is one under its `place`: evictable, and bounded in time until
/// the peer proved itself (the secret, or a grant where there is none).
async fn answer_peer(
    peer: Packets,
    place: Place,
    exports: Arc<Exports>,
    lanes: Arc<OwnerLanes>,
    auth: Arc<SocketAuth>,
    refusals: Arc<Refusals>,
) {
    let mut buf = [0u8; 160];
    const _: () =
        assert!(LaneOpen::LEN <= 160 && Request::MAX_LEN <= 160 && auth::HELLO_LEN <= 160);
    let mut asker = Asker {
        socket: &peer,
        lane: None,
    };
    let pid = peer.peer_pid().unwrap_or(0);
    let from = || format!("same-host process {pid}");
    // The node the peer proved it is; `None` until then, and for good
    // where this node has no secret.
    let mut proven = None;
    let closed = |e: Closed| debug!(pid, "memory transport: a same-host socket closed: {e}");
    loop {
        let (n, fd) = match place.waiting(peer.recv(&mut buf)).await {
            Err(e) => return closed(e),
            Ok(Ok((0, _)) | Err(_)) => return,
            Ok(Ok(got)) => got,
        };
        let packet = &buf[..n];
        if auth::is_hello(packet) {
            match place.waiting(auth::check(&peer, packet, &auth)).await {
                Err(e) => return closed(e),
                Ok(Ok(node)) if proven.is_none() => {
                    proven = Some(node);
                    place.prove();
                    continue;
                }
                Ok(Ok(_)) => return,
                Ok(Err(e)) => return refusals.refused(&from(), &e),
            }
        }
        let unproven = auth.secret().is_some() && proven.is_none();
        let (answer, fd) = match Request::decode(packet) {
            Some(request) if unproven => {
                refusals.refused(&from(), &"a region request without the cluster secret");
                let refused = Reply::Refused(Refusal::Unauthenticated);
                let _ = peer
                    .send(&Answer::to(&request, refused).encode(), None)
                    .await;
                return;
            }
            Some(request) => {
                let (reply, fd) = exports.answer(&request, &mut asker);
                // Without a secret, a grant (which took a handle's token)
                // is what shows the socket belongs to a peer.
                if !matches!(reply, Reply::Refused(_)) {
                    place.prove();
                }
                (Answer::to(&request, reply), fd)
            }
            None => match LaneOpen::decode(packet) {
                Some(open) if unproven || proven.is_some_and(|node| node != open.from.id) => {
                    refusals.refused(
                        &from(),
                        &"a notification lane without the cluster secret, or for another node",
                    );
                    let _ = peer.send(&LaneAck::Refused.encode(), None).await;
                    return;
                }
                Some(open) => {
                    // A lane is bounded on its own (`lane.rs`).
                    drop(place);
                    return serve_lane(peer, open, fd, lanes).await;
                }
                // Neither: nothing to answer to; the peer broke.
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
