//! The owner side: serves one-sided reads and writes into registered
//! regions on each data connection the endpoint hands over. A misbehaving
//! client loses its own connection and nothing else.

use std::io;
use std::sync::Arc;

use ferry_control::Connection;
use tokio::net::TcpStream;
use tracing::debug;

use crate::frame::{REQUEST_LEN, RESPONSE_LEN, Refusal, Request, RequestKind, Response};
use crate::io::{FrameReader, IoVecs, MAX_IOV};
use crate::table::RegionTable;

/// Acknowledgements are coalesced up to this many before they are sent.
const MAX_PENDING_ACKS: usize = 64;
// A read response shares its system call with the staged acks.
const _: () = assert!(MAX_PENDING_ACKS + 2 <= MAX_IOV);

/// Serves one data connection (after its hello) until the client closes it
/// or breaks the protocol.
pub(crate) async fn serve_connection(connection: Connection, table: Arc<RegionTable>) {
    let Connection {
        stream,
        node,
        remote,
    } = connection;
    debug!(%remote, client = ?node, "data connection open");
    if let Err(e) = serve(&stream, &table).await {
        debug!(%remote, error = %e, "data connection closed with an error");
    }
}

async fn serve(stream: &TcpStream, table: &RegionTable) -> io::Result<()> {
    let mut reader = FrameReader::default();

    let mut out = Outgoing::default();
    loop {
        // About to block on the socket: first send the acks we owe, so a
        // client waiting for them is never stalled behind our own read.
        if reader.buffered() < REQUEST_LEN || out.acks.len() >= MAX_PENDING_ACKS {
            out.flush(stream).await?;
        }
        let Some(bytes) = reader.header::<REQUEST_LEN>(stream).await? else {
            return out.flush(stream).await;
        };
        let req = match Request::decode(&bytes) {
            Ok(req) => req,
            Err((id, e)) => {
                // The payload length cannot be trusted: refuse and hang up.
                out.refuse(id, Refusal::Malformed, 0);
                out.flush(stream).await?;
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
                        .payload(stream, grant.memory.as_ptr().add(grant.offset), len)
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
                iov.send_all(stream).await?;
                out.acks.clear();
                served("read", req.len);
            }
            (kind, Err(refusal)) => {
                if kind == RequestKind::Write {
                    reader.discard(stream, len).await?;
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
