//! The initiator side: splits ops into chunks, spreads them over a pool of
//! connections per peer, and completes each submit when every chunk is
//! acknowledged, refused, lost, or the deadline passes.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_control::Channel;
use ferry_core::{
    Answer, BatchProgress, NodeAddr, NodeId, OpError, OpKind, RdmaOp, Region, SubmitError,
};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, debug_span};

use crate::deadline::Deadlines;
use crate::frame::{RESPONSE_LEN, Request, RequestKind, Response};
use crate::io::{FrameReader, IoVecs};

/// Initiator tuning; see `TcpConfig` for what each knob trades.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientConfig {
    pub node: NodeId,
    pub connections: usize,
    pub chunk_size: usize,
    pub queue_depth: usize,
    /// Bytes one connection may have requested and not yet had answered.
    pub window: u32,
}

/// Most chunks one connection writes with a single `sendmsg`.
const MAX_CHUNKS_PER_SEND: usize = 128;

/// A piece of one op, at most `chunk_size` bytes, travelling as one request.
///
/// It holds a `Region` clone: the local bytes stay registered and allocated
/// for as long as the chunk exists, whichever task holds it. Dropping a chunk
/// without `finish` counts it as lost, so a submit can never wait on a chunk
/// that no longer exists.
struct Chunk {
    op: usize,
    kind: OpKind,
    region: Region,
    offset: usize,
    request: Request,
    submit: Option<Arc<BatchProgress>>,
    endpoint: SocketAddr,
}

impl Chunk {
    fn len(&self) -> usize {
        self.request.len as usize
    }

    /// What the chunk takes of its connection's window while in flight: its
    /// bytes, capped at the window so that any chunk fits on its own.
    fn cost(&self, window: u32) -> u32 {
        self.request.len.min(window.into()).max(1) as u32
    }

    /// First byte of the local range this chunk reads from or writes to.
    fn local_ptr(&self) -> *mut u8 {
        // SAFETY: `offset + len` lies within the region (the op's local slice
        // was bounds-checked and chunks partition it).
        unsafe { self.region.memory().as_ptr().add(self.offset) }
    }

    fn is_abandoned(&self) -> bool {
        self.submit.as_ref().is_some_and(|s| s.is_abandoned())
    }

    fn finish(mut self, result: Result<(), OpError>) {
        if let Some(submit) = self.submit.take() {
            submit.piece_done(self.op, result);
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Some(submit) = self.submit.take() {
            submit.piece_done(
                self.op,
                Err(OpError::ConnectionLost {
                    endpoint: self.endpoint,
                }),
            );
        }
    }
}

/// Sending half of one data connection; the connection task owns the rest.
#[derive(Clone)]
struct Conn {
    tx: mpsc::Sender<Chunk>,
    closed: CancellationToken,
}

struct Peer {
    addr: NodeAddr,
    slots: Vec<tokio::sync::Mutex<Option<Conn>>>,
    next: AtomicUsize,
}

/// Connection pools to every peer this node has talked to.
pub(crate) struct Peers {
    config: ClientConfig,
    peers: Mutex<HashMap<NodeAddr, Arc<Peer>>>,
    deadlines: Arc<Deadlines>,
}

impl Peers {
    /// Starts the deadline keeper on the current tokio runtime.
    pub fn new(config: ClientConfig) -> Self {
        Peers {
            config,
            peers: Mutex::default(),
            deadlines: Deadlines::start(),
        }
    }

    pub fn connected(&self) -> usize {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.values().map(|p| p.live_connections()).sum()
    }

    fn peer(&self, addr: NodeAddr) -> Arc<Peer> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        peers
            .entry(addr)
            .or_insert_with(|| {
                Arc::new(Peer {
                    addr,
                    slots: (0..self.config.connections.max(1))
                        .map(|_| Default::default())
                        .collect(),
                    next: AtomicUsize::new(0),
                })
            })
            .clone()
    }

    /// Runs one batch to completion or deadline.
    pub async fn submit(&self, ops: Vec<RdmaOp>, timeout: Duration) -> Result<(), SubmitError> {
        let (tx, rx) = oneshot::channel();
        self.start(ops, timeout, Box::new(move |result| _ = tx.send(result)))
            .await;
        // Every path through `start` answers exactly once (a batch's last
        // piece, or its deadline); a dropped answer would be a bug there.
        rx.await.unwrap_or(Err(SubmitError::BackendStopped))
    }

    /// Starts one batch and hands its outcome to `answer`, from the thread
    /// that finishes it: the last chunk's response, or the deadline. The
    /// future returned queues the chunks on their connections (connecting
    /// first if needed) and ends once they are queued or the deadline has
    /// passed; the answer may come before or after. A caller that is an
    /// actor answers its own caller this way without a task per submit.
    pub async fn start(&self, ops: Vec<RdmaOp>, timeout: Duration, answer: Answer) {
        let deadline = Instant::now() + timeout;
        let bytes: u64 = ops.iter().map(RdmaOp::len).sum();
        // A batch usually goes to one peer; name the first.
        let peer = ops.first().map(|op| op.remote.owner().endpoint);
        let span = debug_span!(
            "submit",
            transport = "tcp",
            peer = ?peer,
            ops = ops.len(),
            bytes,
            outcome = tracing::field::Empty
        );
        let answer: Answer = {
            let span = span.clone();
            Box::new(move |result| {
                span.record("outcome", tracing::field::debug(&result));
                debug!(parent: &span, ?result, "submit finished");
                answer(result)
            })
        };
        // Every op is checked before any byte moves: a bad op fails the whole
        // batch untouched.
        for (index, op) in ops.iter().enumerate() {
            let error = match op.validate() {
                Err(error) => error,
                Ok(()) if op.remote.transports().tcp.is_none() => OpError::NoSharedTransport,
                Ok(()) => continue,
            };
            return answer(Err(SubmitError::Op { index, error }));
        }
        let chunk_size = self.config.chunk_size.max(1) as u64;
        let state = Arc::new(BatchProgress::new(
            ops.iter().map(|op| op.len().div_ceil(chunk_size) as u32),
        ));
        if state.total_pieces() == 0 {
            return answer(Ok(()));
        }
        let key = self.deadlines.insert(deadline, state.clone(), timeout);
        let deadlines = self.deadlines.clone();
        state.answer_when_done(Box::new(move |result| {
            deadlines.remove(key);
            answer(result)
        }));

        let enqueue = async {
            // A peer that could not be reached is not retried for every chunk.
            let mut unreachable: HashMap<NodeAddr, OpError> = HashMap::new();
            for (index, op) in ops.into_iter().enumerate() {
                let peer = self.peer(op.remote.owner());
                let tcp = op.remote.transports().tcp.expect("checked above");
                let kind = match op.kind {
                    OpKind::Read => RequestKind::Read,
                    OpKind::Write => RequestKind::Write,
                };
                let mut queued = 0;
                while queued < op.len() {
                    let len = chunk_size.min(op.len() - queued);
                    let chunk = Chunk {
                        op: index,
                        kind: op.kind,
                        region: op.local.region().clone(),
                        // Inside the local slice, so below the region's
                        // length, which fits usize.
                        offset: (op.local.offset() + queued) as usize,
                        request: Request {
                            kind,
                            id: 0,
                            region: op.remote.region(),
                            generation: op.remote.generation(),
                            addr: op.remote.addr() + queued,
                            len,
                            token: tcp.token,
                        },
                        submit: Some(state.clone()),
                        endpoint: peer.addr.endpoint,
                    };
                    queued += len;
                    if let Some(e) = unreachable.get(&peer.addr) {
                        chunk.finish(Err(e.clone()));
                        continue;
                    }
                    if let Err(e) = peer.send(chunk, self.config).await {
                        unreachable.insert(peer.addr, e);
                    }
                }
            }
        };

        // Pinned here rather than moved into `timeout_at`, so that at the
        // deadline the batch is answered while the queueing still exists:
        // dropping it drops the chunks it was still queueing, which count as
        // lost and must not turn a timeout into a connection error.
        let work = std::pin::pin!(enqueue.instrument(span));
        if tokio::time::timeout_at(deadline, work).await.is_err() {
            state.expire(timeout);
        }
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        self.deadlines.stop();
    }
}

impl Peer {
    fn live_connections(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.try_lock()
                    .is_ok_and(|c| c.as_ref().is_some_and(|c| !c.closed.is_cancelled()))
            })
            .count()
    }

    /// Queues `chunk` on the next connection, connecting it first if needed.
    /// A connection failure finishes the chunk and is returned too.
    async fn send(&self, chunk: Chunk, config: ClientConfig) -> Result<(), OpError> {
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let conn = {
            let mut guard = self.slots[slot].lock().await;
            match &*guard {
                Some(conn) if !conn.closed.is_cancelled() => conn.clone(),
                _ => match connect(self.addr, config).await {
                    Ok(conn) => guard.insert(conn).clone(),
                    Err(e) => {
                        chunk.finish(Err(e.clone()));
                        return Err(e);
                    }
                },
            }
        };
        if let Err(mpsc::error::SendError(chunk)) = conn.tx.send(chunk).await {
            // The connection ended between the check above and now.
            let endpoint = chunk.endpoint;
            chunk.finish(Err(OpError::ConnectionLost { endpoint }));
        }
        Ok(())
    }
}

async fn connect(addr: NodeAddr, config: ClientConfig) -> Result<Conn, OpError> {
    let stream = ferry_control::connect(addr, config.node, Channel::TCP_DATA).await?;
    let endpoint = addr.endpoint;
    let (tx, rx) = mpsc::channel(config.queue_depth.max(1));
    let closed = CancellationToken::new();
    tokio::spawn(run_connection(
        stream,
        rx,
        closed.clone(),
        endpoint,
        config.window.max(1),
    ));
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
    window: u32,
) {
    let pending = Mutex::new(HashMap::<u64, Chunk>::new());
    let room = Semaphore::new(window as usize);
    let mut reader = FrameReader::default();
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
    pending: &Mutex<HashMap<u64, Chunk>>,
    closed: &CancellationToken,
    (room, window): (&Semaphore, u32),
) -> io::Result<()> {
    let mut next_id = 0u64;
    let mut batch = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    let mut headers = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
    // (pin, payload pointer as integer, payload length) per chunk in flight
    let mut payloads: Vec<(Region, usize, usize)> = Vec::with_capacity(MAX_CHUNKS_PER_SEND);
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
        if first.is_abandoned() {
            // Its submit already returned Timeout; never put it on the wire.
            first.finish(Ok(()));
        } else {
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
            if first.is_abandoned() {
                room.add_permits(cost as usize);
                first.finish(Ok(()));
            } else {
                batch.push(first);
            }
        }
        // Then whatever is queued and fits now.
        while batch.len() < MAX_CHUNKS_PER_SEND {
            let Ok(chunk) = rx.try_recv() else { break };
            if chunk.is_abandoned() {
                chunk.finish(Ok(()));
                continue;
            }
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
                chunk.request.id = next_id;
                headers.push(chunk.request.encode());
                let payload_len = if chunk.kind == OpKind::Write {
                    chunk.len()
                } else {
                    0
                };
                // The writer keeps its own pin: a (buggy or hostile) early
                // response must not free memory that sendmsg is still reading.
                payloads.push((
                    chunk.region.clone(),
                    chunk.local_ptr() as usize,
                    payload_len,
                ));
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
    pending: &Mutex<HashMap<u64, Chunk>>,
    closed: &CancellationToken,
    (room, window): (&Semaphore, u32),
) -> io::Result<()> {
    let protocol = |msg: &str| io::Error::new(io::ErrorKind::InvalidData, msg.to_string());
    loop {
        let header = tokio::select! {
            biased;
            _ = closed.cancelled() => return Ok(()),
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
                if chunk.kind != OpKind::Read || len != chunk.request.len {
                    return Err(protocol("read data does not match its request"));
                }
                let dst = chunk.local_ptr();
                // SAFETY: `chunk` holds a Region clone, keeping `dst..dst+len`
                // (inside the op's bounds-checked local slice) allocated and
                // registered until after this call.
                let received = tokio::select! {
                    biased;
                    _ = closed.cancelled() => return Ok(()),
                    r = unsafe { reader.payload(stream, dst, len as usize) } => r,
                };
                received?;
                chunk.finish(Ok(()));
            }
            Response::WriteAck { .. } => {
                if chunk.kind != OpKind::Write {
                    return Err(protocol("write ack for a read request"));
                }
                chunk.finish(Ok(()));
            }
            Response::Refused { refusal, .. } => {
                let error = refusal.into_op_error(chunk.request.generation, chunk.request.len);
                chunk.finish(Err(error));
            }
        }
        room.add_permits(cost as usize);
    }
}
