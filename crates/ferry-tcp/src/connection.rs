//! One data connection of the initiator: the chunks it carries (pieces of
//! ops, and notifications), and the task that writes them within its
//! window and applies the owner's responses.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_control::Channel;
use ferry_control::auth::{FRAME_TAG_LEN, FrameMac};
use ferry_control::hello::{Authenticated, Sealing};
use ferry_core::{NodeAddr, OpError};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::chunk::{Chunk, Local};
use crate::client::ClientConfig;
use crate::frame::{ClientFrame, REQUEST_LEN, RESPONSE_LEN, Range, RequestKind, Response};
use crate::io::{FrameReader, IoVecs, LARGE_PAYLOAD, extend_from_raw, poll_for};
use crate::pool::{PeerTable, release, resend};

/// Chunks sent and not yet answered, by request id.
type Pending = HashMap<u64, Chunk, BuildHasherDefault<IdHasher>>;

/// Hashes a request id with one multiplication. Ids are this connection's
/// own counter, inserted only here (a peer's answer can only look one up),
/// so the table needs no defence against chosen keys, and SipHash, the
/// default, cost more than the rest of a small chunk's bookkeeping.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(FIBONACCI);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(FIBONACCI);
    }
}

/// 2^64 / the golden ratio, odd: multiplying by it keeps consecutive ids
/// apart in the low bits (the table's bucket) and mixes them into the high
/// ones (its tag).
const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

/// Most chunks one connection writes with a single `sendmsg`.
const MAX_CHUNKS_PER_SEND: usize = 128;

/// Sending half of one data connection; the connection task owns the rest.
#[derive(Clone)]
pub(crate) struct Conn {
    tx: mpsc::Sender<Chunk>,
    pub(crate) closed: CancellationToken,
}

impl Conn {
    /// Queues `chunk`, waiting for room in the queue; one the connection can
    /// no longer take is finished as lost.
    pub(crate) async fn queue(&self, chunk: Chunk) {
        if let Err(mpsc::error::SendError(chunk)) = self.tx.send(chunk).await {
            // The connection ended after it was chosen.
            let endpoint = chunk.endpoint;
            chunk.finish(Err(OpError::connection_lost(endpoint)));
        }
    }
}

/// Opens a data connection to `addr` and runs it in a task of its own,
/// which releases the peer's pool entry in `pool` when the connection ends.
pub(crate) async fn connect(
    addr: NodeAddr,
    config: ClientConfig,
    pool: (std::sync::Weak<PeerTable>, NodeAddr),
) -> Result<Conn, OpError> {
    let greeted = config.dialer.connect(addr, Channel::TCP_DATA).await?;
    let endpoint = addr.endpoint;
    let (tx, rx) = mpsc::channel(config.queue_depth.max(1));
    let closed = CancellationToken::new();
    let run = run_connection(
        greeted.stream,
        greeted.auth,
        rx,
        closed.clone(),
        endpoint,
        config.clone(),
    );
    tokio::spawn(async move {
        let unread = run.await;
        if !unread.is_empty() {
            resend(&pool.0, pool.1, config, unread);
        }
        // Closed by now (both loops mark it): the pool may be empty.
        release(&pool.0, pool.1, None);
    });
    debug!(%endpoint, node = ?addr.id, "data connection open");
    Ok(Conn { tx, closed })
}

/// Drives one connection until either direction fails or every sender is gone.
///
/// Returns the chunks to send again on another connection: those the
/// owner closed this one without reading. An owner closes (or evicts) a
/// connection only while it waits for its client, and answers what it
/// read before it waits, so when the connection was idle (nothing in
/// flight) as the chunks went out, and it ended by the owner's hand (end
/// of stream or reset) with none of them answered, the owner read none of
/// them whole: repeating a one-sided READ or WRITE of unchanged bytes is
/// harmless. Each chunk is sent again once at most; notifications are not
/// (see below), and what is not sent again is finished as lost.
///
/// At most `window` bytes of requests are in flight (sent and not yet
/// answered): enough to keep the link busy, and all that a submit which
/// times out still moves on this connection, since what it has not sent by
/// then is dropped unsent.
/// Where the hello proved a cluster secret (`auth`), every request is sealed
/// and every response checked (see `ferry_control::auth::FrameMac`), and
/// the connection ends when that secret is revoked.
async fn run_connection(
    stream: TcpStream,
    auth: Option<Authenticated>,
    mut rx: mpsc::Receiver<Chunk>,
    closed: CancellationToken,
    endpoint: SocketAddr,
    config: ClientConfig,
) -> Vec<Chunk> {
    let Sealing {
        send: mut send_mac,
        recv: mut recv_mac,
        revoked,
        tracked,
    } = Authenticated::split(auth);
    let window = config.window.max(1);
    let pending = Mutex::new(Pending::default());
    // Set when a chunk goes out with nothing in flight, cleared by any
    // answer: while set, the owner has read nothing sent since it was idle.
    let unanswered = AtomicBool::new(false);
    let room = Semaphore::new(window as usize);
    // Sealed, each response's tag follows its header.
    let trailer = if recv_mac.is_some() { FRAME_TAG_LEN } else { 0 };
    let mut reader = FrameReader::new(config.busy_poll).with_trailer(trailer);
    let busy_poll = config.busy_poll;
    let writing = async {
        let r = write_loop(
            &stream,
            send_mac.as_mut(),
            &mut rx,
            &pending,
            &unanswered,
            &closed,
            (&room, window),
        )
        .await;
        closed.cancel();
        r
    };
    let reading = async {
        let r = read_loop(
            &stream,
            &mut reader,
            recv_mac.as_mut(),
            busy_poll,
            &pending,
            &unanswered,
            &closed,
            (&room, window),
        )
        .await;
        closed.cancel();
        r
    };
    // A revoked secret ends the connection as a close does.
    let revoking = async {
        if let Some(revoked) = &revoked {
            tokio::select! {
                _ = revoked.cancelled() => {
                    debug!(%endpoint, "data connection closed: the cluster secret it proved was revoked");
                    closed.cancel();
                }
                _ = closed.cancelled() => {}
            }
        }
    };
    let (w, r, ()) = tokio::join!(writing, reading, revoking);
    let closed_by_owner = |r: &io::Result<()>| {
        r.as_ref().err().is_some_and(|e| {
            matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            )
        })
    };
    let unread = closed_by_owner(&r)
        && (w.is_ok() || closed_by_owner(&w))
        && unanswered.load(Ordering::Acquire);
    match w.and(r) {
        Err(e) if crate::io::is_forged(&e) => {
            if let Some(tracked) = &tracked {
                tracked.forged("tcp-data", &endpoint);
            }
        }
        Err(e) => debug!(%endpoint, error = %e, "data connection lost"),
        Ok(()) => {}
    }
    // Both loops have returned, so nothing reaches region memory through this
    // connection any more: only now may the chunks (and their pins) go.
    let lost = || Err(OpError::connection_lost(endpoint));
    // In the order they were sent: a notified batch's notification stays
    // behind its chunks.
    let mut orphans: Vec<(u64, Chunk)> = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .collect();
    orphans.sort_unstable_by_key(|(id, _)| *id);
    let mut orphans: Vec<Chunk> = orphans.into_iter().map(|(_, c)| c).collect();
    rx.close();
    while let Ok(chunk) = rx.try_recv() {
        orphans.push(chunk);
    }
    if !unread || orphans.iter().any(|c| c.resent) {
        orphans.into_iter().for_each(|c| c.finish(lost()));
        return Vec::new();
    }
    // A notification is not sent again: the owner keeps a batch's refused
    // chunks per connection, and on another one it could deliver the
    // notification of a batch that failed here. It fails as before; its
    // batch's data goes again.
    let (notifications, mut resend): (Vec<Chunk>, Vec<Chunk>) = orphans
        .into_iter()
        .partition(|c| matches!(c.frame, ClientFrame::Notify(_)));
    notifications.into_iter().for_each(|c| c.finish(lost()));
    if !resend.is_empty() {
        debug!(%endpoint, chunks = resend.len(), "the owner closed an idle connection as chunks went out, unread: sending them again");
    }
    for chunk in &mut resend {
        chunk.resent = true;
    }
    resend
}

/// Sends queued chunks, as many per `sendmsg` as are queued and fit in the
/// window, skipping (and finishing) those whose submit has timed out.
async fn write_loop(
    stream: &TcpStream,
    mut seal: Option<&mut FrameMac>,
    rx: &mut mpsc::Receiver<Chunk>,
    pending: &Mutex<Pending>,
    unanswered: &AtomicBool,
    closed: &CancellationToken,
    (room, window): (&Semaphore, u32),
) -> io::Result<()> {
    let mut next_id = 0u64;
    let mut batch = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    let mut headers = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    // Range tables, and the small payloads of ranges writes, copied here:
    // one iovec for many of them instead of one each.
    let mut staged: Vec<u8> = Vec::new();
    // What the round sends, in order; pointers are taken from `headers`
    // and `staged` only once both are complete.
    let mut segments: Vec<Segment> = Vec::with_capacity(2 * MAX_CHUNKS_PER_SEND);
    // The writer keeps its own pin of what each chunk sends from: a (buggy
    // or hostile) early response must not free memory that sendmsg is
    // still reading.
    let mut pins: Vec<Local> = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    let mut iov = IoVecs::default();
    // A chunk taken from the queue that did not fit in the window yet.
    let mut deferred: Option<Chunk> = None;
    loop {
        let first = match deferred.take() {
            Some(chunk) => chunk,
            None => tokio::select! {
                biased;
                _ = closed.cancelled() => return Ok(()),
                chunk = rx.recv() => match chunk {
                    Some(chunk) => chunk,
                    None => return Ok(()),
                },
            },
        };
        // Nothing can go before the round's first chunk: it waits for room.
        // A chunk whose submit already returned Timeout never goes on the
        // wire (a notification goes as a discard).
        if let Some(first) = first.unless_abandoned() {
            let cost = first.cost(window);
            tokio::select! {
                biased;
                _ = closed.cancelled() => return Ok(()),
                permit = room.acquire_many(cost) => match permit {
                    Ok(permit) => permit.forget(),
                    Err(_) => return Ok(()),
                },
            }
            // The wait may have been long.
            match first.unless_abandoned() {
                Some(first) => batch.push(first),
                None => room.add_permits(cost as usize),
            }
        }
        // Then whatever is queued and fits now.
        while batch.len() < MAX_CHUNKS_PER_SEND {
            let Ok(chunk) = rx.try_recv() else { break };
            let Some(chunk) = chunk.unless_abandoned() else {
                continue;
            };
            match room.try_acquire_many(chunk.cost(window)) {
                Ok(permit) => {
                    permit.forget();
                    batch.push(chunk);
                }
                Err(_) => {
                    deferred = Some(chunk);
                    break;
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        {
            let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
            if pending.is_empty() {
                unanswered.store(true, Ordering::Release);
            }
            for mut chunk in batch.drain(..) {
                next_id += 1;
                chunk.frame.set_id(next_id);
                segments.push(Segment::Header(headers.len()));
                let header = chunk.frame.encode();
                headers.push(header);
                plan_payload(
                    &chunk,
                    &header,
                    seal.as_deref_mut(),
                    &mut staged,
                    &mut segments,
                );
                pins.push(chunk.local.clone());
                pending.insert(next_id, chunk);
            }
        }
        for segment in &segments {
            // SAFETY: `headers` and `staged` are not modified until the send
            // below is done, and each payload range is pinned in `pins`.
            unsafe {
                match *segment {
                    Segment::Header(k) => iov.push(headers[k].as_ptr(), REQUEST_LEN),
                    Segment::Staged { start, len } => iov.push(staged.as_ptr().add(start), len),
                    Segment::Payload { ptr, len } => iov.push(ptr as *const u8, len),
                }
            }
        }
        let sent = tokio::select! {
            biased;
            _ = closed.cancelled() => return Ok(()),
            sent = iov.send_all(stream, None) => sent,
        };
        iov.clear();
        headers.clear();
        staged.clear();
        segments.clear();
        pins.clear();
        sent?;
    }
}

/// One piece of what a round of the writer sends.
enum Segment {
    /// The `k`-th header of the round.
    Header(usize),
    /// Bytes of the round's staging buffer.
    Staged { start: usize, len: usize },
    /// Bytes in place, in pinned memory (an address as an integer, so that
    /// the writer's future stays `Send`).
    Payload { ptr: usize, len: usize },
}

/// Ranges writes' payloads at most this long are copied next to their
/// table: a 64-byte payload costs less to copy than an iovec of its own,
/// and one `sendmsg` takes at most [`crate::io::MAX_IOV`] of those.
const STAGE_MAX: usize = 512;

/// Plans what follows `chunk`'s `header`: its scopes, if any, staged; then
/// a ranges request's table, staged, then its payloads, small ones staged
/// as well; any other request's payload in place. Sealed (`seal`), the
/// frame's tag is staged after the header, scopes and table, before any
/// payload; a notification's covers its body too, and follows it.
fn plan_payload(
    chunk: &Chunk,
    header: &[u8; REQUEST_LEN],
    seal: Option<&mut FrameMac>,
    staged: &mut Vec<u8>,
    segments: &mut Vec<Segment>,
) {
    let scopes_start = staged.len();
    if let Some(scopes) = chunk.frame.scopes().filter(|s| !s.is_empty()) {
        scopes.encode_into(staged);
        note_staged(segments, scopes_start, staged.len());
    }
    let scopes = scopes_start..staged.len();
    let ClientFrame::Ranges(ranges) = chunk.frame else {
        // Payloads are at most MAX_CHUNK bytes, far below usize::MAX.
        let len = chunk.frame.payload_len() as usize;
        let ptr = chunk.local_ptr() as usize;
        let notification = matches!(chunk.frame, ClientFrame::Notify(_));
        if let Some(mac) = seal {
            let tag = if notification {
                // SAFETY: a notification's body is its chunk's own bytes,
                // `len` long, alive as long as the chunk.
                let body = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
                segments.push(Segment::Payload { ptr, len });
                mac.seal(&[header, body])
            } else {
                mac.seal(&[header, &staged[scopes.clone()]])
            };
            let start = staged.len();
            staged.extend_from_slice(&tag);
            note_staged(segments, start, staged.len());
            if notification {
                return;
            }
        }
        segments.push(Segment::Payload { ptr, len });
        return;
    };
    let start = staged.len();
    for range in chunk.ranges() {
        let entry = Range {
            addr: range.remote,
            len: range.len as u64,
        };
        staged.extend_from_slice(&entry.encode());
    }
    if let Some(mac) = seal {
        let tag = mac.seal(&[header, &staged[scopes], &staged[start..]]);
        staged.extend_from_slice(&tag);
    }
    note_staged(segments, start, staged.len());
    if ranges.kind != RequestKind::Write {
        return;
    }
    for range in chunk.ranges() {
        let ptr = chunk.range_ptr(range);
        if range.len <= STAGE_MAX {
            let start = staged.len();
            // SAFETY: the range lies in the chunk's local region, which the
            // chunk pins for the call.
            unsafe { extend_from_raw(staged, ptr, range.len) };
            note_staged(segments, start, staged.len());
        } else {
            let ptr = ptr as usize;
            segments.push(Segment::Payload {
                ptr,
                len: range.len,
            });
        }
    }
}

/// Adds `staged[start..end]` to the round, in the same iovec as the staged
/// bytes right before it if they are the round's last segment.
fn note_staged(segments: &mut Vec<Segment>, start: usize, end: usize) {
    match segments.last_mut() {
        Some(Segment::Staged { start: s, len }) if *s + *len == start => *len = end - *s,
        _ => segments.push(Segment::Staged {
            start,
            len: end - start,
        }),
    }
}

/// Applies responses; each answered chunk gives its bytes back to the window.
#[expect(clippy::too_many_arguments, reason = "one connection's whole context")]
async fn read_loop(
    stream: &TcpStream,
    reader: &mut FrameReader,
    mut check: Option<&mut FrameMac>,
    busy_poll: Duration,
    pending: &Mutex<Pending>,
    unanswered: &AtomicBool,
    closed: &CancellationToken,
    (room, window): (&Semaphore, u32),
) -> io::Result<()> {
    let protocol = |msg: &str| io::Error::new(io::ErrorKind::InvalidData, msg.to_string());
    // Made once, not per response: registering a new waiter on the token
    // for every frame cost as much as decoding it.
    let mut cancelled = std::pin::pin!(closed.cancelled());
    loop {
        // Behind a bulk window the next answer is a payload's transfer
        // time away: see `poll_for`.
        let in_flight = (window as usize).saturating_sub(room.available_permits());
        reader.set_busy_poll(poll_for(in_flight, busy_poll));
        let header = tokio::select! {
            biased;
            _ = &mut cancelled => return Ok(()),
            header = reader.header::<RESPONSE_LEN>(stream) => header?,
        };
        let Some(header) = header else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ));
        };
        if let Some(mac) = check.as_deref_mut() {
            reader.check_tag(stream, mac, &[&header]).await?;
        }
        let response = Response::decode(&header).map_err(|e| protocol(&e.to_string()))?;
        let chunk = {
            let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
            unanswered.store(false, Ordering::Release);
            pending.remove(&response.id())
        };
        let chunk = chunk.ok_or_else(|| protocol("response to a request never sent"))?;
        let cost = chunk.cost(window);
        match response {
            Response::ReadData { len, .. } => {
                if chunk.op_kind() != Some(RequestKind::Read) || len != chunk.frame.bytes() {
                    return Err(protocol("read data does not match its request"));
                }
                let received = tokio::select! {
                    biased;
                    _ = &mut cancelled => return Ok(()),
                    r = receive(stream, reader, &chunk, len as usize) => r,
                };
                received?;
                chunk.finish(Ok(()));
            }
            Response::WriteAck { .. } => {
                if chunk.op_kind() != Some(RequestKind::Write) {
                    return Err(protocol("write ack for a request that is no write"));
                }
                chunk.finish(Ok(()));
            }
            Response::Notified {
                outcome: answer, ..
            } => {
                let Local::Notification { outcome, .. } = &chunk.local else {
                    return Err(protocol("notification outcome for an op"));
                };
                _ = outcome.set(Ok(answer));
                chunk.finish(Ok(()));
            }
            Response::Refused { refusal, range, .. } => {
                let range = usize::from(range);
                match chunk.frame {
                    ClientFrame::Ranges(request) => {
                        let Some(failed) = chunk.ranges().get(range) else {
                            return Err(protocol("refusal names a range never sent"));
                        };
                        let error = refusal.into_op_error(request.generation, failed.len as u64);
                        chunk.finish_at(range, error);
                    }
                    _ if range != 0 => {
                        return Err(protocol("refusal names a range of a plain request"));
                    }
                    ClientFrame::Op(request) => {
                        chunk.finish(Err(refusal.into_op_error(request.generation, request.len)));
                    }
                    ClientFrame::Notify(_) => {
                        let generation = ferry_core::Generation(0);
                        chunk.finish(Err(refusal.into_op_error(generation, 0)));
                    }
                }
            }
        }
        room.add_permits(cost as usize);
    }
}

/// Receives a read's `len` bytes of data into `chunk`'s local memory: in
/// place, or range by range for a ranges request.
async fn receive(
    stream: &TcpStream,
    reader: &mut FrameReader,
    chunk: &Chunk,
    len: usize,
) -> io::Result<()> {
    if let ClientFrame::Ranges(_) = chunk.frame
        && len >= LARGE_PAYLOAD
    {
        // Many ranges, small ones among them: straight into their places,
        // not through the read buffer.
        let mut landing = IoVecs::default();
        for range in chunk.ranges() {
            // SAFETY: `chunk` holds a Region clone, keeping each range
            // (inside an op's bounds-checked local slice) allocated and
            // registered until after this call.
            unsafe { landing.push_mut(chunk.range_ptr(range), range.len) };
        }
        // SAFETY: as above.
        return unsafe { reader.scatter(stream, &mut landing) }.await;
    }
    if let ClientFrame::Ranges(_) = chunk.frame {
        for range in chunk.ranges() {
            // SAFETY: `chunk` holds a Region clone, keeping each range
            // (inside an op's bounds-checked local slice) allocated and
            // registered until after this call.
            unsafe { reader.payload(stream, chunk.range_ptr(range), range.len) }.await?;
        }
        return Ok(());
    }
    // SAFETY: as above, for the chunk's one range.
    unsafe { reader.payload(stream, chunk.local_ptr(), len) }.await
}
