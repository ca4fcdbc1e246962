//! The owner side: serves one-sided reads and writes into registered
//! regions on each data connection the endpoint hands over. A misbehaving
//! client loses its own connection and nothing else.

use std::collections::HashSet;
use std::io;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ferry_control::{Connection, ConnectionPermit, IdleClose, Messages, OfferError};
use ferry_core::{MemoryHold, MemoryHolder, NodeId};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::frame::{
    ClientFrame, Notify, NotifyOutcome, REQUEST_LEN, RESPONSE_LEN, Range, Ranges, Refusal,
    RequestKind, Response, SCOPE_LEN,
};
use crate::io::{FrameReader, IoVecs, LARGE_PAYLOAD, MAX_IOV, open_tag};
use crate::table::{Credentials, RegionTable, ScopeCache};
use ferry_control::auth::{FRAME_TAG_LEN, FrameMac};
use ferry_control::hello::{Authenticated, Sealing};

/// Acknowledgements are coalesced up to this many before they are sent.
const MAX_PENDING_ACKS: usize = 64;
// A read response shares its system call with the staged acks.
const _: () = assert!(MAX_PENDING_ACKS + 2 <= MAX_IOV);

/// Tags of notified batches with a refused chunk whose notification has not
/// come yet, per connection. A well-behaved client sends every tagged
/// batch's notification (or its discard) behind its chunks, so this holds
/// only batches in flight; one that grows past this is hostile.
const MAX_FAILED_TAGS: usize = 1 << 16;

/// Serves one data connection (after its hello) until the client closes it
/// or breaks the protocol, or the endpoint closes it for being idle: for its
/// idle timeout, or to make room for a new connection at a bound. It is idle
/// while it waits for a request with every response sent; a peer silent in
/// the middle of a frame, or not reading the responses it asked for, is cut
/// after the frame timeout and evictable before. Notifications go
/// to `inbox`, if the node has one. Each wait for a request polls the socket
/// for `busy_poll` before it sleeps (see `TcpConfig::busy_poll`).
pub(crate) async fn serve_connection(
    connection: Connection,
    table: Arc<RegionTable>,
    inbox: Weak<Messages>,
    busy_poll: Duration,
) {
    let Connection {
        stream,
        node,
        auth,
        remote,
        permit,
        ..
    } = connection;
    // Sealed where the hello proved a cluster secret: every request's tag
    // is checked before it acts, every response carries one, and the
    // connection ends when that secret is revoked.
    let Sealing {
        recv: check,
        send: seal,
        revoked,
        tracked,
    } = Authenticated::split(auth);
    debug!(%remote, client = ?node, "data connection open");
    // Chunks this connection serves hold their region's memory in the
    // peer's name (see `table::Grant`).
    let peer = MemoryHolder::TcpPeer { node, remote };
    // Every wait inside a frame is bounded by the permit (see
    // `ConnectionLimits::frame_timeout`), reads and response writes alike.
    let permit = Arc::new(permit);
    let reader = FrameReader::new(busy_poll).mid_frame_bound(permit.clone());
    let out = Outgoing {
        acks: Vec::new(),
        seal,
    };
    let serving = serve(
        &stream, reader, check, out, &table, &inbox, &permit, &peer, node,
    );
    let revoked = async {
        match &revoked {
            Some(revoked) => revoked.cancelled().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        served = serving => match served {
            Ok(None) => {}
            Ok(Some(idle)) => debug!(%remote, "data connection closed: {idle}"),
            Err(e) if crate::io::is_forged(&e) => {
                if let Some(tracked) = &tracked {
                    tracked.forged("tcp-data", &remote);
                }
            }
            Err(e) => debug!(%remote, error = %e, "data connection closed with an error"),
        },
        () = revoked => debug!(%remote, "data connection closed: the cluster secret it proved was revoked"),
    }
}

/// `Some` when the connection was closed for being idle. `check`: the
/// receiving direction's keys of a sealed connection.
#[expect(clippy::too_many_arguments, reason = "one connection's whole context")]
async fn serve(
    stream: &TcpStream,
    mut reader: FrameReader,
    mut check: Option<FrameMac>,
    mut out: Outgoing,
    table: &RegionTable,
    inbox: &Weak<Messages>,
    permit: &ConnectionPermit,
    peer: &MemoryHolder,
    node: NodeId,
) -> io::Result<Option<IdleClose>> {
    let mut failed_tags = HashSet::new();
    let mut scratch = Scratch::default();
    loop {
        // About to block on the socket: first send the acks we owe, so a
        // client waiting for them is never stalled behind our own read.
        let header = if reader.buffered() < REQUEST_LEN {
            out.flush(stream, permit).await?;
            // Nothing in flight: idle until the next request has come.
            match permit
                .while_idle(reader.header::<REQUEST_LEN>(stream))
                .await
            {
                Ok(header) => header?,
                Err(idle) => return Ok(Some(idle)),
            }
        } else {
            if out.staged() >= MAX_PENDING_ACKS {
                out.flush(stream, permit).await?;
            }
            reader.header::<REQUEST_LEN>(stream).await?
        };
        let Some(bytes) = header else {
            return out.flush(stream, permit).await.map(|()| None);
        };
        let frame = match ClientFrame::decode(&bytes) {
            Ok(frame) if frame.scopes_len() > 0 => {
                read_scopes(stream, &mut reader, frame, &mut scratch.scopes).await?
            }
            other => other,
        };
        // The scopes' bytes, as read (none for an unscoped frame): sealed,
        // the frame's tag covers them.
        let scoped = match &frame {
            Ok(frame) => frame.scopes_len(),
            Err(_) => 0,
        };
        // A plain request is checked into one span, a ranges request into
        // one per range; `answer` moves or refuses either.
        let (asked, checked) = match frame {
            Ok(ClientFrame::Op(req)) => {
                if let Some(mac) = &mut check {
                    let scopes = &scratch.scopes[..scoped];
                    reader.check_tag(stream, mac, &[&bytes, scopes]).await?;
                }
                let spans = &mut scratch.spans;
                spans.clear();
                let cache = &mut scratch.cache;
                let checked = table.authorize(&req, cache, || peer.clone()).map(|grant| {
                    // Below MAX_CHUNK, far below usize::MAX.
                    spans.push((grant.offset, req.len as usize));
                    grant.memory
                });
                let asked = Asked {
                    kind: req.kind,
                    id: req.id,
                    len: req.len,
                    tag: req.tag,
                };
                (asked, checked.map_err(|refusal| (0, refusal)))
            }
            Ok(ClientFrame::Ranges(ranges)) => {
                let checked = check_ranges(
                    stream,
                    permit,
                    &mut reader,
                    (&bytes, scoped, check.as_mut()),
                    &ranges,
                    table,
                    peer,
                    &mut out,
                    &mut scratch,
                )
                .await?;
                let asked = Asked {
                    kind: ranges.kind,
                    id: ranges.id,
                    len: ranges.len,
                    tag: ranges.tag,
                };
                (asked, checked)
            }
            Ok(ClientFrame::Notify(notify)) if notify.from.id != node => {
                // The sender a notification names is the node this
                // connection's hello named (and, with a cluster secret,
                // proved): a peer cannot speak as another node. Refused
                // and hung up on, as for a malformed frame.
                warn!(hello = %node, claimed = %notify.from.id,
                    "a notification naming another node than the connection's; disconnected");
                out.refuse(notify.id, 0, Refusal::Malformed, 0);
                out.flush(stream, permit).await?;
                return Err(invalid("a notification naming another node"));
            }
            Ok(ClientFrame::Notify(notify)) => {
                let sealed = (&bytes, check.as_mut());
                let outcome = notified(
                    stream,
                    &mut reader,
                    sealed,
                    &notify,
                    &mut failed_tags,
                    inbox,
                )
                .await?;
                out.push(
                    Response::Notified {
                        id: notify.id,
                        outcome,
                    }
                    .encode(),
                );
                continue;
            }
            Err((_, e)) if check.is_some() => {
                // Nothing of a sealed frame that does not parse can be
                // trusted, its id included: hang up.
                out.flush(stream, permit).await?;
                return Err(invalid(e));
            }
            Err((id, e)) => {
                // The payload length cannot be trusted: refuse and hang up.
                out.refuse(id, 0, Refusal::Malformed, 0);
                out.flush(stream, permit).await?;
                return Err(invalid(e));
            }
        };
        answer(
            stream,
            permit,
            &mut reader,
            &mut out,
            &mut failed_tags,
            asked,
            checked,
            (&scratch.spans, &mut scratch.landing),
        )
        .await?;
    }
}

/// What answering a request needs of its frame, a plain or a ranges one.
struct Asked {
    kind: RequestKind,
    id: u64,
    /// Bytes of all its spans.
    len: u64,
    tag: u64,
}

/// Answers a checked request. Granted: a write's payloads go from the
/// stream into `spans` (offset, length) of `memory`, in order, and its ack
/// is staged; a read's spans go back, in order, behind one `ReadData`
/// header, with the staged acks. Refused: a write's payload is read and
/// dropped, the refusal names `range`, and a notified batch's tag is
/// remembered so that its notification is not delivered.
#[expect(clippy::too_many_arguments, reason = "one request's whole context")]
async fn answer(
    stream: &TcpStream,
    permit: &ConnectionPermit,
    reader: &mut FrameReader,
    out: &mut Outgoing,
    failed_tags: &mut HashSet<u64>,
    asked: Asked,
    checked: Result<MemoryHold, (u16, Refusal)>,
    (spans, landing): (&[(usize, usize)], &mut IoVecs),
) -> io::Result<()> {
    let memory = match checked {
        Ok(memory) => memory,
        Err((range, refusal)) => {
            if asked.kind == RequestKind::Write {
                reader.discard(stream, asked.len as usize).await?;
            }
            out.refuse(asked.id, range, refusal, asked.len);
            if asked.tag != 0 {
                remember_failed(failed_tags, asked.tag, stream, permit, out).await?;
            }
            return Ok(());
        }
    };
    let base = || memory.memory().as_ptr();
    match asked.kind {
        RequestKind::Write if spans.len() > 1 && asked.len >= LARGE_PAYLOAD as u64 => {
            // Many payloads, small ones among them: straight into their
            // places, not through the read buffer.
            landing.clear();
            for &(offset, len) in spans {
                // SAFETY: every span was bounds-checked against the block's
                // length, and `memory` keeps the block alive across the
                // call. Spans that overlap are filled in order, the later
                // bytes winning, as one by one.
                unsafe { landing.push_mut(base().add(offset), len) };
            }
            // SAFETY: as above.
            unsafe { reader.scatter(stream, landing).await? };
            served("write", asked.len);
            out.push(Response::WriteAck { id: asked.id }.encode());
        }
        RequestKind::Write => {
            for &(offset, len) in spans {
                // SAFETY: every span was bounds-checked against the block's
                // length, and `memory` keeps the block alive across the call.
                unsafe { reader.payload(stream, base().add(offset), len).await? };
            }
            served("write", asked.len);
            out.push(Response::WriteAck { id: asked.id }.encode());
        }
        RequestKind::Read => {
            let (header, header_len) = out.sealed(
                Response::ReadData {
                    id: asked.id,
                    len: asked.len,
                }
                .encode(),
            );
            let mut iov = IoVecs::default();
            // SAFETY: `out`'s staged bytes and `header` live on this frame
            // until `send_all` returns; the spans were bounds-checked and
            // `memory` pins them until then too.
            unsafe {
                out.push_into(&mut iov);
                iov.push(header.as_ptr(), header_len);
                for &(offset, len) in spans {
                    iov.push(base().add(offset), len);
                }
            }
            iov.send_all(stream, Some(permit)).await?;
            out.acks.clear();
            served("read", asked.len);
        }
    }
    Ok(())
}

/// Notes that batch `tag` had a chunk refused, so that its notification is
/// not delivered; a client with too many such batches outstanding is cut off.
async fn remember_failed(
    failed_tags: &mut HashSet<u64>,
    tag: u64,
    stream: &TcpStream,
    permit: &ConnectionPermit,
    out: &mut Outgoing,
) -> io::Result<()> {
    if failed_tags.len() >= MAX_FAILED_TAGS {
        out.flush(stream, permit).await?;
        return Err(invalid("too many failed batches without a notification"));
    }
    failed_tags.insert(tag);
    Ok(())
}

/// A connection's buffers for requests, kept between them.
#[derive(Default)]
struct Scratch {
    /// A [`Ranges`] request's table, as read.
    table: Vec<u8>,
    /// The table, parsed.
    ranges: Vec<Range>,
    /// The granted request's (offset, length) spans in its region.
    spans: Vec<(usize, usize)>,
    /// A scoped request's scopes, as read.
    scopes: Vec<u8>,
    /// The narrowed credentials checked last.
    cache: ScopeCache,
    /// A ranges write's destinations, received into with one `recvmsg`.
    landing: IoVecs,
}

/// Reads the scopes that follow a scoped request's header into `frame`.
/// Scopes that do not parse leave the rest of the frame undelimited: the
/// caller refuses it and hangs up, as for a malformed header.
async fn read_scopes(
    stream: &TcpStream,
    reader: &mut FrameReader,
    mut frame: ClientFrame,
    bytes: &mut Vec<u8>,
) -> io::Result<Result<ClientFrame, (u64, crate::frame::FrameError)>> {
    let len = frame.scopes_len();
    debug_assert!(len <= ferry_core::MAX_SCOPES * SCOPE_LEN);
    bytes.resize(len, 0);
    // Exactly the scopes: a large payload behind them goes straight to its
    // place.
    // SAFETY: `bytes` is `len` bytes long and lives across the call.
    unsafe { reader.exact(stream, bytes.as_mut_ptr(), len).await? };
    Ok(match frame.read_scopes(bytes) {
        Ok(()) => Ok(frame),
        Err(e) => Err((frame.id(), e)),
    })
}

/// Checks one [`Ranges`] request: reads its table (and, sealed, the tag
/// over its `header` and table, checked with `check`), authorizes the
/// region once and checks every range's bounds, filling `scratch.spans`,
/// before any byte moves. Refused: the first range that failed, and why.
#[expect(clippy::too_many_arguments, reason = "one request's whole context")]
async fn check_ranges(
    stream: &TcpStream,
    permit: &ConnectionPermit,
    reader: &mut FrameReader,
    (header, scoped, check): (&[u8; REQUEST_LEN], usize, Option<&mut FrameMac>),
    req: &Ranges,
    table: &RegionTable,
    peer: &MemoryHolder,
    out: &mut Outgoing,
    scratch: &mut Scratch,
) -> io::Result<Result<MemoryHold, (u16, Refusal)>> {
    let Scratch {
        table: bytes,
        ranges,
        spans,
        cache,
        scopes,
        ..
    } = scratch;
    let table_len = req.table_len();
    let tag_len = if check.is_some() { FRAME_TAG_LEN } else { 0 };
    bytes.resize(table_len + tag_len, 0);
    // Exactly the table, and its tag when sealed, in one read (a second
    // read for the tag alone cost a `recv`, and often a sleep, per frame):
    // the ranges' payloads behind it, if large, go straight from the
    // socket to their places.
    // SAFETY: `bytes` is that long and lives across the call.
    unsafe {
        reader
            .exact(stream, bytes.as_mut_ptr(), bytes.len())
            .await?
    };
    let (entries, tag) = bytes.split_at(table_len);
    if let Some(mac) = check {
        open_tag(mac, &[header, &scopes[..scoped], entries], tag)?;
    }
    if let Err(e) = req.decode_table(entries, ranges) {
        // The payload can no longer be delimited: refuse and hang up.
        out.refuse(req.id, 0, Refusal::Malformed, 0);
        out.flush(stream, permit).await?;
        return Err(invalid(e));
    }
    let credentials = Credentials {
        region: req.region,
        generation: req.generation,
        token: req.token,
        scopes: &req.scopes,
    };
    Ok(table
        .authorize_region(credentials, req.kind, cache)
        .map_err(|refusal| (0, refusal))
        .and_then(|region| {
            spans.clear();
            for (k, range) in ranges.iter().enumerate() {
                // `k` < MAX_RANGES, which fits u16.
                let offset = region.offset(range.addr, range.len);
                let offset = offset.map_err(|refusal| (k as u16, refusal))?;
                // Below MAX_CHUNK, far below usize::MAX.
                spans.push((offset, range.len as usize));
            }
            region.hold(|| peer.clone()).map_err(|r| (0, r))
        }))
}

/// Reads a notification's body and hands it to the inbox, unless a chunk of
/// its batch was refused on this connection. Every chunk the client sent
/// before it has been served by now: frames are served in order. Sealed,
/// the tag that follows the body covers its `header` and body, and is
/// checked (with `check`) before anything is delivered.
async fn notified(
    stream: &TcpStream,
    reader: &mut FrameReader,
    (header, check): (&[u8; REQUEST_LEN], Option<&mut FrameMac>),
    notify: &Notify,
    failed_tags: &mut HashSet<u64>,
    inbox: &Weak<Messages>,
) -> io::Result<NotifyOutcome> {
    let inbox = inbox.upgrade();
    let len = notify.len as usize;
    let failed = failed_tags.remove(&notify.tag);
    let limit = inbox.as_ref().map_or(0, |inbox| inbox.max_len());
    let outcome = if notify.discard {
        NotifyOutcome::Discarded
    } else if failed {
        NotifyOutcome::BatchFailed
    } else if inbox.is_none() {
        NotifyOutcome::NoInbox
    } else if len > limit {
        NotifyOutcome::TooLarge {
            limit: limit as u64,
        }
    } else {
        NotifyOutcome::Delivered
    };
    let delivered = matches!((outcome, &inbox), (NotifyOutcome::Delivered, Some(_)));
    if !delivered && check.is_none() {
        reader.discard(stream, len).await?;
        return Ok(outcome);
    }
    let mut body = vec![0u8; len];
    // SAFETY: `body` is `len` bytes long and lives across the call.
    unsafe { reader.payload(stream, body.as_mut_ptr(), len).await? };
    if let Some(mac) = check {
        reader.check_tag(stream, mac, &[header, &body]).await?;
    }
    let (NotifyOutcome::Delivered, Some(inbox)) = (outcome, inbox) else {
        return Ok(outcome);
    };
    metrics::counter!("ferry_served_notifications_total", "transport" => "tcp").increment(1);
    Ok(match inbox.offer_notification(notify.from, body.into()) {
        Ok(()) => NotifyOutcome::Delivered,
        Err(OfferError::Full) => NotifyOutcome::InboxFull,
        Err(OfferError::Closed) => NotifyOutcome::NoInbox,
    })
}

/// Counts bytes and requests this node served to peers (one-sided ops leave
/// no other trace on the owner's side).
fn served(op: &'static str, bytes: u64) {
    metrics::counter!("ferry_served_bytes_total", "transport" => "tcp", "op" => op)
        .increment(bytes);
    metrics::counter!("ferry_served_requests_total", "transport" => "tcp", "op" => op).increment(1);
}

/// Small responses waiting to be sent in one system call, each sealed as
/// it is staged on a sealed connection (so tags go out in the order they
/// were made, which is the order the client checks them in).
struct Outgoing {
    /// Encoded responses (and their tags), back to back.
    acks: Vec<u8>,
    /// The sending direction's keys of a sealed connection.
    seal: Option<FrameMac>,
}

impl Outgoing {
    /// Stages `response`, and its tag on a sealed connection.
    fn push(&mut self, response: [u8; RESPONSE_LEN]) {
        self.acks.extend_from_slice(&response);
        if let Some(mac) = &mut self.seal {
            self.acks.extend_from_slice(&mac.seal(&[&response]));
        }
    }

    /// `header` and its tag (on a sealed connection), for a response sent
    /// apart from the staged ones (read data): the bytes and their length.
    fn sealed(
        &mut self,
        header: [u8; RESPONSE_LEN],
    ) -> ([u8; RESPONSE_LEN + FRAME_TAG_LEN], usize) {
        let mut out = [0u8; RESPONSE_LEN + FRAME_TAG_LEN];
        out[..RESPONSE_LEN].copy_from_slice(&header);
        match &mut self.seal {
            Some(mac) => {
                out[RESPONSE_LEN..].copy_from_slice(&mac.seal(&[&header]));
                (out, out.len())
            }
            None => (out, RESPONSE_LEN),
        }
    }

    fn refuse(&mut self, id: u64, range: u16, refusal: Refusal, len: u64) {
        metrics::counter!("ferry_served_refusals_total", "transport" => "tcp").increment(1);
        let refused = Response::Refused {
            id,
            range,
            refusal,
            len,
        };
        self.push(refused.encode());
    }

    /// How many responses are staged.
    fn staged(&self) -> usize {
        let each = RESPONSE_LEN
            + if self.seal.is_some() {
                FRAME_TAG_LEN
            } else {
                0
            };
        self.acks.len() / each
    }

    /// # Safety
    ///
    /// `self` must not be modified until `iov` has been sent or cleared.
    unsafe fn push_into(&self, iov: &mut IoVecs) {
        if !self.acks.is_empty() {
            // SAFETY: forwarded to the caller.
            unsafe { iov.push(self.acks.as_ptr(), self.acks.len()) };
        }
    }

    async fn flush(&mut self, stream: &TcpStream, permit: &ConnectionPermit) -> io::Result<()> {
        if self.acks.is_empty() {
            return Ok(());
        }
        let mut iov = IoVecs::default();
        // SAFETY: `self.acks` is not touched until `send_all` returns.
        unsafe { self.push_into(&mut iov) };
        iov.send_all(stream, Some(permit)).await?;
        self.acks.clear();
        Ok(())
    }
}

fn invalid(e: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}
