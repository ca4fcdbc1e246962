//! The handshake over a connection: the client's half ([`Dialer`]) and
//! the server's ([`accept`]), each sending and checking the frames of
//! [`super`], and the transcripts their proofs of the cluster secret cover.

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_core::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Channel, HELLO_LEN, Hello, HelloReply, HelloStatus, VERSION, encode_header};
use crate::ControlError;
use crate::auth::{AuthFailure, ClusterSecret, TAG_LEN, Tag, nonce};

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
