//! ferry's same-host transport: one-sided copies between processes on one
//! host at memory speed, with no owner CPU in the data path.
//!
//! Regions ferry allocates live in sealed memfds ([`alloc`]). A peer on
//! the same host asks the owner for a region once, over a Unix socket in
//! the abstract namespace, presenting its handle's credentials; the owner
//! answers with the memfd (read-only unless writes are allowed and asked
//! for), and the peer maps it. From then on reads and writes are copies in
//! the initiator's process. A peer is taken for same-host when its handle
//! carries this kernel's boot id *and* the socket connects (which it does
//! not across network namespaces), never by IP address.
//!
//! Memory that is not such a memfd (wrapped with `MemoryBlock::from_raw`,
//! or a plain `MemoryBlock::alloc`) cannot be mapped by another process.
//! Its handles say `process_vm`: a peer asks the owner the same way and
//! gets the region's address range in the owner instead of a memfd, and
//! copies with `process_vm_readv`/`process_vm_writev` where the kernel
//! permits it (the peer may ptrace the owner: same uid and Yama allowing,
//! or `CAP_SYS_PTRACE`). The peer probes that once per owner; where the
//! kernel refuses, those regions go over the next transport (ibverbs,
//! TCP), and [`MemoryBackend::path`] says which. The owner's pid comes from
//! the kernel (`SO_PEERCRED`), never from the owner's words.
//!
//! Access: the kernel does not know a region is read-only, so the
//! initiator refuses writes to a region granted read-only (`ReadOnly`, as
//! for a memfd region), and the owner grants writes only to regions that
//! allow them. A process the kernel lets use `process_vm_writev` on the
//! owner could as well ptrace it and write anywhere: the check guards
//! against mistakes and forged handles, and `process_vm` grants no
//! privilege beyond what the kernel already does.
//!
//! Notifications: a batch's notification to a same-host owner goes in a
//! ring the two share (a *lane*, `lane.rs`), behind the batch's copies,
//! without a round trip; one the ring has no room for goes over the
//! control session.
//!
//! Deregistration: a `process_vm` write must never land once the memory
//! is the caller's again (`from_raw`'s `keep_alive` dropped). Every copy
//! goes in bounded steps through the owner's gate table; dropping the
//! registration closes the gate at once, and the gate keeps the memory
//! until the steps in flight are done, off the dropping thread
//! (`drain.rs`): `gate.rs` states the invariant and enforces the owner's
//! half, `pvm.rs` the peer's.

#![warn(missing_docs)]

mod auth;
mod copy;
mod drain;
mod gate;
mod lane;
mod mapping;
mod owner;
mod peer;
mod places;
mod plan;
mod pool;
mod pvm;
mod shared;
mod socket;
mod submit;
mod target;
#[doc(hidden)]
pub mod wire;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use ferry_control::NotificationSink;
use ferry_control::auth::Refusals;
use ferry_control::hello::SecretCell;
use ferry_core::{
    MemRemote, MemoryBlock, NodeAddr, NodeId, OpError, RdmaOp, RegisterError, RegisterRegion,
    RemoteBuffer, random_u128,
};

/// What [`MemoryBackend::notify`] did with a notification.
pub use ferry_core::DataPathNotification;
pub use lane::{MAX_BODY as LANE_MAX_NOTIFICATION, SLOTS as LANE_SLOTS};
pub use owner::MemRegistration;
pub use places::{DEFAULT_UNPROVEN_TIMEOUT, SameHostLimits};
pub use shared::{SharedMapping, alloc, boot_id, mapping_of};
pub use submit::Pairs;

/// The abstract socket name of node `id`'s memory transport.
pub fn socket_name(id: NodeId) -> String {
    format!("ferry-memory/{:032x}", id.0)
}

/// Why the memory transport cannot start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The kernel's boot id is unreadable (no `/proc`).
    #[error("no boot id in /proc/sys/kernel/random/boot_id")]
    NoBootId,
    /// The node's socket could not be bound.
    #[error("cannot listen on the same-host socket: {0}")]
    Socket(#[from] std::io::Error),
}

/// How the memory transport carries an op on a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryPath {
    /// The region's memfd is mapped here; copies are `memcpy`s.
    Mapped,
    /// Copies are `process_vm_readv`/`process_vm_writev` into the owner's
    /// address space (memory ferry did not allocate).
    ProcessVm,
}

/// A region registered with the memory transport: its remote half for
/// handles, and the registration that keeps it shared.
pub struct MemRegistered {
    /// What handles carry.
    pub remote: MemRemote,
    /// Dropping it stops sharing the region.
    pub registration: MemRegistration,
}

/// How often mappings of regions that are gone are unmapped.
const SWEEP: Duration = Duration::from_secs(1);

struct Inner {
    boot_id: u128,
    exports: Arc<owner::Exports>,
    links: Arc<peer::Links>,
    /// Same-host peers the owner side answers now.
    served: Arc<std::sync::atomic::AtomicUsize>,
    /// Peers' notification lanes into this node.
    lanes: Arc<lane::OwnerLanes>,
    /// The task that answers peers (and owns their tasks and the
    /// listener); taken by [`MemoryBackend::shutdown`].
    server: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    sweeper: tokio::task::JoinHandle<()>,
    /// Peers' sockets refused for the cluster secret.
    refusals: Arc<Refusals>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(server) = self.server.get_mut().unwrap_or_else(|e| e.into_inner()) {
            server.abort();
        }
        self.sweeper.abort();
    }
}

/// The memory transport of one node. Cheap to clone.
#[derive(Clone)]
pub struct MemoryBackend(Arc<Inner>);

impl MemoryBackend {
    /// Starts sharing regions for node `node` (listening on its socket).
    /// Needs a tokio runtime.
    ///
    /// With a secret in `secret` (the node's endpoint's, shared), every same-host socket (region requests, notification
    /// lanes) proves it both ways before anything else crosses, and peers
    /// without it are refused (`ferry_control::auth`). The sockets it
    /// answers are bounded by [`SameHostLimits::default`].
    pub fn start(node: NodeId, secret: SecretCell) -> Result<Self, MemoryError> {
        Self::start_with_limits(node, secret, SameHostLimits::default())
    }

    /// [`MemoryBackend::start`], answering same-host sockets within
    /// `limits`: any local process can connect to the node's socket, so
    /// those that prove nothing hold a place only briefly (see
    /// [`SameHostLimits`]).
    pub fn start_with_limits(
        node: NodeId,
        secret: SecretCell,
        limits: SameHostLimits,
    ) -> Result<Self, MemoryError> {
        let auth = Arc::new(auth::SocketAuth { me: node, secret });
        let refusals = Arc::new(Refusals::default());
        let boot_id = boot_id().ok_or(MemoryError::NoBootId)?;
        let listener = socket::Listener::bind(&socket_name(node))?;
        let gates = gate::Gates::new();
        if gates.is_none() {
            tracing::info!(
                "memory transport: no gate table (memfd or pidfd unavailable); raw memory goes over the next transport"
            );
        }
        let exports = Arc::new(owner::Exports::new(gates));
        let served = Arc::default();
        let lanes = Arc::default();
        let server = tokio::spawn(owner::serve(
            listener,
            exports.clone(),
            Arc::clone(&served),
            places::Places::new(limits),
            Arc::clone(&lanes),
            auth.clone(),
            refusals.clone(),
        ));
        let links = Arc::new(peer::Links::new(auth));
        let sweeper = {
            let links = Arc::downgrade(&links);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(SWEEP);
                loop {
                    every.tick().await;
                    let Some(links) = links.upgrade() else { return };
                    links.sweep();
                }
            })
        };
        Ok(MemoryBackend(Arc::new(Inner {
            boot_id,
            exports,
            links,
            served,
            lanes,
            server: std::sync::Mutex::new(Some(server)),
            sweeper,
            refusals,
        })))
    }

    /// Same-host sockets refused for the cluster secret since the start
    /// (a peer without it, with another, or with a wrong proof).
    pub fn auth_refusals(&self) -> u64 {
        self.0.refusals.count()
    }

    /// Stops the transport for good, in both directions: no peer is
    /// answered any more (the socket is closed, and with it every peer's
    /// socket and lane, so their links see the owner gone), every region
    /// shared is marked dead (peers' copies through mappings or gates they
    /// already hold are refused from their next step on; steps already
    /// under way finish), and the links to other owners are dropped. The
    /// registrations themselves stay until their regions drop, which
    /// keeps the memory-lifetime invariant as before. Returns once the
    /// socket is closed.
    pub async fn shutdown(&self) {
        self.0.exports.revoke_all();
        let server = self
            .0
            .server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(server) = server {
            server.abort();
            // Cancelled: the listener and the peers' sockets are closed.
            let _ = server.await;
        }
        self.0.links.clear();
    }

    /// Delivers the notifications same-host peers send on lanes to `sink`
    /// (the node's inbox). Until then, peers' lanes are refused and their
    /// notifications take the control session. Set once; later calls are
    /// ignored.
    pub fn take_notifications(&self, sink: NotificationSink) {
        let _ = self.0.lanes.sink.set(sink);
    }

    /// Notification lanes same-host peers have open into this node now;
    /// one goes once its peer closed it and what its ring held is in the
    /// inbox.
    pub fn served_lanes(&self) -> usize {
        self.0.lanes.open.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Puts `notification` from node `from` in the lane to `owner`, after
    /// a batch to it completed here: its copies are done, so when the owner
    /// reads the notification, a write's bytes are in its memory and a
    /// read's were taken. Does not wait for the owner:
    /// [`Accepted`](DataPathNotification::Accepted) once it is in the ring,
    /// which the owner delivers. [`NotSent`](DataPathNotification::NotSent)
    /// when the owner takes no notifications this way (or is not reachable
    /// over its socket), the ring is full (the owner's inbox is), or the
    /// notification is larger than [`LANE_MAX_NOTIFICATION`]: notify the
    /// owner another way. [`Failed`](DataPathNotification::Failed) when the
    /// owner is gone: its socket closed, or closed as the notification went
    /// into the ring, where it may or may not have been read.
    /// Opening the lane, at the first notification to an owner, waits
    /// until `deadline` at most.
    pub async fn notify(
        &self,
        owner: NodeAddr,
        from: NodeAddr,
        notification: &[u8],
        deadline: tokio::time::Instant,
    ) -> DataPathNotification {
        match self.0.links.get(owner) {
            Some(link) => link.notify(from, notification, deadline).await,
            None => DataPathNotification::NotSent,
        }
    }

    /// Sets up what ops to `owner` need before the first one, by `deadline`:
    /// the link (its socket) and the notification lane from node `from`.
    /// False when `owner` is not reachable this way (another host, or the
    /// memory transport off there).
    pub async fn connect(
        &self,
        owner: NodeAddr,
        from: NodeAddr,
        deadline: tokio::time::Instant,
    ) -> bool {
        let Some(link) = self.0.links.get(owner) else {
            return false;
        };
        link.lane(from, deadline).await;
        true
    }

    /// Maps (or is granted) `remote`'s region ahead of the first op, as
    /// that op would: the owner checks the handle's generation, token and
    /// access (`write`: for writes) now, and the ops find the mapping
    /// cached. `Ok` also when this transport does not carry ops on
    /// `remote` (nothing to prepare).
    ///
    /// Then starts filling in this process's page tables for the bytes at
    /// `span` of the handle (those a prepared list names), so that the
    /// first transfers through them take no page fault per 4 KiB (on these
    /// VMs 2 µs each: a first 1 MiB request took 540 µs against 28 µs
    /// warm). Best effort, on a blocking thread, not waited for: preparing
    /// stays fast (a list of 100,000 blocks spans 400 MB, 75 ms of filling
    /// in), the kernel fills from the lowest address up, and a transfer
    /// that comes first faults its pages in as it would have. Nothing is
    /// filled in for a region reached through `process_vm` (nothing is
    /// mapped here).
    pub async fn prepare(
        &self,
        remote: &RemoteBuffer,
        write: bool,
        span: Range<u64>,
    ) -> Result<(), OpError> {
        if !self.routes(remote) {
            return Ok(());
        }
        let Some(link) = self.0.links.get(remote.owner()) else {
            return Ok(());
        };
        remote.check_address_range()?;
        if let target::Target::Mapped(mapping) = link.mapping_for(remote, write).await?
            && !span.is_empty()
        {
            let at = |offset: u64| remote.addr().saturating_add(offset.min(remote.len()));
            let range = at(span.start)..at(span.end);
            drop(tokio::task::spawn_blocking(move || mapping.populate(range)));
        }
        Ok(())
    }

    /// Forgets the owners of `remotes` that closed their sockets; see
    /// [`forget_dead_owners`](Self::forget_dead_owners).
    pub fn forget_dead_owners_of<'a>(
        &self,
        remotes: impl IntoIterator<Item = &'a RemoteBuffer>,
    ) -> bool {
        let mut seen: Vec<NodeId> = Vec::new();
        let mut forgot = false;
        for remote in remotes {
            let owner = remote.owner().id;
            if seen.contains(&owner) {
                continue;
            }
            seen.push(owner);
            // An owner that closed an idle socket and still listens gets
            // a fresh one; one that stopped is forgotten.
            if self.0.links.gone(remote.owner()) {
                tracing::debug!(owner = %remote.owner().endpoint, "memory transport: the owner closed its socket");
                forgot = true;
            }
        }
        forgot
    }

    /// Same-host owners this node keeps a link to (or remembers as
    /// unreachable). An owner's entry goes within a second (the sweep)
    /// after its socket closed, and an unreachable verdict after a few
    /// seconds. For leak checks and `ferry info`.
    pub fn links(&self) -> usize {
        self.0.links.len()
    }

    /// Same-host sockets this node answers now, notification lanes
    /// included; one goes as soon as it closes (a lane's, once what its
    /// ring held is in the inbox).
    pub fn served_peers(&self) -> usize {
        self.0.served.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What `ferry info` says about it: the memfd path, and whether raw
    /// memory goes over `process_vm` (which the kernel still decides per
    /// pair of processes: same uid and Yama's ptrace scope, or
    /// `CAP_SYS_PTRACE`).
    pub fn describe(&self) -> String {
        let process_vm = if self.0.exports.process_vm() {
            let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
                .map(|s| format!("Yama ptrace scope {}", s.trim()))
                .unwrap_or_else(|_| "no Yama".into());
            format!("other memory over process_vm_readv/writev where the kernel permits ({scope})")
        } else {
            "other memory over the next transport (no gate table)".into()
        };
        format!(
            "sealed memfd regions shared with processes on this host (boot {:08x}…); {process_vm}",
            (self.0.boot_id >> 96) as u32
        )
    }

    /// Shares `region`: a shared block ([`alloc`]) as its memfd, other
    /// memory over `process_vm`. `None` when neither can be had (no gate
    /// table, or all its gates taken): other transports carry it.
    pub fn register(&self, region: &RegisterRegion) -> Option<MemRegistered> {
        let token = random_u128();
        let (registration, process_vm) = self.0.exports.insert(
            region.id,
            region.generation,
            region.access,
            region.memory.clone(),
            token,
        )?;
        Some(MemRegistered {
            remote: MemRemote {
                boot_id: self.0.boot_id,
                token,
                process_vm,
            },
            registration,
        })
    }

    /// Whether this transport carries ops on `remote`; see
    /// [`path`](Self::path).
    pub fn routes(&self, remote: &RemoteBuffer) -> bool {
        self.path(remote).is_some()
    }

    /// How this transport would carry ops on `remote`, or `None` if it
    /// does not: the region was shared by a node on this boot whose socket
    /// this node reaches (a refused connect is remembered per owner; other
    /// failures are tried again), and for a `process_vm` region, the
    /// kernel lets this process reach the owner (probed once per owner and
    /// remembered; a refusal leaves the op to the next transport).
    pub fn path(&self, remote: &RemoteBuffer) -> Option<MemoryPath> {
        let memory = remote
            .transports()
            .memory
            .filter(|m| m.boot_id == self.0.boot_id)?;
        let link = self.0.links.get(remote.owner())?;
        if !memory.process_vm {
            return Some(MemoryPath::Mapped);
        }
        link.process_vm_permitted(remote.addr())
            .then_some(MemoryPath::ProcessVm)
    }

    /// Whether `remote`'s owner runs on this kernel boot with its memory
    /// transport on: a same-host owner, reachable now or not.
    pub fn same_host(&self, remote: &RemoteBuffer) -> bool {
        (remote.transports().memory).is_some_and(|m| m.boot_id == self.0.boot_id)
    }

    /// Forgets the owners of `ops` that closed their sockets (they stopped,
    /// or restarted under a new node id), looking at each owner once; true
    /// if it forgot any. Their ops then take the next transport
    /// ([`path`](Self::path) says `None` for a while), whose answer tells
    /// what is at the address now, instead of failing here with
    /// `ConnectionLost`. An owner that closed this node's socket while it
    /// still listens (at its bound, see [`SameHostLimits`]) is not
    /// forgotten: the socket is replaced. One non-blocking peek per linked
    /// owner, and a connect per closed one.
    pub fn forget_dead_owners<'a>(&self, ops: impl IntoIterator<Item = &'a RdmaOp>) -> bool {
        self.forget_dead_owners_of(ops.into_iter().map(|op| &op.remote))
    }
}

/// Allocates memory the memory transport can share (see [`alloc`]), as a
/// plain block where shared memory cannot be had.
pub fn alloc_or_plain(len: u64) -> Result<MemoryBlock, RegisterError> {
    alloc(len).or_else(|_| MemoryBlock::alloc(len))
}
