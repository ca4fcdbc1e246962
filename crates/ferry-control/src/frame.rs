//! Frames of a control session and their codec: where a control frame is
//! parsed.
//!
//! Every frame is length-prefixed (a 4-byte big-endian length), then a
//! 16-byte little-endian header, then the body, then, on a session whose
//! hello proved a cluster secret, a 16-byte tag over all of it
//! ([`crate::auth::FrameMac`]; a frame whose tag fails ends the session):
//!
//! ```text
//! length u32 BE | kind u8 | status u8 | service u16 | deadline_ms u32 | id u64 | body ... | tag?
//! ```
//!
//! Nothing is reserved for a frame before its bytes arrive: a peer that
//! declares a long frame and stalls holds only what it sent.
//!
//! - `Open` (kind 1) is each side's first frame: the protocol versions it
//!   speaks and the node it is (id and advertised endpoint).
//! - `Request` (kind 2) asks the peer's handler for `service`, with the time
//!   the sender will wait for an answer; `id` is the sender's, unique among
//!   its requests in flight on the session.
//! - `Response` (kind 3) answers the request with the same `id`.
//! - `Cancel` (kind 4, session version 2) says the sender no longer waits
//!   for its request `id` (dropped, or timed out): the peer stops its
//!   handler. Sent only on sessions that agreed on version 2 or later.
//! - `Tell` (kind 5, session version 3) calls the peer's handler for
//!   `service` like a request, but nothing answers it: `id` is zero, and
//!   the handler's answer (or failure) stays with the peer. For calls whose
//!   answer nobody needs (credit returns), it saves the response's packet
//!   and the wake-ups it costs both ends. Sent only on sessions that agreed
//!   on version 3 or later.
//!
//! New uses (notifications, messages, RPC, metadata) are new services or new
//! kinds; a peer that receives a kind it does not know ends the session,
//! which the version exchange in `Open` prevents between compatible nodes.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use ferry_core::NodeAddr;
use tokio_util::codec::{Decoder, Encoder};

use crate::auth::{FRAME_TAG_LEN, FrameMac};
use crate::wire::{NODE_ADDR_LEN, encode_node_addr, node_addr_at, u16_at, u32_at, u64_at};

/// Oldest and newest session protocol versions this build speaks.
pub const SESSION_VERSIONS: (u16, u16) = (1, 3);
/// The first session version with `Cancel` frames.
pub const CANCEL_VERSION: u16 = 2;
/// The first session version with `Tell` frames.
pub const TELL_VERSION: u16 = 3;
/// Bytes before a frame's body.
pub const HEADER_LEN: usize = 16;
/// Default bound on a frame's length (header and body); a longer one ends
/// the session as a protocol error rather than allocate what a peer asks.
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;
const OPEN_LEN: usize = 4 + NODE_ADDR_LEN;

/// A request's target on the peer: a handler registered with
/// [`crate::Endpoint::serve`]. Numbers are listed here so that no two users
/// pick the same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Service(pub u16);

impl Service {
    /// ibverbs queue-pair exchange (`ferry-ibverbs`).
    pub const IBVERBS_CONNECT: Service = Service(1);
    /// Calls of named handlers (`crate::rpc`).
    pub const RPC: Service = Service(2);
    /// Messages into a node's inbox (`crate::inbox`).
    pub const MESSAGE: Service = Service(3);
    /// Notifications of completed transfers into a node's inbox
    /// (`crate::inbox`).
    pub const NOTIFY: Service = Service(4);
    /// Receive credits for notifications sent on a queue pair, returned by
    /// the node that holds the receive buffers (`ferry-ibverbs`).
    pub const IBVERBS_CREDITS: Service = Service(5);
    /// A node's metadata blob, whole or for chosen region names
    /// (`ferry-discovery`).
    pub const METADATA: Service = Service(6);
    /// How a request tagged by its reader ended, told to the owners of its
    /// memory (the facade's outcomes).
    pub const OUTCOME: Service = Service(7);
}

impl std::fmt::Display for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Service::IBVERBS_CONNECT => f.write_str("ibverbs-connect"),
            Service::RPC => f.write_str("rpc"),
            Service::MESSAGE => f.write_str("message"),
            Service::NOTIFY => f.write_str("notification"),
            Service::IBVERBS_CREDITS => f.write_str("ibverbs-credits"),
            Service::METADATA => f.write_str("metadata"),
            Service::OUTCOME => f.write_str("outcome"),
            Service(n) => write!(f, "service {n}"),
        }
    }
}

/// How a request ended, as its response says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The handler answered; the body is its answer.
    Ok,
    /// No handler for the service; the body is empty.
    NoSuchService,
    /// The handler failed; the body is its message (UTF-8).
    Failed,
    /// Too many requests of this session in flight at the peer; retry later.
    Busy,
    /// The handler did not finish within the request's deadline.
    DeadlineExceeded,
}

impl Status {
    fn code(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::NoSuchService => 1,
            Status::Failed => 2,
            Status::Busy => 3,
            Status::DeadlineExceeded => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Status::Ok,
            1 => Status::NoSuchService,
            2 => Status::Failed,
            3 => Status::Busy,
            4 => Status::DeadlineExceeded,
            _ => return None,
        })
    }
}

/// One frame of a control session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Each side's first frame.
    Open {
        /// Oldest session version the sender speaks.
        min_version: u16,
        /// Newest session version the sender speaks.
        max_version: u16,
        /// The sender: its id and the endpoint it advertises.
        node: NodeAddr,
    },
    /// A call of the peer's handler for `service`.
    Request {
        /// The sender's id for the call, echoed by the response.
        id: u64,
        /// The handler called.
        service: Service,
        /// How long the sender waits for the answer (whole milliseconds,
        /// rounded up; relative, since the two hosts' clocks differ).
        deadline: Duration,
        /// The handler's input.
        body: Bytes,
    },
    /// The answer to request `id`.
    Response {
        /// The request's id.
        id: u64,
        /// How it ended.
        status: Status,
        /// The answer, or the failure's message.
        body: Bytes,
    },
    /// The sender stopped waiting for its request `id`.
    Cancel {
        /// The request's id.
        id: u64,
    },
    /// A call of the peer's handler for `service` that nothing answers.
    Tell {
        /// The handler called.
        service: Service,
        /// How long the handler may run (as for a request).
        deadline: Duration,
        /// The handler's input.
        body: Bytes,
    },
}

/// A frame that does not parse. The session it arrived on ends: framing can
/// no longer be trusted.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The connection failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The length prefix says more than the session's bound.
    #[error("a frame of {len} bytes, over the bound of {max}")]
    TooLong {
        /// The length declared.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The frame's tag does not check out under the session's keys: its
    /// bytes were altered, injected, replayed or reordered on the way (or
    /// the frame is too short to carry a tag).
    #[error("a frame's authentication tag is wrong: altered or injected on the way")]
    Forged,
    /// Shorter than its kind requires.
    #[error("{kind} frame of {len} bytes is truncated")]
    Truncated {
        /// The frame's kind byte.
        kind: u8,
        /// Its length.
        len: usize,
    },
    /// A kind this version does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A response status this version does not know.
    #[error("unknown response status {0}")]
    UnknownStatus(u8),
    /// An address family other than IPv4 (4) and IPv6 (6).
    #[error("unknown address family {0}")]
    BadAddress(u8),
}

/// Length-prefixed control frames, sealed or checked with one direction's
/// [`FrameMac`] on an authenticated session.
pub struct ControlCodec {
    max_frame: usize,
    mac: Option<FrameMac>,
}

impl std::fmt::Debug for ControlCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlCodec")
            .field("max_frame", &self.max_frame)
            .field("sealed", &self.mac.is_some())
            .finish()
    }
}

/// Bytes of a frame's length prefix.
const PREFIX_LEN: usize = 4;

impl ControlCodec {
    /// A codec refusing frames longer than `max_frame` bytes, unsealed.
    pub fn new(max_frame: usize) -> Self {
        Self::sealed(max_frame, None)
    }

    /// A codec that seals what it encodes, or checks what it decodes, with
    /// `mac` (one direction of a session's keys), if given.
    pub fn sealed(max_frame: usize, mac: Option<FrameMac>) -> Self {
        ControlCodec { max_frame, mac }
    }

    fn tag_len(&self) -> usize {
        if self.mac.is_some() { FRAME_TAG_LEN } else { 0 }
    }
}

#[cfg(test)]
impl ControlCodec {
    fn clone_for_test(&self) -> ControlCodec {
        ControlCodec {
            max_frame: self.max_frame,
            mac: self.mac.clone(),
        }
    }
}

impl Default for ControlCodec {
    fn default() -> Self {
        ControlCodec::new(DEFAULT_MAX_FRAME)
    }
}

impl Decoder for ControlCodec {
    type Item = Frame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(prefix) = src.first_chunk::<PREFIX_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*prefix) as usize;
        let max = self.max_frame + self.tag_len();
        if len > max {
            return Err(FrameError::TooLong { len, max });
        }
        // Whole frames only; the buffer grows as bytes come (nothing is
        // reserved on the peer's word).
        if src.len() < PREFIX_LEN + len {
            return Ok(None);
        }
        src.advance(PREFIX_LEN);
        let mut bytes = src.split_to(len).freeze();
        if let Some(mac) = &mut self.mac {
            let Some(body_len) = len.checked_sub(FRAME_TAG_LEN) else {
                return Err(FrameError::Forged);
            };
            let tag = bytes.split_off(body_len);
            if !mac.open(&[&bytes], &tag) {
                return Err(FrameError::Forged);
            }
        }
        parse(bytes).map(Some)
    }
}

impl Encoder<Frame> for ControlCodec {
    type Error = FrameError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), FrameError> {
        let bytes = serialize(&frame);
        if bytes.len() > self.max_frame {
            return Err(FrameError::TooLong {
                len: bytes.len(),
                max: self.max_frame,
            });
        }
        let len = bytes.len() + self.tag_len();
        dst.reserve(PREFIX_LEN + len);
        dst.put_u32(u32::try_from(len).expect("bounded by max_frame"));
        dst.put_slice(&bytes);
        if let Some(mac) = &mut self.mac {
            dst.put_slice(&mac.seal(&[&bytes]));
        }
        Ok(())
    }
}

/// The frame's bytes, without the length prefix.
pub fn serialize(frame: &Frame) -> Bytes {
    let header =
        |out: &mut BytesMut, kind: u8, status: u8, service: u16, deadline: u32, id: u64| {
            out.put_u8(kind);
            out.put_u8(status);
            out.put_u16_le(service);
            out.put_u32_le(deadline);
            out.put_u64_le(id);
        };
    match frame {
        Frame::Open {
            min_version,
            max_version,
            node,
        } => {
            let mut out = BytesMut::with_capacity(HEADER_LEN + OPEN_LEN);
            header(&mut out, 1, 0, 0, 0, 0);
            out.put_u16_le(*min_version);
            out.put_u16_le(*max_version);
            out.put_slice(&encode_node_addr(node));
            out.freeze()
        }
        Frame::Request {
            id,
            service,
            deadline,
            body,
        } => {
            let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
            header(&mut out, 2, 0, service.0, deadline_millis(*deadline), *id);
            out.put_slice(body);
            out.freeze()
        }
        Frame::Response { id, status, body } => {
            let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
            header(&mut out, 3, status.code(), 0, 0, *id);
            out.put_slice(body);
            out.freeze()
        }
        Frame::Cancel { id } => {
            let mut out = BytesMut::with_capacity(HEADER_LEN);
            header(&mut out, 4, 0, 0, 0, *id);
            out.freeze()
        }
        Frame::Tell {
            service,
            deadline,
            body,
        } => {
            let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
            header(&mut out, 5, 0, service.0, deadline_millis(*deadline), 0);
            out.put_slice(body);
            out.freeze()
        }
    }
}

/// A deadline on the wire: whole milliseconds, rounded up, saturating.
fn deadline_millis(deadline: Duration) -> u32 {
    deadline
        .as_nanos()
        .div_ceil(1_000_000)
        .try_into()
        .unwrap_or(u32::MAX)
}

/// Parses one frame (without its length prefix).
pub fn parse(bytes: Bytes) -> Result<Frame, FrameError> {
    let kind = *bytes
        .first()
        .ok_or(FrameError::Truncated { kind: 0, len: 0 })?;
    let truncated = FrameError::Truncated {
        kind,
        len: bytes.len(),
    };
    if bytes.len() < HEADER_LEN {
        return Err(truncated);
    }
    let id = u64_at(&bytes, 8);
    match kind {
        1 => {
            if bytes.len() < HEADER_LEN + OPEN_LEN {
                return Err(truncated);
            }
            let b = &bytes[HEADER_LEN..];
            Ok(Frame::Open {
                min_version: u16_at(b, 0),
                max_version: u16_at(b, 2),
                node: node_addr_at(&b[4..]).map_err(FrameError::BadAddress)?,
            })
        }
        2 => Ok(Frame::Request {
            id,
            service: Service(u16_at(&bytes, 2)),
            deadline: Duration::from_millis(u32_at(&bytes, 4).into()),
            body: bytes.slice(HEADER_LEN..),
        }),
        3 => Ok(Frame::Response {
            id,
            status: Status::from_code(bytes[1]).ok_or(FrameError::UnknownStatus(bytes[1]))?,
            body: bytes.slice(HEADER_LEN..),
        }),
        4 => Ok(Frame::Cancel { id }),
        5 => Ok(Frame::Tell {
            service: Service(u16_at(&bytes, 2)),
            deadline: Duration::from_millis(u32_at(&bytes, 4).into()),
            body: bytes.slice(HEADER_LEN..),
        }),
        other => Err(FrameError::UnknownKind(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::NodeId;

    fn round_trip(frame: Frame) {
        let mut codec = ControlCodec::default();
        let mut buf = BytesMut::new();
        codec.encode(frame.clone(), &mut buf).unwrap();
        // A frame split across reads decodes only once it is whole.
        let mut partial = buf.split_to(buf.len() - 1);
        assert!(codec.decode(&mut partial).unwrap().is_none());
        partial.unsplit(buf);
        assert_eq!(codec.decode(&mut partial).unwrap(), Some(frame));
        assert!(partial.is_empty());
    }

    #[test]
    fn every_kind_round_trips() {
        for endpoint in ["10.1.2.3:7000", "[fd00::1:2]:65535"] {
            round_trip(Frame::Open {
                min_version: 1,
                max_version: 3,
                node: NodeAddr {
                    id: NodeId(u128::MAX - 1),
                    endpoint: endpoint.parse().unwrap(),
                },
            });
        }
        round_trip(Frame::Request {
            id: u64::MAX,
            service: Service::IBVERBS_CONNECT,
            deadline: Duration::from_millis(2500),
            body: Bytes::from_static(b"qp details"),
        });
        for status in [
            Status::Ok,
            Status::NoSuchService,
            Status::Failed,
            Status::Busy,
            Status::DeadlineExceeded,
        ] {
            round_trip(Frame::Response {
                id: 7,
                status,
                body: Bytes::from_static(b"answer"),
            });
        }
        round_trip(Frame::Cancel { id: 42 });
        round_trip(Frame::Tell {
            service: Service::IBVERBS_CREDITS,
            deadline: Duration::from_secs(5),
            body: Bytes::from_static(b"credits"),
        });
    }

    #[test]
    fn deadlines_round_up_to_whole_milliseconds_and_saturate() {
        let bytes = serialize(&Frame::Request {
            id: 1,
            service: Service(9),
            deadline: Duration::from_micros(1500),
            body: Bytes::new(),
        });
        assert!(
            matches!(parse(bytes), Ok(Frame::Request { deadline, .. }) if deadline == Duration::from_millis(2))
        );
        let bytes = serialize(&Frame::Request {
            id: 1,
            service: Service(9),
            deadline: Duration::MAX,
            body: Bytes::new(),
        });
        assert!(
            matches!(parse(bytes), Ok(Frame::Request { deadline, .. }) if deadline == Duration::from_millis(u32::MAX.into()))
        );
    }

    #[test]
    fn malformed_frames_are_typed_errors() {
        assert!(matches!(
            parse(Bytes::new()),
            Err(FrameError::Truncated { .. })
        ));
        assert!(matches!(
            parse(Bytes::from_static(&[2; 5])),
            Err(FrameError::Truncated { kind: 2, len: 5 })
        ));
        assert!(matches!(
            parse(Bytes::from_static(&[5; HEADER_LEN - 1])),
            Err(FrameError::Truncated { kind: 5, .. })
        ));
        assert!(matches!(
            parse(Bytes::from(vec![9; HEADER_LEN])),
            Err(FrameError::UnknownKind(9))
        ));
        let mut response = vec![0; HEADER_LEN];
        response[0] = 3;
        response[1] = 200;
        assert!(matches!(
            parse(Bytes::from(response)),
            Err(FrameError::UnknownStatus(200))
        ));
        let mut open = serialize(&Frame::Open {
            min_version: 1,
            max_version: 1,
            node: NodeAddr {
                id: NodeId(1),
                endpoint: "127.0.0.1:1".parse().unwrap(),
            },
        })
        .to_vec();
        open[HEADER_LEN + 4 + 16] = 5;
        assert!(matches!(
            parse(Bytes::from(open.clone())),
            Err(FrameError::BadAddress(5))
        ));
        open.truncate(HEADER_LEN + 3);
        assert!(matches!(
            parse(Bytes::from(open)),
            Err(FrameError::Truncated { kind: 1, .. })
        ));
        // A length prefix over the bound is refused before anything is buffered.
        let mut codec = ControlCodec::new(64);
        let mut huge = BytesMut::from(&(1u32 << 30).to_be_bytes()[..]);
        assert!(matches!(
            codec.decode(&mut huge),
            Err(FrameError::TooLong {
                len: 0x4000_0000,
                max: 64
            })
        ));
        // One within the bound is waited for without reserving its length.
        let mut codec = ControlCodec::new(1 << 20);
        let mut declared = BytesMut::from(&(1u32 << 20).to_be_bytes()[..]);
        assert!(codec.decode(&mut declared).unwrap().is_none());
        assert!(declared.capacity() < 4096, "{}", declared.capacity());
    }

    #[test]
    fn sealed_frames_check_out_and_altered_ones_do_not() {
        use crate::auth::{ClusterSecret, Side};
        let secret = ClusterSecret::new("a cluster secret, 16+ bytes").unwrap();
        let keys = |side| secret.session_keys(0, &[b"handshake"], side);
        let (client, server) = (keys(Side::Client), keys(Side::Server));
        let mut sender = ControlCodec::sealed(1 << 20, Some(client.send));
        let mut receiver = ControlCodec::sealed(1 << 20, Some(server.recv.clone()));
        let frame = Frame::Cancel { id: 3 };
        let mut buf = BytesMut::new();
        sender.encode(frame.clone(), &mut buf).unwrap();
        sender.encode(frame.clone(), &mut buf).unwrap();
        let second = buf.split_off(buf.len() / 2);
        assert_eq!(receiver.decode(&mut buf).unwrap(), Some(frame.clone()));
        // The same bytes again (a replay) fail: the sequence moved on.
        let mut replay = BytesMut::from(&second[..]);
        let mut fresh = ControlCodec::sealed(1 << 20, Some(server.recv.clone()));
        assert!(matches!(
            fresh.decode(&mut replay.clone()),
            Err(FrameError::Forged)
        ));
        assert_eq!(receiver.decode(&mut replay).unwrap(), Some(frame.clone()));
        // An altered byte, and an unsealed frame on a sealed session.
        let mut altered = BytesMut::new();
        sender.encode(frame.clone(), &mut altered).unwrap();
        altered[PREFIX_LEN + 8] ^= 1;
        assert!(matches!(
            receiver.clone_for_test().decode(&mut altered),
            Err(FrameError::Forged)
        ));
        let mut plain = BytesMut::new();
        ControlCodec::new(1 << 20)
            .encode(frame, &mut plain)
            .unwrap();
        assert!(matches!(
            receiver.decode(&mut plain),
            Err(FrameError::Forged)
        ));
    }
}
