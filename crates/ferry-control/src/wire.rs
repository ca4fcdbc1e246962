//! Little-endian field access for fixed-layout frames: the hello here, and
//! the headers of the data channels that build on it; and the one layout
//! of a [`NodeAddr`] that every frame naming a node uses.
//!
//! Callers index within frames whose length they have already checked, so an
//! out-of-range offset is a bug in the caller, not bad input.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ferry_core::{NodeAddr, NodeId};

/// The `u16` at byte `at` of `b`.
pub fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2-byte slice"))
}

/// The `u32` at byte `at` of `b`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}

/// The `u64` at byte `at` of `b`.
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}

/// The `u128` at byte `at` of `b`.
pub fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16-byte slice"))
}

/// Bytes of an encoded [`NodeAddr`]: id, address family (4 or 6), 16
/// address bytes (an IPv4 address in the first 4), port.
pub const NODE_ADDR_LEN: usize = 16 + 1 + 16 + 2;

/// `node` in its [`NODE_ADDR_LEN`]-byte layout.
pub fn encode_node_addr(node: &NodeAddr) -> [u8; NODE_ADDR_LEN] {
    let mut out = [0u8; NODE_ADDR_LEN];
    out[..16].copy_from_slice(&node.id.0.to_le_bytes());
    match node.endpoint.ip() {
        IpAddr::V4(v4) => {
            out[16] = 4;
            out[17..21].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out[16] = 6;
            out[17..33].copy_from_slice(&v6.octets());
        }
    }
    out[33..35].copy_from_slice(&node.endpoint.port().to_le_bytes());
    out
}

/// The node address at the start of `b` (at least [`NODE_ADDR_LEN`]
/// bytes); `Err` with the family byte when it is neither 4 nor 6.
pub fn node_addr_at(b: &[u8]) -> Result<NodeAddr, u8> {
    let octets: [u8; 16] = b[17..33].try_into().expect("16-byte slice");
    let ip = match b[16] {
        4 => IpAddr::V4(Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3])),
        6 => IpAddr::V6(Ipv6Addr::from(octets)),
        other => return Err(other),
    };
    Ok(NodeAddr {
        id: NodeId(u128_at(b, 0)),
        endpoint: SocketAddr::new(ip, u16_at(b, 33)),
    })
}
