//! Preparing a peer's descriptor list once, and warming the connections to
//! a peer: what NIXL users do at handshake (`prep_xfer_dlist`,
//! `make_connection`), so that a request pays neither routing nor
//! connection set-up. Elsewhere the first request to a peer paid tens of
//! seconds of set-up; here [`Node::connect`] pays it ahead, within a
//! deadline.

use std::sync::Arc;
use std::time::Duration;

use ferry_core::{
    DescError, Descs, NodeAddr, OpError, RdmaTransportLevel, RemoteBuffer, RemoteDescList,
};
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tokio::time::Instant;

use crate::actor::NodeActor;
use crate::node::Node;
use crate::router::Router;

/// A peer's descriptor list, checked, routed and connected once
/// ([`Node::prepare_remote`]): requests built on it take each region's
/// transport without asking again. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PreparedRemote {
    pub(crate) list: Arc<RemoteDescList>,
    /// Each region's transport, as routed at prepare.
    pub(crate) levels: Arc<[RdmaTransportLevel]>,
    /// The list's owners, each once, in region order.
    pub(crate) owners: Arc<[NodeAddr]>,
}

impl PreparedRemote {
    /// The list prepared.
    pub fn list(&self) -> &RemoteDescList {
        &self.list
    }

    /// The transport each region's ops take (as routed at prepare; a
    /// same-host owner that restarted since is routed again at post).
    pub fn levels(&self) -> &[RdmaTransportLevel] {
        &self.levels
    }

    /// The nodes whose memory the list names, each once.
    pub fn owners(&self) -> &[NodeAddr] {
        &self.owners
    }

    /// The same regions, as routed, connected and mapped at prepare, with
    /// other descriptors (checked as [`RemoteDescList::new`] checks them):
    /// for a caller whose every request names descriptors of its own over
    /// regions prepared once (NIXL's backend interface), so that a request
    /// costs no routing, connecting or mapping again.
    pub fn with_descs(&self, descs: Descs) -> Result<PreparedRemote, DescError> {
        Ok(PreparedRemote {
            list: Arc::new(self.list.with_descs(descs)?),
            levels: self.levels.clone(),
            owners: self.owners.clone(),
        })
    }
}

/// Why a list could not be prepared, or a peer connected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// A region of the list is unusable from here: the error names the
    /// region's index in the list. Where each refusal is caught:
    /// - here, over every transport: no transport both ends share, a
    ///   handle whose address range wraps (forged), a peer that is gone;
    /// - here, for a same-host region only, since preparing maps it and its
    ///   owner checks the handle then: a stale generation, a wrong token, a
    ///   region deregistered since (`UnknownRegion`);
    /// - over TCP and ibverbs the owner checks credentials per op, so those
    ///   same faults pass preparing and fail the post (`AccessDenied`,
    ///   `StaleGeneration`, `UnknownRegion` in [`XferError::Submit`]).
    ///
    /// [`XferError::Submit`]: crate::XferError::Submit
    #[error(transparent)]
    Desc(#[from] DescError),
    /// A peer could not be reached, on any transport, within the deadline.
    #[error("could not connect to {peer}: {error}")]
    Connect {
        /// The peer.
        peer: NodeAddr,
        /// Why.
        error: OpError,
    },
    /// The node was shut down.
    #[error("the node was shut down")]
    ShutDown,
}

/// What [`Node::connect`] set up to a peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Connected {
    /// The control session (messages, RPC, queue-pair exchange) is open.
    pub control: bool,
    /// Same-host: the link to the peer's socket and the notification lane
    /// are open, and its regions' ops take the memory transport.
    pub memory: bool,
    /// A queue pair to the peer is connected (ready to send).
    pub ibverbs: bool,
    /// TCP data connections open to the peer.
    pub tcp_connections: usize,
}

impl Router {
    /// See [`Node::connect`]. `levels`: the transports to set up, when a
    /// prepared list says which its ops take; `None`: the fastest one the
    /// peer answers on, and TCP.
    async fn connect(
        &self,
        peer: NodeAddr,
        levels: Option<&[RdmaTransportLevel]>,
        deadline: Instant,
    ) -> Result<Connected, PrepareError> {
        if self.is_shut_down() {
            return Err(PrepareError::ShutDown);
        }
        let allowed = |level| level != RdmaTransportLevel::Tcp || self.tcp_data;
        let wants = |level| allowed(level) && levels.is_none_or(|l| l.contains(&level));
        let left = || deadline.saturating_duration_since(Instant::now());
        let mut connected = Connected::default();
        let session = self.endpoint.session(peer, left()).await;
        connected.control = session.is_ok();
        if let Some(memory) = &self.memory
            && wants(RdmaTransportLevel::Memory)
        {
            connected.memory = memory.connect(peer, self.addr(), deadline).await;
        }
        // Same-host ops never take the NIC or TCP unless the list says so.
        let beside_memory = connected.memory && levels.is_none();
        let mut nic_error = None;
        if let Some(ibverbs) = &self.ibverbs
            && wants(RdmaTransportLevel::Nic)
            && !beside_memory
        {
            match ibverbs.connect(peer, left()).await {
                Ok(()) => connected.ibverbs = true,
                Err(e) => nic_error = Some(e),
            }
        }
        let mut tcp_error = None;
        if wants(RdmaTransportLevel::Tcp) && !beside_memory && !connected.ibverbs {
            match self.tcp.connect(peer, left()).await {
                Ok(open) => connected.tcp_connections = open,
                Err(e) => tcp_error = Some(e),
            }
        }
        if connected.memory || connected.ibverbs || connected.tcp_connections > 0 {
            return Ok(connected);
        }
        let error = match (tcp_error.or(nic_error), session) {
            (Some(e), _) => e,
            (None, Err(e)) => OpError::PeerUnreachable {
                endpoint: peer.endpoint,
                reason: e.to_string(),
            },
            (None, Ok(_)) => OpError::NoSharedTransport,
        };
        Err(PrepareError::Connect { peer, error })
    }

    /// See [`Node::prepare_remote`].
    pub(crate) async fn prepare_remote(
        &self,
        list: RemoteDescList,
        timeout: Duration,
    ) -> Result<PreparedRemote, PrepareError> {
        if self.is_shut_down() {
            return Err(PrepareError::ShutDown);
        }
        let deadline = Instant::now() + timeout;
        let regions = list.regions();
        let mut owners: Vec<NodeAddr> = Vec::new();
        for region in regions {
            if !owners.contains(&region.owner()) {
                owners.push(region.owner());
            }
        }
        // Connect first: a same-host owner is only routed to the memory
        // transport once its socket was reached.
        for &owner in &owners {
            if let Some(memory) = &self.memory {
                memory.connect(owner, self.addr(), deadline).await;
            }
        }
        let levels = route_regions(self, regions)?;
        for &owner in &owners {
            let used: Vec<RdmaTransportLevel> = regions
                .iter()
                .zip(levels.iter())
                .filter(|(r, _)| r.owner() == owner)
                .map(|(_, &l)| l)
                .collect();
            self.connect(owner, Some(&used), deadline).await?;
        }
        // Same-host regions are mapped (or granted) now: the owner checks
        // each handle's generation and token here, not at the first post,
        // and the pages the descriptors name start being filled in, so that
        // the first posts take no page faults.
        if let Some(memory) = &self.memory
            && levels.contains(&RdmaTransportLevel::Memory)
        {
            let spans = list.descs().spans(regions.len());
            for (index, (region, level)) in regions.iter().zip(levels.iter()).enumerate() {
                if *level != RdmaTransportLevel::Memory {
                    continue;
                }
                let write = region.access().allows_write();
                let span = spans[index].clone().unwrap_or(0..0);
                let left = deadline.saturating_duration_since(Instant::now());
                let mapped = tokio::time::timeout(left, memory.prepare(region, write, span)).await;
                let error = match mapped {
                    Ok(Ok(())) => continue,
                    Ok(Err(error)) => error,
                    Err(_) => OpError::PeerUnreachable {
                        endpoint: region.owner().endpoint,
                        reason: format!("its region was not mapped within {timeout:?}"),
                    },
                };
                return Err(DescError::Region {
                    region: index,
                    error,
                }
                .into());
            }
        }
        Ok(PreparedRemote {
            list: Arc::new(list),
            levels: levels.into(),
            owners: owners.into(),
        })
    }
}

/// Each region's transport; an error ([`Router::unroutable`]) names the
/// first that has none.
pub(crate) fn route_regions(
    router: &Router,
    regions: &[RemoteBuffer],
) -> Result<Vec<RdmaTransportLevel>, DescError> {
    regions
        .iter()
        .enumerate()
        .map(|(index, region)| {
            router
                .route_remote(region)
                .ok_or_else(|| DescError::Region {
                    region: index,
                    error: router.unroutable(region),
                })
        })
        .collect()
}

impl Node {
    /// Sets up, within `timeout`, what the first transfer to `peer` would
    /// otherwise set up on its way (NIXL's `make_connection`): the control
    /// session; for a same-host peer the link to its socket and the
    /// notification lane; otherwise the queue pair (both ends with
    /// ibverbs) or the TCP data connections. What a later transfer still
    /// sets up: a same-host region's mapping (done by
    /// [`Node::prepare_remote`]). `Err` when the peer could not be reached
    /// on any transport.
    pub async fn connect(
        &self,
        peer: NodeAddr,
        timeout: Duration,
    ) -> Result<Connected, PrepareError> {
        let deadline = Instant::now() + timeout;
        self.0.router.connect(peer, None, deadline).await
    }

    /// Prepares a peer's descriptor list for requests, within `timeout`:
    /// routes each region once, connects to each owner on the transports
    /// its regions take ([`Node::connect`]), and maps same-host regions,
    /// whose owner then checks each handle's generation and token, and
    /// starts filling in the page tables for the bytes the list names in
    /// the background (up to 4 GiB per region; about 0.19 s per GiB here,
    /// which the first transfers would otherwise pay three times over in
    /// page faults). Bounds were checked when the list was made. A region
    /// that cannot be used is refused with its index
    /// ([`DescError::Region`]).
    pub async fn prepare_remote(
        &self,
        list: RemoteDescList,
        timeout: Duration,
    ) -> Result<PreparedRemote, PrepareError> {
        self.0.router.prepare_remote(list, timeout).await
    }
}

/// Asks a [`NodeActor`] to connect to a peer ([`Node::connect`]).
#[derive(Clone, Copy, Debug)]
pub struct Connect {
    /// The peer.
    pub peer: NodeAddr,
    /// How long it may take.
    pub timeout: Duration,
}

impl Message<Connect> for NodeActor {
    type Reply = DelegatedReply<Result<Connected, PrepareError>>;

    async fn handle(&mut self, msg: Connect, ctx: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let router = self.router.clone();
        let deadline = Instant::now() + msg.timeout;
        // Connecting takes round trips: not for the mailbox.
        ctx.spawn(async move { router.connect(msg.peer, None, deadline).await })
    }
}

/// Asks a [`NodeActor`] to prepare a peer's list ([`Node::prepare_remote`]).
#[derive(Clone, Debug)]
pub struct PrepareRemote {
    /// The list.
    pub list: RemoteDescList,
    /// How long it may take.
    pub timeout: Duration,
}

impl Message<PrepareRemote> for NodeActor {
    type Reply = DelegatedReply<Result<PreparedRemote, PrepareError>>;

    async fn handle(
        &mut self,
        msg: PrepareRemote,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let router = self.router.clone();
        ctx.spawn(async move { router.prepare_remote(msg.list, msg.timeout).await })
    }
}
