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
//! NIXL's calls are synchronous, and none waits on the network: vLLM and
//! SGLang make them on the thread that schedules their model, where one
//! stuck peer must not stall the rest. Connecting to a peer happens in the
//! background: a request made before it is connected waits for that in
//! the background too ([`crate::request`]), a `connect` only starts it, and
//! a notification goes out from a queue per peer. A registration waits on
//! the process's runtime (local work only); a post hands the request to the
//! runtime and starts it, and a check drives the runtime one step and reads
//! the request's status ([`crate::drive`]).

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use ferry::prelude::*;
use ferry::{
    Bytes, Inbox, LocalDescList, MemoryBlock, NodeAddr, OpError, RemoteDescList, XferError,
};
use tokio::sync::mpsc;
use tracing::warn;

use crate::descs::{Desc, bind};
use crate::drive::{Driver, driver};
use crate::notif::frame_notif;
use crate::options::Options;
use crate::place::{Place, conn_info, on_loopback_elsewhere, parse_conn_info};
pub use crate::request::Request;
use crate::request::{Preparing, Standing, failed, prepare};

mod notifs;

/// Agents whose connection info was never loaded whose node a notification
/// bound (see [`Engine::notifs`]); past this many, such notifications are
/// dropped.
pub const MAX_UNLOADED_SENDERS: usize = 4096;

/// Notifications queued to one agent (`genNotif`) while earlier ones are on
/// their way: past this many the call fails, as NIXL's own queues do.
pub const NOTIFS_QUEUED: usize = 1024;

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
    /// Remote memory prepared once (routed, connected, mapped), or being
    /// prepared, by the ids of its handles in order: each request over the
    /// same handles only brings descriptors of its own
    /// ([`ferry::PreparedRemote::with_descs`]).
    prepared: HashMap<Vec<u64>, Preparing>,
    /// Each peer's queue of notifications sent on their own (`genNotif`),
    /// in order, by a task of its own.
    notifiers: HashMap<NodeAddr, mpsc::Sender<Bytes>>,
    /// The node each agent named in a notification came from, for agents
    /// whose connection info was never loaded here: the first one binds
    /// the name (see [`Engine::notifs`]).
    senders: HashMap<String, ferry::NodeId>,
    /// Notifications dropped because they named an agent of another node.
    misnamed: u64,
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

    /// `connect`: the node's connections to `agent` start opening, in the
    /// background (a failure is logged; the requests that need them
    /// report it).
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
        let (node, deadline, agent) = (self.node.clone(), self.deadline, agent.to_string());
        self.driver.handle().spawn(async move {
            if let Err(e) = node.connect(addr, deadline).await {
                warn!(agent, "FERRY: connect: {e}");
            }
        });
        Status::Success
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
    /// handle. The remote memory is prepared (routed, connected, mapped)
    /// once per set of handles, in the background: a request made before
    /// that ends waits for it ([`crate::request`]).
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
        let kind = if read { OpKind::Read } else { OpKind::Write };
        let n = local.len();
        let local_list = LocalDescList::new(locals.memory, locals.descs).map_err(invalid)?;
        let remote_ids = remotes.ids;
        let ready = prepared
            .as_ref()
            .and_then(|preparing| preparing.borrow().clone());
        if let Some(Ok(prepared)) = ready {
            let remote = prepared.with_descs(remotes.descs).map_err(invalid)?;
            let xfer = self
                .node
                .make_xfer(kind, &local_list, 0..n, &remote, 0..n)
                .map_err(invalid)?;
            return Ok(Request::made(xfer, locals.ids, remote_ids));
        }
        // Checked now as the made request would check them: a bad request
        // is refused at once, not at its post.
        let remote_list = RemoteDescList::new(remotes.memory, remotes.descs).map_err(invalid)?;
        if let Some(k) = (0..n).find(|&k| local[k].len != remote[k].len) {
            warn!(
                "FERRY: prepXfer: descriptor {k} moves {} bytes locally, {} remotely",
                local[k].len, remote[k].len
            );
            return Err(Status::InvalidParam);
        }
        let preparing = match prepared {
            Some(preparing) if !failed(&preparing) => preparing,
            _ => self.preparation(&remote_ids, &remote_list),
        };
        Ok(Request::unmade(
            kind,
            local_list,
            remote_list,
            preparing,
            locals.ids,
            remote_ids,
        ))
    }

    /// Starts preparing the memory of `list` (whose handles' ids are
    /// `ids`), and keeps the preparation for the requests to come while
    /// every handle is still loaded.
    fn preparation(&self, ids: &[u64], list: &RemoteDescList) -> Preparing {
        let preparing = prepare(
            self.driver.handle(),
            &self.node,
            list.clone(),
            self.deadline,
        );
        let mut tables = self.tables();
        // One unloaded meanwhile must not come back through the cache.
        if ids.iter().all(|id| tables.remote.contains_key(id)) {
            tables.prepared.insert(ids.to_vec(), preparing.clone());
        }
        preparing
    }

    /// `postXfer`: starts the request (returns at once), with `notif` for
    /// the remote agent behind its data.
    pub fn post(&self, request: &Request, notif: Option<&[u8]>) -> Status {
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
        let notif = notif.map(|msg| frame_notif(&self.agent, msg));
        // Started here when this caller drives, as UCX starts a send
        // inside its post: the first bytes leave before the first check.
        // A small same-host copy is done within the post: nothing to drive.
        let (status, _) = self.driver.poll_with(
            || {
                request.post(
                    &self.node,
                    self.driver.handle(),
                    notif,
                    self.deadline,
                    |list| self.preparation(&request.remote, list),
                    |xfer| xfer.post(self.deadline),
                )
            },
            |status| *status != Status::InProgress,
        );
        status
    }

    /// `checkXfer`: where the request stands; never waits.
    pub fn check(&self, request: &Request) -> Status {
        let mut standing = request.standing(&self.node);
        if standing == Standing::InProgress {
            // NIXL's callers poll this in a tight loop: the bytes move
            // here (see `drive`), or on the thread that drives now, which
            // then gets the core this caller holds.
            if self.driver.poll() {
                standing = request.standing(&self.node);
            } else {
                std::thread::yield_now();
            }
        }
        match standing {
            Standing::InProgress => Status::InProgress,
            Standing::Done => Status::Success,
            Standing::Ready => Status::InvalidParam,
            Standing::Failed(status) => status,
        }
    }

    /// `releaseReqH`: `Success` when the request may be freed; one still
    /// moving bytes is cancelled and answered `RepostActive` (NIXL keeps
    /// the handle until its window settles).
    pub fn release(&self, request: &Request) -> Status {
        request.release()
    }

    /// `estimateXferCost`: ferry's estimate, in microseconds.
    /// A request still waiting for its peer is estimated at the deadline,
    /// give or take all of it.
    pub fn estimate(&self, request: &Request) -> (i64, i64) {
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        match request.with_xfer(|xfer| self.node.estimate(xfer)) {
            Some(estimate) => (micros(estimate.duration), micros(estimate.margin)),
            None => (micros(self.deadline), micros(self.deadline)),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.driver.block_on(self.node.shutdown());
    }
}

/// NIXL's status for a failed transfer.
pub(crate) fn status_of(error: &XferError) -> Status {
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
