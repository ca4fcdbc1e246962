//! The packets of the memory transport's setup: a peer asks for a
//! region's memory (`Request`), the owner answers (`Reply`, with the memfd
//! attached when granted, or the gate table's memfd with a `process_vm`
//! grant). On a socket of its own, a peer opens a notification lane
//! (`LaneOpen`, with the ring's memfd attached), the owner answers
//! (`LaneAck`), and then only one-byte doorbells cross (see `lane.rs`).
//! Fixed-size little-endian; nothing else crosses.
//!
//! Peers built before `process_vm` send 0 in the request's byte 7 and
//! never get a `process_vm` grant (they could not read one): the owner
//! refuses them such a region as unknown.
//!
//! A request through a narrowed handle carries its chain of scopes (see
//! `ferry_core::Scopes`) behind the 32 bytes, [`SCOPE_LEN`] each; one
//! through the region's own token is 32 bytes, as it always was.
//!
//! Public (and hidden from the docs) only so that the fuzz targets in
//! `fuzz/` reach these decoders: they are not part of ferry's API.

use ferry_control::wire::{NODE_ADDR_LEN, encode_node_addr, node_addr_at};
use ferry_core::{Generation, MAX_SCOPES, NodeAddr, OpError, RegionId, SCOPE_LEN, Scopes};

const MAGIC: [u8; 4] = *b"FMEM";
const VERSION: u16 = 1;
/// The reply code of a `process_vm` grant.
const PROCESS_VM: u8 = 16;

/// A peer asks for region `region`'s memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The slot.
    pub region: RegionId,
    /// The generation the peer's handle carries.
    pub generation: Generation,
    /// Whether it wants to write (a read-write mapping).
    pub write: bool,
    /// The handle's memory token.
    pub token: u128,
    /// The scopes the token was narrowed through; empty for the region's
    /// own token.
    pub scopes: Scopes,
    /// Whether the peer takes a [`Reply::ProcessVm`] grant.
    pub process_vm: bool,
}

impl Request {
    /// Encoded length without scopes.
    pub const LEN: usize = 32;
    /// Encoded length with the most scopes.
    pub const MAX_LEN: usize = Self::LEN + MAX_SCOPES * SCOPE_LEN;

    /// The packet: the fixed part, then the scopes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0; Self::LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = u8::from(self.write);
        out[7] = u8::from(self.process_vm);
        out[8..12].copy_from_slice(&self.region.0.to_le_bytes());
        out[12..16].copy_from_slice(&self.generation.0.to_le_bytes());
        out[16..32].copy_from_slice(&self.token.to_le_bytes());
        self.scopes.encode_into(&mut out);
        out
    }

    /// Reads a packet; `None` if it is not one.
    pub fn decode(packet: &[u8]) -> Option<Self> {
        let (packet, scopes) = packet.split_at_checked(Self::LEN)?;
        let scopes = match scopes {
            [] => Scopes::default(),
            scopes => Scopes::decode(scopes)?,
        };
        let packet: &[u8; Self::LEN] = packet.try_into().ok()?;
        if packet[0..4] != MAGIC
            || packet[4..6] != VERSION.to_le_bytes()
            || packet[6] > 1
            || packet[7] > 1
        {
            return None;
        }
        let u32_at = |at: usize| u32::from_le_bytes(packet[at..at + 4].try_into().unwrap());
        Some(Request {
            write: packet[6] == 1,
            process_vm: packet[7] == 1,
            region: RegionId(u32_at(8)),
            generation: Generation(u32_at(12)),
            token: u128::from_le_bytes(packet[16..32].try_into().unwrap()),
            scopes,
        })
    }
}

/// The owner's answer to one request, naming it: a peer whose earlier
/// exchange was cancelled after its request went out skips that reply
/// instead of taking it for the answer to the next one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The request answered: slot, generation, write.
    pub to: (RegionId, Generation, bool),
    /// The answer.
    pub reply: Reply,
}

impl Answer {
    /// Encoded length: the reply, then slot and generation.
    pub const LEN: usize = Reply::LEN + 8;

    /// The answer to `request`.
    pub fn to(request: &Request, reply: Reply) -> Self {
        Answer {
            to: (request.region, request.generation, request.write),
            reply,
        }
    }

    /// Whether it answers `request`.
    pub fn answers(&self, request: &Request) -> bool {
        self.to == (request.region, request.generation, request.write)
    }

    /// The packet.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        out[..Reply::LEN].copy_from_slice(&self.reply.encode());
        out[1] = u8::from(self.to.2);
        out[32..36].copy_from_slice(&self.to.0.0.to_le_bytes());
        out[36..40].copy_from_slice(&self.to.1.0.to_le_bytes());
        out
    }

    /// Reads a packet; `None` if it is not one.
    pub fn decode(packet: &[u8]) -> Option<Self> {
        let packet: &[u8; Self::LEN] = packet.try_into().ok()?;
        let mut reply = [0; Reply::LEN];
        reply.copy_from_slice(&packet[..Reply::LEN]);
        let write = match reply[1] {
            0 => false,
            1 => true,
            _ => return None,
        };
        reply[1] = 0;
        let u32_at = |at: usize| u32::from_le_bytes(packet[at..at + 4].try_into().unwrap());
        Some(Answer {
            to: (RegionId(u32_at(32)), Generation(u32_at(36)), write),
            reply: Reply::decode(&reply)?,
        })
    }
}

/// The owner's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Granted: the memfd comes with this packet.
    Granted {
        /// The region's first byte in the owner (handles' addresses are
        /// offsets from it).
        base: u64,
        /// The region's length.
        len: u64,
        /// Where its trailer page (the liveness word) starts in the memfd.
        data_len: u64,
    },
    /// Granted over `process_vm`: the gate table's memfd comes with this
    /// packet. Writes are granted iff the request asked for them.
    ProcessVm {
        /// The region's first byte in the owner's address space.
        base: u64,
        /// The region's length.
        len: u64,
        /// The region's gate in the table.
        gate: u32,
        /// The peer process's lane in the table.
        lane: u16,
        /// What the gate's live word holds while the region is registered.
        stamp: u64,
    },
    /// Refused, with the error the op gets.
    Refused(Refusal),
}

/// Why the owner refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No region in that slot, or not one shared memory can reach.
    UnknownRegion,
    /// The slot holds a newer generation.
    StaleGeneration {
        /// What the slot holds now.
        current: Generation,
    },
    /// The token does not match.
    AccessDenied,
    /// A write asked of a read-only region.
    ReadOnly,
    /// The request was malformed.
    BadRequest,
    /// The owner already serves `process_vm` to as many processes as its
    /// gate table has lanes.
    NoLane,
    /// The owner requires its cluster secret, and the peer proved none.
    Unauthenticated,
}

impl Refusal {
    /// The op error it means for a handle of `generation`.
    pub fn error(self, generation: Generation) -> OpError {
        match self {
            Refusal::UnknownRegion => OpError::UnknownRegion,
            Refusal::StaleGeneration { current } => OpError::StaleGeneration {
                handle: generation,
                current,
            },
            Refusal::AccessDenied => OpError::AccessDenied,
            Refusal::ReadOnly => OpError::ReadOnly,
            Refusal::BadRequest => {
                OpError::Protocol("the owner refused a malformed request".into())
            }
            Refusal::NoLane => OpError::Protocol(
                "the owner serves process_vm to too many processes to take another".into(),
            ),
            // The link names the owner's endpoint instead (`peer.rs`).
            Refusal::Unauthenticated => OpError::Protocol(
                "the same-host owner requires a cluster secret and this node has none".into(),
            ),
        }
    }
}

impl Reply {
    /// Encoded length.
    pub const LEN: usize = 32;

    /// The packet.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        match *self {
            Reply::Granted {
                base,
                len,
                data_len,
            } => {
                out[8..16].copy_from_slice(&base.to_le_bytes());
                out[16..24].copy_from_slice(&len.to_le_bytes());
                out[24..32].copy_from_slice(&data_len.to_le_bytes());
            }
            Reply::ProcessVm {
                base,
                len,
                gate,
                lane,
                stamp,
            } => {
                out[0] = PROCESS_VM;
                out[2..4].copy_from_slice(&lane.to_le_bytes());
                out[4..8].copy_from_slice(&gate.to_le_bytes());
                out[8..16].copy_from_slice(&base.to_le_bytes());
                out[16..24].copy_from_slice(&len.to_le_bytes());
                out[24..32].copy_from_slice(&stamp.to_le_bytes());
            }
            Reply::Refused(refusal) => {
                let (code, current) = match refusal {
                    Refusal::UnknownRegion => (1, 0),
                    Refusal::StaleGeneration { current } => (2, current.0),
                    Refusal::AccessDenied => (3, 0),
                    Refusal::ReadOnly => (4, 0),
                    Refusal::BadRequest => (5, 0),
                    Refusal::NoLane => (6, 0),
                    Refusal::Unauthenticated => (7, 0),
                };
                out[0] = code;
                out[4..8].copy_from_slice(&current.to_le_bytes());
            }
        }
        out
    }

    /// Reads a packet; `None` if it is not one.
    pub fn decode(packet: &[u8]) -> Option<Self> {
        let packet: &[u8; Self::LEN] = packet.try_into().ok()?;
        let u64_at = |at: usize| u64::from_le_bytes(packet[at..at + 8].try_into().unwrap());
        let current = Generation(u32::from_le_bytes(packet[4..8].try_into().unwrap()));
        Some(match packet[0] {
            0 => Reply::Granted {
                base: u64_at(8),
                len: u64_at(16),
                data_len: u64_at(24),
            },
            1 => Reply::Refused(Refusal::UnknownRegion),
            2 => Reply::Refused(Refusal::StaleGeneration { current }),
            3 => Reply::Refused(Refusal::AccessDenied),
            4 => Reply::Refused(Refusal::ReadOnly),
            5 => Reply::Refused(Refusal::BadRequest),
            6 => Reply::Refused(Refusal::NoLane),
            7 => Reply::Refused(Refusal::Unauthenticated),
            PROCESS_VM => Reply::ProcessVm {
                base: u64_at(8),
                len: u64_at(16),
                gate: u32::from_le_bytes(packet[4..8].try_into().unwrap()),
                lane: u16::from_le_bytes(packet[2..4].try_into().unwrap()),
                stamp: u64_at(24),
            },
            _ => return None,
        })
    }
}

const LANE_MAGIC: [u8; 4] = *b"FMNL";
const LANE_VERSION: u16 = 1;

/// A peer opens a notification lane to the owner: the ring's memfd comes
/// with this packet, on a socket that carries nothing else from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneOpen {
    /// The node sending: what the owner's inbox names as the sender.
    pub from: NodeAddr,
    /// Slots in the ring.
    pub slots: u32,
    /// Bytes per slot, its length word included.
    pub slot_len: u32,
}

impl LaneOpen {
    /// Encoded length.
    pub const LEN: usize = 16 + NODE_ADDR_LEN;

    /// The packet.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        out[0..4].copy_from_slice(&LANE_MAGIC);
        out[4..6].copy_from_slice(&LANE_VERSION.to_le_bytes());
        out[8..12].copy_from_slice(&self.slots.to_le_bytes());
        out[12..16].copy_from_slice(&self.slot_len.to_le_bytes());
        out[16..].copy_from_slice(&encode_node_addr(&self.from));
        out
    }

    /// Reads a packet; `None` if it is not one.
    pub fn decode(packet: &[u8]) -> Option<Self> {
        let packet: &[u8; Self::LEN] = packet.try_into().ok()?;
        if packet[0..4] != LANE_MAGIC || packet[4..6] != LANE_VERSION.to_le_bytes() {
            return None;
        }
        let u32_at = |at: usize| u32::from_le_bytes(packet[at..at + 4].try_into().unwrap());
        Some(LaneOpen {
            slots: u32_at(8),
            slot_len: u32_at(12),
            from: node_addr_at(&packet[16..]).ok()?,
        })
    }
}

/// The owner's answer to a [`LaneOpen`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneAck {
    /// The ring is mapped and watched: notifications of up to `max_len`
    /// bytes (the owner's limit) may go.
    Open {
        /// The longest notification the owner takes.
        max_len: u32,
    },
    /// The owner takes no notifications this way (no inbox yet, or a
    /// ring it cannot use): they go over the control session.
    Refused,
}

impl LaneAck {
    /// Encoded length.
    pub const LEN: usize = 12;

    /// The packet.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        out[0..4].copy_from_slice(&LANE_MAGIC);
        match self {
            LaneAck::Open { max_len } => {
                out[4] = 1;
                out[8..12].copy_from_slice(&max_len.to_le_bytes());
            }
            LaneAck::Refused => out[4] = 2,
        }
        out
    }

    /// Reads a packet; `None` if it is not one.
    pub fn decode(packet: &[u8]) -> Option<Self> {
        let packet: &[u8; Self::LEN] = packet.try_into().ok()?;
        if packet[0..4] != LANE_MAGIC {
            return None;
        }
        match packet[4] {
            1 => Some(LaneAck::Open {
                max_len: u32::from_le_bytes(packet[8..12].try_into().unwrap()),
            }),
            2 => Some(LaneAck::Refused),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_round_trip_and_garbage_is_refused() {
        let request = Request {
            region: RegionId(7),
            generation: Generation(3),
            write: true,
            token: u128::MAX - 5,
            scopes: Scopes::default(),
            process_vm: true,
        };
        assert_eq!(request.encode().len(), Request::LEN);
        assert_eq!(Request::decode(&request.encode()), Some(request));
        let mut bad = request.encode();
        bad[0] = b'X';
        assert_eq!(Request::decode(&bad), None);
        assert_eq!(Request::decode(&request.encode()[..31]), None);
        // Narrowed: its scopes follow, whole.
        let scope = ferry_core::Scope {
            addr: 0x1000,
            len: 10,
            access: ferry_core::Access::ReadOnly,
        };
        let scoped = Request {
            scopes: Scopes::new(&[scope; MAX_SCOPES]).unwrap(),
            ..request
        };
        let packet = scoped.encode();
        assert_eq!(packet.len(), Request::MAX_LEN);
        assert_eq!(Request::decode(&packet), Some(scoped));
        assert_eq!(Request::decode(&packet[..Request::MAX_LEN - 1]), None);
        let mut five = packet.clone();
        five.extend_from_slice(&scope.encode());
        assert_eq!(Request::decode(&five), None);
        for reply in [
            Reply::Granted {
                base: 0x7000_0000,
                len: 10,
                data_len: 4096,
            },
            Reply::Refused(Refusal::StaleGeneration {
                current: Generation(9),
            }),
            Reply::Refused(Refusal::ReadOnly),
            Reply::Refused(Refusal::NoLane),
            Reply::Refused(Refusal::Unauthenticated),
            Reply::ProcessVm {
                base: 0x7f00_0000_1000,
                len: 5,
                gate: 4095,
                lane: 1023,
                stamp: 77,
            },
        ] {
            assert_eq!(Reply::decode(&reply.encode()), Some(reply));
        }
        let mut bad = Reply::Refused(Refusal::ReadOnly).encode();
        bad[0] = 99;
        assert_eq!(Reply::decode(&bad), None);
        let answer = Answer::to(&request, Reply::Refused(Refusal::AccessDenied));
        let decoded = Answer::decode(&answer.encode()).unwrap();
        assert_eq!(decoded, answer);
        assert!(decoded.answers(&request));
        let other = Request {
            write: false,
            ..request
        };
        assert!(!decoded.answers(&other));
    }

    #[test]
    fn lane_packets_round_trip_and_garbage_is_refused() {
        let open = LaneOpen {
            from: NodeAddr {
                id: ferry_core::NodeId(u128::MAX - 3),
                endpoint: "[::1]:7100".parse().unwrap(),
            },
            slots: 64,
            slot_len: 4096,
        };
        assert_eq!(LaneOpen::decode(&open.encode()), Some(open));
        // A region request is not a lane, nor the reverse.
        assert_eq!(LaneOpen::decode(&[0; Request::LEN]), None);
        assert_eq!(Request::decode(&open.encode()), None);
        let mut bad = open.encode();
        bad[16 + 16] = 5; // address family
        assert_eq!(LaneOpen::decode(&bad), None);
        for ack in [LaneAck::Open { max_len: 65536 }, LaneAck::Refused] {
            assert_eq!(LaneAck::decode(&ack.encode()), Some(ack));
        }
        let mut bad = LaneAck::Open { max_len: 1 }.encode();
        bad[4] = 0;
        assert_eq!(LaneAck::decode(&bad), None);
    }
}
