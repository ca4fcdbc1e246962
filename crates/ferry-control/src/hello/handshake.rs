//! The handshake over a connection: the client's half ([`Dialer`]) and
//! the server's ([`accept`]), each sending and checking the frames of
//! [`super`], and the transcripts their proofs of the cluster secret cover.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ferry_core::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Channel, HELLO_LEN, Hello, HelloReply, HelloStatus, VERSION, encode_header};
use crate::ControlError;
use crate::auth::{
    AuthFailure, ClusterSecret, FrameMac, KeyId, SessionKeys, Side, TAG_LEN, Tag, nonce,
};
use tokio_util::sync::CancellationToken;

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

/// What the session keys come from: the whole handshake, the client's
/// proof included.
fn session_transcript<'a>(
    hello: &'a [u8],
    reply_header: &'a [u8],
    tail: &'a [u8],
    proof: &'a [u8],
) -> [&'a [u8]; 4] {
    [hello, reply_header, tail, proof]
}

/// A connection whose hello went through.
#[derive(Debug)]
pub struct Greeted {
    /// The stream, positioned at the channel's first byte.
    pub stream: TcpStream,
    /// Where both ends proved a cluster secret: what the channel seals its
    /// frames with, and what tells it to close when the secret it proved is
    /// revoked.
    pub auth: Option<Authenticated>,
}

/// What a connection's hello proved, for its channel to use and to keep as
/// long as the connection.
#[derive(Debug)]
pub struct Authenticated {
    /// The keys every frame is sealed with from here on
    /// ([`crate::auth::FrameMac`]).
    pub keys: SessionKeys,
    /// Cancelled when the node's secret is replaced by one that does not
    /// accept the key this connection proved: the channel closes then.
    pub revoked: CancellationToken,
    /// Keeps the connection on its secret's list of live ones
    /// ([`SecretCell::set`]).
    pub tracked: Tracked,
}

/// A connection's [`Authenticated`] in parts, each `None` where its hello
/// proved no secret: a channel's reader, writer and task each take their
/// own.
pub struct Sealing {
    /// Seals what this end sends.
    pub send: Option<FrameMac>,
    /// Checks what this end receives.
    pub recv: Option<FrameMac>,
    /// Cancelled when the secret the connection proved is revoked.
    pub revoked: Option<CancellationToken>,
    /// Keeps the connection on its secret's list of live ones.
    pub tracked: Option<Tracked>,
}

impl Authenticated {
    /// `auth` in parts, all `None` for a connection without a secret.
    pub fn split(auth: Option<Authenticated>) -> Sealing {
        match auth {
            Some(a) => Sealing {
                send: Some(a.keys.send),
                recv: Some(a.keys.recv),
                revoked: Some(a.revoked),
                tracked: Some(a.tracked),
            },
            None => Sealing {
                send: None,
                recv: None,
                revoked: None,
                tracked: None,
            },
        }
    }

    /// `keys`, tracked in `cell` until the result drops.
    pub(crate) fn track(cell: &SecretCell, keys: SessionKeys) -> Authenticated {
        let revoked = CancellationToken::new();
        let tracked = cell.track(keys.key, revoked.clone());
        Authenticated {
            keys,
            revoked,
            tracked,
        }
    }
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
/// so that [`Dialer::set_secret`] changes it for all of them at once; and
/// the live connections that proved it, so that a secret replaced closes
/// those that proved one no longer accepted (revocation). Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct SecretCell(Arc<SecretState>);

#[derive(Debug, Default)]
struct SecretState {
    secret: std::sync::RwLock<Option<ClusterSecret>>,
    /// Each live authenticated connection: the key it proved, and what
    /// closes it.
    live: std::sync::Mutex<HashMap<u64, (KeyId, CancellationToken)>>,
    next: AtomicU64,
    /// Authenticated connections closed for a frame whose tag failed.
    forged: AtomicU64,
}

impl SecretCell {
    /// A cell holding `secret`.
    pub fn new(secret: Option<ClusterSecret>) -> Self {
        let cell = SecretCell::default();
        *cell.0.secret.write().unwrap_or_else(|e| e.into_inner()) = secret;
        cell
    }

    /// The secret now, if any.
    pub fn get(&self) -> Option<ClusterSecret> {
        self.0
            .secret
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the secret. With `revoke`, also closes every live
    /// connection that proved a key the new secret does not accept (every
    /// one, if it has none): how a leaked secret is revoked. Returns how
    /// many were closed.
    pub fn set(&self, secret: Option<ClusterSecret>, revoke: bool) -> usize {
        let mut live = self.0.live.lock().unwrap_or_else(|e| e.into_inner());
        let revoked: Vec<u64> = live
            .iter()
            .filter(|_| revoke)
            .filter(|(_, (key, _))| !secret.as_ref().is_some_and(|s| s.accepts(*key)))
            .map(|(&id, _)| id)
            .collect();
        for id in &revoked {
            if let Some((_, close)) = live.remove(id) {
                close.cancel();
            }
        }
        *self.0.secret.write().unwrap_or_else(|e| e.into_inner()) = secret;
        revoked.len()
    }

    /// Records a live connection that proved `key`: `close` is cancelled
    /// if the secret is revoked ([`SecretCell::set`]) for one that does not
    /// accept it. The record goes when the returned guard drops (the
    /// connection ended).
    pub fn track(&self, key: KeyId, close: CancellationToken) -> Tracked {
        let id = self.0.next.fetch_add(1, Ordering::Relaxed);
        let mut live = self.0.live.lock().unwrap_or_else(|e| e.into_inner());
        live.insert(id, (key, close));
        Tracked {
            cell: self.clone(),
            id,
        }
    }

    /// Live authenticated connections tracked now.
    pub fn tracked(&self) -> usize {
        self.0.live.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Authenticated connections closed so far because a frame failed its
    /// tag: bytes altered, injected or replayed on the way, by a relay or
    /// anyone on the path ([`Tracked::forged`]).
    pub fn forged(&self) -> u64 {
        self.0.forged.load(Ordering::Relaxed)
    }
}

/// A connection's record in its [`SecretCell`]; dropped when it ends.
#[derive(Debug)]
pub struct Tracked {
    cell: SecretCell,
    id: u64,
}

impl Tracked {
    /// Records that the connection is being closed for a frame that failed
    /// its tag (counted in [`SecretCell::forged`], and in the
    /// `ferry_forged_frames_total` metric), and logs it.
    pub fn forged(&self, channel: &str, remote: &dyn std::fmt::Display) {
        self.cell.0.forged.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("ferry_forged_frames_total", "channel" => channel.to_string())
            .increment(1);
        tracing::warn!(%remote, channel, "an authenticated connection closed: a frame's tag was wrong (altered or injected on the way)");
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut live = self.cell.0.live.lock().unwrap_or_else(|e| e.into_inner());
        live.remove(&self.id);
    }
}

impl Dialer {
    /// Says hello as node `id`, proving `secret` if given.
    pub fn new(id: NodeId, secret: Option<ClusterSecret>) -> Self {
        Dialer {
            id,
            secret: SecretCell::new(secret),
        }
    }

    /// The node this dialer says it is.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The secret it proves now, if any.
    pub fn secret(&self) -> Option<ClusterSecret> {
        self.secret.get()
    }

    /// The cell every clone of this dialer reads its secret from.
    pub fn secret_cell(&self) -> SecretCell {
        self.secret.clone()
    }

    /// Proves and requires `secret` from now on, in every clone of this
    /// dialer and on the endpoint it came from: connections opened or
    /// accepted later. Those already open stay (they proved themselves when
    /// they opened), so a cluster rolls a new secret without a failed
    /// transfer (see [`crate::auth`]).
    pub fn set_secret(&self, secret: Option<ClusterSecret>) {
        self.secret.set(secret, false);
    }

    /// [`Dialer::set_secret`], and every open connection that proved a
    /// secret `secret` does not accept is closed now (transfers on it fail;
    /// the next ones reconnect under `secret`): how a leaked secret is
    /// revoked. Returns how many connections were closed.
    pub fn revoke_secret(&self, secret: Option<ClusterSecret>) -> usize {
        self.secret.set(secret, true)
    }

    /// Connects to node `peer` and asks for `channel`. On success the
    /// stream belongs to the channel's protocol, sealed with the returned
    /// keys where both ends prove a secret. Fails with `WrongNode` if
    /// another node answers at that endpoint (a restarted process, or a
    /// handle that names the wrong address: that node refuses a hello
    /// meant for `peer`, before any proof), and with `AuthFailed` if the
    /// two do not hold the same cluster secret. The caller bounds how long
    /// this may take.
    pub async fn connect(&self, peer: NodeAddr, channel: Channel) -> Result<Greeted, ControlError> {
        let (stream, found, keys) = self.say_hello(peer.endpoint, channel, peer.id).await?;
        // The server checked the hello's target; an answer naming another
        // node breaks the protocol (or is a server of another mind).
        if found != peer.id {
            return Err(ControlError::WrongNode {
                expected: peer.id,
                endpoint: peer.endpoint,
            });
        }
        let auth = keys.map(|keys| Authenticated::track(&self.secret, keys));
        Ok(Greeted { stream, auth })
    }

    /// The id of the node listening at `endpoint`, for a caller that knows
    /// only its address (authenticated like any connection). The caller
    /// bounds how long this may take.
    pub async fn identify(&self, endpoint: SocketAddr) -> Result<NodeId, ControlError> {
        self.say_hello(endpoint, Channel::IDENTIFY, NodeId(0))
            .await
            .map(|(_, node, _)| node)
    }

    /// Connects to `endpoint`, asks for `channel` of node `target` (0: any,
    /// for [`Channel::IDENTIFY`]), and returns the stream, the id of the
    /// node that took it, and the session keys where both prove a secret.
    async fn say_hello(
        &self,
        endpoint: SocketAddr,
        channel: Channel,
        target: NodeId,
    ) -> Result<(TcpStream, NodeId, Option<SessionKeys>), ControlError> {
        let unreachable = |e: std::io::Error| ControlError::Unreachable {
            endpoint,
            reason: e.to_string(),
        };
        let protocol = |reason: String| ControlError::Protocol { endpoint, reason };
        let auth = |reason| ControlError::AuthFailed { endpoint, reason };
        let secret = self.secret();
        let mut stream = TcpStream::connect(endpoint).await.map_err(unreachable)?;
        crate::socket::configure(&stream).map_err(unreachable)?;
        let mut hello = Hello::new(channel, self.id, target);
        hello.proves = secret.is_some();
        let hello = hello.encode();
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
            HelloStatus::WrongNode => {
                return Err(ControlError::WrongNode {
                    expected: target,
                    endpoint,
                });
            }
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
        let keys = match (&secret, reply.proves) {
            (None, false) => None,
            (Some(secret), true) => {
                let transcript = server_transcript(&hello, &header, &reply.nonce);
                let key = secret
                    .check_server(&transcript, &reply.tag)
                    .ok_or(auth(AuthFailure::WrongSecret))?;
                let proof = secret.client_tag(key, &client_transcript(&hello, &header, &tail));
                stream.write_all(&proof).await.map_err(hung_up)?;
                let transcript = session_transcript(&hello, &header, &tail, &proof);
                Some(secret.session_keys(key, &transcript, Side::Client))
            }
            // A server of this version answers `NoSecret` first.
            (Some(_), false) => return Err(auth(AuthFailure::PeerHasNoSecret)),
            (None, true) => {
                return Err(protocol(
                    "the node proved a cluster secret this node was not asked for".into(),
                ));
            }
        };
        Ok((stream, reply.node, keys))
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
/// connection was taken, with the session keys where both proved a secret.
/// `serves(channel)` says whether a handler exists.
pub(crate) async fn accept(
    stream: &mut TcpStream,
    me: NodeId,
    secret: Option<&ClusterSecret>,
    serves: impl FnOnce(Channel) -> bool,
) -> Result<(Hello, Option<SessionKeys>), Declined> {
    let mut hello = [0; Hello::LEN];
    stream.read_exact(&mut hello[..HELLO_LEN]).await?;
    let header: &[u8; HELLO_LEN] = hello[..HELLO_LEN].try_into().expect("24 bytes");
    // A refusal names no node: it tells a stranger nothing.
    let refuse = |status| HelloReply {
        version: VERSION,
        status,
        node: NodeId(0),
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
    let meant_for_me =
        parsed.target == me || (parsed.channel == Channel::IDENTIFY && parsed.target == NodeId(0));
    let status = if !serves(parsed.channel) {
        HelloStatus::BadChannel
    } else if !meant_for_me {
        HelloStatus::WrongNode
    } else if parsed.node == me && parsed.channel != Channel::IDENTIFY {
        HelloStatus::Reflected
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
        node: me,
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
    let Some(secret) = secret else {
        return Ok((parsed, None));
    };
    let mut proof = [0; TAG_LEN];
    // A client that hangs up instead of proving (it found this node's
    // proof wrong: another secret) failed as much as a wrong proof.
    if stream.read_exact(&mut proof).await.is_err() {
        return Err(Declined::BadProof);
    }
    let tail = &sent[HELLO_LEN..];
    if !secret.check_client(&client_transcript(&hello, &reply_header, tail), &proof) {
        return Err(Declined::BadProof);
    }
    let transcript = session_transcript(&hello, &reply_header, tail, &proof);
    Ok((
        parsed,
        Some(secret.session_keys(0, &transcript, Side::Server)),
    ))
}

/// Tells a client the endpoint is at its connection limit
/// ([`HelloStatus::Busy`]) as its connection is closed: one non-blocking
/// send, before its hello is read, so a refusal costs no task and no wait.
/// Best effort: a client that misses it sees the connection closed before
/// the reply, which it reads as a refusal too.
pub(crate) fn refuse_busy(stream: &TcpStream) {
    let reply = encode_header(VERSION, HelloStatus::Busy.code(), false, NodeId(0));
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
