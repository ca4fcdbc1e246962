//! The engine NIXL drives, in Rust over a [`ferry::Node`]: NIXL's calls in
//! NIXL's terms (registrations, loaded metadata, agents, requests), each
//! answered with a NIXL status. The C++ shim only unpacks arguments.
//!
//! NIXL names memory by metadata pointers it keeps inside prepared lists,
//! even after the memory was deregistered or the peer removed; here every
//! such pointer carries an id, looked up in a table on each use, so a stale
//! one is an error ([`Status::NotFound`]), never a transfer into memory the
//! caller let go of.
//!
//! NIXL's calls are synchronous: one that waits (a registration, a
//! connect) blocks its caller on the process's runtime; a post hands the
//! request to the runtime and starts it, and a check drives the runtime one
//! step and reads the request's status ([`crate::drive`]); neither waits.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use ferry::prelude::*;
use ferry::{
    DeliveryKind, Inbox, LocalDescList, MemoryBlock, NodeAddr, OpError, RemoteDescList, Xfer,
    XferError, XferStatus,
};
use tracing::warn;

use crate::descs::{Desc, bind};
use crate::drive::{Driver, driver};
use crate::notif::{frame_notif, unframe_notif};
use crate::options::Options;
use crate::place::{Place, conn_info, on_loopback_elsewhere, parse_conn_info};

/// NIXL's status codes (`nixl_status_t`), as this engine answers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Status {
    /// Posted; not done yet.
    InProgress = 1,
    /// Done.
    Success = 0,
    /// A parameter NIXL passed is unusable (a descriptor outside its
    /// memory, garbage metadata).
    InvalidParam = -2,
    /// ferry failed the call (its error is logged).
    Backend = -3,
    /// A registration, handle or agent the call names is not (or no
    /// longer) known.
    NotFound = -4,
    /// A request still in progress cannot be released or re-posted.
    RepostActive = -7,
    /// A panic was caught at the boundary: a bug.
    Unknown = -8,
    /// Memory this engine does not move (VRAM, for now).
    NotSupported = -9,
    /// The peer is gone: NIXL invalidates its metadata.
    RemoteDisconnect = -10,
    /// The request was cancelled (released while in progress).
    Canceled = -11,
}

/// `nixl_mem_t`'s host memory.
const DRAM_SEG: i32 = 0;

/// What the ids name.
#[derive(Default)]
struct Tables {
    next_id: u64,
    /// This agent's registrations.
    local: HashMap<u64, Region>,
    /// Handles to memory of other agents (or this one, for transfers to
    /// itself), with the agent they came from.
    remote: HashMap<u64, (String, RemoteBuffer)>,
    /// Agents by name, from their connection info.
    agents: HashMap<String, NodeAddr>,
    /// Remote memory prepared once (routed, connected, mapped), by the ids
    /// of its handles in order: each request over the same handles only
    /// brings descriptors of its own ([`ferry::PreparedRemote::with_descs`]).
    prepared: HashMap<Vec<u64>, ferry::PreparedRemote>,
}

impl Tables {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

/// The FERRY engine of one NIXL agent.
pub struct Engine {
    driver: &'static Driver,
    node: Node,
    /// This agent's name.
    agent: String,
    deadline: Duration,
    /// Where this agent runs (boot and network namespace), read once:
    /// every agent's connection info is checked against it (see
    /// [`on_loopback_elsewhere`]).
    place: Place,
    tables: Mutex<Tables>,
    inbox: Mutex<Inbox>,
}

/// A prepared transfer ([`Engine::prep`]).
pub struct Request {
    xfer: Mutex<Xfer>,
    /// Every id its descriptors name: checked again at each post.
    local: Vec<u64>,
    remote: Vec<u64>,
}

impl Request {
    fn status(&self) -> XferStatus {
        self.xfer.lock().unwrap_or_else(|e| e.into_inner()).status()
    }
}

impl Engine {
    /// Starts a ferry node for agent `agent` on the process's runtime.
    pub fn new(agent: &str, params: &HashMap<String, String>) -> Result<Engine, String> {
        let options = Options::parse(params)?;
        let driver = driver();
        let mut builder = Node::builder()
            .name(format!("nixl-{agent}"))
            .listen(options.listen)
            .memory(options.memory)
            .ibverbs(options.ibverbs)
            .tcp(options.tcp)
            .tcp_busy_poll(options.tcp_busy_poll);
        if let Some(advertise) = options.advertise {
            builder = builder.advertise(advertise);
        }
        if let Some(path) = &options.cluster_secret_file {
            let secret = ferry::ClusterSecret::from_file(path).map_err(|e| e.to_string())?;
            builder = builder.cluster_secret(secret);
        }
        if let Some(n) = options.tcp_connections {
            builder = builder.tcp_connections(n);
        }
        let node = driver
            .block_on(builder.spawn())
            .map_err(|e| format!("cannot start a ferry node: {e}"))?;
        // A backend that can move no bytes is refused at creation, not at
        // its first transfer: `transports=ibverbs` on a host without an
        // RDMA device, say.
        if !node.transports().iter().any(|t| t.is_running()) {
            let why: Vec<String> = node.transports().iter().map(|t| t.to_string()).collect();
            driver.block_on(node.shutdown());
            return Err(format!(
                "none of the transports allowed (option transports) runs here: {}",
                why.join("; ")
            ));
        }
        let inbox = node.inbox().map_err(|e| format!("the node's inbox: {e}"))?;
        Ok(Engine {
            driver,
            node,
            agent: agent.to_string(),
            deadline: options.deadline,
            place: Place::here(),
            tables: Mutex::default(),
            inbox: Mutex::new(inbox),
        })
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `getConnInfo`: the node's address, and where it runs.
    pub fn conn_info(&self) -> String {
        conn_info(&self.node.addr(), &self.place)
    }

    /// `loadRemoteConnInfo`: where agent `agent` is. Refused when its node
    /// listens on a loopback address this agent's loopback is not.
    pub fn load_conn_info(&self, agent: &str, info: &[u8]) -> Status {
        let (addr, theirs) = match parse_conn_info(info) {
            Ok(parsed) => parsed,
            Err(e) => {
                warn!(agent, "FERRY: connection info that is not FERRY's: {e}");
                return Status::InvalidParam;
            }
        };
        if on_loopback_elsewhere(addr.endpoint, &theirs, &self.place) {
            warn!(
                agent,
                "FERRY: the agent runs on another host or in another network namespace, but \
                 its FERRY backend listens on loopback only ({}): nothing here can reach it. \
                 Set `listen` (or FERRY_NIXL_LISTEN) to an address the other agents reach, on \
                 every host",
                addr.endpoint
            );
            return Status::InvalidParam;
        }
        let ours = self.node.addr().endpoint;
        // Said once per process, not once per agent added.
        static TOLD: AtomicBool = AtomicBool::new(false);
        if on_loopback_elsewhere(ours, &theirs, &self.place) && !TOLD.swap(true, Ordering::Relaxed)
        {
            warn!(
                agent,
                "FERRY: the agent runs on another host or in another network namespace, and \
                 this agent's FERRY backend listens on loopback only ({ours}): transfers from \
                 here work, the agent cannot reach this one. Set `listen` (or \
                 FERRY_NIXL_LISTEN) on every host"
            );
        }
        self.tables().agents.insert(agent.to_string(), addr);
        Status::Success
    }

    fn agent_addr(&self, agent: &str) -> Option<NodeAddr> {
        if agent == self.agent {
            return Some(self.node.addr());
        }
        self.tables().agents.get(agent).copied()
    }

    /// `connect`: the node's connections to `agent` opened ahead.
    pub fn connect(&self, agent: &str) -> Status {
        if agent == self.agent {
            return Status::Success;
        }
        let Some(addr) = self.agent_addr(agent) else {
            warn!(
                agent,
                "FERRY: connect to an agent whose metadata was never loaded"
            );
            return Status::NotFound;
        };
        match self.driver.block_on(self.node.connect(addr, self.deadline)) {
            Ok(_) => Status::Success,
            Err(e) => {
                warn!(agent, "FERRY: connect: {e}");
                Status::RemoteDisconnect
            }
        }
    }

    /// `disconnect` (NIXL's `remove_remote_agent`): the agent's address is
    /// forgotten, so that its metadata loads again only with its
    /// connection info; ferry closes idle connections itself.
    pub fn disconnect(&self, agent: &str) -> Status {
        if agent != self.agent {
            self.tables().agents.remove(agent);
        }
        Status::Success
    }

    /// `registerMem`: host memory at `addr..addr+len`, registered with the
    /// node (the caller keeps it alive, as NIXL requires).
    pub fn register(&self, mem: i32, addr: u64, len: u64) -> Result<u64, Status> {
        if mem != DRAM_SEG {
            warn!(
                mem,
                "FERRY moves host memory (DRAM) only for now: register GPU memory with another \
                 backend (UCX)"
            );
            return Err(Status::NotSupported);
        }
        let Some(ptr) = usize::try_from(addr)
            .ok()
            .and_then(|a| NonNull::new(a as *mut u8))
        else {
            return Err(Status::InvalidParam);
        };
        // SAFETY: NIXL's contract: registered memory stays valid until it
        // is deregistered, and a transfer over it is complete by then; the
        // keep-alive is empty because the caller owns the memory.
        let memory = unsafe { MemoryBlock::from_raw(ptr, len, Box::new(())) };
        let memory = memory.map_err(|e| {
            warn!(addr, len, "FERRY: registerMem: {e}");
            Status::InvalidParam
        })?;
        let region = self
            .driver
            .block_on(self.node.register(memory, Access::ReadWrite))
            .map_err(|e| {
                warn!(addr, len, "FERRY: registerMem: {e}");
                Status::Backend
            })?;
        let mut tables = self.tables();
        let id = tables.id();
        tables.local.insert(id, region);
        Ok(id)
    }

    /// `deregisterMem`: the registration goes; requests that named it fail
    /// their next post.
    pub fn deregister(&self, md: u64) -> Status {
        match self.tables().local.remove(&md) {
            Some(_) => Status::Success,
            None => Status::NotFound,
        }
    }

    /// `getPublicData`: the registration's handle, for peers.
    pub fn public_data(&self, md: u64) -> Result<String, Status> {
        let tables = self.tables();
        let region = tables.local.get(&md).ok_or(Status::NotFound)?;
        Ok(serde_json::to_string(&region.remote()).expect("a handle serializes"))
    }

    /// `loadRemoteMD`: agent `agent`'s handle for its memory at
    /// `addr..addr+len`. Untrusted: it must be a ferry handle for exactly
    /// that range, of the node the agent's connection info (loaded before)
    /// named.
    pub fn load_remote(
        &self,
        agent: &str,
        mem: i32,
        addr: u64,
        len: u64,
        blob: &[u8],
    ) -> Result<u64, Status> {
        if mem != DRAM_SEG {
            return Err(Status::NotSupported);
        }
        let handle: RemoteBuffer = serde_json::from_slice(blob).map_err(|e| {
            warn!(agent, "FERRY: metadata that is not a ferry handle: {e}");
            Status::InvalidParam
        })?;
        if handle.addr() != addr || handle.len() != len {
            warn!(
                agent,
                "FERRY: metadata for {addr:#x}+{len} names {:#x}+{}",
                handle.addr(),
                handle.len()
            );
            return Err(Status::InvalidParam);
        }
        let mut tables = self.tables();
        // NIXL loads an agent's connection info before its memory: none
        // here means it was refused (or never sent), and so is this.
        let Some(node) = tables.agents.get(agent) else {
            warn!(
                agent,
                "FERRY: metadata of an agent whose connection info was not loaded"
            );
            return Err(Status::NotFound);
        };
        // The whole address: ops dial the handle's endpoint, and the
        // connection info's is the one checked at `load_conn_info`.
        if *node != handle.owner() {
            warn!(agent, "FERRY: metadata of another node than the agent's");
            return Err(Status::InvalidParam);
        }
        let id = tables.id();
        tables.remote.insert(id, (agent.to_string(), handle));
        Ok(id)
    }

    /// `loadLocalMD`: a handle to this agent's own registration, for
    /// transfers to itself.
    pub fn load_local(&self, md: u64) -> Result<u64, Status> {
        let mut tables = self.tables();
        let handle = tables.local.get(&md).ok_or(Status::NotFound)?.remote();
        let id = tables.id();
        tables.remote.insert(id, (self.agent.clone(), handle));
        Ok(id)
    }

    /// `unloadMD`: the handle goes, and what was prepared over it.
    pub fn unload(&self, md: u64) -> Status {
        let mut tables = self.tables();
        tables.prepared.retain(|ids, _| !ids.contains(&md));
        match tables.remote.remove(&md) {
            Some(_) => Status::Success,
            None => Status::NotFound,
        }
    }

    /// `queryMem`: whether `addr..addr+len` lies in a registration.
    pub fn query(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        self.tables().local.values().any(|region| {
            let start = region.memory().addr();
            addr >= start && end <= start.saturating_add(region.len())
        })
    }

    /// `prepXfer`: a request from `local[k]` to `remote[k]` (a READ fills
    /// `local`), every descriptor checked against its registration or
    /// handle, the remote memory prepared (routed, connected, mapped).
    pub fn prep(
        &self,
        read: bool,
        local: &[Desc],
        remote: &[Desc],
        agent: &str,
    ) -> Result<Request, Status> {
        if local.len() != remote.len() {
            warn!(
                "FERRY: {} local descriptors against {} remote",
                local.len(),
                remote.len()
            );
            return Err(Status::InvalidParam);
        }
        let (locals, remotes, prepared) = {
            let tables = self.tables();
            let locals = bind(
                local,
                |md| tables.local.get(&md).cloned(),
                |region| (region.memory().addr(), region.len()),
            )?;
            let remotes = bind(
                remote,
                |md| {
                    let (owner, handle) = tables.remote.get(&md)?;
                    (owner == agent).then(|| handle.clone())
                },
                |handle| (handle.addr(), handle.len()),
            )?;
            let prepared = tables.prepared.get(&remotes.ids).cloned();
            (locals, remotes, prepared)
        };
        let invalid = |e: ferry::DescError| {
            warn!("FERRY: prepXfer: {e}");
            Status::InvalidParam
        };
        let local_list = LocalDescList::new(locals.memory, locals.descs).map_err(invalid)?;
        let remote_ids = remotes.ids;
        let prepared = match prepared {
            Some(prepared) => prepared.with_descs(remotes.descs).map_err(invalid)?,
            None => {
                let remote_list =
                    RemoteDescList::new(remotes.memory, remotes.descs).map_err(invalid)?;
                let prepared = self
                    .driver
                    .block_on(self.node.prepare_remote(remote_list, self.deadline))
                    .map_err(|e| {
                        warn!(agent, "FERRY: prepXfer: {e}");
                        match e {
                            ferry::PrepareError::Connect { .. } => Status::RemoteDisconnect,
                            _ => Status::Backend,
                        }
                    })?;
                let mut tables = self.tables();
                // Only while every handle is still loaded: one unloaded
                // meanwhile must not come back through the cache.
                if remote_ids.iter().all(|id| tables.remote.contains_key(id)) {
                    tables.prepared.insert(remote_ids.clone(), prepared.clone());
                }
                prepared
            }
        };
        let kind = if read { OpKind::Read } else { OpKind::Write };
        let n = local.len();
        let xfer = self
            .node
            .make_xfer(kind, &local_list, 0..n, &prepared, 0..n)
            .map_err(invalid)?;
        Ok(Request {
            xfer: Mutex::new(xfer),
            local: locals.ids,
            remote: remote_ids,
        })
    }

    /// `postXfer`: starts the request (returns at once), with `notif` for
    /// the remote agent behind its data.
    pub fn post(&self, request: &Request, notif: Option<&[u8]>) -> Status {
        let mut xfer = request.xfer.lock().unwrap_or_else(|e| e.into_inner());
        if xfer.status() == XferStatus::InProgress {
            return Status::RepostActive;
        }
        {
            let tables = self.tables();
            let stale = request
                .local
                .iter()
                .find(|id| !tables.local.contains_key(id));
            let unloaded = request
                .remote
                .iter()
                .find(|id| !tables.remote.contains_key(id));
            if stale.is_some() || unloaded.is_some() {
                warn!(
                    "FERRY: postXfer: the request names {} since it was prepared",
                    if stale.is_some() {
                        "memory deregistered"
                    } else {
                        "an agent's memory unloaded (agent removed?)"
                    }
                );
                return Status::NotFound;
            }
        }
        xfer.set_notification(notif.map(|msg| frame_notif(&self.agent, msg)));
        // Started here when this caller drives, as UCX starts a send
        // inside its post: the first bytes leave before the first check.
        // A small same-host copy is done within the post: nothing to drive.
        let (posted, _) = self.driver.poll_with(
            || xfer.post(self.deadline),
            |posted| posted.is_err() || xfer.status() == XferStatus::Done,
        );
        if posted.is_err() {
            return Status::RepostActive;
        }
        drop(xfer);
        match request.status() {
            // Done within the post (a small same-host copy): NIXL takes
            // `Success` from postXfer as complete, and skips the checks.
            XferStatus::Done => Status::Success,
            // A failure is the checks' to report.
            _ => Status::InProgress,
        }
    }

    /// `checkXfer`: where the request stands; never waits.
    pub fn check(&self, request: &Request) -> Status {
        let mut status = request.status();
        if status == XferStatus::InProgress {
            // NIXL's callers poll this in a tight loop: the bytes move
            // here (see `drive`), or on the thread that drives now, which
            // then gets the core this caller holds.
            if self.driver.poll() {
                status = request.status();
            } else {
                std::thread::yield_now();
            }
        }
        match status {
            XferStatus::InProgress => Status::InProgress,
            XferStatus::Done => Status::Success,
            XferStatus::Ready => Status::InvalidParam,
            XferStatus::Failed(e) => {
                warn!("FERRY: transfer failed: {e}");
                status_of(&e)
            }
        }
    }

    /// `releaseReqH`: `Success` when the request may be freed; one still
    /// in progress is cancelled and answered `RepostActive` (NIXL keeps
    /// the handle), since its window may still be moving bytes.
    pub fn release(&self, request: &Request) -> Status {
        let xfer = request.xfer.lock().unwrap_or_else(|e| e.into_inner());
        if xfer.status() == XferStatus::InProgress {
            xfer.cancel();
            return Status::RepostActive;
        }
        Status::Success
    }

    /// `estimateXferCost`: ferry's estimate, in microseconds.
    pub fn estimate(&self, request: &Request) -> (i64, i64) {
        let xfer = request.xfer.lock().unwrap_or_else(|e| e.into_inner());
        let estimate = self.node.estimate(&xfer);
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        (micros(estimate.duration), micros(estimate.margin))
    }

    /// `getNotifs`: every notification that came, with its sender agent.
    pub fn notifs(&self, mut each: impl FnMut(&[u8], &[u8])) {
        // Callers poll this in a loop, as they poll checkXfer: the bytes
        // sent to this agent move here too.
        let drove = self.driver.poll();
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        let mut none = true;
        while let Some(delivery) = inbox.try_recv() {
            none = false;
            if delivery.kind != DeliveryKind::Notification {
                continue;
            }
            match unframe_notif(&delivery.body) {
                Some((agent, msg)) => each(agent, msg),
                None => {
                    warn!(from = %delivery.from, "FERRY: a notification not framed by FERRY, dropped")
                }
            }
        }
        if none && !drove {
            // The thread that drives now moves them: give it the core.
            std::thread::yield_now();
        }
    }

    /// `genNotif`: `msg` to agent `agent` on its own.
    pub fn gen_notif(&self, agent: &str, msg: &[u8]) -> Status {
        let Some(addr) = self.agent_addr(agent) else {
            warn!(
                agent,
                "FERRY: genNotif to an agent whose metadata was never loaded"
            );
            return Status::NotFound;
        };
        let body = frame_notif(&self.agent, msg);
        match self
            .driver
            .block_on(self.node.notify(addr, body, self.deadline))
        {
            Ok(()) => Status::Success,
            Err(e) => {
                warn!(agent, "FERRY: genNotif: {e}");
                Status::RemoteDisconnect
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.driver.block_on(self.node.shutdown());
    }
}

/// NIXL's status for a failed transfer.
fn status_of(error: &XferError) -> Status {
    use ferry::SubmitError;
    match error {
        XferError::Cancelled { .. } => Status::Canceled,
        XferError::Submit(SubmitError::Op {
            error:
                OpError::ConnectionLost { .. }
                | OpError::PeerUnreachable { .. }
                | OpError::UnknownNode { .. },
            ..
        }) => Status::RemoteDisconnect,
        _ => Status::Backend,
    }
}
