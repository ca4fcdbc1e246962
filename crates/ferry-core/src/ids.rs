use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// A 128-bit value from the operating system's CSPRNG.
///
/// Node ids and TCP access tokens must not be guessable by another process on
/// the network, so they never come from a seeded or time-based generator.
pub fn random_u128() -> u128 {
    let mut bytes = [0u8; 16];
    // The OS RNG only fails on exotic platforms before boot-time entropy exists;
    // continuing with a predictable token would be a silent security hole.
    getrandom::fill(&mut bytes).expect("operating system random number generator failed");
    u128::from_le_bytes(bytes)
}

/// Compares access tokens without an early exit, so timing does not reveal
/// how many leading bytes of a guessed token were right.
pub fn tokens_equal(a: u128, b: u128) -> bool {
    std::hint::black_box(a ^ b) == 0
}

/// Identity of one ferry node (one per process), random so that a restarted
/// process on the same address is a different node.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(#[serde(with = "hex_u128")] pub u128);

impl NodeId {
    /// A fresh, unguessable id from [`random_u128`]; a node takes one when it
    /// spawns.
    pub fn random() -> Self {
        NodeId(random_u128())
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({:08x})", (self.0 >> 96) as u32)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Where a node can be reached: its id plus its control endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeAddr {
    /// The node's id; a connection to `endpoint` that finds another node
    /// fails with [`OpError::UnknownNode`](crate::OpError::UnknownNode).
    pub id: NodeId,
    /// The node's advertised endpoint address (never `0.0.0.0`).
    pub endpoint: SocketAddr,
}

impl fmt::Display for NodeAddr {
    /// The endpoint, then the full id: what a person needs to find the
    /// node, and to tell it from a restarted process at the same address.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (node {})", self.endpoint, self.id)
    }
}

/// Slot of a region in its node's region table. Slots are reused, so a
/// [`RegionId`] alone does not name a region: pair it with its [`Generation`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u32);

/// Incremented every time a region slot is reused; a handle whose generation
/// differs from the slot's current one refers to a region that is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Generation(pub u32);

impl fmt::Display for RegionId {
    /// The bare number, for error texts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for Generation {
    /// The bare number, for error texts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Serde for 128-bit values: a 32-digit hex string in human-readable formats
/// (JSON numbers above 2^53 lose precision in most readers), a plain integer in
/// binary formats.
pub(crate) mod hex_u128 {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u128, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&format!("{value:032x}"))
        } else {
            s.serialize_u128(*value)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u128, D::Error> {
        if d.is_human_readable() {
            let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
            u128::from_str_radix(&text, 16).map_err(D::Error::custom)
        } else {
            u128::deserialize(d)
        }
    }
}
