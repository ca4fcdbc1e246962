//! The first bytes of every connection to a node's endpoint: which node the
//! client is, which channel it wants, whether the server is the node the
//! client meant to reach, and, where the nodes hold a cluster secret,
//! proof both ways that they hold the same one (see [`crate::auth`]).
//!
//! ```text
//! client -> Hello (72 B: header, the node it means to reach, nonce)
//! server -> HelloReply (24 B header; + nonce and tag, 64 B, when taken)
//! client -> proof (32 B tag), only where both prove a secret
//! then the channel's own protocol (every frame sealed, where both prove
//! a secret: see [`crate::auth::SessionKeys`])
//! ```
//!
//! A server refuses a hello meant for another node ([`HelloStatus::WrongNode`])
//! and one that claims to come from itself ([`HelloStatus::Reflected`]), so
//! that a hello relayed to another member or bounced back to its sender is
//! refused before any proof is checked; a refusal names no node, so that
//! it tells a stranger nothing.
//!
//! The client says nothing more until it has the reply, so the server never
//! finds bytes of the channel's protocol behind the hello; its proof goes
//! out with the channel's first bytes, since the server reads exactly its
//! 32 bytes and answers nothing until they check out: a secret costs no
//! round trip.

use std::fmt;

use ferry_core::NodeId;

use crate::auth::{TAG_LEN, Tag};
use crate::wire::{u16_at, u32_at, u128_at};

mod handshake;

pub use handshake::{Authenticated, Dialer, Greeted, Sealing, SecretCell, Tracked};
pub(crate) use handshake::{accept, refuse_busy};

/// "FRY1": every hello starts with it, so a stray client is told apart from
/// a ferry node at once.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FRY1");
/// Version of the endpoint protocol: the hello, the control session and the
/// channels behind it. Nodes of different versions refuse each other.
/// 3: the TCP data channel's ranges requests. 4: the
/// [`HelloStatus::Busy`] reply, which a version 3 client cannot read (it
/// reported a protocol error); the bump makes a mixed cluster fail at the
/// hello with `BadVersion` instead. An endpoint at its bound sends `Busy`
/// before it reads the hello, so an older client still sees it there.
/// 5: nonces, tags and the cluster secret's statuses. 6: the node the
/// client means to reach, refusals that name no node, sealed frames after a
/// hello that proved a secret, and the TCP data channel's scoped requests
/// (narrowed handles).
pub const VERSION: u16 = 6;
/// Length of a hello's and a reply's header, the part every version
/// shares (so that a node of another version reads the refusal).
pub const HELLO_LEN: usize = 24;
/// Bit of a header's byte 7: the sender proves a cluster secret.
const PROVES: u8 = 1;

/// What a connection to the endpoint is for. The endpoint serves
/// [`Channel::CONTROL`] itself and hands every other channel to the data
/// plane that registered for it; the numbers are listed here so that no two
/// data planes pick the same one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Channel(pub u8);

impl Channel {
    /// The TCP data plane's requests and responses (`ferry-tcp`).
    pub const TCP_DATA: Channel = Channel(1);
    /// The node's control session (see [`crate::Session`]).
    pub const CONTROL: Channel = Channel(2);
    /// Asks only who the node is: the hello reply carries its id, and the
    /// connection ends there (see [`Dialer::identify`]). Served by whoever handles
    /// it on the endpoint (`ferry-discovery`).
    pub const IDENTIFY: Channel = Channel(3);
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Channel::TCP_DATA => f.write_str("Channel::TCP_DATA"),
            Channel::CONTROL => f.write_str("Channel::CONTROL"),
            Channel(n) => write!(f, "Channel({n})"),
        }
    }
}

/// A client's first frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hello {
    /// The client's [`VERSION`].
    pub version: u16,
    /// The channel the client wants.
    pub channel: Channel,
    /// The node the client says it is: a claim, unless both ends prove a
    /// cluster secret, whose tags cover it.
    pub node: NodeId,
    /// The node the client means to reach; [`NodeId`] 0 only on
    /// [`Channel::IDENTIFY`], which asks who the node is.
    pub target: NodeId,
    /// Whether the client proves a cluster secret.
    pub proves: bool,
    /// The client's fresh nonce, which the server's tag covers.
    pub nonce: Tag,
}

/// The server's answer to a [`Hello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloReply {
    /// The server's [`VERSION`].
    pub version: u16,
    /// Whether the server takes the connection.
    pub status: HelloStatus,
    /// The node that answered: a client checks it is the node it meant.
    pub node: NodeId,
    /// Whether the server proves a cluster secret (`tag`).
    pub proves: bool,
    /// The server's fresh nonce, which the client's tag covers (sent only
    /// with [`HelloStatus::Ok`], as is the tag).
    pub nonce: Tag,
    /// The server's tag over the hello and this reply's header and nonce;
    /// zeros when it proves no secret.
    pub tag: Tag,
}

/// Whether the server takes a connection, and if not, why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloStatus {
    /// Taken: the channel's protocol follows.
    Ok,
    /// The client speaks another protocol version.
    BadVersion,
    /// No handler serves the requested channel on this node.
    BadChannel,
    /// The node is at its connection limit and none of the connections it
    /// holds is idle enough to make room (see [`crate::ConnectionLimits`]):
    /// a client carries on over the connections it already has, or tries
    /// again later.
    Busy,
    /// The node requires a cluster secret, and the client proves none.
    SecretRequired,
    /// The client proves a cluster secret, and the node has none.
    NoSecret,
    /// The hello names another node than this one: a relayed hello, or a
    /// handle naming another node's id at this address.
    WrongNode,
    /// The hello claims to come from this very node: a hello bounced back
    /// to its sender.
    Reflected,
    /// A status this version does not know (from a newer server).
    Unknown(u8),
}

impl HelloStatus {
    fn code(self) -> u8 {
        match self {
            HelloStatus::Ok => 0,
            HelloStatus::BadVersion => 1,
            HelloStatus::BadChannel => 2,
            HelloStatus::Busy => 3,
            HelloStatus::SecretRequired => 4,
            HelloStatus::NoSecret => 5,
            HelloStatus::WrongNode => 6,
            HelloStatus::Reflected => 7,
            HelloStatus::Unknown(code) => code,
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            0 => HelloStatus::Ok,
            1 => HelloStatus::BadVersion,
            2 => HelloStatus::BadChannel,
            3 => HelloStatus::Busy,
            4 => HelloStatus::SecretRequired,
            5 => HelloStatus::NoSecret,
            6 => HelloStatus::WrongNode,
            7 => HelloStatus::Reflected,
            other => HelloStatus::Unknown(other),
        }
    }
}

/// A hello or reply whose bytes are not a ferry hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a ferry hello (magic {0:#010x})")]
pub struct BadMagic(pub u32);

fn encode_header(version: u16, byte: u8, proves: bool, node: NodeId) -> [u8; HELLO_LEN] {
    let mut b = [0; HELLO_LEN];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&version.to_le_bytes());
    b[6] = byte;
    b[7] = if proves { PROVES } else { 0 };
    b[8..24].copy_from_slice(&node.0.to_le_bytes());
    b
}

/// A header's version, status or channel byte, proof flag and node.
fn decode_header(b: &[u8]) -> Result<(u16, u8, bool, NodeId), BadMagic> {
    match u32_at(b, 0) {
        MAGIC => Ok((
            u16_at(b, 4),
            b[6],
            b[7] & PROVES != 0,
            NodeId(u128_at(b, 8)),
        )),
        other => Err(BadMagic(other)),
    }
}

fn tag_at(b: &[u8], at: usize) -> Tag {
    b[at..at + TAG_LEN].try_into().expect("a 32-byte slice")
}

impl Hello {
    /// Length of a hello: its header, the target node, and the nonce.
    pub const LEN: usize = HELLO_LEN + 16 + TAG_LEN;

    /// A hello of this version from node `node`, for `channel` of node
    /// `target`, proving no secret, with a fresh nonce.
    pub fn new(channel: Channel, node: NodeId, target: NodeId) -> Hello {
        Hello {
            version: VERSION,
            channel,
            node,
            target,
            proves: false,
            nonce: crate::auth::nonce(),
        }
    }

    /// The hello's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..HELLO_LEN].copy_from_slice(&encode_header(
            self.version,
            self.channel.0,
            self.proves,
            self.node,
        ));
        b[HELLO_LEN..HELLO_LEN + 16].copy_from_slice(&self.target.0.to_le_bytes());
        b[HELLO_LEN + 16..].copy_from_slice(&self.nonce);
        b
    }

    /// The version a hello's header names, for the server to judge before
    /// it reads the rest (a node of another version may send another
    /// length).
    pub fn version_of(header: &[u8; HELLO_LEN]) -> Result<u16, BadMagic> {
        decode_header(header).map(|(version, ..)| version)
    }

    /// Parses a hello; any version is returned as it is, for the server to judge.
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, BadMagic> {
        let (version, channel, proves, node) = decode_header(b)?;
        Ok(Hello {
            version,
            channel: Channel(channel),
            node,
            target: NodeId(u128_at(b, HELLO_LEN)),
            proves,
            nonce: tag_at(b, HELLO_LEN + 16),
        })
    }
}

impl HelloReply {
    /// Length of a reply that takes the connection: header, nonce and tag.
    pub const LEN: usize = HELLO_LEN + 2 * TAG_LEN;

    /// The reply's header: all of a refusal.
    pub fn header(&self) -> [u8; HELLO_LEN] {
        encode_header(self.version, self.status.code(), self.proves, self.node)
    }

    /// The reply's bytes: its header, then (if it takes the connection) its
    /// nonce and tag.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.header().to_vec();
        if self.status == HelloStatus::Ok {
            b.extend_from_slice(&self.nonce);
            b.extend_from_slice(&self.tag);
        }
        b
    }

    /// Parses a reply's header; the nonce and tag are zeros until
    /// [`HelloReply::with_tail`].
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, BadMagic> {
        let (version, status, proves, node) = decode_header(b)?;
        Ok(HelloReply {
            version,
            status: HelloStatus::from_code(status),
            node,
            proves,
            nonce: [0; TAG_LEN],
            tag: [0; TAG_LEN],
        })
    }

    /// The reply with the nonce and tag that follow a taking header.
    pub fn with_tail(mut self, tail: &[u8; 2 * TAG_LEN]) -> Self {
        self.nonce = tag_at(tail, 0);
        self.tag = tag_at(tail, TAG_LEN);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_round_trip_and_reject_garbage() {
        let mut hello = Hello::new(Channel::TCP_DATA, NodeId(77), NodeId(78));
        hello.proves = true;
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        for status in [
            HelloStatus::Ok,
            HelloStatus::BadVersion,
            HelloStatus::BadChannel,
            HelloStatus::Busy,
            HelloStatus::SecretRequired,
            HelloStatus::NoSecret,
            HelloStatus::WrongNode,
            HelloStatus::Reflected,
            HelloStatus::Unknown(9),
        ] {
            let reply = HelloReply {
                version: 7,
                status,
                node: NodeId(u128::MAX),
                proves: status == HelloStatus::Ok,
                nonce: [1; TAG_LEN],
                tag: [2; TAG_LEN],
            };
            let bytes = reply.encode();
            let mut decoded = HelloReply::decode(bytes[..HELLO_LEN].try_into().unwrap()).unwrap();
            if status == HelloStatus::Ok {
                decoded = decoded.with_tail(bytes[HELLO_LEN..].try_into().unwrap());
                assert_eq!(decoded, reply);
            } else {
                assert_eq!(bytes.len(), HELLO_LEN, "a refusal is its header");
                assert_eq!((decoded.status, decoded.node), (status, reply.node));
            }
        }
        assert_eq!(Hello::decode(&[0xff; Hello::LEN]), Err(BadMagic(u32::MAX)));
    }
}
