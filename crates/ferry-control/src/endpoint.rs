//! The node's endpoint: one listener for everything peers open to this node.
//!
//! Each accepted connection is admitted under the [`ConnectionLimits`]
//! (at a bound, an idle connection makes room for it, see [`crate::limits`]),
//! says hello within their deadline, and is then either a control session
//! (served here) or handed, as it is, to the data plane that registered for
//! its [`Channel`]. The endpoint knows nothing of what the data planes do.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{NodeAddr, NodeId};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::hello::Authenticated;
use crate::limits::{Admission, ConnectionLimits, ConnectionPermit, IdleClose};
use crate::session::{self, ServiceFuture, ServiceHandler};
use crate::{
    Channel, ControlError, DEFAULT_MAX_FRAME, Dialer, EndpointError, Request, Service,
    ServiceError, Session,
};

/// Tuning of the endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointConfig {
    /// Bounds on accepted connections.
    pub limits: ConnectionLimits,
    /// Longest control frame accepted (header and body), in bytes.
    pub max_frame: usize,
    /// Requests of one session that may run here at once; more are answered
    /// `Busy`. As many of its tells may wait for a turn (within their
    /// deadlines); more are dropped, and logged.
    pub max_requests_in_flight: usize,
    /// A peer that acknowledges nothing on its control session for this
    /// long (no data, no keepalive probe) is declared lost: the session
    /// ends, and with it what depends on it, except transfers a data plane
    /// still sees completing (see [`Session::went_silent`]). A peer process
    /// that dies on a live host is seen at once: its kernel closes the
    /// connection.
    pub peer_timeout: std::time::Duration,
    /// After a session went silent, how long a data plane may go on with
    /// the transfers it had under way over it while they keep completing:
    /// the path works for them, only the session's does not (TCP blocked,
    /// say). Both ends keep to it: the owner of memory cannot see one-sided
    /// transfers complete, so it keeps its end of a queue pair this long.
    /// Give every node the same value.
    pub silent_grace: std::time::Duration,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        EndpointConfig {
            limits: ConnectionLimits::default(),
            max_frame: DEFAULT_MAX_FRAME,
            max_requests_in_flight: 64,
            peer_timeout: crate::socket::DEFAULT_PEER_TIMEOUT,
            silent_grace: crate::socket::DEFAULT_SILENT_GRACE,
        }
    }
}

/// A connection for a data plane, after its hello.
#[derive(Debug)]
pub struct Connection {
    /// The stream, positioned at the channel's first byte.
    pub stream: TcpStream,
    /// The node the client said it is in its hello: proved where both ends
    /// hold a cluster secret (`auth` is then set), a claim otherwise.
    pub node: NodeId,
    /// Where both ends proved a cluster secret: the keys the channel seals
    /// and checks every frame with, and the token that ends it when that
    /// secret is revoked. The data plane keeps it as long as the
    /// connection.
    pub auth: Option<Authenticated>,
    /// Where the connection comes from.
    pub remote: SocketAddr,
    /// Its place under the [`ConnectionLimits`], held until the connection
    /// is closed: the data plane waits for each of the client's requests
    /// through [`ConnectionPermit::while_idle`], so that an idle connection
    /// is closed in time or makes room for a new one at a bound.
    pub permit: ConnectionPermit,
}

type ChannelHandler =
    Arc<dyn Fn(Connection) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// This node's endpoint. Cheap to clone; the listener, and every session
/// and connection it serves, stop when the last clone is dropped or
/// [`Endpoint::shutdown`] is called.
#[derive(Clone)]
pub struct Endpoint(Arc<Owner>);

/// Held only by `Endpoint` handles: its drop is the endpoint's end.
struct Owner {
    shared: Arc<Shared>,
    listener: Mutex<Option<TcpListener>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

/// What the endpoint's tasks share. Tasks hold this, never an `Endpoint`,
/// so that dropping the last `Endpoint` ends them.
pub(crate) struct Shared {
    pub local: NodeAddr,
    /// How this node says hello, with its cluster secret, if any.
    pub dialer: Dialer,
    /// Connections refused for the cluster secret, and when they were
    /// last logged.
    auth_refusals: crate::auth::Refusals,
    pub config: EndpointConfig,
    pub shutdown: CancellationToken,
    admission: Arc<Admission>,
    channels: RwLock<HashMap<Channel, ChannelHandler>>,
    services: RwLock<HashMap<Service, ServiceHandler>>,
    /// Sessions this node opened, by peer. A slot lives while its session
    /// is open or a caller is opening one: [`Shared::release_slot`] removes
    /// it when the session closes and when the last opener gives up, so a
    /// peer that went away leaves nothing here.
    sessions: Mutex<BTreeMap<NodeAddr, SessionSlot>>,
    next_session: AtomicU64,
    /// Sessions running now, both those this node opened and those peers
    /// opened to it.
    live_sessions: AtomicUsize,
}

/// The session to one peer, and a lock that makes concurrent first
/// requests share one connection attempt.
#[derive(Default)]
struct SessionSlot {
    session: Option<Session>,
    opening: Arc<tokio::sync::Mutex<()>>,
}

impl Shared {
    pub fn next_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    pub fn service(&self, service: Service) -> Option<ServiceHandler> {
        let services = self.services.read().unwrap_or_else(|e| e.into_inner());
        services.get(&service).cloned()
    }

    fn channel(&self, channel: Channel) -> Option<ChannelHandler> {
        let channels = self.channels.read().unwrap_or_else(|e| e.into_inner());
        channels.get(&channel).cloned()
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeAddr, SessionSlot>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops a closed session from the table, if it is still the one there,
    /// and its slot with it unless a caller is opening a new one.
    pub fn forget_session(&self, session: &Session) {
        let mut sessions = self.lock_sessions();
        if let Some(slot) = sessions.get_mut(&session.peer())
            && slot
                .session
                .as_ref()
                .is_some_and(|s| s.id() == session.id())
        {
            slot.session = None;
        }
        Self::release_slot(&mut sessions, session.peer());
    }

    /// Removes `peer`'s slot if it holds no session and nobody holds its
    /// opening lock (the table's own reference is the only one). Callers
    /// drop their clone of the lock before calling, under the table's lock,
    /// so that of two openers finishing at once the second sees the count
    /// the first left.
    fn release_slot(sessions: &mut BTreeMap<NodeAddr, SessionSlot>, peer: NodeAddr) {
        if sessions
            .get(&peer)
            .is_some_and(|slot| slot.session.is_none() && Arc::strong_count(&slot.opening) == 1)
        {
            sessions.remove(&peer);
        }
    }

    /// A session started running (see [`Shared::session_ended`]).
    pub fn session_started(&self) {
        self.live_sessions.fetch_add(1, Ordering::Relaxed);
    }

    /// A session's task ended.
    pub fn session_ended(&self) {
        self.live_sessions.fetch_sub(1, Ordering::Relaxed);
    }

    fn live_session(&self, peer: NodeAddr) -> Option<Session> {
        let sessions = self.lock_sessions();
        let session = sessions.get(&peer)?.session.clone()?;
        (!session.is_closed()).then_some(session)
    }
}

impl Endpoint {
    /// Binds `listen` for node `node`. Peers are told `advertise` (its port
    /// 0 meaning the bound port) or, without one, the bound address, which
    /// must then not be unspecified (`0.0.0.0`, `::`). Nothing is accepted
    /// until [`Endpoint::start`].
    pub async fn bind(
        listen: SocketAddr,
        advertise: Option<SocketAddr>,
        node: NodeId,
        config: EndpointConfig,
    ) -> Result<Endpoint, EndpointError> {
        Self::bind_with_dialer(listen, advertise, config, Dialer::new(node, None)).await
    }

    /// [`Endpoint::bind`], for the node `dialer` says hello as, with its
    /// cluster secret: every connection the endpoint accepts, and every one
    /// its data planes open with [`Endpoint::dialer`] (control, data
    /// channels, identify), must prove the same secret in its hello and is
    /// refused otherwise (see [`crate::auth`]). [`Dialer::set_secret`]
    /// changes it later, for both directions.
    pub async fn bind_with_dialer(
        listen: SocketAddr,
        advertise: Option<SocketAddr>,
        config: EndpointConfig,
        dialer: Dialer,
    ) -> Result<Endpoint, EndpointError> {
        let node = dialer.id();
        if let Some(advertise) = advertise
            && advertise.ip().is_unspecified()
        {
            return Err(EndpointError::UnspecifiedAdvertise { advertise });
        }
        if advertise.is_none() && listen.ip().is_unspecified() {
            return Err(EndpointError::Unadvertised { listen });
        }
        let bind = |source| EndpointError::Bind {
            addr: listen,
            source,
        };
        let listener = TcpListener::bind(listen).await.map_err(bind)?;
        let bound = listener.local_addr().map_err(bind)?;
        let endpoint = match advertise {
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), bound.port()),
            Some(a) => a,
            None => bound,
        };
        let local = NodeAddr { id: node, endpoint };
        let shared = Arc::new(Shared {
            local,
            dialer,
            auth_refusals: crate::auth::Refusals::default(),
            config,
            shutdown: CancellationToken::new(),
            admission: Admission::new(config.limits, bound),
            channels: RwLock::default(),
            services: RwLock::default(),
            sessions: Mutex::default(),
            next_session: AtomicU64::new(1),
            live_sessions: AtomicUsize::new(0),
        });
        Ok(Endpoint(Arc::new(Owner {
            shared,
            listener: Mutex::new(Some(listener)),
        })))
    }

    /// This node as peers reach it: its id and advertised endpoint.
    pub fn local(&self) -> NodeAddr {
        self.0.shared.local
    }

    /// How this node says hello to peers' endpoints (its id, and its
    /// cluster secret): what data planes open their connections with.
    pub fn dialer(&self) -> Dialer {
        self.0.shared.dialer.clone()
    }

    /// Connections this endpoint refused for the cluster secret since it
    /// started: without one, with another, or with a wrong or replayed
    /// proof (see [`crate::auth`]).
    pub fn auth_refusals(&self) -> u64 {
        self.0.shared.auth_refusals.count()
    }

    /// The endpoint's configuration.
    pub fn config(&self) -> EndpointConfig {
        self.0.shared.config
    }

    /// The longest payload a service on its sessions may accept: the frame
    /// limit, less 1 KiB for the frame's header and what a service puts
    /// before the payload (an RPC's name).
    pub fn max_payload(&self) -> usize {
        self.0.shared.config.max_frame.saturating_sub(1024)
    }

    /// Starts accepting connections (once; later calls do nothing).
    pub fn start(&self) {
        let listener = self
            .0
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(listener) = listener {
            let bound = listener.local_addr().ok();
            info!(listen = ?bound, advertised = %self.local().endpoint, limits = ?self.config().limits, "endpoint accepting connections");
            tokio::spawn(accept_loop(self.0.shared.clone(), listener));
        }
    }

    /// Serves `channel` with `handler`: it gets each connection for the
    /// channel after its hello, and must serve it to its end (the connection
    /// counts against the limits until its [`Connection::permit`] is
    /// dropped, and is idle only while the handler says so through it).
    pub fn handle<F, Fut>(&self, channel: Channel, handler: F) -> Result<(), EndpointError>
    where
        F: Fn(Connection) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if channel == Channel::CONTROL {
            return Err(EndpointError::ChannelTaken(channel));
        }
        let mut channels = self
            .0
            .shared
            .channels
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if channels.contains_key(&channel) {
            return Err(EndpointError::ChannelTaken(channel));
        }
        channels.insert(channel, Arc::new(move |c| Box::pin(handler(c))));
        Ok(())
    }

    /// Answers requests for `service`, on every session, with `handler`.
    /// `handler` is called on the session's reader, in the order requests
    /// arrive, and must return at once: its future does the work, in a task
    /// of its own.
    pub fn serve<F, Fut>(&self, service: Service, handler: F) -> Result<(), EndpointError>
    where
        F: Fn(Request) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Bytes, ServiceError>> + Send + 'static,
    {
        let mut services = self
            .0
            .shared
            .services
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if services.contains_key(&service) {
            return Err(EndpointError::ServiceTaken(service));
        }
        let handler: ServiceHandler = Arc::new(move |r| -> ServiceFuture { Box::pin(handler(r)) });
        services.insert(service, handler);
        Ok(())
    }

    /// This node's session to `peer`: the open one, or a new one (opened
    /// within `timeout`). Concurrent callers share one attempt.
    pub async fn session(
        &self,
        peer: NodeAddr,
        timeout: Duration,
    ) -> Result<Session, ControlError> {
        let shared = &self.0.shared;
        if let Some(session) = shared.live_session(peer) {
            return Ok(session);
        }
        let deadline = Instant::now() + timeout;
        let timed_out = || ControlError::Unreachable {
            endpoint: peer.endpoint,
            reason: format!("no control session within {timeout:?}"),
        };
        let opening = shared
            .lock_sessions()
            .entry(peer)
            .or_default()
            .opening
            .clone();
        let opened = self.open_session(peer, deadline, &opening, timed_out).await;
        // However the attempt ended, a slot with no session and no other
        // opener goes (a peer that could not be reached leaves nothing).
        let mut sessions = shared.lock_sessions();
        drop(opening);
        Shared::release_slot(&mut sessions, peer);
        opened
    }

    /// Opens a session to `peer` by `deadline`, one caller at a time per
    /// peer (`opening`); a caller that waited finds the session its
    /// predecessor opened.
    async fn open_session(
        &self,
        peer: NodeAddr,
        deadline: Instant,
        opening: &tokio::sync::Mutex<()>,
        timed_out: impl Fn() -> ControlError,
    ) -> Result<Session, ControlError> {
        let shared = &self.0.shared;
        let _turn = tokio::time::timeout_at(deadline, opening.lock())
            .await
            .map_err(|_| timed_out())?;
        // Another caller may have opened it while this one waited.
        if let Some(session) = shared.live_session(peer) {
            return Ok(session);
        }
        let open = async {
            let greeted = shared.dialer.connect(peer, Channel::CONTROL).await?;
            session::start(
                shared,
                greeted.stream,
                greeted.auth,
                session::Side::Opened(peer),
            )
            .await
        };
        let (session, _task) = tokio::select! {
            opened = tokio::time::timeout_at(deadline, open) => opened.map_err(|_| timed_out())??,
            _ = shared.shutdown.cancelled() => {
                return Err(ControlError::SessionClosed { endpoint: peer.endpoint });
            }
        };
        // Recorded while this caller still holds the turn, so the next one
        // finds it. A session that already closed is not: its task has
        // already forgotten it (it marks itself closed first), and nothing
        // would take it out again.
        let mut sessions = shared.lock_sessions();
        if !session.is_closed() {
            sessions.entry(peer).or_default().session = Some(session.clone());
        }
        Ok(session)
    }

    /// How many peers have an entry in this node's table of sessions it
    /// opened (open, or being opened now). Each entry goes when its session
    /// closes (the peer shut down, vanished, or broke the protocol: at the
    /// latest when keepalive gives up on a silent peer, after the peer
    /// timeout, see [`crate::DEFAULT_PEER_TIMEOUT`]) or when the last caller opening it
    /// fails. For leak checks and `ferry info`.
    pub fn session_table_len(&self) -> usize {
        self.0.shared.lock_sessions().len()
    }

    /// Control sessions running now, in both directions (opened by this
    /// node or by peers). A session's count goes when its task has ended.
    pub fn live_sessions(&self) -> usize {
        self.0.shared.live_sessions.load(Ordering::Relaxed)
    }

    /// Accepted connections open now (control and data channels, counted
    /// against [`ConnectionLimits`]); each is released when its connection
    /// task ends.
    pub fn accepted_connections(&self) -> usize {
        self.0.shared.admission.open_total()
    }

    /// Stops accepting, and ends every session and connection.
    pub fn shutdown(&self) {
        self.0.shared.shutdown.cancel();
    }
}

/// Accepts until shutdown; each admitted connection runs in a task of the
/// loop's set, so that shutdown ends them all.
async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut connections = JoinSet::new();
    let mut last_accept_error: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shared.shutdown.cancelled() => break,
        };
        // Reap finished connection tasks so the set does not grow forever.
        while connections.try_join_next().is_some() {}
        match accepted {
            Ok((stream, remote)) => {
                // Over a bound with nothing idle to make room: told so and
                // closed, before it costs a task or a buffer.
                let Some(permit) = shared.admission.admit(remote.ip()) else {
                    crate::hello::refuse_busy(&stream);
                    continue;
                };
                let shared = shared.clone();
                connections.spawn(async move {
                    serve_connection(&shared, stream, remote, permit).await;
                });
            }
            // Out of descriptors, most likely: transient. Back off instead of
            // spinning, and say so at most every few seconds.
            Err(e) => {
                if last_accept_error.is_none_or(|at| at.elapsed() > Duration::from_secs(10)) {
                    warn!(endpoint = %shared.local.endpoint, error = %e, "accept failed; retrying");
                    last_accept_error = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    connections.shutdown().await;
}

/// The hello (the connection idle until it has come), then the channel: a
/// control session served here, holding `permit` while it lasts, or the
/// registered data plane's handler, which gets `permit`.
async fn serve_connection(
    shared: &Arc<Shared>,
    mut stream: TcpStream,
    remote: SocketAddr,
    permit: ConnectionPermit,
) {
    if let Err(e) = crate::socket::configure(&stream) {
        debug!(%remote, error = %e, "cannot configure an accepted connection");
        return;
    }
    let me = shared.local.id;
    let serves = |channel| channel == Channel::CONTROL || shared.channel(channel).is_some();
    let hello = permit
        .idle_within(
            shared.config.limits.hello_timeout,
            crate::hello::accept(&mut stream, me, shared.dialer.secret().as_ref(), serves),
        )
        .await;
    let (hello, keys) = match hello {
        Ok(Ok(hello)) => hello,
        Ok(Err(e)) if e.is_auth() => return shared.auth_refusals.refused(&remote, &e),
        Ok(Err(e)) => return debug!(%remote, error = %e, "hello failed"),
        Err(IdleClose::TimedOut(_)) => {
            return debug!(%remote, "no hello within the deadline; disconnected");
        }
        Err(e) => return debug!(%remote, "before its hello: {e}"),
    };
    let auth = keys.map(|keys| Authenticated::track(&shared.dialer.secret_cell(), keys));
    if hello.channel == Channel::CONTROL {
        // The connection and its permit last as long as the session: idle
        // while the peer stalls inside a frame, and between frames (then
        // only evictable: the session has its own liveness).
        let permit = Arc::new(permit);
        let opened = tokio::time::timeout(
            shared.config.limits.hello_timeout,
            session::start(
                shared,
                stream,
                auth,
                session::Side::Accepted {
                    hello: hello.node,
                    permit: permit.clone(),
                },
            ),
        )
        .await;
        match opened {
            Ok(Ok((_, task))) => drop(task.await),
            Ok(Err(e)) => warn!(%remote, node = %hello.node, "control session refused: {e}"),
            Err(_) => debug!(%remote, "no session Open within the deadline; disconnected"),
        }
        return;
    }
    let Some(handler) = shared.channel(hello.channel) else {
        return;
    };
    handler(Connection {
        stream,
        node: hello.node,
        auth,
        remote,
        permit,
    })
    .await;
}
