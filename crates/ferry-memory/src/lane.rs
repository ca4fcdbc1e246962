//! Notifications between nodes on one host, in shared memory: a *lane*
//! from one initiator to one owner (no relation to the gate table's
//! per-process lanes of `gate.rs`).
//!
//! Why: a same-host batch is done in a microsecond or two (copies in the
//! initiator); a notification over the control session is a TCP round trip
//! on loopback, tens of times that. On a lane the initiator puts the
//! notification in a ring both processes map, rings a doorbell only when
//! the owner sleeps, and does not wait for the owner.
//!
//! Setup: the initiator makes the ring (a sealed memfd, `shared::alloc`)
//! and hands it to the owner on a socket of its own (`LaneOpen`). The owner
//! maps it once its size and seals check out, answers (`LaneAck`), and from
//! then on the socket carries only one-byte doorbells. The initiator
//! closing it ends the lane once the owner delivered what the ring holds;
//! the owner ending it (a protocol error, its node stopping) drops what is
//! left, as a node that stops drops what its inbox holds.
//!
//! Layout: a header page, with `tail` (slots the initiator filled) at 0,
//! `head` (slots the owner took) at 64 and `sleeping` at 128; then the
//! slots, each a `u32` length (padded to 8 bytes) and the body.
//!
//! Ordering: the initiator writes a slot, then stores `tail` (Release);
//! the owner loads `tail` (Acquire) before it reads the slot. The batch's
//! copies were complete before that store, so its bytes are visible to the
//! owner's application when the notification reaches it. The owner stores
//! `head` (Release) once it copied a slot out; the initiator loads it
//! (Acquire) before it reuses one. Sleeping: the owner stores `sleeping`,
//! then (SeqCst) loads `tail` one last time; the initiator stores `tail`,
//! then (SeqCst) swaps `sleeping` to 0 and rings if it was set. One of the
//! two sees the other: a notification never waits in the ring while the
//! owner sleeps.
//!
//! Trust: the owner keeps its own count of slots taken and checks every
//! count and length the initiator wrote. A peer that scribbles on the ring
//! ends its own lane, never the owner; the ring is sealed, so the owner's
//! accesses to it cannot fault.
//!
//! Accepted means in the ring: the owner's consumer hands it to the inbox,
//! waiting for room as long as that takes, and only then frees its slot.
//! A consumer that stops reading so fills the ring, and the initiator's
//! next notifications go the slow way (the control session), where the
//! sender waits for room until its deadline.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use ferry_control::NotificationSink;
use ferry_core::{MemoryBlock, NodeAddr, PAGE_SIZE};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::auth::SocketAuth;
use crate::shared::{alloc, map_sealed, mapping_of};
use crate::socket::Packets;
use crate::wire::{LaneAck, LaneOpen};

/// Slots in a lane's ring: notifications one initiator may have waiting
/// at one owner before the next go over the control session.
pub const SLOTS: u32 = 64;
/// Bytes per slot, its length word included: larger notifications go over
/// the control session.
pub const SLOT_LEN: u32 = 4096;
/// Bytes before a slot's body: its `u32` length, padded.
const LEN_WORD: usize = 8;
/// The largest notification a lane carries.
pub const MAX_BODY: usize = SLOT_LEN as usize - LEN_WORD;
/// The most slots, bytes per slot, and bytes in all, an owner maps for
/// one lane.
const MAX_SLOTS: u32 = 1024;
const MAX_SLOT_LEN: u32 = 1 << 20;
const MAX_RING: usize = 16 << 20;
/// Lanes one node serves at once; more are refused (their notifications
/// take the control session).
const MAX_LANES: usize = 1024;

/// Bytes of a ring of `slots` slots of `slot_len` bytes.
fn ring_len(slots: u32, slot_len: u32) -> usize {
    PAGE_SIZE + slots as usize * slot_len as usize
}

/// A ring mapped in this process, as either side sees it.
struct Ring {
    base: *mut u8,
    slots: u32,
    slot_len: u32,
}

// SAFETY: shared memory valid while the ring's owner (a `MemoryBlock` or a
// `Mapped`) lives; the words are accessed atomically, the slots through
// raw copies under the protocol above.
unsafe impl Send for Ring {}
// SAFETY: as for Send.
unsafe impl Sync for Ring {}

impl Ring {
    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: the header page is mapped read-write for the ring's life;
        // `at` is 0 or 64, 8-byte aligned in a page-aligned mapping.
        unsafe { AtomicU64::from_ptr(self.base.add(at).cast()) }
    }

    fn tail(&self) -> &AtomicU64 {
        self.word(0)
    }

    fn head(&self) -> &AtomicU64 {
        self.word(64)
    }

    fn sleeping(&self) -> &AtomicU32 {
        // SAFETY: as in `word`; 128 is 4-byte aligned.
        unsafe { AtomicU32::from_ptr(self.base.add(128).cast()) }
    }

    /// The slot the `n`th notification goes in.
    fn slot(&self, n: u64) -> *mut u8 {
        let index = (n % u64::from(self.slots)) as usize;
        // SAFETY: index < slots, so the slot lies inside the mapping.
        unsafe { self.base.add(PAGE_SIZE + index * self.slot_len as usize) }
    }

    fn max_body(&self) -> usize {
        self.slot_len as usize - LEN_WORD
    }
}

/// How a push went.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// In the ring: the owner delivers it.
    Accepted,
    /// Every slot holds a notification the owner has not taken yet.
    Full,
    /// Larger than a slot, or than the owner takes.
    TooLarge,
}

/// The initiator's end of a lane.
pub(crate) struct LaneSender {
    socket: Packets,
    ring: Ring,
    /// Keeps the ring mapped; declared after `ring`, which points into it.
    _block: MemoryBlock,
    /// One push at a time (this node's submitters share the lane): the
    /// next slot's number.
    tail: Mutex<u64>,
    /// The longest notification the lane takes: a slot's, or the owner's
    /// limit if lower (a longer one goes the way that reports the limit).
    max_body: usize,
}

impl LaneSender {
    /// Opens a lane from node `from` to owner `owner` by `deadline`:
    /// `Ok(None)` if the owner takes no notifications this way (an owner
    /// built before lanes closes the socket at the unknown packet).
    pub async fn open(
        owner: NodeAddr,
        from: NodeAddr,
        deadline: Instant,
        auth: &SocketAuth,
    ) -> io::Result<Option<LaneSender>> {
        let block =
            alloc(ring_len(SLOTS, SLOT_LEN) as u64).map_err(|e| io::Error::other(e.to_string()))?;
        let mapping = mapping_of(&block).expect("a shared block");
        let ring = Ring {
            base: mapping.base(),
            slots: SLOTS,
            slot_len: SLOT_LEN,
        };
        let socket = Packets::connect(&crate::socket_name(owner.id))?;
        if let Some(secret) = &auth.secret() {
            let proving = crate::auth::prove(&socket, auth.me, secret, owner);
            tokio::time::timeout_at(deadline, proving)
                .await
                .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        let open = LaneOpen {
            from,
            slots: SLOTS,
            slot_len: SLOT_LEN,
        };
        let exchange = async {
            socket.send(&open.encode(), Some(mapping.fd())).await?;
            let mut buf = [0u8; LaneAck::LEN];
            let (n, _) = socket.recv(&mut buf).await?;
            Ok::<_, io::Error>(LaneAck::decode(&buf[..n]))
        };
        let ack = tokio::time::timeout_at(deadline, exchange)
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        let max_len = match ack {
            Some(LaneAck::Open { max_len }) => max_len,
            Some(LaneAck::Refused) => return Ok(None),
            // Closed unanswered: an owner built before lanes (which drops
            // a packet it does not know), or one that turned the socket
            // away while it had too many peers. Asked again next time.
            None => return Err(io::Error::other("the owner closed the lane unanswered")),
        };
        Ok(Some(LaneSender {
            max_body: ring.max_body().min(max_len as usize),
            socket,
            ring,
            _block: block,
            tail: Mutex::new(0),
        }))
    }

    /// Whether the owner closed the lane (it stopped, or dropped the lane
    /// for a protocol error).
    pub fn is_closed(&self) -> bool {
        self.socket.is_closed()
    }

    /// Puts `body` in the ring, ringing the doorbell if the owner sleeps.
    /// `Err` only when the doorbell cannot reach the owner (it is gone):
    /// the notification is in the ring but may never be read.
    pub fn push(&self, body: &[u8]) -> io::Result<Pushed> {
        let ring = &self.ring;
        if body.len() > self.max_body {
            return Ok(Pushed::TooLarge);
        }
        let mut tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        if tail.wrapping_sub(ring.head().load(Ordering::Acquire)) >= u64::from(ring.slots) {
            return Ok(Pushed::Full);
        }
        let slot = ring.slot(*tail);
        // SAFETY: the slot is ours until `tail` passes it (the owner reads
        // it only then) and holds LEN_WORD + max_body bytes; `body` fits.
        unsafe {
            slot.cast::<u32>().write(body.len() as u32);
            std::ptr::copy_nonoverlapping(body.as_ptr(), slot.add(LEN_WORD), body.len());
        }
        *tail += 1;
        ring.tail().store(*tail, Ordering::Release);
        drop(tail);
        fence(Ordering::SeqCst);
        if ring.sleeping().swap(0, Ordering::SeqCst) != 0 {
            match self.socket.try_send(&[1]) {
                // A full socket holds doorbells the owner has yet to read:
                // it wakes anyway.
                Err(e) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
                _ => {}
            }
        }
        Ok(Pushed::Accepted)
    }
}

/// The owner's lanes: where they deliver, and how many are open.
#[derive(Default)]
pub(crate) struct OwnerLanes {
    /// The node's inbox, once it is up; lanes are refused before.
    pub sink: OnceLock<NotificationSink>,
    /// Lanes open now.
    pub open: AtomicUsize,
}

/// Counts a lane open while it lives.
struct OpenLane<'a>(&'a AtomicUsize);

impl Drop for OpenLane<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The owner's end: maps the ring `open` describes (`fd`), answers on
/// `socket`, then hands every notification the ring receives to the
/// node's inbox, in order, until the initiator closes the lane (what it
/// left in the ring is still delivered), the ring breaks the protocol, or
/// the inbox is gone.
pub(crate) async fn serve_lane(
    socket: Packets,
    open: LaneOpen,
    fd: Option<OwnedFd>,
    lanes: Arc<OwnerLanes>,
) {
    let from = open.from;
    let sink = lanes.sink.get().cloned();
    let room = lanes.open.load(Ordering::Relaxed) < MAX_LANES;
    let mapped = match (&sink, fd) {
        (Some(_), Some(fd)) if room => map_ring(&open, fd),
        _ => None,
    };
    if mapped.is_none() {
        debug!(node = %from.endpoint, inbox = sink.is_some(), room, "memory transport: a notification lane refused");
    }
    let ack = match (&mapped, &sink) {
        (Some(_), Some(sink)) => LaneAck::Open {
            max_len: u32::try_from(sink.max_len()).unwrap_or(u32::MAX),
        },
        _ => LaneAck::Refused,
    };
    if socket.send(&ack.encode(), None).await.is_err() {
        return;
    }
    let (Some(mapped), Some(sink)) = (mapped, sink) else {
        return;
    };
    lanes.open.fetch_add(1, Ordering::Relaxed);
    let _open = OpenLane(&lanes.open);
    debug!(node = %from.endpoint, "memory transport: a notification lane opened");
    let ring = &mapped.ring;
    let mut head = 0u64;
    let mut closing = false;
    let mut doorbell = [0u8; 1];
    loop {
        let tail = ring.tail().load(Ordering::Acquire);
        let filled = tail.wrapping_sub(head);
        if filled > u64::from(ring.slots) {
            warn!(node = %from.endpoint, "memory transport: a notification lane's ring is corrupt ({filled} filled); lane closed");
            return;
        }
        for _ in 0..filled {
            let slot = ring.slot(head);
            // SAFETY: the slot lies in the mapping (sealed, so it cannot
            // fault); its length is checked before any body byte is read.
            let len = unsafe { slot.cast::<u32>().read_volatile() } as usize;
            if len > ring.max_body().min(sink.max_len()) {
                warn!(node = %from.endpoint, "memory transport: a notification of {len} bytes, over the slot's or the node's limit; lane closed");
                return;
            }
            let mut body = vec![0u8; len];
            // SAFETY: `len` bytes after the length word lie in the slot. A
            // peer that breaks the protocol may write them meanwhile: any
            // byte values do here, and only its own notification is garbled.
            unsafe { std::ptr::copy_nonoverlapping(slot.add(LEN_WORD), body.as_mut_ptr(), len) };
            if sink.deliver(from, Bytes::from(body)).await.is_err() {
                debug!("memory transport: the inbox is gone: lane closed");
                return;
            }
            head += 1;
            ring.head().store(head, Ordering::Release);
        }
        if filled > 0 {
            continue;
        }
        if closing {
            return;
        }
        ring.sleeping().store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if ring.tail().load(Ordering::SeqCst) != head {
            ring.sleeping().store(0, Ordering::Relaxed);
            continue;
        }
        match socket.recv(&mut doorbell).await {
            Ok((1, _)) => {}
            // Closed (or broken, or not a doorbell): deliver what the
            // ring holds, then end.
            _ => closing = true,
        }
    }
}

/// A ring the owner mapped; unmapped on drop.
struct Mapped {
    ring: Ring,
    len: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping `map_ring` made, of `len` bytes; nothing
        // points into it after the ring (a field of self) goes.
        unsafe { libc::munmap(self.ring.base.cast(), self.len) };
    }
}

/// Maps the ring `open` describes, if its geometry is sane and `fd` is a
/// sealed memfd that holds it.
fn map_ring(open: &LaneOpen, fd: OwnedFd) -> Option<Mapped> {
    use std::os::fd::AsFd;
    let sane = (1..=MAX_SLOTS).contains(&open.slots)
        && (LEN_WORD as u32 + 1..=MAX_SLOT_LEN).contains(&open.slot_len)
        && open.slot_len.is_multiple_of(8);
    if !sane {
        return None;
    }
    let len = ring_len(open.slots, open.slot_len);
    if len > MAX_RING {
        return None;
    }
    let base = map_sealed(fd.as_fd(), len, true)?;
    Some(Mapped {
        ring: Ring {
            base,
            slots: open.slots,
            slot_len: open.slot_len,
        },
        len,
    })
}

/// How long an initiator waits for an owner to answer a `LaneOpen`, at
/// most (the submit's own deadline may be shorter).
pub(crate) const OPEN_WAIT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests;
