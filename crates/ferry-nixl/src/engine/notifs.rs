//! The engine's notifications: `getNotifs`, which hands over what came
//! with the agent that sent it, checked against the node it came from,
//! and `genNotif`, which queues one to an agent and returns at once.

use ferry::{Bytes, DeliveryKind};
use tokio::sync::mpsc;
use tracing::warn;

use super::{Engine, MAX_UNLOADED_SENDERS, NOTIFS_QUEUED, Status};
use crate::notif::{frame_notif, unframe_notif};

impl Engine {
    /// `getNotifs`: every notification that came, with its sender agent.
    ///
    /// NIXL reports a notification with the agent that sent it, and FERRY
    /// carries the name in the body (the receiver may not have loaded the
    /// sender), so the name is the sender's claim; the node it came from is
    /// not (it is the one its connection's hello named, proved under a
    /// cluster secret). A notification naming an agent whose connection
    /// info names another node, or an agent first heard of from another
    /// node, is dropped, counted ([`Engine::misnamed`]) and logged.
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
                Some((agent, msg)) if self.sent_by(agent, delivery.from.id) => each(agent, msg),
                Some((agent, _)) => {
                    self.tables().misnamed += 1;
                    warn!(from = %delivery.from, agent = %String::from_utf8_lossy(agent),
                        "FERRY: a notification naming an agent of another node, dropped")
                }
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

    /// Whether node `node` may speak as agent `agent`: this agent's own
    /// node for its own name; the node an agent's loaded connection info
    /// names; else the first node heard from under that name.
    fn sent_by(&self, agent: &[u8], node: ferry::NodeId) -> bool {
        let Ok(agent) = std::str::from_utf8(agent) else {
            return false;
        };
        if agent == self.agent {
            return node == self.node.addr().id;
        }
        let mut tables = self.tables();
        if let Some(addr) = tables.agents.get(agent) {
            return addr.id == node;
        }
        if let Some(first) = tables.senders.get(agent) {
            return *first == node;
        }
        // Bounded: a flood of made-up names is dropped, not remembered.
        if tables.senders.len() >= MAX_UNLOADED_SENDERS {
            return false;
        }
        tables.senders.insert(agent.to_string(), node);
        true
    }

    /// Notifications dropped so far because they named an agent of
    /// another node than the one they came from.
    pub fn misnamed(&self) -> u64 {
        self.tables().misnamed
    }

    /// `genNotif`: `msg` to agent `agent` on its own, queued behind the
    /// ones before it to that agent and sent by the agent's own task, so
    /// that the call returns at once whatever the agent does. A failure to
    /// deliver is logged; a full queue ([`NOTIFS_QUEUED`]) fails the call.
    pub fn gen_notif(&self, agent: &str, msg: &[u8]) -> Status {
        let Some(addr) = self.agent_addr(agent) else {
            warn!(
                agent,
                "FERRY: genNotif to an agent whose metadata was never loaded"
            );
            return Status::NotFound;
        };
        let body = frame_notif(&self.agent, msg);
        let mut tables = self.tables();
        let queue = tables.notifiers.entry(addr).or_insert_with(|| {
            let (queue, mut queued) = mpsc::channel::<Bytes>(NOTIFS_QUEUED);
            let (node, deadline, agent) = (self.node.clone(), self.deadline, agent.to_string());
            self.driver.handle().spawn(async move {
                while let Some(body) = queued.recv().await {
                    if let Err(e) = node.notify(addr, body, deadline).await {
                        warn!(agent, "FERRY: genNotif: {e}");
                    }
                }
            });
            queue
        });
        match queue.try_send(body) {
            Ok(()) => Status::Success,
            Err(e) => {
                warn!(
                    agent,
                    "FERRY: genNotif: {NOTIFS_QUEUED} notifications to the agent are still on \
                     their way ({e})"
                );
                Status::Backend
            }
        }
    }
}
