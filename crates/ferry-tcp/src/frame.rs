//! Wire format of the TCP data channel: fixed-size little-endian headers, the
//! payload of a write request or read response following its header directly.
//!
//! ```text
//! connect:  the endpoint's hello for `Channel::TCP_DATA` (see ferry-control)
//! request:  client -> Request (64 B) [+ scopes] [+ len payload bytes for a write]
//!           client -> Ranges (64 B) [+ scopes] + count × Range (16 B)
//!                     [+ len payload bytes, the ranges' in order, for a write]
//!           client -> Notify (64 B) + len notification bytes
//! response: server -> Response (40 B) [+ len payload bytes for read data]
//! ```
//!
//! A [`Ranges`] request moves many small ranges of one region with one
//! header and one response: a prepared request of thousands of small
//! descriptors would otherwise pay a header, an authorization, a response
//! and the initiator's per-request bookkeeping for each of them. The owner
//! authorizes the region once and checks every range's bounds before any
//! byte moves; a refusal names the first range that failed.
//!
//! A notification rides the data connection behind the chunks it
//! announces: the owner serves a connection's frames in order, so when it
//! reads a [`Notify`], every chunk sent before it has been written to (or
//! read from) its memory. Chunks of a notified batch carry the batch's
//! `tag`; the owner remembers the tags of refused chunks and does not
//! deliver their notification, so a failed batch notifies nobody without
//! the initiator waiting for its acks first.
//!
//! A request through a narrowed handle (see `ferry_core::Scopes`) carries
//! its chain of scopes right behind the header: the header's kind byte has
//! [`SCOPED`] set and its byte 1 counts the scopes, 1 to
//! [`MAX_SCOPES`], each [`SCOPE_LEN`] bytes. A
//! request through the region's own token is as it always was, byte for
//! byte; an owner that predates scopes refuses a scoped one as a bad kind.
//! Versioned by the hello exchange; any frame that does not parse ends the
//! connection after an error response, since framing can no longer be trusted.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ferry_control::wire::{u16_at, u32_at, u64_at, u128_at};
pub use ferry_core::SCOPE_LEN;
use ferry_core::{Access, Generation, MAX_SCOPES, NodeAddr, NodeId, RegionId, Scope, Scopes};

mod ranges;
mod response;

pub use ranges::{Range, Ranges};
pub use response::{NotifyOutcome, Refusal, Response};

/// Largest payload one request may carry; a larger length is a framing error.
pub const MAX_CHUNK: u64 = 64 << 20;

/// Length of a request header.
pub const REQUEST_LEN: usize = 64;
/// Length of a response header.
pub const RESPONSE_LEN: usize = 40;
/// Length of one entry of a [`Ranges`] request's table.
pub const RANGE_LEN: usize = 16;
/// Most ranges one [`Ranges`] request may carry; more is a framing error.
/// Its table is then at most 16 KiB, which the owner reads before it moves
/// any byte, and a refusal's range index fits its 16 bits.
pub const MAX_RANGES: u32 = 1024;

/// A header that does not parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A kind (or refusal code) this version does not know.
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    /// A payload length over [`MAX_CHUNK`].
    #[error("payload length {0} exceeds the {MAX_CHUNK}-byte limit")]
    TooLong(u64),
    /// A [`Ranges`] request with no ranges, or more than [`MAX_RANGES`].
    #[error("{0} ranges in one request; 1 to {MAX_RANGES} may be")]
    RangeCount(u32),
    /// A [`Ranges`] table whose lengths do not add up to the header's, or
    /// that holds an empty range.
    #[error("range table does not match its request: {0}")]
    RangeTable(&'static str),
    /// A scoped request announcing no scopes, or more than
    /// [`MAX_SCOPES`].
    #[error("{0} scopes behind a request; 1 to {MAX_SCOPES} may be")]
    ScopeCount(u8),
    /// Scopes behind a request that do not parse.
    #[error("malformed scopes behind a request")]
    BadScopes,
}

/// What a request asks of the owner; the value is the header's kind byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// Send `len` bytes at `addr` back.
    Read = 1,
    /// Store the `len` payload bytes that follow at `addr`.
    Write = 2,
}

/// Set in a [`Request`]'s or [`Ranges`]' kind byte when its scopes
/// follow the header (byte 1 counts them).
pub const SCOPED: u8 = 0x80;

/// Kind byte of a [`Notify`] frame.
const NOTIFY_KIND: u8 = 3;
/// Kind byte of a [`Ranges`] frame: 4 for reads, 5 for writes.
const RANGES_KIND: u8 = 4;

/// One chunk of an op: read `len` bytes at `addr`, or write the `len` payload
/// bytes that follow to `addr`. `addr` is a virtual address in the owner's
/// process, as in RDMA; the owner maps it into the region after its checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Read or write.
    pub kind: RequestKind,
    /// Chosen by the client, unique on its connection; the response echoes it.
    pub id: u64,
    /// The region's slot on the owner, from the handle.
    pub region: RegionId,
    /// The region's generation, from the handle.
    pub generation: Generation,
    /// Virtual address of the first byte in the owner's process.
    pub addr: u64,
    /// Bytes to read or write, at most [`MAX_CHUNK`].
    pub len: u64,
    /// The handle's TCP token.
    pub token: u128,
    /// The scopes the token was narrowed through (empty: the region's own
    /// token); sent behind the header. Decoded from a header, they are
    /// placeholders to replace with the trailer's (see
    /// [`ClientFrame::scopes_len`]).
    pub scopes: Scopes,
    /// The notified batch this chunk belongs to, or 0: the owner remembers
    /// a refused chunk's tag until that batch's [`Notify`] comes.
    pub tag: u64,
}

impl Request {
    /// The header as sent; its scopes and a write's payload follow it
    /// separately.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0; REQUEST_LEN];
        b[0] = self.kind as u8;
        mark_scoped(&mut b, &self.scopes);
        b[4..8].copy_from_slice(&self.generation.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.region.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.addr.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..56].copy_from_slice(&self.token.to_le_bytes());
        b[56..64].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    /// The request id is returned even for a bad frame so that the error
    /// response can name it.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, (u64, FrameError)> {
        let id = u64_at(b, 8);
        let scopes = scoped(b).map_err(|e| (id, e))?;
        let kind = match b[0] & !SCOPED {
            1 => RequestKind::Read,
            2 => RequestKind::Write,
            other => return Err((id, FrameError::BadKind(other))),
        };
        let len = u64_at(b, 32);
        if len > MAX_CHUNK {
            return Err((id, FrameError::TooLong(len)));
        }
        Ok(Request {
            kind,
            id,
            region: RegionId(u32_at(b, 16)),
            generation: Generation(u32_at(b, 4)),
            addr: u64_at(b, 24),
            len,
            token: u128_at(b, 40),
            scopes,
            tag: u64_at(b, 56),
        })
    }
}

/// Marks header `b` as followed by `scopes`, if there are any.
fn mark_scoped(b: &mut [u8; REQUEST_LEN], scopes: &Scopes) {
    if !scopes.is_empty() {
        b[0] |= SCOPED;
        // At most MAX_SCOPES, which fits a byte.
        b[1] = scopes.len() as u8;
    }
}

/// The scopes header `b` announces, as placeholders: none unless its kind
/// byte says so, and then 1 to [`MAX_SCOPES`].
fn scoped(b: &[u8; REQUEST_LEN]) -> Result<Scopes, FrameError> {
    if b[0] & SCOPED == 0 {
        return Ok(Scopes::default());
    }
    const PLACEHOLDER: Scope = Scope {
        addr: 0,
        len: 0,
        access: Access::ReadOnly,
    };
    let count = usize::from(b[1]);
    (1..=MAX_SCOPES)
        .contains(&count)
        .then(|| Scopes::new(&[PLACEHOLDER; MAX_SCOPES][..count]))
        .flatten()
        .ok_or(FrameError::ScopeCount(b[1]))
}

/// A notification for the owner's inbox, sent after every chunk of batch
/// `tag` on the same connection; `len` bytes of body follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Notify {
    /// As a [`Request`]'s: the response echoes it.
    pub id: u64,
    /// The batch announced; its chunks carry the same tag.
    pub tag: u64,
    /// Body bytes that follow.
    pub len: u64,
    /// The batch was given up (timed out) after its chunks were sent:
    /// deliver nothing, only forget the tag. No body follows.
    pub discard: bool,
    /// The sender, as the owner's inbox reports it.
    pub from: NodeAddr,
}

impl Notify {
    /// The header as sent; the body follows it.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0; REQUEST_LEN];
        b[0] = NOTIFY_KIND;
        b[1] = self.discard as u8;
        b[2..4].copy_from_slice(&self.from.endpoint.port().to_le_bytes());
        b[4] = match self.from.endpoint.ip() {
            IpAddr::V4(v4) => {
                b[16..20].copy_from_slice(&v4.octets());
                4
            }
            IpAddr::V6(v6) => {
                b[16..32].copy_from_slice(&v6.octets());
                6
            }
        };
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..56].copy_from_slice(&self.from.id.0.to_le_bytes());
        b[56..64].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, (u64, FrameError)> {
        let id = u64_at(b, 8);
        let len = u64_at(b, 32);
        if len > MAX_CHUNK {
            return Err((id, FrameError::TooLong(len)));
        }
        let octets: [u8; 16] = b[16..32].try_into().expect("16-byte slice");
        let ip = match b[4] {
            4 => IpAddr::V4(Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3])),
            6 => IpAddr::V6(Ipv6Addr::from(octets)),
            other => return Err((id, FrameError::BadKind(other))),
        };
        let discard = match b[1] {
            0 => false,
            1 => true,
            other => return Err((id, FrameError::BadKind(other))),
        };
        Ok(Notify {
            id,
            tag: u64_at(b, 56),
            len,
            discard,
            from: NodeAddr {
                id: NodeId(u128_at(b, 40)),
                endpoint: SocketAddr::new(ip, u16_at(b, 2)),
            },
        })
    }
}

/// Any frame a client sends: an op's chunk, or a notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientFrame {
    /// A read or write chunk.
    Op(Request),
    /// Many small ranges of one region.
    Ranges(Ranges),
    /// A notification.
    Notify(Notify),
}

impl ClientFrame {
    /// Parses a header by its kind byte; the request id is returned even
    /// for a bad frame so that the error response can name it.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, (u64, FrameError)> {
        match b[0] & !SCOPED {
            NOTIFY_KIND if b[0] == NOTIFY_KIND => Notify::decode(b).map(ClientFrame::Notify),
            NOTIFY_KIND => Err((u64_at(b, 8), FrameError::BadKind(b[0]))),
            RANGES_KIND | 5 => Ranges::decode(b).map(ClientFrame::Ranges),
            _ => Request::decode(b).map(ClientFrame::Op),
        }
    }

    /// The header as sent.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        match self {
            ClientFrame::Op(request) => request.encode(),
            ClientFrame::Ranges(ranges) => ranges.encode(),
            ClientFrame::Notify(notify) => notify.encode(),
        }
    }

    /// The frame's request id.
    pub fn id(&self) -> u64 {
        match self {
            ClientFrame::Op(request) => request.id,
            ClientFrame::Ranges(ranges) => ranges.id,
            ClientFrame::Notify(notify) => notify.id,
        }
    }

    /// Sets the request id (the connection chooses it when it sends).
    pub fn set_id(&mut self, id: u64) {
        match self {
            ClientFrame::Op(request) => request.id = id,
            ClientFrame::Ranges(ranges) => ranges.id = id,
            ClientFrame::Notify(notify) => notify.id = id,
        }
    }

    /// Bytes of the scopes that follow the header, before anything else.
    pub fn scopes_len(&self) -> usize {
        self.scopes().map_or(0, |s| s.len() * SCOPE_LEN)
    }

    /// The scopes of an op's request; `None` for a notification.
    pub fn scopes(&self) -> Option<&Scopes> {
        match self {
            ClientFrame::Op(request) => Some(&request.scopes),
            ClientFrame::Ranges(ranges) => Some(&ranges.scopes),
            ClientFrame::Notify(_) => None,
        }
    }

    /// Replaces the placeholder scopes of a decoded header by those that
    /// followed it, `bytes` ([`scopes_len`](Self::scopes_len) of them).
    pub fn read_scopes(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        let scopes = match self {
            ClientFrame::Op(request) => &mut request.scopes,
            ClientFrame::Ranges(ranges) => &mut ranges.scopes,
            ClientFrame::Notify(_) => return Err(FrameError::BadScopes),
        };
        *scopes = Scopes::decode(bytes)
            .filter(|s| s.len() == scopes.len())
            .ok_or(FrameError::BadScopes)?;
        Ok(())
    }

    /// The length field: bytes an op moves, or a notification's body.
    pub fn bytes(&self) -> u64 {
        match self {
            ClientFrame::Op(request) => request.len,
            ClientFrame::Ranges(ranges) => ranges.len,
            ClientFrame::Notify(notify) => notify.len,
        }
    }

    /// Bytes that follow the header and its scopes on the wire (a
    /// [`Ranges`] table included).
    pub fn payload_len(&self) -> u64 {
        match self {
            ClientFrame::Ranges(ranges) => {
                let data = match ranges.kind {
                    RequestKind::Write => ranges.len,
                    RequestKind::Read => 0,
                };
                ranges.table_len() as u64 + data
            }
            ClientFrame::Op(Request {
                kind: RequestKind::Write,
                len,
                ..
            })
            | ClientFrame::Notify(Notify { len, .. }) => *len,
            ClientFrame::Op(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests;
