//! The owner side: accepts data connections and serves one-sided reads and
//! writes into registered regions. A misbehaving client loses its own
//! connection and nothing else.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::NodeId;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::frame::{
    Channel, HELLO_LEN, Hello, HelloReply, HelloStatus, REQUEST_LEN, RESPONSE_LEN, Refusal,
    Request, RequestKind, Response, VERSION,
};
use crate::io::{FrameReader, IoVecs, MAX_IOV};
use crate::table::RegionTable;

/// A client must say hello this fast; a silent socket does not get to hold a
/// task forever.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);

/// Acknowledgements are coalesced up to this many before they are sent.
const MAX_PENDING_ACKS: usize = 64;
// A read response shares its system call with the staged acks.
const _: () = assert!(MAX_PENDING_ACKS + 2 <= MAX_IOV);

/// A `Control` connection, after a successful hello, for the transport that
/// registered to receive them.
pub struct ControlConnection {
    pub stream: TcpStream,
    /// The node id the client announced in its hello.
    pub peer: NodeId,
}

pub(crate) async fn accept_loop(
    listener: TcpListener,
    node: NodeId,
    table: Arc<RegionTable>,
    control: Option<mpsc::Sender<ControlConnection>>,
    shutdown: CancellationToken,
) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.cancelled() => break,
        };
        // Reap finished connection tasks so the set does not grow forever.
        while connections.try_join_next().is_some() {}
        match accepted {
            Ok((stream, peer)) => {
                let table = table.clone();
                let control = control.clone();
                connections.spawn(async move {
                    if let Err(e) = serve(stream, node, &table, control.as_ref()).await {
                        debug!(%peer, error = %e, "data connection closed with an error");
                    }
                });
            }
            // Running out of fds is transient; back off instead of spinning.
            Err(e) => {
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    connections.shutdown().await;
}

async fn serve(
    mut stream: TcpStream,
    node: NodeId,
    table: &RegionTable,
    control: Option<&mpsc::Sender<ControlConnection>>,
) -> io::Result<()> {
    crate::io::configure(&stream)?;
    let peer: SocketAddr = stream.peer_addr()?;
    let mut reader = FrameReader::default();

    let hello =
        match tokio::time::timeout(HELLO_DEADLINE, reader.header::<HELLO_LEN>(&stream)).await {
            Ok(Ok(Some(bytes))) => Hello::decode(&bytes).map_err(invalid)?,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "no hello")),
        };
    let status = if hello.version != VERSION {
        HelloStatus::BadVersion
    } else if hello.channel == Channel::Data as u8
        || (hello.channel == Channel::Control as u8 && control.is_some())
    {
        HelloStatus::Ok
    } else {
        HelloStatus::BadChannel
    };
    let reply = HelloReply {
        version: VERSION,
        status: status as u8,
        node,
    };
    stream.write_all(&reply.encode()).await?;
    if status != HelloStatus::Ok {
        return Err(invalid(format!("refused hello from {peer}: {status:?}")));
    }
    if let (Some(control), true) = (control, hello.channel == Channel::Control as u8) {
        // The client waits for our reply before it says more, so nothing of
        // the next protocol can be sitting in our read buffer.
        if reader.buffered() != 0 {
            return Err(invalid("control client spoke before the hello reply"));
        }
        let handed = control
            .send(ControlConnection {
                stream,
                peer: hello.node,
            })
            .await;
        return handed
            .map_err(|_| io::Error::new(io::ErrorKind::NotConnected, "control handler gone"));
    }
    debug!(%peer, client = ?hello.node, "data connection open");

    let mut out = Outgoing::default();
    loop {
        // About to block on the socket: first send the acks we owe, so a
        // client waiting for them is never stalled behind our own read.
        if reader.buffered() < REQUEST_LEN || out.acks.len() >= MAX_PENDING_ACKS {
            out.flush(&stream).await?;
        }
        let Some(bytes) = reader.header::<REQUEST_LEN>(&stream).await? else {
            return out.flush(&stream).await;
        };
        let req = match Request::decode(&bytes) {
            Ok(req) => req,
            Err((id, e)) => {
                // The payload length cannot be trusted: refuse and hang up.
                out.refuse(id, Refusal::Malformed, 0);
                out.flush(&stream).await?;
                return Err(invalid(e));
            }
        };
        let len = req.len as usize;
        match (req.kind, table.authorize(&req)) {
            (RequestKind::Write, Ok(grant)) => {
                // SAFETY: `authorize` checked offset+len against the block's
                // length, and `grant.memory` keeps the block alive across the call.
                unsafe {
                    reader
                        .payload(&stream, grant.memory.as_ptr().add(grant.offset), len)
                        .await?
                };
                served("write", req.len);
                out.acks.push(Response::WriteAck { id: req.id }.encode());
            }
            (RequestKind::Read, Ok(grant)) => {
                let header = Response::ReadData {
                    id: req.id,
                    len: req.len,
                }
                .encode();
                let mut iov = IoVecs::default();
                // SAFETY: `out`'s staged bytes and `header` live on this frame
                // until `send_all` returns; the region range was bounds-checked
                // and `grant.memory` pins it until then too.
                unsafe {
                    out.push_into(&mut iov);
                    iov.push(header.as_ptr(), header.len());
                    iov.push(grant.memory.as_ptr().add(grant.offset), len);
                }
                iov.send_all(&stream).await?;
                out.acks.clear();
                served("read", req.len);
            }
            (kind, Err(refusal)) => {
                if kind == RequestKind::Write {
                    reader.discard(&stream, len).await?;
                }
                metrics::counter!("ferry_served_refusals_total", "transport" => "tcp").increment(1);
                out.refuse(req.id, refusal, req.len);
            }
        }
    }
}

/// Counts bytes and requests this node served to peers (one-sided ops leave
/// no other trace on the owner's side).
fn served(op: &'static str, bytes: u64) {
    metrics::counter!("ferry_served_bytes_total", "transport" => "tcp", "op" => op)
        .increment(bytes);
    metrics::counter!("ferry_served_requests_total", "transport" => "tcp", "op" => op).increment(1);
}

/// Small responses waiting to be sent in one system call.
#[derive(Default)]
struct Outgoing {
    acks: Vec<[u8; RESPONSE_LEN]>,
}

impl Outgoing {
    fn refuse(&mut self, id: u64, refusal: Refusal, len: u64) {
        self.acks
            .push(Response::Refused { id, refusal, len }.encode());
    }

    /// # Safety
    ///
    /// `self` must not be modified until `iov` has been sent or cleared.
    unsafe fn push_into(&self, iov: &mut IoVecs) {
        for ack in &self.acks {
            // SAFETY: forwarded to the caller.
            unsafe { iov.push(ack.as_ptr(), ack.len()) };
        }
    }

    async fn flush(&mut self, stream: &TcpStream) -> io::Result<()> {
        if self.acks.is_empty() {
            return Ok(());
        }
        let mut iov = IoVecs::default();
        // SAFETY: `self.acks` is not touched until `send_all` returns.
        unsafe { self.push_into(&mut iov) };
        iov.send_all(stream).await?;
        self.acks.clear();
        Ok(())
    }
}

fn invalid(e: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}
