//! Wire format of the TCP data channel: fixed-size little-endian headers, the
//! payload of a write request or read response following its header directly.
//!
//! ```text
//! connect:  the endpoint's hello for `Channel::TCP_DATA` (see ferry-control)
//! request:  client -> Request (64 B) [+ len payload bytes for a write]
//!           client -> Notify (64 B) + len notification bytes
//! response: server -> Response (40 B) [+ len payload bytes for read data]
//! ```
//!
//! A notification rides the data connection behind the chunks it
//! announces: the owner serves a connection's frames in order, so when it
//! reads a [`Notify`], every chunk sent before it has been written to (or
//! read from) its memory. Chunks of a notified batch carry the batch's
//! `tag`; the owner remembers the tags of refused chunks and does not
//! deliver their notification, so a failed batch notifies nobody without
//! the initiator waiting for its acks first.
//! Versioned by the hello exchange; any frame that does not parse ends the
//! connection after an error response, since framing can no longer be trusted.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ferry_control::wire::{u16_at, u32_at, u64_at, u128_at};
use ferry_core::{Generation, NodeAddr, NodeId, OpError, RegionId};

/// Largest payload one request may carry; a larger length is a framing error.
pub const MAX_CHUNK: u64 = 64 << 20;

/// Length of a request header.
pub const REQUEST_LEN: usize = 64;
/// Length of a response header.
pub const RESPONSE_LEN: usize = 40;

/// A header that does not parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A kind (or refusal code) this version does not know.
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    /// A payload length over [`MAX_CHUNK`].
    #[error("payload length {0} exceeds the {MAX_CHUNK}-byte limit")]
    TooLong(u64),
}

/// What a request asks of the owner; the value is the header's kind byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// Send `len` bytes at `addr` back.
    Read = 1,
    /// Store the `len` payload bytes that follow at `addr`.
    Write = 2,
}

/// Kind byte of a [`Notify`] frame.
const NOTIFY_KIND: u8 = 3;

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
    /// The notified batch this chunk belongs to, or 0: the owner remembers
    /// a refused chunk's tag until that batch's [`Notify`] comes.
    pub tag: u64,
}

impl Request {
    /// The header as sent; a write's payload follows it separately.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0; REQUEST_LEN];
        b[0] = self.kind as u8;
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
        let kind = match b[0] {
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
            tag: u64_at(b, 56),
        })
    }
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
    /// A notification.
    Notify(Notify),
}

impl ClientFrame {
    /// Parses a header by its kind byte; the request id is returned even
    /// for a bad frame so that the error response can name it.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, (u64, FrameError)> {
        match b[0] {
            NOTIFY_KIND => Notify::decode(b).map(ClientFrame::Notify),
            _ => Request::decode(b).map(ClientFrame::Op),
        }
    }

    /// The header as sent.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        match self {
            ClientFrame::Op(request) => request.encode(),
            ClientFrame::Notify(notify) => notify.encode(),
        }
    }

    /// The frame's request id.
    pub fn id(&self) -> u64 {
        match self {
            ClientFrame::Op(request) => request.id,
            ClientFrame::Notify(notify) => notify.id,
        }
    }

    /// Sets the request id (the connection chooses it when it sends).
    pub fn set_id(&mut self, id: u64) {
        match self {
            ClientFrame::Op(request) => request.id = id,
            ClientFrame::Notify(notify) => notify.id = id,
        }
    }

    /// The length field: bytes an op moves, or a notification's body.
    pub fn bytes(&self) -> u64 {
        match self {
            ClientFrame::Op(request) => request.len,
            ClientFrame::Notify(notify) => notify.len,
        }
    }

    /// Bytes that follow the header on the wire.
    pub fn payload_len(&self) -> u64 {
        match self {
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

/// What the owner did with a [`Notify`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotifyOutcome {
    /// In the owner's inbox.
    Delivered,
    /// The owner's inbox is full: not delivered. The sender may wait for
    /// room over the control session.
    InboxFull,
    /// A chunk of the batch was refused: not delivered.
    BatchFailed,
    /// Forgotten as the sender asked ([`Notify::discard`]).
    Discarded,
    /// Over the owner's limit on notifications: not delivered.
    TooLarge {
        /// The owner's limit, in bytes.
        limit: u64,
    },
    /// The owner takes no notifications (it has no inbox, or is stopping).
    NoInbox,
}

/// Why the owner refused a request; maps one to one onto [`OpError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No region in that slot: [`OpError::UnknownRegion`].
    UnknownRegion,
    /// The slot holds a newer region: [`OpError::StaleGeneration`].
    StaleGeneration {
        /// The slot's generation now.
        current: Generation,
    },
    /// Wrong token: [`OpError::AccessDenied`].
    AccessDenied,
    /// The range leaves the region: [`OpError::OutOfBounds`].
    OutOfBounds {
        /// Bytes from the region's start to `addr` (wrapped if `addr` lies
        /// below it).
        offset: u64,
        /// The region's length in bytes.
        bound: u64,
    },
    /// A write to a read-only region: [`OpError::ReadOnly`].
    ReadOnly,
    /// The request header did not parse; the owner closes the connection
    /// after this response: [`OpError::Protocol`].
    Malformed,
}

/// The owner's answer to one request, matched to it by `id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Response {
    /// `len` bytes of read data follow.
    ReadData {
        /// The request's id.
        id: u64,
        /// Payload bytes that follow, the request's `len`.
        len: u64,
    },
    /// The write's bytes are in the owner's memory.
    WriteAck {
        /// The request's id.
        id: u64,
    },
    /// What the owner did with a notification.
    Notified {
        /// The notification's id.
        id: u64,
        /// Delivered or not, and why.
        outcome: NotifyOutcome,
    },
    /// The request was refused; no bytes follow. A refused write's payload
    /// was read and dropped, except after [`Refusal::Malformed`].
    Refused {
        /// The request's id (for a header that did not parse, as read from it).
        id: u64,
        /// Why.
        refusal: Refusal,
        /// The request's `len`, echoed; 0 for [`Refusal::Malformed`].
        len: u64,
    },
}

impl Response {
    /// The id of the request this answers.
    pub fn id(&self) -> u64 {
        match *self {
            Response::ReadData { id, .. }
            | Response::WriteAck { id }
            | Response::Notified { id, .. }
            | Response::Refused { id, .. } => id,
        }
    }

    /// The header as sent; read data follows it separately.
    pub fn encode(&self) -> [u8; RESPONSE_LEN] {
        let mut b = [0; RESPONSE_LEN];
        // (kind, refusal code, id, len, generation, offset, bound)
        let (kind, code, id, len, generation, offset, bound) = match *self {
            Response::ReadData { id, len } => (1, 0, id, len, 0, 0, 0),
            Response::WriteAck { id } => (2, 0, id, 0, 0, 0, 0),
            Response::Notified { id, outcome } => match outcome {
                NotifyOutcome::Delivered => (4, 0, id, 0, 0, 0, 0),
                NotifyOutcome::InboxFull => (4, 1, id, 0, 0, 0, 0),
                NotifyOutcome::BatchFailed => (4, 2, id, 0, 0, 0, 0),
                NotifyOutcome::Discarded => (4, 3, id, 0, 0, 0, 0),
                NotifyOutcome::TooLarge { limit } => (4, 4, id, 0, 0, 0, limit),
                NotifyOutcome::NoInbox => (4, 5, id, 0, 0, 0, 0),
            },
            Response::Refused { id, refusal, len } => match refusal {
                Refusal::UnknownRegion => (3, 1, id, len, 0, 0, 0),
                Refusal::StaleGeneration { current } => (3, 2, id, len, current.0, 0, 0),
                Refusal::AccessDenied => (3, 3, id, len, 0, 0, 0),
                Refusal::OutOfBounds { offset, bound } => (3, 4, id, len, 0, offset, bound),
                Refusal::ReadOnly => (3, 5, id, len, 0, 0, 0),
                Refusal::Malformed => (3, 6, id, len, 0, 0, 0),
            },
        };
        b[0] = kind;
        b[1] = code;
        b[4..8].copy_from_slice(&generation.to_le_bytes());
        b[8..16].copy_from_slice(&id.to_le_bytes());
        b[16..24].copy_from_slice(&len.to_le_bytes());
        b[24..32].copy_from_slice(&offset.to_le_bytes());
        b[32..40].copy_from_slice(&bound.to_le_bytes());
        b
    }

    /// Parses a header; a `ReadData` over [`MAX_CHUNK`] bytes or an unknown
    /// kind or refusal code is a [`FrameError`], after which the connection
    /// cannot be trusted.
    pub fn decode(b: &[u8; RESPONSE_LEN]) -> Result<Self, FrameError> {
        let id = u64_at(b, 8);
        let len = u64_at(b, 16);
        let generation = u32_at(b, 4);
        match (b[0], b[1]) {
            (1, _) if len > MAX_CHUNK => Err(FrameError::TooLong(len)),
            (1, _) => Ok(Response::ReadData { id, len }),
            (2, _) => Ok(Response::WriteAck { id }),
            (3, code) => {
                let refusal = match code {
                    1 => Refusal::UnknownRegion,
                    2 => Refusal::StaleGeneration {
                        current: Generation(generation),
                    },
                    3 => Refusal::AccessDenied,
                    4 => Refusal::OutOfBounds {
                        offset: u64_at(b, 24),
                        bound: u64_at(b, 32),
                    },
                    5 => Refusal::ReadOnly,
                    6 => Refusal::Malformed,
                    other => return Err(FrameError::BadKind(other)),
                };
                Ok(Response::Refused { id, refusal, len })
            }
            (4, code) => {
                let outcome = match code {
                    0 => NotifyOutcome::Delivered,
                    1 => NotifyOutcome::InboxFull,
                    2 => NotifyOutcome::BatchFailed,
                    3 => NotifyOutcome::Discarded,
                    4 => NotifyOutcome::TooLarge {
                        limit: u64_at(b, 32),
                    },
                    5 => NotifyOutcome::NoInbox,
                    other => return Err(FrameError::BadKind(other)),
                };
                Ok(Response::Notified { id, outcome })
            }
            (other, _) => Err(FrameError::BadKind(other)),
        }
    }
}

impl Refusal {
    /// The caller-facing error for this refusal of a request of `len` bytes
    /// made with a handle of generation `handle`.
    pub fn into_op_error(self, handle: Generation, len: u64) -> OpError {
        match self {
            Refusal::UnknownRegion => OpError::UnknownRegion,
            Refusal::StaleGeneration { current } => OpError::StaleGeneration { handle, current },
            Refusal::AccessDenied => OpError::AccessDenied,
            Refusal::OutOfBounds { offset, bound } => OpError::OutOfBounds { offset, len, bound },
            Refusal::ReadOnly => OpError::ReadOnly,
            Refusal::Malformed => OpError::Protocol("owner could not parse the request".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let req = Request {
            kind: RequestKind::Write,
            id: 7,
            region: RegionId(3),
            generation: Generation(9),
            addr: 0x0dea_dbee_f000,
            len: 4096,
            token: u128::MAX - 5,
            tag: 11,
        };
        assert_eq!(Request::decode(&req.encode()), Ok(req));
        for endpoint in ["10.1.2.3:7000", "[fd00::5]:1"] {
            let notify = Notify {
                id: 12,
                tag: 11,
                len: 64,
                discard: true,
                from: NodeAddr {
                    id: NodeId(u128::MAX - 1),
                    endpoint: endpoint.parse().unwrap(),
                },
            };
            let frame = ClientFrame::Notify(notify);
            assert_eq!(ClientFrame::decode(&frame.encode()), Ok(frame));
        }
        for resp in [
            Response::ReadData { id: 1, len: 10 },
            Response::WriteAck { id: 2 },
            Response::Refused {
                id: 3,
                refusal: Refusal::StaleGeneration {
                    current: Generation(4),
                },
                len: 5,
            },
            Response::Refused {
                id: 4,
                refusal: Refusal::OutOfBounds {
                    offset: 9,
                    bound: 100,
                },
                len: 5,
            },
            Response::Notified {
                id: 5,
                outcome: NotifyOutcome::TooLarge { limit: 1024 },
            },
            Response::Notified {
                id: 6,
                outcome: NotifyOutcome::InboxFull,
            },
        ] {
            assert_eq!(Response::decode(&resp.encode()), Ok(resp));
        }
    }

    #[test]
    fn bad_frames_are_typed_errors() {
        let mut b = [0u8; REQUEST_LEN];
        b[0] = 9;
        b[8] = 42;
        assert_eq!(Request::decode(&b), Err((42, FrameError::BadKind(9))));
        b[0] = 1;
        b[32..40].copy_from_slice(&(MAX_CHUNK + 1).to_le_bytes());
        assert_eq!(
            Request::decode(&b),
            Err((42, FrameError::TooLong(MAX_CHUNK + 1)))
        );
    }
}
