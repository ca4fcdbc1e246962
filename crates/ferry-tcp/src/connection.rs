//! One data connection of the initiator: the chunks it carries (pieces of
//! ops, and notifications), and the task that writes them within its
//! window and applies the owner's responses.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use ferry_control::Channel;
use ferry_core::{BatchProgress, NodeAddr, OpError, Region};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::client::{ClientConfig, NotificationResult, PeerTable, release};
use crate::frame::{ClientFrame, RESPONSE_LEN, RequestKind, Response};
use crate::io::{FrameReader, IoVecs};

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

/// What a chunk moves on the initiator's side.
#[derive(Clone)]
pub(crate) enum Local {
    /// An op's local bytes, from `offset`: the region clone keeps them
    /// registered and allocated.
    Region { region: Region, offset: usize },
    /// A notification's body, and where the owner's answer goes.
    Notification {
        body: Bytes,
        outcome: Arc<OnceLock<NotificationResult>>,
    },
}

/// A piece of one op, at most `chunk_size` bytes, or a batch's notification,
/// travelling as one request.
///
/// It holds what it moves (see [`Local`]) for as long as it exists, whichever
/// task holds it. Dropping a chunk without `finish` counts it as lost, so a
/// submit can never wait on a chunk that no longer exists.
///
/// Boxed: a chunk is moved a dozen times between the batch that makes it
/// and the response that finishes it (queue, send batch, pending table),
/// and those moves of its 220 bytes cost more than the rest of a small
/// chunk's bookkeeping (callgrind); a box moves as one pointer.
pub(crate) struct Chunk(Box<Piece>);

/// What a [`Chunk`] holds.
pub(crate) struct Piece {
    /// Index of its op in the batch's progress (a notification's comes
    /// after the ops).
    op: usize,
    frame: ClientFrame,
    local: Local,
    /// The window bytes it takes while in flight; fixed at creation, so
    /// that what is taken is what is given back.
    cost: u64,
    submit: Option<Arc<BatchProgress>>,
    endpoint: SocketAddr,
}

impl std::ops::Deref for Chunk {
    type Target = Piece;

    fn deref(&self) -> &Piece {
        &self.0
    }
}

impl std::ops::DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut Piece {
        &mut self.0
    }
}

impl Chunk {
    pub(crate) fn new(
        op: usize,
        frame: ClientFrame,
        local: Local,
        submit: &Arc<BatchProgress>,
        endpoint: SocketAddr,
    ) -> Self {
        Chunk(Box::new(Piece {
            op,
            cost: frame.bytes(),
            frame,
            local,
            submit: Some(submit.clone()),
            endpoint,
        }))
    }

    /// What the chunk takes of its connection's window while in flight: its
    /// bytes, capped at the window so that any chunk fits on its own.
    fn cost(&self, window: u32) -> u32 {
        self.cost.min(window.into()).max(1) as u32
    }

    /// The request kind of an op's chunk.
    fn op_kind(&self) -> Option<RequestKind> {
        match self.frame {
            ClientFrame::Op(request) => Some(request.kind),
            ClientFrame::Notify(_) => None,
        }
    }

    /// First byte of the local range this chunk reads from or writes to.
    fn local_ptr(&self) -> *mut u8 {
        match &self.local {
            // SAFETY: `offset + len` lies within the region (the op's local
            // slice was bounds-checked and chunks partition it).
            Local::Region { region, offset } => unsafe { region.memory().as_ptr().add(*offset) },
            // Only ever sent from, never written to.
            Local::Notification { body, .. } => body.as_ptr().cast_mut(),
        }
    }

    /// The chunk as it may still go once its submit was answered: an op's
    /// chunk never goes on the wire (it is finished here); a notification
    /// goes as a discard, so that the owner forgets the batch.
    fn unless_abandoned(mut self) -> Option<Self> {
        if !self.submit.as_ref().is_some_and(|s| s.is_abandoned()) {
            return Some(self);
        }
        let piece = &mut *self.0;
        match (&mut piece.frame, &mut piece.local) {
            (ClientFrame::Notify(notify), Local::Notification { body, .. }) => {
                notify.discard = true;
                notify.len = 0;
                *body = Bytes::new();
                Some(self)
            }
            _ => {
                self.finish(Ok(()));
                None
            }
        }
    }

    pub(crate) fn finish(mut self, result: Result<(), OpError>) {
        self.settle(result);
    }

    /// Records the outcome once; later calls (and the drop) do nothing.
    fn settle(&mut self, result: Result<(), OpError>) {
        let Some(submit) = self.submit.take() else {
            return;
        };
        if let (Err(e), Local::Notification { outcome, .. }) = (&result, &self.local) {
            _ = outcome.set(Err(e.clone()));
        }
        submit.piece_done(self.op, result);
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let endpoint = self.endpoint;
        self.settle(Err(OpError::ConnectionLost { endpoint }));
    }
}

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
            chunk.finish(Err(OpError::ConnectionLost { endpoint }));
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
    let stream = ferry_control::connect(addr, config.local.id, Channel::TCP_DATA).await?;
    let endpoint = addr.endpoint;
    let (tx, rx) = mpsc::channel(config.queue_depth.max(1));
    let closed = CancellationToken::new();
    let run = run_connection(stream, rx, closed.clone(), endpoint, config);
    tokio::spawn(async move {
        run.await;
        // Closed by now (both loops mark it): the pool may be empty.
        release(&pool.0, pool.1, None);
    });
    debug!(%endpoint, node = ?addr.id, "data connection open");
    Ok(Conn { tx, closed })
}

/// Drives one connection until either direction fails or every sender is gone.
///
/// At most `window` bytes of requests are in flight (sent and not yet
/// answered): enough to keep the link busy, and all that a submit which
/// times out still moves on this connection, since what it has not sent by
/// then is dropped unsent.
async fn run_connection(
    stream: TcpStream,
    mut rx: mpsc::Receiver<Chunk>,
    closed: CancellationToken,
    endpoint: SocketAddr,
    config: ClientConfig,
) {
    let window = config.window.max(1);
    let pending = Mutex::new(Pending::default());
    let room = Semaphore::new(window as usize);
    let mut reader = FrameReader::new(config.busy_poll);
    let writing = async {
        let r = write_loop(&stream, &mut rx, &pending, &closed, (&room, window)).await;
        closed.cancel();
        r
    };
    let reading = async {
        let r = read_loop(&stream, &mut reader, &pending, &closed, (&room, window)).await;
        closed.cancel();
        r
    };
    let (w, r) = tokio::join!(writing, reading);
    if let Err(e) = w.and(r) {
        debug!(%endpoint, error = %e, "data connection lost");
    }
    // Both loops have returned, so nothing reaches region memory through this
    // connection any more: only now may the chunks (and their pins) go.
    let lost = || Err(OpError::ConnectionLost { endpoint });
    let orphans: Vec<Chunk> = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .map(|(_, c)| c)
        .collect();
    orphans.into_iter().for_each(|c| c.finish(lost()));
    rx.close();
    while let Ok(chunk) = rx.try_recv() {
        chunk.finish(lost());
    }
}

/// Sends queued chunks, as many per `sendmsg` as are queued and fit in the
/// window, skipping (and finishing) those whose submit has timed out.
async fn write_loop(
    stream: &TcpStream,
    rx: &mut mpsc::Receiver<Chunk>,
    pending: &Mutex<Pending>,
    closed: &CancellationToken,
    (room, window): (&Semaphore, u32),
) -> io::Result<()> {
    let mut next_id = 0u64;
    let mut batch = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    let mut headers = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    // (pin, payload pointer as integer, payload length) per chunk in flight
    let mut payloads: Vec<(Local, usize, usize)> = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
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
            for mut chunk in batch.drain(..) {
                next_id += 1;
                chunk.frame.set_id(next_id);
                headers.push(chunk.frame.encode());
                // Payloads are at most MAX_CHUNK bytes, far below usize::MAX.
                let payload_len = chunk.frame.payload_len() as usize;
                // The writer keeps its own pin: a (buggy or hostile) early
                // response must not free memory that sendmsg is still reading.
                payloads.push((chunk.local.clone(), chunk.local_ptr() as usize, payload_len));
                pending.insert(next_id, chunk);
            }
        }
        for (header, (_, ptr, len)) in headers.iter().zip(&payloads) {
            // SAFETY: `headers` is not modified until the send below is done,
            // and each payload range is pinned by the Region clone beside it.
            unsafe {
                iov.push(header.as_ptr(), header.len());
                iov.push(*ptr as *const u8, *len);
            }
        }
        let sent = tokio::select! {
            biased;
            _ = closed.cancelled() => return Ok(()),
            sent = iov.send_all(stream) => sent,
        };
        iov.clear();
        headers.clear();
        payloads.clear();
        sent?;
    }
}

/// Applies responses; each answered chunk gives its bytes back to the window.
async fn read_loop(
    stream: &TcpStream,
    reader: &mut FrameReader,
    pending: &Mutex<Pending>,
    closed: &CancellationToken,
    (room, window): (&Semaphore, u32),
) -> io::Result<()> {
    let protocol = |msg: &str| io::Error::new(io::ErrorKind::InvalidData, msg.to_string());
    // Made once, not per response: registering a new waiter on the token
    // for every frame cost as much as decoding it.
    let mut cancelled = std::pin::pin!(closed.cancelled());
    loop {
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
        let response = Response::decode(&header).map_err(|e| protocol(&e.to_string()))?;
        let chunk = pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&response.id())
            .ok_or_else(|| protocol("response to a request never sent"))?;
        let cost = chunk.cost(window);
        match response {
            Response::ReadData { len, .. } => {
                if chunk.op_kind() != Some(RequestKind::Read) || len != chunk.frame.bytes() {
                    return Err(protocol("read data does not match its request"));
                }
                let dst = chunk.local_ptr();
                // SAFETY: `chunk` holds a Region clone, keeping `dst..dst+len`
                // (inside the op's bounds-checked local slice) allocated and
                // registered until after this call.
                let received = tokio::select! {
                    biased;
                    _ = &mut cancelled => return Ok(()),
                    r = unsafe { reader.payload(stream, dst, len as usize) } => r,
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
            Response::Refused { refusal, .. } => {
                let error = match chunk.frame {
                    ClientFrame::Op(request) => {
                        refusal.into_op_error(request.generation, request.len)
                    }
                    ClientFrame::Notify(_) => refusal.into_op_error(ferry_core::Generation(0), 0),
                };
                chunk.finish(Err(error));
            }
        }
        room.add_permits(cost as usize);
    }
}
