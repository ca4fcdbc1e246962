//! The queue-pair exchange on a node's `Control` channel: the initiator sends
//! its QP details, the owner answers with those of the QP it created for it.
//! Both are one fixed-size little-endian frame.

use crate::verbs::QpEndpoint;

pub const QP_INFO_LEN: usize = 40;
const MAGIC: u32 = u32::from_le_bytes(*b"FQP1");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// 0 on success; non-zero in a reply means the owner could not set up a QP.
    pub status: u8,
    /// `ibv_mtu` value of the sender's port.
    pub mtu: u8,
    pub endpoint: QpEndpoint,
}

impl QpInfo {
    pub fn encode(&self) -> [u8; QP_INFO_LEN] {
        let mut b = [0; QP_INFO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.status;
        b[5] = self.mtu;
        b[6..8].copy_from_slice(&self.endpoint.lid.to_le_bytes());
        b[8..12].copy_from_slice(&self.endpoint.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.endpoint.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.endpoint.gid);
        b
    }

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
        })
    }
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
        };
        assert_eq!(QpInfo::decode(&info.encode()), Some(info));
        assert_eq!(QpInfo::decode(&[0; QP_INFO_LEN]), None);
    }
}
