//! The first bytes of every connection to a node's endpoint: which node the
//! client is, which channel it wants, whether the server is the node the
//! client meant to reach, and, where the nodes hold a cluster secret,
//! proof both ways that they hold the same one (see [`crate::auth`]).
//!
//! ```text
//! client -> Hello (56 B: header, nonce)
//! server -> HelloReply (24 B header; + nonce and tag, 64 B, when taken)
//! client -> proof (32 B tag), only where both prove a secret
//! then the channel's own protocol
//! ```
//!
//! The client says nothing more until it has the reply, so the server never
//! finds bytes of the channel's protocol behind the hello; its proof goes
//! out with the channel's first bytes, since the server reads exactly its
//! 32 bytes and answers nothing until they check out: a secret costs no
//! round trip.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use ferry_core::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::ControlError;
use crate::auth::{AuthFailure, ClusterSecret, TAG_LEN, Tag, nonce};
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
/// 5: nonces, tags and the cluster secret's statuses.
pub const VERSION: u16 = 5;
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
pub struct Hello {
    /// The client's [`VERSION`].
    pub version: u16,
    /// The channel the client wants.
    pub channel: Channel,
    /// The node the client says it is: a claim, unless both ends prove a
    /// cluster secret, whose tags cover it.
    pub node: NodeId,
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
    /// Length of a hello: its header and nonce.
    pub const LEN: usize = HELLO_LEN + TAG_LEN;

    /// The hello's bytes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[..HELLO_LEN].copy_from_slice(&encode_header(
            self.version,
            self.channel.0,
            self.proves,
            self.node,
        ));
        b[HELLO_LEN..].copy_from_slice(&self.nonce);
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
            proves,
            nonce: tag_at(b, HELLO_LEN),
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

/// What the server's tag covers: the client's hello, and the reply's
/// header and nonce.
fn server_transcript<'a>(hello: &'a [u8], reply_header: &'a [u8], nonce: &'a Tag) -> [&'a [u8]; 3] {
    [hello, reply_header, nonce]
}

/// What the client's tag covers: the client's hello, and the whole reply
/// (header, then nonce and tag as sent).
fn client_transcript<'a>(hello: &'a [u8], reply_header: &'a [u8], tail: &'a [u8]) -> [&'a [u8]; 3] {
    [hello, reply_header, tail]
}

/// How this node says hello: its id, and the cluster secret it proves, if
/// any. Cheap to clone; every data plane that opens connections to peers'
/// endpoints holds one ([`crate::Endpoint::dialer`]).
#[derive(Clone, Debug)]
pub struct Dialer {
    id: NodeId,
    secret: SecretCell,
}

/// A node's cluster secret, shared by everything that says hello for it,
/// so that [`Dialer::set_secret`] changes it for all of them at once.
pub type SecretCell = Arc<std::sync::RwLock<Option<ClusterSecret>>>;

impl Dialer {
    /// Says hello as node `id`, proving `secret` if given.
    pub fn new(id: NodeId, secret: Option<ClusterSecret>) -> Self {
        Dialer {
            id,
            secret: Arc::new(std::sync::RwLock::new(secret)),
        }
    }

    /// The node this dialer says it is.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The secret it proves now, if any.
    pub fn secret(&self) -> Option<ClusterSecret> {
        self.secret
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The cell every clone of this dialer reads its secret from.
    pub fn secret_cell(&self) -> SecretCell {
        self.secret.clone()
    }

    /// Proves and requires `secret` from now on, in every clone of this
    /// dialer and on the endpoint it came from: connections opened or
    /// accepted later. Those already open stay (they proved themselves when
    /// they opened). How a cluster rolls a new secret without downtime (see
    /// [`crate::auth`]).
    pub fn set_secret(&self, secret: Option<ClusterSecret>) {
        *self.secret.write().unwrap_or_else(|e| e.into_inner()) = secret;
    }

    /// Connects to node `peer` and asks for `channel`. On success the
    /// stream belongs to the channel's protocol. Fails with `WrongNode` if
    /// another node answers at that endpoint (a restarted process, or a
    /// handle that names the wrong address), and with `AuthFailed` if the
    /// two do not hold the same cluster secret. The caller bounds how long
    /// this may take.
    pub async fn connect(
        &self,
        peer: NodeAddr,
        channel: Channel,
    ) -> Result<TcpStream, ControlError> {
        let (stream, found) = self.say_hello(peer.endpoint, channel).await?;
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
    /// only its address (authenticated like any connection). The caller
    /// bounds how long this may take.
    pub async fn identify(&self, endpoint: SocketAddr) -> Result<NodeId, ControlError> {
        self.say_hello(endpoint, Channel::IDENTIFY)
            .await
            .map(|(_, node)| node)
    }

    /// Connects to `endpoint`, asks for `channel`, and returns the stream
    /// and the id of the node that took it.
    async fn say_hello(
        &self,
        endpoint: SocketAddr,
        channel: Channel,
    ) -> Result<(TcpStream, NodeId), ControlError> {
        let unreachable = |e: std::io::Error| ControlError::Unreachable {
            endpoint,
            reason: e.to_string(),
        };
        let protocol = |reason: String| ControlError::Protocol { endpoint, reason };
        let auth = |reason| ControlError::AuthFailed { endpoint, reason };
        let secret = self.secret();
        let mut stream = TcpStream::connect(endpoint).await.map_err(unreachable)?;
        crate::socket::configure(&stream).map_err(unreachable)?;
        let hello = Hello {
            version: VERSION,
            channel,
            node: self.id,
            proves: secret.is_some(),
            nonce: nonce(),
        }
        .encode();
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
        let mut header = [0; HELLO_LEN];
        // A refusing server may have replied and closed before the hello got
        // there: its reply is still read.
        let sent = stream.write_all(&hello).await;
        if let Err(e) = stream.read_exact(&mut header).await {
            return Err(hung_up(sent.err().unwrap_or(e)));
        }
        let reply = HelloReply::decode(&header).map_err(|e| protocol(e.to_string()))?;
        match reply.status {
            HelloStatus::Ok => {}
            HelloStatus::SecretRequired => return Err(auth(AuthFailure::SecretRequired)),
            HelloStatus::NoSecret => return Err(auth(AuthFailure::PeerHasNoSecret)),
            status => {
                return Err(ControlError::Refused {
                    endpoint,
                    status: Some(status),
                });
            }
        }
        // Taken, yet the hello did not go out whole: nothing to build on.
        sent.map_err(hung_up)?;
        let mut tail = [0; 2 * TAG_LEN];
        stream.read_exact(&mut tail).await.map_err(hung_up)?;
        let reply = reply.with_tail(&tail);
        match (&secret, reply.proves) {
            (None, false) => {}
            (Some(secret), true) => {
                let transcript = server_transcript(&hello, &header, &reply.nonce);
                let key = secret
                    .check_server(&transcript, &reply.tag)
                    .ok_or(auth(AuthFailure::WrongSecret))?;
                let proof = secret.client_tag(key, &client_transcript(&hello, &header, &tail));
                stream.write_all(&proof).await.map_err(hung_up)?;
            }
            // A server of this version answers `NoSecret` first.
            (Some(_), false) => return Err(auth(AuthFailure::PeerHasNoSecret)),
            (None, true) => {
                return Err(protocol(
                    "the node proved a cluster secret this node was not asked for".into(),
                ));
            }
        }
        Ok((stream, reply.node))
    }
}

/// Why the server's half did not take a connection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Declined {
    /// The connection failed, or the client broke the protocol.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Told `status` (another version, an unserved channel, a secret
    /// required or missing).
    #[error("refused {0:?}")]
    Refused(HelloStatus),
    /// The client claimed to hold the cluster secret and could not prove
    /// it (another secret, or a replayed proof): hung up on, told nothing.
    #[error("the client's proof of the cluster secret was wrong")]
    BadProof,
}

impl Declined {
    /// Whether it was refused for the cluster secret (missing, wrong, or
    /// proved where the node has none), which the endpoint logs.
    pub(crate) fn is_auth(&self) -> bool {
        matches!(
            self,
            Declined::BadProof
                | Declined::Refused(HelloStatus::SecretRequired | HelloStatus::NoSecret)
        )
    }
}

/// The server's half: reads the hello, answers it, checks the client's
/// proof where this node has a secret, and returns the hello if the
/// connection was taken. `serves(channel)` says whether a handler exists.
pub(crate) async fn accept(
    stream: &mut TcpStream,
    me: NodeId,
    secret: Option<&ClusterSecret>,
    serves: impl FnOnce(Channel) -> bool,
) -> Result<Hello, Declined> {
    let mut hello = [0; Hello::LEN];
    stream.read_exact(&mut hello[..HELLO_LEN]).await?;
    let header: &[u8; HELLO_LEN] = hello[..HELLO_LEN].try_into().expect("24 bytes");
    let refuse = |status| HelloReply {
        version: VERSION,
        status,
        node: me,
        proves: false,
        nonce: [0; TAG_LEN],
        tag: [0; TAG_LEN],
    };
    if Hello::version_of(header).map_err(invalid)? != VERSION {
        // Of another length, maybe: told at once, the rest unread.
        stream
            .write_all(&refuse(HelloStatus::BadVersion).header())
            .await?;
        return Err(Declined::Refused(HelloStatus::BadVersion));
    }
    stream.read_exact(&mut hello[HELLO_LEN..]).await?;
    let parsed = Hello::decode(&hello).map_err(invalid)?;
    let status = if !serves(parsed.channel) {
        HelloStatus::BadChannel
    } else if secret.is_some() && !parsed.proves {
        HelloStatus::SecretRequired
    } else if secret.is_none() && parsed.proves {
        HelloStatus::NoSecret
    } else {
        HelloStatus::Ok
    };
    if status != HelloStatus::Ok {
        stream.write_all(&refuse(status).header()).await?;
        return Err(Declined::Refused(status));
    }
    let mut reply = HelloReply {
        proves: secret.is_some(),
        nonce: nonce(),
        ..refuse(HelloStatus::Ok)
    };
    let reply_header = reply.header();
    if let Some(secret) = secret {
        reply.tag = secret.server_tag(&server_transcript(&hello, &reply_header, &reply.nonce));
    }
    let sent = reply.encode();
    stream.write_all(&sent).await?;
    if let Some(secret) = secret {
        let mut proof = [0; TAG_LEN];
        // A client that hangs up instead of proving (it found this node's
        // proof wrong: another secret) failed as much as a wrong proof.
        if stream.read_exact(&mut proof).await.is_err() {
            return Err(Declined::BadProof);
        }
        let transcript = client_transcript(&hello, &reply_header, &sent[HELLO_LEN..]);
        if !secret.check_client(&transcript, &proof) {
            return Err(Declined::BadProof);
        }
    }
    Ok(parsed)
}

/// Tells a client the endpoint is at its connection limit
/// ([`HelloStatus::Busy`]) as its connection is closed: one non-blocking
/// send, before its hello is read, so a refusal costs no task and no wait.
/// Best effort: a client that misses it sees the connection closed before
/// the reply, which it reads as a refusal too.
pub(crate) fn refuse_busy(stream: &TcpStream, me: NodeId) {
    let reply = encode_header(VERSION, HelloStatus::Busy.code(), false, me);
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
            proves: true,
            nonce: [7; TAG_LEN],
        };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        for status in [
            HelloStatus::Ok,
            HelloStatus::BadVersion,
            HelloStatus::BadChannel,
            HelloStatus::Busy,
            HelloStatus::SecretRequired,
            HelloStatus::NoSecret,
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
