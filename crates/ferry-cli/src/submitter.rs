//! Where `ferry bench` workers send what they measure: a transfer to the
//! node (or its actor), an RPC or a message over the control session, or
//! an empty message to a do-nothing actor (the floor under any actor hop).

use bytes::Bytes;
use ferry::prelude::*;
use ferry::{
    Call, DescIndices, LocalDescList, MakeXfer, PreparedRemote, SendMessage, SubmitWithNotification,
};
use kameo::actor::ActorRef;

use crate::Failure;
use crate::bench::{Op, SUBMIT_TIMEOUT, Share};

/// The RPC handler `ferry serve` answers `bench --op rpc` with.
pub const ECHO_RPC: &str = "echo";

/// Where a worker's submits go.
#[derive(Clone)]
pub enum Submitter {
    /// `Node` calls, with the notification to attach to transfers, if any.
    Node(Node, Option<Bytes>),
    /// Messages to the node's actor, likewise.
    Actor(ActorRef<NodeActor>, Option<Bytes>),
    /// Nowhere: `--via echo`.
    Echo(ActorRef<Echo>),
}

/// The do-nothing actor of `--via echo`.
#[derive(kameo::Actor)]
pub struct Echo;

/// The empty message `Echo` answers.
pub struct Ping;

impl kameo::message::Message<Ping> for Echo {
    type Reply = ();

    async fn handle(&mut self, _: Ping, _: &mut kameo::message::Context<Self, ()>) {}
}

impl Submitter {
    /// One measured unit of work of `op` over `share`.
    pub async fn run(&self, share: &Share, op: Op) -> Result<(), Failure> {
        let peer = share.remote.owner();
        if let (Some(lists), Op::Write | Op::Read) = (&share.prepared, op) {
            return self.request(share, lists, op).await;
        }
        match (op, self) {
            (_, Submitter::Echo(echo)) => Ok(echo.ask(Ping).await?),
            (Op::Rpc, Submitter::Node(node, _)) => {
                let answer = node
                    .call(peer, ECHO_RPC, share.payload.clone(), SUBMIT_TIMEOUT)
                    .await?;
                check_echo(&answer, &share.payload)
            }
            (Op::Rpc, Submitter::Actor(actor, _)) => {
                let call = Call {
                    peer,
                    name: ECHO_RPC.into(),
                    body: share.payload.clone(),
                    timeout: SUBMIT_TIMEOUT,
                };
                check_echo(&actor.ask(call).await?, &share.payload)
            }
            (Op::Register, _) => Err(Failure("a registration is not submitted".into())),
            (Op::Message, Submitter::Node(node, _)) => Ok(node
                .send_message(peer, share.payload.clone(), SUBMIT_TIMEOUT)
                .await?),
            (Op::Message, Submitter::Actor(actor, _)) => {
                let send = SendMessage {
                    peer,
                    body: share.payload.clone(),
                    timeout: SUBMIT_TIMEOUT,
                };
                Ok(actor.ask(send).await?)
            }
            (Op::Write | Op::Read, Submitter::Node(node, None)) => {
                Ok(node.submit(share.ops(op)?, SUBMIT_TIMEOUT).await?)
            }
            (Op::Write | Op::Read, Submitter::Node(node, Some(notification))) => Ok(node
                .submit_with_notification(share.ops(op)?, SUBMIT_TIMEOUT, notification.clone())
                .await?),
            (Op::Write | Op::Read, Submitter::Actor(actor, None)) => {
                let submit = Submit {
                    ops: share.ops(op)?,
                    timeout: SUBMIT_TIMEOUT,
                };
                Ok(actor.ask(submit).await?)
            }
            (Op::Write | Op::Read, Submitter::Actor(actor, Some(notification))) => {
                let submit = SubmitWithNotification {
                    ops: share.ops(op)?,
                    timeout: SUBMIT_TIMEOUT,
                    notification: notification.clone(),
                };
                Ok(actor.ask(submit).await?)
            }
        }
    }
}

impl Submitter {
    /// One transfer request on the prepared lists: made (as vLLM makes one
    /// per request), posted, awaited.
    async fn request(
        &self,
        share: &Share,
        (local, remote): &(LocalDescList, PreparedRemote),
        op: Op,
    ) -> Result<(), Failure> {
        let kind = match op {
            Op::Read => OpKind::Read,
            _ => OpKind::Write,
        };
        let xfer = match self {
            Submitter::Node(node, notification) => {
                let xfer = node.make_xfer(kind, local, share.descs(), remote, share.descs())?;
                match notification {
                    Some(body) => xfer.with_notification(body.clone()),
                    None => xfer,
                }
            }
            Submitter::Actor(actor, notification) => {
                let make = MakeXfer {
                    kind,
                    local: local.clone(),
                    local_idx: DescIndices::to_indices(&share.descs()),
                    remote: remote.clone(),
                    remote_idx: DescIndices::to_indices(&share.descs()),
                    notification: notification.clone(),
                };
                actor.ask(make).await?
            }
            Submitter::Echo(echo) => return Ok(echo.ask(Ping).await?),
        };
        xfer.post(SUBMIT_TIMEOUT)?;
        Ok(xfer.wait().await?)
    }
}

fn check_echo(answer: &Bytes, sent: &Bytes) -> Result<(), Failure> {
    match answer == sent {
        true => Ok(()),
        false => Err(Failure(format!(
            "the echo RPC answered {} bytes that differ from the {} sent",
            answer.len(),
            sent.len()
        ))),
    }
}
