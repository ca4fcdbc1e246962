//! The queue-pair exchange on a node's `Control` channel: the initiator sends
//! its QP details, the owner answers with those of the QP it created for it.
//! Both are one fixed-size little-endian frame. The owner's answer also
//! says how many notification receive buffers it posted on its QP, and
//! their size (zero: it takes notifications over the control session only).
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

/// One side's queue-pair details, as the exchange carries them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// 0 on success; non-zero in a reply means the owner could not set up a QP.
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
        assert_eq!(decode_credits(&[0; CREDITS_LEN + 1]), None);
    }
}
