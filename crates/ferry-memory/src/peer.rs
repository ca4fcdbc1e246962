//! The initiator's side: one socket per same-host owner, the regions it
//! mapped through it, and the copies.
//!
//! **Invariant (stale regions).** A copy through a mapping reports `Ok`
//! only if the region's liveness word read `alive(handle generation)` both
//! before and after the copy, with a SeqCst fence between the copy and the
//! second read (the owner clears the word with SeqCst). The owner clears the word before it stops
//! sharing a region, and a mapping only ever reaches the pages of the
//! memfd it was made from, which are never reused for another region: so a
//! copy that races a deregistration touches only that region's orphaned
//! pages, and reports `StaleGeneration`. (The copies are `copy.rs`'s.)
//!
//! Regions granted over `process_vm` are no mapping but a [`Grant`]: the
//! owner's address range, reached through the owner's gate (`gate.rs` has
//! their invariant, `pvm.rs` the copies). Whether the kernel lets this
//! process reach an owner at all is probed once per link.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::{NodeAddr, NodeId, OpError, OpKind, RdmaOp, RegionId, RemoteBuffer};

use crate::DataPathNotification;
use crate::auth::SocketAuth;
use crate::gate::Table;
use crate::lane::{self, LaneSender, Pushed};
use crate::mapping::Mapping;
use crate::pvm::{Grant, Probe, probe};
use crate::socket::Packets;
use crate::target::Target;
use crate::wire::{Answer, Refusal, Reply, Request};

/// A region the owner granted, cached under its slot and the token the
/// grant was made for.
///
/// **Invariant (credentials).** Every op is checked against its handle's
/// token, not only the one that first asked: an op through a cached grant
/// goes only if its token is the one the owner accepted for that grant,
/// so holding a grant for a region never lets a forged handle to it
/// through: another token is asked of the owner, which refuses it (or
/// grants it, cached beside the first: a region reached through its own
/// handle and a narrowed one holds two grants). A handle with a granted
/// token but other scopes than it was granted for is a forgery of one
/// granted, and gets no more than that grant: the owner made it for the
/// range and access those credentials open (a narrowed `process_vm`
/// grant covers its scope alone; a memfd is granted only to credentials
/// that open the whole region), and every op is checked against it.
struct Granted {
    target: Target,
}

/// A grant's key: the region's slot and the token it was granted for.
type GrantKey = (RegionId, u128);

/// Whether the kernel lets this process reach an owner over `process_vm`:
/// not probed yet, permitted, refused.
const UNPROBED: u8 = 0;
const PERMITTED: u8 = 1;
const REFUSED: u8 = 2;

/// One owner's socket and the regions mapped through it.
pub(crate) struct Link {
    packets: Packets,
    owner: NodeAddr,
    /// The owner's pid, from the kernel when the socket connected.
    owner_pid: Option<i32>,
    /// Until when (nanoseconds on [`clock`]) the last peek that found the
    /// socket open answers [`Link::is_alive`]; 0 until the first.
    alive_until: AtomicU64,
    /// [`UNPROBED`], [`PERMITTED`] or [`REFUSED`].
    process_vm: AtomicU8,
    /// The owner's gate table, mapped at its first `process_vm` grant.
    table: Mutex<Option<Arc<Table>>>,
    /// One request in flight at a time: the replies come in order.
    asking: tokio::sync::Mutex<()>,
    mapped: Mutex<HashMap<GrantKey, Granted>>,
    /// The notification lane to the owner, once opened (`None`: the owner
    /// refused one).
    lane: tokio::sync::OnceCell<Option<Arc<LaneSender>>>,
    /// Until when a lane that could not be opened is not asked for again.
    lane_retry: Mutex<Option<Instant>>,
    /// This node, and the cluster secret the socket proves, if any.
    auth: Arc<SocketAuth>,
    /// How proving it went (once, before the socket's first request): a
    /// failure stays, and the socket is shut, so that the owner does not
    /// wait for a proof and every op through the link is told why.
    proved: tokio::sync::OnceCell<Result<(), OpError>>,
}

impl Link {
    /// The lane that carries notifications from node `from` to the owner,
    /// opened at the first (waiting until `deadline` at most, also while
    /// another caller opens it); `None` if the owner refused one, or could
    /// not be asked (asked again [`UNREACHABLE_FOR`] later).
    pub async fn lane(
        &self,
        from: NodeAddr,
        deadline: tokio::time::Instant,
    ) -> Option<Arc<LaneSender>> {
        let retry = || self.lane_retry.lock().unwrap_or_else(|e| e.into_inner());
        if self.lane.get().is_none() && retry().is_some_and(|at| Instant::now() < at) {
            return None;
        }
        let open_by = deadline.min(tokio::time::Instant::now() + lane::OPEN_WAIT);
        let opening = self.lane.get_or_try_init(|| async {
            LaneSender::open(self.owner, from, open_by, &self.auth)
                .await
                .map(|lane| lane.map(Arc::new))
        });
        let Ok(opened) = tokio::time::timeout_at(deadline, opening).await else {
            // This caller's own deadline: the lane may open for the next.
            return None;
        };
        match opened {
            Ok(lane) => lane.clone(),
            Err(e) => {
                tracing::debug!(owner = %self.owner.endpoint, "memory transport: cannot open a notification lane: {e}");
                *retry() = Some(Instant::now() + UNREACHABLE_FOR);
                None
            }
        }
    }

    /// See [`MemoryBackend::notify`](crate::MemoryBackend::notify).
    pub async fn notify(
        &self,
        from: NodeAddr,
        notification: &[u8],
        deadline: tokio::time::Instant,
    ) -> DataPathNotification {
        let lost = || DataPathNotification::Failed(OpError::connection_lost(self.owner.endpoint));
        if !self.is_alive() {
            return lost();
        }
        let Some(lane) = self.lane(from, deadline).await else {
            return DataPathNotification::NotSent;
        };
        if lane.is_closed() {
            // The owner dropped the lane; if it is alive, it hears the
            // slow way.
            return if self.is_alive() {
                DataPathNotification::NotSent
            } else {
                lost()
            };
        }
        match lane.push(notification) {
            Ok(Pushed::Accepted) => DataPathNotification::Accepted,
            Ok(Pushed::Full | Pushed::TooLarge) => DataPathNotification::NotSent,
            Err(e) => {
                tracing::debug!(owner = %self.owner.endpoint, "memory transport: a notification lane's doorbell failed: {e}");
                lost()
            }
        }
    }

    /// Whether the kernel lets this process copy to and from the owner
    /// over `process_vm`: probed once (reading a byte at `addr`, one of the
    /// owner's addresses), then remembered. A refusal sends the owner's
    /// `process_vm` regions over the next transport.
    pub fn process_vm_permitted(&self, addr: u64) -> bool {
        match self.process_vm.load(Ordering::Relaxed) {
            PERMITTED => return true,
            REFUSED => return false,
            _ => {}
        }
        match probe(self.owner_pid.unwrap_or(0), addr) {
            Probe::Permitted => {
                self.process_vm.store(PERMITTED, Ordering::Relaxed);
                true
            }
            Probe::Refused => {
                self.refuse_process_vm();
                false
            }
            // The owner is gone: nothing to remember, the socket says so.
            Probe::Gone => false,
        }
    }

    /// Remembers that the kernel refuses `process_vm` to the owner.
    pub fn refuse_process_vm(&self) {
        if self.process_vm.swap(REFUSED, Ordering::Relaxed) != REFUSED {
            tracing::info!(
                owner = %self.owner.endpoint,
                pid = ?self.owner_pid,
                "memory transport: the kernel refuses process_vm access to this owner \
                 (EPERM: another uid, or ptrace restricted); its raw-memory regions go \
                 over the next transport"
            );
        }
    }

    /// Whether the owner is still there: a peek at its socket, or the
    /// answer of one made within [`ALIVE_FOR`].
    pub fn is_alive(&self) -> bool {
        let now = clock();
        if now < self.alive_until.load(Ordering::Relaxed) {
            return true;
        }
        let alive = !self.packets.is_closed();
        if alive {
            let until = now.saturating_add(ALIVE_FOR.as_nanos() as u64);
            self.alive_until.store(until, Ordering::Relaxed);
        }
        alive
    }

    fn unreachable(&self, reason: impl std::fmt::Display) -> OpError {
        tracing::debug!(owner = %self.owner.endpoint, "memory transport: same-host socket: {reason}");
        OpError::connection_lost(self.owner.endpoint)
    }

    /// Why `op`'s region died under its mapping: the mapping is dropped
    /// and the owner asked again, whose refusal (stale generation, unknown
    /// region) is the error.
    pub async fn why_dead(&self, op: &RdmaOp) -> OpError {
        let token = op.remote.transports().memory.map_or(0, |m| m.token);
        self.mapped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(op.remote.region(), token));
        match self.mapping(op).await {
            Err(e) => e,
            Ok(_) => {
                OpError::Protocol("a same-host owner granted a region it had marked dead".into())
            }
        }
    }

    /// The mapping or grant `op` needs: cached, or asked of the owner.
    pub async fn mapping(&self, op: &RdmaOp) -> Result<Target, OpError> {
        self.mapping_for(&op.remote, op.kind == OpKind::Write).await
    }

    /// [`mapping_for`](Self::mapping_for)'s answer when the owner need not
    /// be asked: the mapping or grant already held for `remote`'s region
    /// and token (and generation, and writes if `write`); `None` when the
    /// owner must be asked. Never an error: the owner's answer is the one
    /// that refuses.
    pub fn cached_mapping(
        &self,
        remote: &RemoteBuffer,
        write: bool,
    ) -> Option<Result<Target, OpError>> {
        let token = remote.transports().memory.map_or(0, |m| m.token);
        let mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        let granted = mapped.get(&(remote.region(), token))?;
        let usable = granted.target.generation() == remote.generation()
            && (granted.target.writable() || !write);
        usable.then(|| Ok(granted.target.clone()))
    }

    /// The mapping or grant ops on `remote` need (writes when `write`):
    /// cached, or asked of the owner, which checks the handle's generation,
    /// token and access as it would for an op.
    pub async fn mapping_for(&self, remote: &RemoteBuffer, write: bool) -> Result<Target, OpError> {
        let token = remote.transports().memory.map_or(0, |m| m.token);
        let cached = || self.cached_mapping(remote, write);
        if let Some(mapping) = cached() {
            return mapping;
        }
        let _asking = self.asking.lock().await;
        // Another task may have mapped it while this one waited.
        if let Some(mapping) = cached() {
            return mapping;
        }
        if let Some(secret) = &self.auth.secret() {
            let proving = async {
                let proved =
                    crate::auth::prove(&self.packets, self.auth.me, secret, self.owner).await;
                if proved.is_err() {
                    self.packets.shutdown();
                }
                proved
            };
            self.proved.get_or_init(|| proving).await.clone()?;
        }
        let request = Request {
            region: remote.region(),
            generation: remote.generation(),
            write,
            token,
            scopes: *remote.scopes(),
            process_vm: true,
        };
        self.packets
            .send(&request.encode(), None)
            .await
            .map_err(|e| self.unreachable(e))?;
        // Answers come in request order, one each. An exchange cancelled
        // after its request went out (a timed-out submit) left its answer
        // queued: skip it, and any such, up to the one for this request.
        let (reply, fd) = loop {
            let mut buf = [0u8; Answer::LEN];
            let (n, fd) = self
                .packets
                .recv(&mut buf)
                .await
                .map_err(|e| self.unreachable(e))?;
            if n == 0 {
                return Err(self.unreachable("the owner closed it"));
            }
            let answer = Answer::decode(&buf[..n]).ok_or_else(|| {
                OpError::Protocol("a malformed reply from a same-host owner".into())
            })?;
            if answer.answers(&request) {
                break (answer.reply, fd);
            }
        };
        if let Reply::Refused(refusal) = reply {
            if refusal == Refusal::Unauthenticated {
                return Err(OpError::AuthFailed {
                    endpoint: self.owner.endpoint,
                    reason: ferry_control::AuthFailure::SecretRequired.to_string(),
                });
            }
            return Err(refusal.error(remote.generation()));
        }
        let fd = fd.ok_or_else(|| OpError::Protocol("a grant without a descriptor".into()))?;
        let mapping = match reply {
            Reply::ProcessVm {
                base,
                len,
                gate,
                lane,
                stamp,
            } => {
                let table = self.table(&fd)?;
                let pid = self.owner_pid.filter(|&p| p > 0).ok_or_else(|| {
                    OpError::Protocol("a process_vm grant from an owner of unknown pid".into())
                })?;
                let grant = Grant::new(
                    table,
                    lane,
                    gate,
                    stamp,
                    pid,
                    (base, len),
                    remote.generation(),
                    write,
                )
                .ok_or_else(|| OpError::Protocol("a malformed process_vm grant".into()))?;
                Target::ProcessVm(Arc::new(grant))
            }
            reply => {
                let mapping =
                    Mapping::map(&fd, reply, remote.generation(), write).ok_or_else(|| {
                        OpError::Protocol("a same-host owner's region could not be mapped".into())
                    })?;
                Target::Mapped(Arc::new(mapping))
            }
        };
        let replaced = self
            .mapped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                (remote.region(), token),
                Granted {
                    target: mapping.clone(),
                },
            );
        // Unmapped (if this was its last reference) outside the lock.
        drop(replaced);
        Ok(mapping)
    }

    /// The owner's gate table: mapped from `fd` at the first grant, the
    /// same mapping after.
    fn table(&self, fd: &OwnedFd) -> Result<Arc<Table>, OpError> {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(table) = &*table {
            return Ok(table.clone());
        }
        let mapped = Arc::new(Table::map(fd).ok_or_else(|| {
            OpError::Protocol("a same-host owner's gate table could not be mapped".into())
        })?);
        *table = Some(mapped.clone());
        Ok(mapped)
    }
}

/// How long an owner found unreachable over the socket is remembered (its
/// ops meanwhile go over other transports without a connect each). After
/// that the next op tries again: a failed connect to an abstract socket
/// costs microseconds, and forgetting keeps owners that are gone for good
/// from piling up here.
pub(crate) const UNREACHABLE_FOR: Duration = Duration::from_secs(5);

/// How long a peek that found an owner's socket open stands for the next
/// liveness checks. A post asks twice (its routing and its copy, a few
/// microseconds apart) and a loop of small requests asks every few
/// microseconds; each peek is a syscall, a tenth of an 8-byte same-host
/// request's time. An owner that dies is noticed this much later at most:
/// no caller can tell that from a death that raced its post, which the
/// check never caught either.
pub(crate) const ALIVE_FOR: Duration = Duration::from_micros(50);

/// Nanoseconds since the first call: the clock [`Link::is_alive`]'s cache
/// runs on.
fn clock() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What this node knows of each same-host owner it tried.
enum LinkState {
    Up(Arc<Link>),
    /// Not reachable over the socket (another network namespace, or it
    /// stopped), as of then: other transports carry its ops.
    Unreachable(Instant),
}

/// The links to same-host owners, by node. An owner's entry goes at the
/// first [`Links::sweep`] after its socket closed (the owner stopped or
/// died) with no copy using it, and an unreachable verdict after
/// [`UNREACHABLE_FOR`].
pub(crate) struct Links {
    links: Mutex<HashMap<NodeId, LinkState>>,
    /// Who this node is, and the secret its sockets prove.
    auth: Arc<SocketAuth>,
}

impl Links {
    /// No links yet; each one proves `auth`'s secret, if any, when it
    /// connects.
    pub fn new(auth: Arc<SocketAuth>) -> Self {
        Links {
            links: Mutex::default(),
            auth,
        }
    }

    /// The link to `owner`, connecting on first use; `None` when it cannot
    /// be reached this way (remembered for [`UNREACHABLE_FOR`]).
    ///
    /// A link whose socket the owner closed is replaced by a fresh one if
    /// the owner still listens: it closes sockets that wait for their
    /// client at its bound, or that proved nothing in time (its
    /// `places.rs`), and is alive. An owner that stopped refuses the
    /// connect, and is remembered unreachable.
    pub fn get(&self, owner: NodeAddr) -> Option<Arc<Link>> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        match links.get(&owner.id) {
            Some(LinkState::Up(link)) if link.is_alive() => return Some(link.clone()),
            Some(LinkState::Unreachable(since)) if since.elapsed() < UNREACHABLE_FOR => {
                return None;
            }
            _ => {}
        }
        // AsyncFd needs a runtime: outside one, only known links count.
        tokio::runtime::Handle::try_current().ok()?;
        let state = match Packets::connect(&crate::socket_name(owner.id)) {
            Ok(packets) => LinkState::Up(Arc::new(Link {
                owner_pid: packets.peer_pid(),
                alive_until: AtomicU64::new(0),
                packets,
                owner,
                process_vm: AtomicU8::new(UNPROBED),
                table: Mutex::default(),
                asking: tokio::sync::Mutex::new(()),
                mapped: Mutex::default(),
                lane: tokio::sync::OnceCell::new(),
                lane_retry: Mutex::default(),
                auth: self.auth.clone(),
                proved: tokio::sync::OnceCell::new(),
            })),
            // Nobody listens under that name here (another host, another
            // network namespace, memory off, or it stopped): remembered.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT)) => {
                tracing::debug!(owner = %owner.endpoint, "memory transport: not reachable on this host: {e}");
                LinkState::Unreachable(Instant::now())
            }
            // Anything else (a full backlog, out of descriptors) may pass:
            // other transports carry this batch, the next one tries again.
            Err(e) => {
                tracing::debug!(owner = %owner.endpoint, "memory transport: cannot connect now: {e}");
                return None;
            }
        };
        let link = match &state {
            LinkState::Up(link) => Some(link.clone()),
            LinkState::Unreachable(_) => None,
        };
        links.insert(owner.id, state);
        link
    }

    /// The link to `owner` if one is up, without connecting.
    pub fn known(&self, owner: NodeId) -> Option<Arc<Link>> {
        match self
            .links
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&owner)
        {
            Some(LinkState::Up(link)) => Some(link.clone()),
            _ => None,
        }
    }

    /// Whether `owner`'s link is closed and the owner no longer answers
    /// (it stopped, or cannot be connected to now): its ops take the next
    /// transport. A link the owner closed while it still listens is
    /// replaced (see [`Links::get`]), and `false`.
    pub fn gone(&self, owner: NodeAddr) -> bool {
        let closed = self.known(owner.id).is_some_and(|link| !link.is_alive());
        closed && self.get(owner).is_none()
    }

    /// Forgets every owner (this node is shutting down); mappings go when
    /// the last copy through them ends.
    pub fn clear(&self) {
        let links = std::mem::take(&mut *self.links.lock().unwrap_or_else(|e| e.into_inner()));
        drop(links);
    }

    /// Owners with an entry here (linked, or remembered unreachable). For
    /// leak checks and `ferry info`.
    pub fn len(&self) -> usize {
        self.links.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Unmaps regions their owners stopped sharing, and every region of
    /// owners that closed their sockets: a mapping keeps the owner's pages
    /// from being freed, so none may outlive its region for long. Copies
    /// in flight hold their own reference and finish first.
    pub fn sweep(&self) {
        // Unmapping a large region takes a while: after the locks are gone.
        let mut unmap: Vec<Target> = Vec::new();
        let mut gone: Vec<Arc<Link>> = Vec::new();
        {
            let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
            // Owners gone, and verdicts of unreachable that expired, leave.
            let dead = links.extract_if(|_, state| match state {
                LinkState::Up(link) => !link.is_alive(),
                LinkState::Unreachable(since) => since.elapsed() >= UNREACHABLE_FOR,
            });
            gone.extend(dead.filter_map(|(_, state)| match state {
                LinkState::Up(link) => Some(link),
                LinkState::Unreachable(_) => None,
            }));
            for state in links.values() {
                let LinkState::Up(link) = state else { continue };
                let mut mapped = link.mapped.lock().unwrap_or_else(|e| e.into_inner());
                unmap.extend(
                    mapped
                        .extract_if(|_, g| !g.target.is_alive())
                        .map(|(_, g)| g.target),
                );
            }
        }
        drop(unmap);
        drop(gone);
    }
}
