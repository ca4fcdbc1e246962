//! Messages between nodes, the facade's side: sending (from a [`Node`] or
//! through its actor) and receiving, the plain way (the node's [`Inbox`],
//! a stream) or the kameo way (every delivery told to a subscribed actor).
//! Delivery itself is in [`ferry_control::inbox`].

use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Delivery, Inbox, MessageError};
use ferry_core::NodeAddr;
use kameo::Actor;
use kameo::actor::ActorRef;
use kameo::error::SendError;
use kameo::message::{Context, Message};
use kameo::reply::DelegatedReply;
use tracing::warn;

use crate::{Node, NodeActor};

/// The node's inbox has a consumer already: it has one at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the node's inbox is taken: it has one consumer at a time")]
pub struct InboxTaken;

impl Node {
    /// Sends `body` to `peer`'s inbox: `Ok` once it is there, or a typed
    /// error within `timeout`. Messages from one node to another arrive in
    /// the order they were sent; a full inbox holds the sender back until
    /// its deadline (then `Timeout`, and the message is not delivered).
    pub async fn send_message(
        &self,
        peer: NodeAddr,
        body: impl Into<Bytes>,
        timeout: Duration,
    ) -> Result<(), MessageError> {
        let messages = &self.0.router.messages;
        messages.send(peer, body.into(), timeout).await
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

impl Message<SendMessage> for NodeActor {
    type Reply = DelegatedReply<Result<(), MessageError>>;

    async fn handle(
        &mut self,
        msg: SendMessage,
        ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let messages = self.router.messages.clone();
        // Delivery may wait for room at the peer: never in the mailbox.
        ctx.spawn(async move { messages.send(msg.peer, msg.body, msg.timeout).await })
    }
}
