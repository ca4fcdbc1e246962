//! Wire format of the TCP data channel: fixed-size little-endian headers, the
//! payload of a write request or read response following its header directly.
//!
//! ```text
//! connect:  the endpoint's hello for `Channel::TCP_DATA` (see ferry-control)
//! request:  client -> Request (64 B) [+ len payload bytes for a write]
//! response: server -> Response (40 B) [+ len payload bytes for read data]
//! ```
//! Versioned by the hello exchange; any frame that does not parse ends the
//! connection after an error response, since framing can no longer be trusted.

use ferry_control::wire::{u32_at, u64_at, u128_at};
use ferry_core::{Generation, OpError, RegionId};

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
        })
    }
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
        };
        assert_eq!(Request::decode(&req.encode()), Ok(req));
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
