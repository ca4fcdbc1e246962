//! Messages and notifications between nodes, the facade's side: sending
//! (from a [`Node`] or through its actor), notifying the owners of a
//! batch's remote memory once it has completed, and receiving, the plain
//! way (the node's [`Inbox`], a stream) or the kameo way (every delivery
//! told to a subscribed actor). Delivery itself is in
//! [`ferry_control::inbox`].

use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Delivery, Inbox, MessageError, Messages};
use ferry_core::{
    DataPathNotification, NodeAddr, OpError, RdmaOp, RdmaTransportLevel, SubmitError,
};
use ferry_tcp::frame::NotifyOutcome;
use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::error::SendError;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::meters::Submitted;
use crate::router::Router;
use crate::{IntoBody, Node, NodeActor};

/// Why a submit with a notification failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    /// The batch failed or timed out; no notification was sent.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The notification is over the message limit: refused before any op
    /// of the batch ran.
    #[error("notification of {len} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// The notification's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The batch completed, but this owner did not accept its notification
    /// (within the deadline, or at all).
    #[error("transfers done, but the notification to {} failed: {error}", owner.endpoint)]
    Notification {
        /// The owner not notified.
        owner: NodeAddr,
        /// Why.
        error: MessageError,
    },
}

impl<M> From<SendError<M, NotifyError>> for NotifyError {
    /// The handler's error as it is; a node actor that did not take or
    /// answer [`SubmitWithNotification`] as [`SubmitError::BackendStopped`]
    /// (nothing ran, nobody was notified), so `actor.ask(msg).await?` works.
    fn from(e: SendError<M, NotifyError>) -> Self {
        match e {
            SendError::HandlerError(e) => e,
            _ => NotifyError::Submit(SubmitError::BackendStopped),
        }
    }
}

/// The node's inbox has a consumer already: it has one at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the node's inbox is taken: it has one consumer at a time")]
pub struct InboxTaken;

impl Node {
    /// Runs `ops` as [`Node::submit`] does and then delivers `notification`
    /// to the inbox of every node whose memory the ops touch, each once,
    /// and only after every op of the batch has completed: for writes, the
    /// bytes are in the owner's memory when its application sees the
    /// notification; for reads, the reads are done (the owner may reuse the
    /// memory). `Ok` once every owner has accepted its notification, all
    /// within `timeout`: it is in the owner's inbox, or in a buffer the
    /// owner set aside for it (the receive buffers and lanes below), from
    /// which the owner moves it to the inbox, waiting for room as long as
    /// it takes (unless the owner stops first). A batch that fails or times out notifies nobody
    /// (except where the deadline passes just after the notification left:
    /// like any send that times out, it may still arrive).
    ///
    /// A batch to a single owner carries its notification behind its data,
    /// at no extra round trip: over TCP on the data connection after its
    /// chunks; over ibverbs as a SEND on the queue pair after its work
    /// requests, into receive buffers the owner posted for it (which add
    /// up to `IbvConfig::notify_slots` notifications per initiator to the
    /// inbox's capacity before senders are held back); over the same-host
    /// memory transport in a ring the two processes share, once the copies
    /// are done (which adds up to [`ferry_memory::LANE_SLOTS`] notifications of
    /// at most [`ferry_memory::LANE_MAX_NOTIFICATION`] bytes). Batches over several
    /// owners, or over several transports, notify over the control session
    /// once they have completed; so does a notification the data path has
    /// no room for, and may then overtake earlier notifications still
    /// waiting on the data path. Notifications and messages are not ordered
    /// with each other.
    pub async fn submit_with_notification(
        &self,
        ops: Vec<RdmaOp>,
        timeout: Duration,
        notification: impl IntoBody,
    ) -> Result<(), NotifyError> {
        submit_with_notification(&self.0.router, ops, timeout, notification.into_body()).await
    }

    /// Sends `body` to `peer`'s inbox: `Ok` once it is there, or a typed
    /// error within `timeout`. Messages from one node to another arrive in
    /// the order they were sent; a full inbox holds the sender back until
    /// its deadline (then `Timeout`, and the message is not delivered).
    ///
    /// "Sent" is when a send takes its turn on the session, during its
    /// first polls: sends awaited one after another keep their order, and
    /// so do concurrent ones polled in a fixed order on every wake-up.
    /// Sends in separate tasks, or in a `FuturesUnordered` (what
    /// `join_all` uses past 30 futures), are polled in the order they were
    /// woken, and may overtake each other.
    pub async fn send_message(
        &self,
        peer: NodeAddr,
        body: impl IntoBody,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        self.0
            .router
            .send_message(peer, body.into_body(), timeout)
            .await
    }

    /// Sends `body` to `peer` as a notification on its own (NIXL's
    /// `send_notif`): the peer's inbox gets it as a
    /// [`DeliveryKind::Notification`](crate::DeliveryKind::Notification),
    /// as if a batch of no ops announced it. Otherwise as
    /// [`Node::send_message`], with which it is not ordered.
    pub async fn notify(
        &self,
        peer: NodeAddr,
        body: impl IntoBody,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        let router = &self.0.router;
        if router.is_shut_down() {
            return Err(MessageError::ShutDown);
        }
        router
            .messages
            .notify(peer, body.into_body(), timeout)
            .await
    }

    /// The node's inbox, for a task that pulls deliveries (a stream); give
    /// it back with [`Node::return_inbox`] for another consumer. Fails
    /// while another consumer (or a subscribed actor) has it.
    pub fn inbox(&self) -> Result<Inbox, InboxTaken> {
        self.0.router.messages.take_inbox().ok_or(InboxTaken)
    }

    /// Gives the inbox back, deliveries it still holds included.
    pub fn return_inbox(&self, inbox: Inbox) {
        self.0.router.messages.return_inbox(inbox);
    }

    /// Tells every delivery to `actor`, in order. Its mailbox bounds how
    /// many wait for it; when full, senders are held back. If the actor
    /// stops, the delivery it did not take stays first in the inbox, which
    /// goes back to the node for the next consumer. Fails while another
    /// consumer has the inbox.
    pub fn subscribe<A>(&self, actor: ActorRef<A>) -> Result<(), InboxTaken>
    where
        A: Actor + Message<Delivery>,
    {
        let mut inbox = self.inbox()?;
        let messages = std::sync::Arc::downgrade(&self.0.router.messages);
        tokio::spawn(async move {
            while let Some(delivery) = inbox.recv().await {
                match actor.tell(delivery).await {
                    Ok(()) => continue,
                    Err(SendError::ActorNotRunning(delivery))
                    | Err(SendError::ActorRestarting(delivery))
                    | Err(SendError::MailboxFull(delivery)) => inbox.put_back(delivery),
                    // Not returned by kameo: say so rather than lose it quietly.
                    Err(e) => warn!(actor = %actor.id(), "a delivery was lost telling it: {e}"),
                }
                warn!(actor = %actor.id(), "the inbox's subscriber stopped; its deliveries wait for the next consumer");
                if let Some(messages) = messages.upgrade() {
                    messages.return_inbox(inbox);
                }
                return;
            }
        });
        Ok(())
    }
}

impl Router {
    /// See [`Node::send_message`].
    pub(crate) async fn send_message(
        &self,
        peer: NodeAddr,
        body: Bytes,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        if self.is_shut_down() {
            return Err(MessageError::ShutDown);
        }
        self.messages.send(peer, body, timeout).await
    }
}

/// See [`Node::submit_with_notification`].
pub(crate) async fn submit_with_notification(
    router: &Router,
    ops: Vec<RdmaOp>,
    timeout: Duration,
    notification: Bytes,
) -> Result<(), NotifyError> {
    if router.is_shut_down() {
        return Err(SubmitError::ShutDown.into());
    }
    let messages = &router.messages;
    if notification.len() > messages.max_len() {
        return Err(NotifyError::TooLarge {
            len: notification.len(),
            limit: messages.max_len(),
        });
    }
    let deadline = Instant::now() + timeout;
    let mut owners: Vec<NodeAddr> = Vec::with_capacity(1);
    for op in &ops {
        let owner = op.remote.owner();
        if !owners.contains(&owner) {
            owners.push(owner);
        }
    }
    // One owner knows by itself whether the batch succeeded: its
    // notification can follow the data. Several must each hear only once
    // all have succeeded, which the initiator learns first.
    if let [owner] = owners[..] {
        let route = router.route(&ops[0]);
        if ops.iter().all(|op| router.route(op) == route) {
            match route {
                Some(RdmaTransportLevel::Tcp) => {
                    return notify_behind_tcp(router, ops, timeout, notification).await;
                }
                Some(RdmaTransportLevel::Nic) => {
                    if router.no_rail_reaches(owner, &ops, timeout).await {
                        let left = deadline.saturating_duration_since(Instant::now());
                        return notify_behind_tcp(router, ops, left, notification).await;
                    }
                    return notify_on_qp(router, owner, ops, timeout, notification).await;
                }
                Some(RdmaTransportLevel::Memory) => {
                    return notify_in_memory(router, owner, ops, timeout, notification).await;
                }
                None => {}
            }
        }
    }
    router.submit(ops, timeout).await?;
    // The batch is complete on every owner: now tell them, at once.
    notify_over_control(messages, owners, notification, deadline, timeout, "mixed").await
}

/// Notifies each of `owners` over its control session, all at once, with
/// what is left until `deadline` of the submit's `timeout`; counted under
/// `transport`.
async fn notify_over_control(
    messages: &Messages,
    owners: Vec<NodeAddr>,
    notification: Bytes,
    deadline: Instant,
    timeout: Duration,
    transport: &'static str,
) -> Result<(), NotifyError> {
    notification_path(transport, "control", owners.len());
    let left = deadline.saturating_duration_since(Instant::now());
    let notified = futures_util::future::join_all(owners.into_iter().map(|owner| {
        let notification = notification.clone();
        async move {
            messages
                .notify(owner, notification, left)
                .await
                .map_err(|error| notification_failed(owner, error, timeout))
        }
    }))
    .await;
    notified.into_iter().collect()
}

/// A notification not delivered to `owner`; a timeout names the submit's
/// whole deadline, of which the notification had what was left.
fn notification_failed(owner: NodeAddr, error: MessageError, timeout: Duration) -> NotifyError {
    let error = match error {
        MessageError::Timeout { peer, .. } => MessageError::Timeout {
            peer,
            after: timeout,
        },
        other => other,
    };
    NotifyError::Notification { owner, error }
}

/// A batch all over TCP: the owner's notification follows its chunks on
/// their connection, so it costs no round trip of its own, and the owner
/// drops it if it refused a chunk. An owner whose inbox was full gets it
/// over the control session instead, where the sender waits for room until
/// the deadline.
async fn notify_behind_tcp(
    router: &Router,
    ops: Vec<RdmaOp>,
    timeout: Duration,
    notification: Bytes,
) -> Result<(), NotifyError> {
    let deadline = Instant::now() + timeout;
    let submitted = Submitted::new(&ops);
    let result = router
        .tcp
        .submit_notified(ops, timeout, notification.clone())
        .await;
    submitted.finish(
        &router.tcp_meters,
        &result.as_ref().map(|_| ()).map_err(Clone::clone),
    );
    let mut waiting = Vec::new();
    for (owner, outcome) in result? {
        let peer = owner.endpoint;
        let error = match outcome {
            Ok(NotifyOutcome::Delivered) => {
                notification_path("tcp", "data", 1);
                continue;
            }
            Ok(NotifyOutcome::InboxFull) => {
                waiting.push(owner);
                continue;
            }
            Ok(NotifyOutcome::TooLarge { limit }) => MessageError::TooLarge {
                len: notification.len(),
                limit: usize::try_from(limit).unwrap_or(usize::MAX),
            },
            Ok(NotifyOutcome::NoInbox) => MessageError::Refused {
                peer,
                reason: "it takes no notifications (it is shutting down)".into(),
            },
            // Only ever the answer to a failed batch, which is not `Ok`.
            Ok(other @ (NotifyOutcome::BatchFailed | NotifyOutcome::Discarded)) => {
                MessageError::Refused {
                    peer,
                    reason: format!("it answered {other:?} for a batch that succeeded"),
                }
            }
            Err(e) => undelivered(owner, e),
        };
        return Err(NotifyError::Notification { owner, error });
    }
    notify_over_control(
        &router.messages,
        waiting,
        notification,
        deadline,
        timeout,
        "tcp",
    )
    .await
}

/// A batch all over ibverbs to one owner: its notification is a SEND on
/// the owner's queue pair behind the batch's work requests. One the queue
/// pair had no room for goes over the control session, once the batch has
/// completed.
async fn notify_on_qp(
    router: &Router,
    owner: NodeAddr,
    ops: Vec<RdmaOp>,
    timeout: Duration,
    notification: Bytes,
) -> Result<(), NotifyError> {
    let Some(ibverbs) = &router.ibverbs else {
        return Err(SubmitError::BackendStopped.into());
    };
    let deadline = Instant::now() + timeout;
    let submitted = Submitted::new(&ops);
    let result = ibverbs
        .submit_notified(ops, timeout, notification.clone())
        .await;
    submitted.finish(
        &router.ibverbs_meters,
        &result.as_ref().map(|_| ()).map_err(Clone::clone),
    );
    let sent = result?;
    after_data_path(
        router,
        owner,
        notification,
        deadline,
        timeout,
        "ibverbs",
        sent,
    )
    .await
}

/// A batch all over the same-host memory transport to one owner: once its
/// copies are done here, the notification goes in the ring the owner
/// reads (its lane), with no round trip. One the ring has no room for goes
/// over the control session.
async fn notify_in_memory(
    router: &Router,
    owner: NodeAddr,
    ops: Vec<RdmaOp>,
    timeout: Duration,
    notification: Bytes,
) -> Result<(), NotifyError> {
    let Some(memory) = &router.memory else {
        return Err(SubmitError::BackendStopped.into());
    };
    let deadline = Instant::now() + timeout;
    router.submit(ops, timeout).await?;
    let sent = memory
        .notify(owner, router.addr(), &notification, deadline)
        .await;
    after_data_path(
        router,
        owner,
        notification,
        deadline,
        timeout,
        "memory",
        sent,
    )
    .await
}

/// Finishes a notification the `transport`'s data path handled as `sent`:
/// counted when it went, sent over the control session when it did not,
/// an error when it may have arrived (sending it again could deliver it
/// twice).
async fn after_data_path(
    router: &Router,
    owner: NodeAddr,
    notification: Bytes,
    deadline: Instant,
    timeout: Duration,
    transport: &'static str,
    sent: DataPathNotification,
) -> Result<(), NotifyError> {
    match sent {
        DataPathNotification::Accepted => {
            notification_path(transport, "data", 1);
            Ok(())
        }
        DataPathNotification::NotSent => {
            // Slower (a round trip after the batch): worth seeing when a
            // consumer's pace, or the payload size, sends many this way.
            debug!(owner = %owner.endpoint, transport, "notification not sent on the data path: over the control session");
            notify_over_control(
                &router.messages,
                vec![owner],
                notification,
                deadline,
                timeout,
                transport,
            )
            .await
        }
        DataPathNotification::Failed(error) => Err(NotifyError::Notification {
            owner,
            error: undelivered(owner, error),
        }),
    }
}

/// Counts `count` notifications a submit sent, by `transport` and the
/// `path` they took: behind the batch on the data path, or over the control
/// session (`mixed`: a batch over several transports or owners).
fn notification_path(transport: &'static str, path: &'static str, count: usize) {
    metrics::counter!("ferry_notifications_sent_total", "transport" => transport, "path" => path)
        .increment(count as u64);
}

/// A notification the data path failed to carry to `owner`, as the
/// message error it is.
fn undelivered(owner: NodeAddr, error: OpError) -> MessageError {
    let peer = owner.endpoint;
    match error {
        OpError::ConnectionLost { .. } => MessageError::ConnectionLost { peer },
        e => MessageError::Unreachable {
            peer,
            reason: e.to_string(),
        },
    }
}

/// Send a message to a peer's inbox through the node's actor (as
/// [`Node::send_message`]).
#[derive(Clone, Debug)]
pub struct SendMessage {
    /// The peer.
    pub peer: NodeAddr,
    /// The message.
    pub body: Bytes,
    /// How long to wait for delivery.
    pub timeout: Duration,
}

impl SendMessage {
    /// The message, with `body` as any [`IntoBody`] (`b"done"` included).
    pub fn new(peer: NodeAddr, body: impl IntoBody, timeout: Duration) -> Self {
        SendMessage {
            peer,
            body: body.into_body(),
            timeout,
        }
    }
}

/// Run a batch and notify its owners once it has completed, through the
/// node's actor (as [`Node::submit_with_notification`]).
#[derive(Debug)]
pub struct SubmitWithNotification {
    /// The batch.
    pub ops: Vec<RdmaOp>,
    /// For the batch and the notifications together.
    pub timeout: Duration,
    /// What each owner's inbox receives.
    pub notification: Bytes,
}

impl SubmitWithNotification {
    /// The message, with `notification` as any [`IntoBody`].
    pub fn new(ops: Vec<RdmaOp>, timeout: Duration, notification: impl IntoBody) -> Self {
        SubmitWithNotification {
            ops,
            timeout,
            notification: notification.into_body(),
        }
    }
}

impl Message<SubmitWithNotification> for NodeActor {
    type Reply = DelegatedReply<Result<(), NotifyError>>;

    async fn handle(
        &mut self,
        msg: SubmitWithNotification,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let router = self.router.clone();
        ctx.spawn(async move {
            submit_with_notification(&router, msg.ops, msg.timeout, msg.notification).await
        })
    }
}

impl Message<SendMessage> for NodeActor {
    type Reply = DelegatedReply<Result<(), MessageError>>;

    async fn handle(
        &mut self,
        msg: SendMessage,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let router = self.router.clone();
        // Delivery may wait for room at the peer: never in the mailbox.
        ctx.spawn(async move { router.send_message(msg.peer, msg.body, msg.timeout).await })
    }
}
