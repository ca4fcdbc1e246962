//! The queue-pair exchange on a node's `Control` channel, in two requests.
//! First the initiator asks for the owner's rails ([`RAILS_QUERY`], answered
//! with [`encode_rails`]). Then it proposes rail pairs ([`encode_pairs`]):
//! for each, which of its rails and which of the owner's, and the details
//! of a QP on its rail; the owner answers, in the same frame, with those of
//! the QP it created on its rail for that pair. Every field is
//! little-endian. The owner's QP details also say how many notification
//! receive buffers it posted on that QP, and their size (zero: it takes
//! notifications over the control session only).
//! The owner of those buffers returns credits for them with an
//! `IBVERBS_CREDITS` tell (a request to a peer before session version 3)
//! whose body is [`encode_credits`].
//!
//! Public (and hidden from the docs) only so that the fuzz targets in
//! `fuzz/` reach these decoders without a device: they are not part of
//! ferry's API.

use crate::verbs::QpEndpoint;

/// Length of a [`QpInfo`] frame.
pub const QP_INFO_LEN: usize = 40;
const MAGIC: u32 = u32::from_le_bytes(*b"FQP1");
/// Length of a credit return's body.
pub const CREDITS_LEN: usize = 8;

/// The body that asks an owner for its rails.
pub const RAILS_QUERY: [u8; 4] = *b"FQR1";
const RELEASE_MAGIC: [u8; 4] = *b"FQX1";

/// Tells the owner to let go of the queue pairs of lease `slot` on this
/// control session (answered with an empty body).
pub fn encode_release(slot: u16) -> [u8; 6] {
    let mut b = [0; 6];
    b[..4].copy_from_slice(&RELEASE_MAGIC);
    b[4..].copy_from_slice(&slot.to_le_bytes());
    b
}

/// Reads [`encode_release`]; `None` unless it is exactly such a frame.
pub fn decode_release(b: &[u8]) -> Option<u16> {
    let b: &[u8; 6] = b.try_into().ok()?;
    (b[..4] == RELEASE_MAGIC).then(|| u16::from_le_bytes([b[4], b[5]]))
}
const PAIRS_MAGIC: [u8; 4] = *b"FQP2";
/// Length of one rail in [`encode_rails`].
const RAIL_LEN: usize = 22;
/// Length of one pair in [`encode_pairs`].
const PAIR_LEN: usize = 4 + QP_INFO_LEN;
/// Most entries one frame carries: pairs of [`ferry_core::MAX_RAILS`] rails each side.
const MAX_ENTRIES: usize = ferry_core::MAX_RAILS * ferry_core::MAX_RAILS;

/// One rail as the owner describes it to an initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailInfo {
    /// The rail's index on its node: handles carry its key at this place.
    pub index: u8,
    /// Whether its link layer is Ethernet (RoCE); else InfiniBand.
    pub ethernet: bool,
    /// `ibv_mtu` value of its port.
    pub mtu: u8,
    /// Its port's LID (0 on RoCE).
    pub lid: u16,
    /// Its GID, in network byte order.
    pub gid: [u8; 16],
}

/// The owner's answer to [`RAILS_QUERY`].
pub fn encode_rails(rails: &[RailInfo]) -> Vec<u8> {
    let mut b = Vec::with_capacity(5 + rails.len() * RAIL_LEN);
    b.extend_from_slice(&RAILS_QUERY);
    b.push(rails.len() as u8);
    for r in rails {
        b.extend_from_slice(&[r.index, u8::from(r.ethernet), r.mtu]);
        b.extend_from_slice(&r.lid.to_le_bytes());
        b.push(0);
        b.extend_from_slice(&r.gid);
    }
    b
}

/// Reads [`encode_rails`]; `None` unless it is exactly such a frame.
pub fn decode_rails(b: &[u8]) -> Option<Vec<RailInfo>> {
    let (head, rest) = b.split_at_checked(5)?;
    let count = usize::from(head[4]);
    if head[..4] != RAILS_QUERY || rest.len() != count * RAIL_LEN {
        return None;
    }
    Some(
        rest.chunks_exact(RAIL_LEN)
            .map(|r| RailInfo {
                index: r[0],
                ethernet: r[1] != 0,
                mtu: r[2],
                lid: u16::from_le_bytes([r[3], r[4]]),
                gid: r[6..22].try_into().unwrap(),
            })
            .collect(),
    )
}

/// One proposed rail pair: the initiator's rail, the owner's, and the QP
/// details of the side sending the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairInfo {
    /// The initiator's rail index.
    pub initiator_rail: u8,
    /// The owner's rail index.
    pub owner_rail: u8,
    /// 0 for the pair ferry posts on; a lease's number for a queue pair
    /// leased to code that posts itself (the owner keeps each apart).
    pub slot: u16,
    /// The sender's queue pair on its end of the pair.
    pub qp: QpInfo,
}

/// A pairs request (initiator) or its answer (owner), entry for entry.
pub fn encode_pairs(pairs: &[PairInfo]) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + pairs.len() * PAIR_LEN);
    b.extend_from_slice(&PAIRS_MAGIC);
    b.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for p in pairs {
        b.extend_from_slice(&[p.initiator_rail, p.owner_rail]);
        b.extend_from_slice(&p.slot.to_le_bytes());
        b.extend_from_slice(&p.qp.encode());
    }
    b
}

/// Reads [`encode_pairs`]; `None` unless it is exactly such a frame of at
/// most 64 entries, each a valid [`QpInfo`].
pub fn decode_pairs(b: &[u8]) -> Option<Vec<PairInfo>> {
    let (head, rest) = b.split_at_checked(8)?;
    let count = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
    if head[..4] != PAIRS_MAGIC || count > MAX_ENTRIES || rest.len() != count * PAIR_LEN {
        return None;
    }
    rest.chunks_exact(PAIR_LEN)
        .map(|p| {
            Some(PairInfo {
                initiator_rail: p[0],
                owner_rail: p[1],
                slot: u16::from_le_bytes([p[2], p[3]]),
                qp: QpInfo::decode(p[4..].try_into().unwrap())?,
            })
        })
        .collect()
}

/// A reply's [`QpInfo::status`]: the owner could not set up a QP.
pub const STATUS_FAILED: u8 = 1;
/// A reply's [`QpInfo::status`]: the owner refused the QP, at its limit
/// for the session or in all (`IbvConfig::max_passive_qps*`). An owner
/// built before this status said [`STATUS_FAILED`], and an initiator built
/// before it takes any non-zero status so.
pub const STATUS_LIMIT: u8 = 2;

/// One side's queue-pair details, as the exchange carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// 0 on success; non-zero in a reply means the owner set up no QP
    /// ([`STATUS_FAILED`], [`STATUS_LIMIT`]).
    pub status: u8,
    /// `ibv_mtu` value of the sender's port.
    pub mtu: u8,
    /// Where the sender's QP is: what the peer connects its own QP to.
    pub endpoint: QpEndpoint,
    /// Receive buffers posted for notifications: the initiator's credits.
    pub recv_slots: u16,
    /// Bytes each of those buffers holds: the largest notification that
    /// may ride the queue pair.
    pub recv_slot_len: u32,
}

impl QpInfo {
    /// The frame as sent.
    pub fn encode(&self) -> [u8; QP_INFO_LEN] {
        let mut b = [0; QP_INFO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.status;
        b[5] = self.mtu;
        b[6..8].copy_from_slice(&self.endpoint.lid.to_le_bytes());
        b[8..12].copy_from_slice(&self.endpoint.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.endpoint.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.endpoint.gid);
        b[32..34].copy_from_slice(&self.recv_slots.to_le_bytes());
        b[36..40].copy_from_slice(&self.recv_slot_len.to_le_bytes());
        b
    }

    /// Parses a frame; `None` if it is not one (wrong magic). Every other
    /// field is taken as sent: the verbs calls that use them refuse what
    /// the device cannot do.
    pub fn decode(b: &[u8; QP_INFO_LEN]) -> Option<Self> {
        if b[0..4] != MAGIC.to_le_bytes() {
            return None;
        }
        Some(QpInfo {
            status: b[4],
            mtu: b[5],
            endpoint: QpEndpoint {
                lid: u16::from_le_bytes([b[6], b[7]]),
                qpn: u32::from_le_bytes(b[8..12].try_into().unwrap()),
                psn: u32::from_le_bytes(b[12..16].try_into().unwrap()),
                gid: b[16..32].try_into().unwrap(),
            },
            recv_slots: u16::from_le_bytes([b[32], b[33]]),
            recv_slot_len: u32::from_le_bytes(b[36..40].try_into().unwrap()),
        })
    }
}

/// A credit return's body: `count` receive buffers of the initiator's QP
/// `initiator_qpn` are free again.
pub fn encode_credits(initiator_qpn: u32, count: u32) -> [u8; CREDITS_LEN] {
    let mut body = [0u8; CREDITS_LEN];
    body[..4].copy_from_slice(&initiator_qpn.to_le_bytes());
    body[4..].copy_from_slice(&count.to_le_bytes());
    body
}

/// Reads a credit return: (the initiator's QP number, how many); `None` if
/// the body is not exactly [`CREDITS_LEN`] bytes.
pub fn decode_credits(body: &[u8]) -> Option<(u32, u32)> {
    let body: &[u8; CREDITS_LEN] = body.try_into().ok()?;
    Some((
        u32::from_le_bytes(body[..4].try_into().unwrap()),
        u32::from_le_bytes(body[4..].try_into().unwrap()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_info_round_trips_and_rejects_garbage() {
        let info = QpInfo {
            status: 0,
            mtu: 3,
            endpoint: QpEndpoint {
                qpn: 0x11,
                psn: 0xabcdef,
                gid: [7; 16],
                lid: 5,
            },
            recv_slots: 16,
            recv_slot_len: 4096,
        };
        assert_eq!(QpInfo::decode(&info.encode()), Some(info));
        assert_eq!(QpInfo::decode(&[0; QP_INFO_LEN]), None);
        assert_eq!(decode_credits(&encode_credits(7, 3)), Some((7, 3)));
        let pairs = [
            PairInfo {
                initiator_rail: 0,
                owner_rail: 1,
                slot: 0,
                qp: info,
            },
            PairInfo {
                initiator_rail: 1,
                owner_rail: 0,
                slot: 7,
                qp: QpInfo { status: 2, ..info },
            },
        ];
        let frame = encode_pairs(&pairs);
        assert_eq!(decode_pairs(&frame).as_deref(), Some(&pairs[..]));
        assert_eq!(decode_pairs(&frame[..frame.len() - 1]), None);
        assert_eq!(
            decode_pairs(&encode_pairs(&[pairs[0]; MAX_ENTRIES + 1])),
            None
        );
        let rails = [RailInfo {
            index: 1,
            ethernet: true,
            mtu: 3,
            lid: 0,
            gid: [9; 16],
        }];
        let frame = encode_rails(&rails);
        assert_eq!(decode_rails(&frame).as_deref(), Some(&rails[..]));
        assert_eq!(decode_rails(&frame[..frame.len() - 1]), None);
        assert_eq!(decode_rails(&RAILS_QUERY), None);
        assert_eq!(decode_release(&encode_release(9)), Some(9));
        assert_eq!(decode_release(&RAILS_QUERY), None);
        assert_eq!(decode_credits(&[0; CREDITS_LEN + 1]), None);
    }
}
