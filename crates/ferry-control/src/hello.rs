//! The first bytes of every connection to a node's endpoint: which node the
//! client is, which channel it wants, and whether the server is the node the
//! client meant to reach.
//!
//! ```text
//! client -> Hello (24 B)    server -> HelloReply (24 B)    then the channel's own protocol
//! ```
//!
//! The client says nothing more until it has the reply, so the server never
//! finds bytes of the channel's protocol behind the hello, and hands the
//! stream on untouched.

use std::fmt;
use std::net::SocketAddr;

use ferry_core::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::ControlError;
use crate::wire::{u16_at, u32_at, u128_at};

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
pub const VERSION: u16 = 4;
/// Length of a hello and of its reply.
pub const HELLO_LEN: usize = 24;

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
    /// connection ends there (see [`identify`]). Served by whoever handles
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
pub struct Hello {
    /// The client's [`VERSION`].
    pub version: u16,
    /// The channel the client wants.
    pub channel: Channel,
    /// The node the client says it is. Unauthenticated: a server treats it
    /// as a claim, never as proof.
    pub node: NodeId,
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
            HelloStatus::Unknown(code) => code,
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            0 => HelloStatus::Ok,
            1 => HelloStatus::BadVersion,
            2 => HelloStatus::BadChannel,
            3 => HelloStatus::Busy,
            other => HelloStatus::Unknown(other),
        }
    }
}

/// A hello or reply whose bytes are not a ferry hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a ferry hello (magic {0:#010x})")]
pub struct BadMagic(pub u32);

fn encode(version: u16, byte: u8, node: NodeId) -> [u8; HELLO_LEN] {
    let mut b = [0; HELLO_LEN];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&version.to_le_bytes());
    b[6] = byte;
    b[8..24].copy_from_slice(&node.0.to_le_bytes());
    b
}

fn decode(b: &[u8; HELLO_LEN]) -> Result<(u16, u8, NodeId), BadMagic> {
    match u32_at(b, 0) {
        MAGIC => Ok((u16_at(b, 4), b[6], NodeId(u128_at(b, 8)))),
        other => Err(BadMagic(other)),
    }
}

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        encode(self.version, self.channel.0, self.node)
    }

    /// Parses a hello; any version is returned as it is, for the server to judge.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, BadMagic> {
        let (version, channel, node) = decode(b)?;
        Ok(Hello {
            version,
            channel: Channel(channel),
            node,
        })
    }
}

impl HelloReply {
    /// The reply's bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        encode(self.version, self.status.code(), self.node)
    }

    /// Parses a reply.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, BadMagic> {
        let (version, status, node) = decode(b)?;
        Ok(HelloReply {
            version,
            status: HelloStatus::from_code(status),
            node,
        })
    }
}

/// Connects to node `peer` as node `me` and asks for `channel`. On success
/// the stream belongs to the channel's protocol. Fails with `WrongNode` if
/// another node answers at that endpoint (a restarted process, or a handle
/// that names the wrong address). The caller bounds how long this may take.
pub async fn connect(
    peer: NodeAddr,
    me: NodeId,
    channel: Channel,
) -> Result<TcpStream, ControlError> {
    let (stream, found) = say_hello(peer.endpoint, me, channel).await?;
    if found != peer.id {
        return Err(ControlError::WrongNode {
            expected: peer.id,
            found,
            endpoint: peer.endpoint,
        });
    }
    Ok(stream)
}

/// The id of the node listening at `endpoint`, for a caller that knows
/// only its address. The caller bounds how long this may take.
pub async fn identify(endpoint: SocketAddr, me: NodeId) -> Result<NodeId, ControlError> {
    say_hello(endpoint, me, Channel::IDENTIFY)
        .await
        .map(|(_, node)| node)
}

/// Connects to `endpoint` as node `me`, asks for `channel`, and returns the
/// stream and the id of the node that took it.
async fn say_hello(
    endpoint: SocketAddr,
    me: NodeId,
    channel: Channel,
) -> Result<(TcpStream, NodeId), ControlError> {
    let unreachable = |e: std::io::Error| ControlError::Unreachable {
        endpoint,
        reason: e.to_string(),
    };
    let mut stream = TcpStream::connect(endpoint).await.map_err(unreachable)?;
    crate::socket::configure(&stream).map_err(unreachable)?;
    let hello = Hello {
        version: VERSION,
        channel,
        node: me,
    };
    // Once connected, a server that hangs up before its reply refused the
    // connection, whether the client sees that as an end of stream or, with
    // its hello unread there, as a reset.
    let hung_up = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::BrokenPipe => ControlError::Refused {
            endpoint,
            status: None,
        },
        _ => unreachable(e),
    };
    let mut bytes = [0; HELLO_LEN];
    // A refusing server may have replied and closed before the hello got
    // there: its reply is still read.
    let sent = stream.write_all(&hello.encode()).await;
    let read = stream.read_exact(&mut bytes).await;
    if let Err(e) = read {
        return Err(hung_up(sent.err().unwrap_or(e)));
    }
    let reply = HelloReply::decode(&bytes).map_err(|e| ControlError::Protocol {
        endpoint,
        reason: e.to_string(),
    })?;
    if reply.status != HelloStatus::Ok {
        return Err(ControlError::Refused {
            endpoint,
            status: Some(reply.status),
        });
    }
    // Taken, yet the hello did not go out whole: nothing to build on.
    sent.map_err(hung_up)?;
    Ok((stream, reply.node))
}

/// The server's half: reads the hello, answers it, and returns it if the
/// connection was taken. `serves(channel)` says whether a handler exists.
pub(crate) async fn accept(
    stream: &mut TcpStream,
    me: NodeId,
    serves: impl FnOnce(Channel) -> bool,
) -> std::io::Result<Hello> {
    let mut bytes = [0; HELLO_LEN];
    stream.read_exact(&mut bytes).await?;
    let hello = Hello::decode(&bytes).map_err(invalid)?;
    let status = if hello.version != VERSION {
        HelloStatus::BadVersion
    } else if serves(hello.channel) {
        HelloStatus::Ok
    } else {
        HelloStatus::BadChannel
    };
    let reply = HelloReply {
        version: VERSION,
        status,
        node: me,
    };
    stream.write_all(&reply.encode()).await?;
    if status != HelloStatus::Ok {
        return Err(invalid(format!("refused {hello:?}: {status:?}")));
    }
    Ok(hello)
}

/// Tells a client the endpoint is at its connection limit
/// ([`HelloStatus::Busy`]) as its connection is closed: one non-blocking
/// send, before its hello is read, so a refusal costs no task and no wait.
/// Best effort: a client that misses it sees the connection closed before
/// the reply, which it reads as a refusal too.
pub(crate) fn refuse_busy(stream: &TcpStream, me: NodeId) {
    let reply = HelloReply {
        version: VERSION,
        status: HelloStatus::Busy,
        node: me,
    }
    .encode();
    // SAFETY: the descriptor is `stream`'s, open for this call; `reply` is
    // a live buffer of the length passed.
    _ = unsafe {
        libc::send(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            reply.as_ptr().cast(),
            reply.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
}

fn invalid(e: impl ToString) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_round_trip_and_reject_garbage() {
        let hello = Hello {
            version: VERSION,
            channel: Channel::TCP_DATA,
            node: NodeId(77),
        };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        for status in [
            HelloStatus::Ok,
            HelloStatus::BadVersion,
            HelloStatus::BadChannel,
            HelloStatus::Busy,
            HelloStatus::Unknown(9),
        ] {
            let reply = HelloReply {
                version: 7,
                status,
                node: NodeId(u128::MAX),
            };
            assert_eq!(HelloReply::decode(&reply.encode()), Ok(reply));
        }
        assert_eq!(Hello::decode(&[0xff; HELLO_LEN]), Err(BadMagic(u32::MAX)));
    }
}
