//! Messages and notifications between nodes, and where they are
//! delivered: each node has one bounded inbox that its application drains
//! (as a stream of deliveries, or forwarded to a kameo actor by the
//! facade).
//!
//! A notification is a message that says a batch of transfers into (or
//! out of) this node's memory is complete, so the data is in place when it
//! is delivered. It arrives one of two ways: on a data channel, right
//! behind the transfers it announces, offered to the inbox without waiting
//! ([`Messages::offer_notification`]); or, once the sender has seen the
//! batch complete, as its own service ([`Service::NOTIFY`]) in the same
//! line as messages, waiting for room like them. Notifications and
//! messages of one sender are therefore not ordered with respect to each
//! other.
//!
//! A message is one request of the session's [`Service::MESSAGE`]. The
//! receiver answers it once the message is in its inbox, so a sender's `Ok`
//! means delivered. Every message waits for room in the inbox until its
//! deadline; a full inbox (nobody consuming) thus holds senders back, and a
//! sender whose deadline passes gets `Timeout` and its message is not
//! delivered. Messages from one sender keep their order: each session
//! queues them, in arrival order, for one task that delivers them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_core::NodeAddr;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::{ControlError, Endpoint, EndpointError, Request, Service, ServiceError, Session};

/// Default bound on a message's length, in bytes.
pub const DEFAULT_MAX_MESSAGE: usize = 64 << 10;
/// Default number of deliveries an inbox holds before senders wait.
pub const DEFAULT_INBOX_CAPACITY: usize = 1024;

/// What a delivery is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeliveryKind {
    /// A message sent on its own.
    Message,
    /// The notification of a batch of transfers that completed on this
    /// node's memory (for writes: the bytes are in place).
    Notification,
}

/// Something a peer sent this node.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// The sender, as its control session names it.
    /// Its `id` is the one the connection's hello named: proved, where the
    /// nodes hold a cluster secret (a member cannot name another node), a
    /// claim otherwise. Its `endpoint` is the address the sender
    /// advertises, as it says: not checked against the connection's source
    /// address, which differs behind NAT or for a node listening on every
    /// interface. Reply to `from` as to any node; decide whom to trust by
    /// `id`, under a secret.
    pub from: NodeAddr,
    /// A message, or a notification.
    pub kind: DeliveryKind,
    /// What it sent.
    pub body: Bytes,
}

/// Why a message was not delivered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// Over the limit: refused before any byte was sent.
    #[error("message of {len} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// The message's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Not delivered within the deadline (the peer's inbox stayed full, or
    /// the peer did not answer); the message is dropped on the peer.
    #[error("message to {peer} not delivered within {after:?}")]
    Timeout {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// The deadline.
        after: Duration,
    },
    /// No control session to the peer could be opened.
    #[error("peer {peer} unreachable: {reason}")]
    Unreachable {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The peer and this node do not hold the same cluster secret: nothing
    /// was sent.
    #[error("{peer} refused: {reason}")]
    AuthFailed {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// Which side lacks what.
        reason: crate::AuthFailure,
    },
    /// The session ended before the peer confirmed delivery.
    #[error("connection to {peer} lost before the message was confirmed")]
    ConnectionLost {
        /// The peer's endpoint.
        peer: SocketAddr,
    },
    /// The peer refused the message: it is shutting down, or serves none.
    #[error("{peer} refused the message: {reason}")]
    Refused {
        /// The peer's endpoint.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The peer has as many requests of this node in flight as it allows.
    #[error("{peer} is busy: too many requests in flight")]
    Busy {
        /// The peer's endpoint.
        peer: SocketAddr,
    },
    /// This node was shut down: it sends nothing any more.
    #[error("the node was shut down: it sends no messages")]
    ShutDown,
    /// The node's actor did not take or answer the send (stopped, crashed,
    /// restarting): nothing was sent. Only from asking a node's actor,
    /// through the conversion from kameo's `SendError` that lets
    /// `actor.ask(send).await?` return a `MessageError`.
    #[error("the node's actor is not running: the message was not sent")]
    NodeStopped,
}

impl<M> From<kameo::error::SendError<M, MessageError>> for MessageError {
    /// The handler's error as it is; an actor that did not take or answer
    /// the message as [`MessageError::NodeStopped`].
    fn from(e: kameo::error::SendError<M, MessageError>) -> Self {
        match e {
            kameo::error::SendError::HandlerError(e) => e,
            _ => MessageError::NodeStopped,
        }
    }
}

/// The receiving end of a node's inbox: deliveries in the order they were
/// accepted. A [`futures_core::Stream`], or drained with [`Inbox::recv`].
#[derive(Debug)]
pub struct Inbox {
    /// A delivery given back ([`Inbox::put_back`]): it comes next.
    head: Option<Delivery>,
    receiver: mpsc::Receiver<Delivery>,
}

impl Inbox {
    /// The next delivery; waits for one. `None` once the node has stopped.
    pub async fn recv(&mut self) -> Option<Delivery> {
        match self.head.take() {
            Some(delivery) => Some(delivery),
            None => self.receiver.recv().await,
        }
    }

    /// The next delivery if one is waiting.
    pub fn try_recv(&mut self) -> Option<Delivery> {
        self.head.take().or_else(|| self.receiver.try_recv().ok())
    }

    /// Puts a delivery its consumer could not take back at the front, so
    /// that the next consumer gets it first: nothing is lost.
    pub fn put_back(&mut self, delivery: Delivery) {
        debug_assert!(self.head.is_none(), "one delivery at a time is taken");
        self.head = Some(delivery);
    }
}

impl futures_core::Stream for Inbox {
    type Item = Delivery;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Delivery>> {
        match self.head.take() {
            Some(delivery) => std::task::Poll::Ready(Some(delivery)),
            None => self.receiver.poll_recv(cx),
        }
    }
}

/// Why [`Messages::offer_notification`] did not deliver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OfferError {
    /// The inbox is full right now.
    #[error("the inbox is full")]
    Full,
    /// The node is shutting down.
    #[error("the node is shutting down")]
    Closed,
}

/// The inbox, as a data plane that receives notifications behind their
/// transfers sees it: on its own receive buffers (the ibverbs queue pairs),
/// where a notification is already accepted when it arrives, and waits
/// here for room. Made by [`Messages::notification_sink`]. Cheap to clone.
#[derive(Clone)]
pub struct NotificationSink {
    inbox: mpsc::Sender<Delivery>,
    max_len: usize,
}

impl NotificationSink {
    /// The node's bound on a notification's length, in bytes.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Delivers `body` if the inbox has room now.
    pub fn offer(&self, from: NodeAddr, body: Bytes) -> Result<(), OfferError> {
        self.inbox
            .try_send(notification(from, body))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => OfferError::Full,
                mpsc::error::TrySendError::Closed(_) => OfferError::Closed,
            })
    }

    /// Delivers `body`, waiting for room for as long as the inbox exists:
    /// for a notification already accepted, whose sender was told so. Fails
    /// only with [`OfferError::Closed`], once the node's inbox is gone.
    pub async fn deliver(&self, from: NodeAddr, body: Bytes) -> Result<(), OfferError> {
        self.inbox
            .send(notification(from, body))
            .await
            .map_err(|_| OfferError::Closed)
    }
}

fn notification(from: NodeAddr, body: Bytes) -> Delivery {
    Delivery {
        from,
        kind: DeliveryKind::Notification,
        body,
    }
}

/// A message waiting, in its session's line, for room in the inbox.
struct Queued {
    delivery: Delivery,
    deadline: Instant,
    delivered: oneshot::Sender<Result<(), ServiceError>>,
}

/// A node's messages: sending, and the inbox they are delivered to.
pub struct Messages {
    endpoint: Endpoint,
    max_len: usize,
    inbox: mpsc::Sender<Delivery>,
    /// The receiving end, until the application takes it.
    receiver: Mutex<Option<Inbox>>,
    /// Per session (by id), the line its messages wait in. A line's task
    /// removes its entry when it ends, which is when its session closes.
    lines: Arc<Lines>,
}

/// Sessions' lines, by session id.
type Lines = Mutex<HashMap<u64, mpsc::UnboundedSender<Queued>>>;

impl Messages {
    /// Serves messages on `endpoint`'s sessions into an inbox of `capacity`
    /// deliveries; messages are bounded by `max_len` bytes (and by the
    /// endpoint's frame limit).
    pub fn start(
        endpoint: &Endpoint,
        max_len: usize,
        capacity: usize,
    ) -> Result<Arc<Self>, EndpointError> {
        let (inbox, receiver) = mpsc::channel(capacity.max(1));
        let messages = Arc::new(Messages {
            endpoint: endpoint.clone(),
            max_len: max_len.min(endpoint.max_payload()),
            inbox,
            receiver: Mutex::new(Some(Inbox {
                head: None,
                receiver,
            })),
            lines: Arc::default(),
        });
        for (service, kind) in [
            (Service::MESSAGE, DeliveryKind::Message),
            (Service::NOTIFY, DeliveryKind::Notification),
        ] {
            // Weak: the endpoint holds its handlers, and must not keep this
            // alive.
            let weak = Arc::downgrade(&messages);
            endpoint.serve(service, move |request| {
                // This node's own limit holds whatever the sender's is.
                let refused = weak
                    .upgrade()
                    .filter(|m| request.body.len() > m.max_len)
                    .map(|m| too_large(request.body.len(), m.max_len));
                // Called in arrival order: the message takes its place in
                // line here, before the handler returns.
                let delivered = match refused {
                    Some(_) => None,
                    None => weak.upgrade().map(|m| m.queue(request, kind)),
                };
                async move {
                    if let Some(refused) = refused {
                        return Err(refused);
                    }
                    let Some(delivered) = delivered else {
                        return Err(ServiceError("the node is shutting down".into()));
                    };
                    match delivered.await {
                        Ok(outcome) => outcome.map(|()| Bytes::new()),
                        // Not delivered by its deadline (or its session
                        // ended): the session answers `DeadlineExceeded`
                        // (or nothing).
                        Err(_) => std::future::pending().await,
                    }
                }
            })?;
        }
        Ok(messages)
    }

    /// Sessions with a line of messages here: one per session a message
    /// arrived on, released when that session closes. For leak checks and
    /// `ferry info`.
    pub fn lines(&self) -> usize {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The bound on a message's length, in bytes.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The inbox's receiving end; `None` while taken (there is one).
    pub fn take_inbox(&self) -> Option<Inbox> {
        self.receiver
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Gives the inbox back (a subscriber that stopped), for the next
    /// [`Messages::take_inbox`].
    pub fn return_inbox(&self, inbox: Inbox) {
        *self.receiver.lock().unwrap_or_else(|e| e.into_inner()) = Some(inbox);
    }

    /// Sends `body` to `peer`: `Ok` once it is in the peer's inbox, or a
    /// typed error within `timeout` (opening the session counts against it).
    pub async fn send(
        &self,
        peer: NodeAddr,
        body: Bytes,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        self.deliver(peer, DeliveryKind::Message, body, timeout)
            .await
    }

    /// Sends `body` to `peer` as a notification; the caller vouches that
    /// the transfers it announces have completed. As [`Messages::send`].
    pub async fn notify(
        &self,
        peer: NodeAddr,
        body: Bytes,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        self.deliver(peer, DeliveryKind::Notification, body, timeout)
            .await
    }

    async fn deliver(
        &self,
        peer: NodeAddr,
        kind: DeliveryKind,
        body: Bytes,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        if body.len() > self.max_len {
            return Err(MessageError::TooLarge {
                len: body.len(),
                limit: self.max_len,
            });
        }
        let deadline = Instant::now() + timeout;
        let error = |e: ControlError| send_error(e, timeout);
        let session = self.endpoint.session(peer, timeout).await.map_err(error)?;
        let left = deadline.saturating_duration_since(Instant::now());
        session
            .request(
                match kind {
                    DeliveryKind::Message => Service::MESSAGE,
                    DeliveryKind::Notification => Service::NOTIFY,
                },
                body,
                left,
            )
            .await
            .map(|_| ())
            .map_err(error)
    }

    /// Delivers a notification that arrived on a data channel (behind the
    /// transfers it announces) if the inbox has room now. It never waits:
    /// a data connection must not stall on a consumer, so a sender told
    /// [`OfferError::Full`] waits for room over its control session.
    pub fn offer_notification(&self, from: NodeAddr, body: Bytes) -> Result<(), OfferError> {
        self.notification_sink().offer(from, body)
    }

    /// Where a data plane hands the notifications it receives itself. It
    /// does not keep this node's messages alive.
    pub fn notification_sink(&self) -> NotificationSink {
        NotificationSink {
            inbox: self.inbox.clone(),
            max_len: self.max_len,
        }
    }

    /// Puts a message in its session's line; resolves once it is delivered
    /// (or its deadline passed).
    fn queue(
        &self,
        request: Request,
        kind: DeliveryKind,
    ) -> oneshot::Receiver<Result<(), ServiceError>> {
        let (delivered, outcome) = oneshot::channel();
        let queued = Queued {
            delivery: Delivery {
                from: request.session.peer(),
                kind,
                body: request.body,
            },
            deadline: request.deadline,
            delivered,
        };
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let line = lines.entry(request.session.id()).or_insert_with(|| {
            let (line, waiting) = mpsc::unbounded_channel();
            let session = request.session.clone();
            let all = Arc::downgrade(&self.lines);
            let inbox = self.inbox.clone();
            tokio::spawn(async move {
                let id = session.id();
                deliver_in_order(waiting, inbox, session).await;
                // Its session has ended (ids are never reused): nothing more
                // can come down this line.
                if let Some(all) = all.upgrade() {
                    all.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                }
            });
            line
        });
        // The line's task ends only when its session has ended.
        let _ = line.send(queued);
        outcome
    }
}

/// Delivers one session's messages in the order they arrived, each
/// waiting for room until its deadline. The number waiting is bounded by
/// the session's limit on requests in flight.
async fn deliver_in_order(
    mut waiting: mpsc::UnboundedReceiver<Queued>,
    inbox: mpsc::Sender<Delivery>,
    session: Session,
) {
    loop {
        let queued = tokio::select! {
            biased;
            queued = waiting.recv() => match queued {
                Some(queued) => queued,
                None => return,
            },
            _ = session.closed() => return,
        };
        // A message whose sender gave up (cancelled, or the session ended)
        // is not delivered.
        if queued.delivered.is_closed() {
            continue;
        }
        let outcome = match tokio::time::timeout_at(queued.deadline, inbox.reserve()).await {
            Ok(Ok(room)) if !queued.delivered.is_closed() => {
                room.send(queued.delivery);
                Ok(())
            }
            Ok(Ok(_)) => continue,
            Ok(Err(_)) => Err(ServiceError("the node is shutting down".into())),
            // The inbox stayed full: dropped undelivered; the session
            // answers the sender `DeadlineExceeded`.
            Err(_) => continue,
        };
        let _ = queued.delivered.send(outcome);
    }
}

/// What a send learns from its session.
/// How an owner refuses a message over its limit; the sender reads it
/// back as [`MessageError::TooLarge`].
const TOO_LARGE: &str = "over the receiver's message limit: ";

fn too_large(len: usize, limit: usize) -> ServiceError {
    ServiceError(format!("{TOO_LARGE}{len} > {limit}"))
}

/// The `(len, limit)` of an owner's [`too_large`] refusal.
fn parse_too_large(message: &str) -> Option<(usize, usize)> {
    let (len, limit) = message.strip_prefix(TOO_LARGE)?.split_once(" > ")?;
    Some((len.parse().ok()?, limit.parse().ok()?))
}

fn send_error(e: ControlError, timeout: Duration) -> MessageError {
    let peer = e.endpoint();
    if let ControlError::Failed { message, .. } = &e
        && let Some((len, limit)) = parse_too_large(message)
    {
        return MessageError::TooLarge { len, limit };
    }
    match e {
        ControlError::Timeout { .. } => MessageError::Timeout {
            peer,
            after: timeout,
        },
        ControlError::SessionClosed { .. } => MessageError::ConnectionLost { peer },
        ControlError::AuthFailed { reason, .. } => MessageError::AuthFailed { peer, reason },
        ControlError::Busy { .. } => MessageError::Busy { peer },
        ControlError::Failed { message, .. } => MessageError::Refused {
            peer,
            reason: message,
        },
        ControlError::NoSuchService { .. } => MessageError::Refused {
            peer,
            reason: "it serves no messages".into(),
        },
        other => MessageError::Unreachable {
            peer,
            reason: other.to_string(),
        },
    }
}
