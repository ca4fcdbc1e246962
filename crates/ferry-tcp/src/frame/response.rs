//! What the owner sends back: one [`Response`] per request.

use ferry_control::wire::{u16_at, u32_at, u64_at};
use ferry_core::{Generation, OpError};

use super::{FrameError, MAX_CHUNK, RESPONSE_LEN};

/// What the owner did with a [`super::Notify`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotifyOutcome {
    /// In the owner's inbox.
    Delivered,
    /// The owner's inbox is full: not delivered. The sender may wait for
    /// room over the control session.
    InboxFull,
    /// A chunk of the batch was refused: not delivered.
    BatchFailed,
    /// Forgotten as the sender asked ([`super::Notify::discard`]).
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
        /// The first range of a [`super::Ranges`] request that failed (no range of
        /// it moved); 0 for any other request.
        range: u16,
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
        let range = match *self {
            Response::Refused { range, .. } => range,
            _ => 0,
        };
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
            Response::Refused {
                id, refusal, len, ..
            } => match refusal {
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
        b[2..4].copy_from_slice(&range.to_le_bytes());
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
                Ok(Response::Refused {
                    id,
                    range: u16_at(b, 2),
                    refusal,
                    len,
                })
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
