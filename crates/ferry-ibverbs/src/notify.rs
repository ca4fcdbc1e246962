//! Notifications on the queue pair, the initiator's side.
//!
//! A notification attached to a batch of writes to one peer is a SEND
//! posted on that peer's QP right behind the batch's work requests. An RC
//! QP executes requests in order, and its peer accepts nothing after a
//! request it refused: the owner receives the notification only once every
//! op of the batch has been executed there. A batch that reads posts its
//! SEND once the reads have completed, so the owner may reuse the memory as
//! soon as it hears. The SEND's completion is the owner's
//! acknowledgement that the notification sits in one of the receive buffers
//! it posted for this QP, from where its node hands it to the inbox; the
//! batch resolves then, with no round trip of its own.
//!
//! Each posted buffer is one credit. The owner returns credits over the
//! control session once it has handed their notifications to its inbox, so
//! a consumer that stops reading holds senders back. A sender without a
//! credit, or with a notification larger than a buffer, notifies over the
//! control session instead (see `ferry::Node::submit_with_notification`).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ferry_core::{BatchProgress, MemoryBlock};
use tokio::sync::Semaphore;

use crate::connection::{PeerQp, Piece, Pin};
use crate::verbs::{MemoryRegion, ProtectionDomain, RdmaOpcode, VerbsError, WorkRequest};

/// The most receive buffers an owner may announce: the initiator mirrors
/// them with send buffers of its own.
const MAX_SLOTS: u16 = 1024;
/// The largest buffer an owner may announce, for the same reason.
const MAX_SLOT_LEN: u32 = 64 << 10;

/// An initiator's notifications to one peer's QP: its credits, and the
/// registered buffers SENDs are posted from.
pub(crate) struct NotifyLane {
    credits: Semaphore,
    /// Credits taken and not yet returned: the bound on what the owner may
    /// return, so a confused owner cannot inflate them.
    in_use: AtomicU32,
    ring: Arc<SendRing>,
}

struct SendRing {
    mr: MemoryRegion,
    slot_len: u32,
    free: Mutex<Vec<u16>>,
}

impl SendRing {
    fn free(&self) -> std::sync::MutexGuard<'_, Vec<u16>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A send buffer holding one notification. A work request's record holds
/// it until the SEND's completion has been polled; dropping it frees the
/// buffer.
pub(crate) struct SendSlot {
    ring: Arc<SendRing>,
    index: u16,
}

impl Drop for SendSlot {
    fn drop(&mut self) {
        self.ring.free().push(self.index);
    }
}

impl NotifyLane {
    /// A lane for a peer that posted `slots` receive buffers of `slot_len`
    /// bytes for us; `None` if it posted none (it takes notifications over
    /// the control session only).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        slots: u16,
        slot_len: u32,
    ) -> Result<Option<Self>, VerbsError> {
        let (slots, slot_len) = (slots.min(MAX_SLOTS), slot_len.min(MAX_SLOT_LEN));
        if slots == 0 || slot_len == 0 {
            return Ok(None);
        }
        let memory = MemoryBlock::alloc(u64::from(slots) * u64::from(slot_len)).map_err(|e| {
            VerbsError::Call {
                call: "allocating notification send buffers",
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        let mr = MemoryRegion::register_local(pd, Arc::new(memory))?;
        Ok(Some(NotifyLane {
            credits: Semaphore::new(usize::from(slots)),
            in_use: AtomicU32::new(0),
            ring: Arc::new(SendRing {
                mr,
                slot_len,
                free: Mutex::new((0..slots).rev().collect()),
            }),
        }))
    }

    /// The SEND that carries `payload`, copied into a send buffer (which
    /// the returned slot holds), taking a credit; `None` when `payload` is
    /// larger than the peer's buffers or no credit (or, briefly, no send
    /// buffer) is free.
    pub fn take(&self, payload: &[u8]) -> Option<(WorkRequest, SendSlot)> {
        let ring = &self.ring;
        if payload.len() > ring.slot_len as usize {
            return None;
        }
        let credit = self.credits.try_acquire().ok()?;
        // A buffer frees when its SEND's completion is polled, which can
        // trail the owner's credit for it: then none may be free. The credit
        // goes back (dropped unforgotten).
        let index = ring.free().pop()?;
        credit.forget();
        self.in_use.fetch_add(1, Ordering::AcqRel);
        let slot = SendSlot {
            ring: ring.clone(),
            index,
        };
        let memory = ring.mr.memory();
        let offset = u64::from(index) * u64::from(ring.slot_len);
        memory
            .write_at(offset, payload)
            .expect("a send buffer lies within the ring");
        let wr = WorkRequest {
            wr_id: 0,
            opcode: RdmaOpcode::Send,
            local_addr: memory.addr() + offset,
            len: payload.len() as u32,
            lkey: ring.mr.lkey(),
            remote_addr: 0,
            rkey: 0,
            signaled: false,
            fence: false,
        };
        Some((wr, slot))
    }

    /// Adds credits the owner returned (at most as many as are out);
    /// returns how many were added.
    pub fn return_credits(&self, count: u32) -> u32 {
        let returned = take_off(&self.in_use, count);
        self.credits.add_permits(returned as usize);
        returned
    }
}

/// A notification waiting to be put behind its batch's pieces.
pub(crate) struct PendingNotification {
    pub payload: Bytes,
    /// Its index in the batch's progress: right after the ops.
    pub index: usize,
}

/// Puts `pending`, if there is one, behind `pieces` as a SEND on `qp`
/// (setting `sent`) when the peer has a free credit and a buffer large
/// enough for it; otherwise finishes its piece unsent, for the caller to
/// notify another way.
pub(crate) fn attach_notification(
    pending: &mut Option<PendingNotification>,
    pieces: &mut Vec<Piece>,
    qp: &PeerQp,
    progress: &BatchProgress,
    sent: &AtomicBool,
) {
    let Some(notification) = pending.take() else {
        return;
    };
    match qp
        .notify_lane()
        .and_then(|lane| lane.take(&notification.payload))
    {
        Some((wr, slot)) => {
            pieces.push(Piece {
                op: notification.index,
                wr,
                pin: Pin::Notification(slot),
                rescue: None,
            });
            sent.store(true, Ordering::Release);
        }
        None => progress.piece_done(notification.index, Ok(())),
    }
}

/// Takes up to `count` off `out`, never below zero; returns how many.
fn take_off(out: &AtomicU32, count: u32) -> u32 {
    out.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        Some(n.saturating_sub(count))
    })
    .map_or(0, |n| n.min(count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_cannot_return_more_credits_than_are_out() {
        let out = AtomicU32::new(3);
        assert_eq!(take_off(&out, 2), 2);
        assert_eq!(take_off(&out, 5), 1, "only one was still out");
        assert_eq!(take_off(&out, 1), 0);
        assert_eq!(out.load(Ordering::Acquire), 0);
    }
}
