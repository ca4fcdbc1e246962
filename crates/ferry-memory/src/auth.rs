//! The cluster secret on the same-host socket: the same challenge-response
//! as the endpoint's hello ([`ferry_control::auth`]), in packets.
//!
//! ```text
//! peer  -> AuthHello (76 B: its node id, the owner's, its pid, its nonce)
//! owner -> AuthReply (92 B: its node id, its pid, its nonce, its tag)
//! peer  -> AuthProof (40 B: its tag), then its requests as before
//! ```
//!
//! The tags bind the exchange to the socket it runs on: each side says its
//! process id, covered by the tags, and the other compares it with the
//! process the kernel says is at the other end of the socket
//! (`SO_PEERCRED`, translated into the peer's own pid namespace). A relay
//! (a local process that got a member to dial its socket with a forged
//! handle, and passes the exchange on to the real owner) is the process at
//! the other end of both sockets, so neither side takes it: the owner would
//! otherwise hand it the region's memory (`SCM_RIGHTS` descriptors go to
//! whoever holds the socket), whatever any later packet proved. A peer whose
//! process the owner cannot see (another pid namespace that is not nested
//! in its own) is refused, and goes over TCP.
//!
//! A peer with a secret opens every socket (region requests, notification
//! lanes) with a hello; one without sends its first request at once. An
//! owner with a secret refuses a socket whose first packet is not a hello
//! (`Refusal::Unauthenticated`, or a refused lane) and hangs up on a wrong
//! proof; one without answers a hello `NO_SECRET`. Either way the peer
//! learns it at the first packet, typed.

use std::time::Duration;

use ferry_control::AuthFailure;
use ferry_control::auth::{ClusterSecret, TAG_LEN, Tag, nonce};
use ferry_control::hello::SecretCell;
use ferry_core::{NodeAddr, NodeId, OpError};

use crate::socket::Packets;

const MAGIC: [u8; 4] = *b"FMAU";
/// 2: the owner's id and both processes' ids in the exchange.
const VERSION: u16 = 2;
const HELLO: u8 = 1;
const REPLY: u8 = 2;
const PROOF: u8 = 3;
/// An [`REPLY`]'s status: the owner has no secret.
const NO_SECRET: u8 = 1;

pub(crate) const HELLO_LEN: usize = 24 + 16 + 4 + TAG_LEN;
const REPLY_LEN: usize = 24 + 4 + 2 * TAG_LEN;
const PROOF_LEN: usize = 8 + TAG_LEN;

/// How long either side waits for the other's next packet of the exchange.
pub(crate) const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// This node's side of the exchange: who it is, and its secret if any.
#[derive(Clone, Debug)]
pub(crate) struct SocketAuth {
    pub me: NodeId,
    /// Shared with the node's endpoint: a new secret applies to both.
    pub secret: SecretCell,
}

impl SocketAuth {
    /// The secret now, if any.
    pub fn secret(&self) -> Option<ClusterSecret> {
        self.secret.get()
    }
}

fn header(kind: u8, byte: u8, node: NodeId) -> [u8; 24] {
    let mut b = [0; 24];
    b[0..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[6] = kind;
    b[7] = byte;
    b[8..24].copy_from_slice(&node.0.to_le_bytes());
    b
}

/// The kind of an exchange packet, if `packet` is one.
fn kind(packet: &[u8]) -> Option<u8> {
    (packet.len() >= 8 && packet[0..4] == MAGIC && packet[4..6] == VERSION.to_le_bytes())
        .then(|| packet[6])
}

fn node_at(packet: &[u8]) -> NodeId {
    NodeId(u128::from_le_bytes(
        packet[8..24].try_into().expect("16 bytes"),
    ))
}

fn tag_at(packet: &[u8], at: usize) -> Tag {
    packet[at..at + TAG_LEN].try_into().expect("32 bytes")
}

/// Whether `packet` is a peer's hello.
pub(crate) fn is_hello(packet: &[u8]) -> bool {
    packet.len() == HELLO_LEN && kind(packet) == Some(HELLO)
}

/// The peer's side: proves `secret` to `owner` on `socket`, as node `me`,
/// and checks that the owner proves it too. `AuthFailed` names the owner's
/// endpoint and what is wrong.
pub(crate) async fn prove(
    socket: &Packets,
    me: NodeId,
    secret: &ClusterSecret,
    owner: NodeAddr,
) -> Result<(), OpError> {
    let failed = |reason: AuthFailure| OpError::AuthFailed {
        endpoint: owner.endpoint,
        reason: reason.to_string(),
    };
    let lost = |e: std::io::Error| {
        tracing::debug!(owner = %owner.endpoint, "memory transport: the cluster secret's exchange failed: {e}");
        OpError::connection_lost(owner.endpoint)
    };
    let exchange = async {
        let mut hello = [0; HELLO_LEN];
        hello[..24].copy_from_slice(&header(HELLO, 1, me));
        hello[24..40].copy_from_slice(&owner.id.0.to_le_bytes());
        hello[40..44].copy_from_slice(&std::process::id().to_le_bytes());
        hello[44..].copy_from_slice(&nonce());
        socket.send(&hello, None).await.map_err(lost)?;
        let mut reply = [0; REPLY_LEN];
        let (n, _) = socket.recv(&mut reply).await.map_err(lost)?;
        let reply = &reply[..n];
        if kind(reply) != Some(REPLY) || n < 8 {
            return Err(OpError::Protocol(
                "a same-host owner answered the cluster secret's hello with something else".into(),
            ));
        }
        if reply[7] == NO_SECRET {
            return Err(failed(AuthFailure::PeerHasNoSecret));
        }
        if n != REPLY_LEN || node_at(reply) != owner.id {
            return Err(OpError::Protocol(
                "a malformed cluster secret reply from a same-host owner".into(),
            ));
        }
        let key = secret
            .check_server(
                &[&hello, &reply[..28], &reply[28..28 + TAG_LEN]],
                &tag_at(reply, 28 + TAG_LEN),
            )
            .ok_or(failed(AuthFailure::WrongSecret))?;
        // Proved by a holder of the secret, but is it the process at the
        // other end of this socket, or one that a relay passed it on to?
        let said = u32::from_le_bytes(reply[24..28].try_into().expect("4 bytes"));
        if !is_the_peer(socket, said) {
            return Err(OpError::Protocol(
                "the process at the other end of the same-host socket is not the owner that \
                 proved the cluster secret (a relay?)"
                    .into(),
            ));
        }
        let mut proof = [0; PROOF_LEN];
        proof[..8].copy_from_slice(&header(PROOF, 0, me)[..8]);
        proof[8..].copy_from_slice(&secret.client_tag(key, &[&hello, &reply[..28], &reply[28..]]));
        socket.send(&proof, None).await.map_err(lost)
    };
    tokio::time::timeout(AUTH_TIMEOUT, exchange)
        .await
        .unwrap_or(Err(OpError::PeerUnreachable {
            endpoint: owner.endpoint,
            reason: format!("no answer to the cluster secret's hello within {AUTH_TIMEOUT:?}"),
        }))
}

/// Why the owner did not take a peer's socket.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Declined {
    /// This node has no secret, and the peer proves one: told so.
    #[error("the peer proves a cluster secret and this node has none")]
    NoSecret,
    /// The peer's proof was wrong (another secret, or replayed).
    #[error("the peer's proof of the cluster secret was wrong")]
    BadProof,
    /// The hello was meant for another node, or the process that proved
    /// the secret is not the one at the other end of the socket (a relay),
    /// or cannot be seen from here.
    #[error("the same-host hello was meant for another node, or came through a relay")]
    Misdirected,
    /// The socket failed or the peer broke the exchange.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The owner's side, given the peer's first packet `hello` (see
/// [`is_hello`]): answers it and checks the peer's proof. Returns the
/// node the peer proved it is.
pub(crate) async fn check(
    socket: &Packets,
    hello: &[u8],
    auth: &SocketAuth,
) -> Result<NodeId, Declined> {
    let Some(secret) = &auth.secret() else {
        let reply = header(REPLY, NO_SECRET, auth.me);
        socket.send(&reply, None).await?;
        return Err(Declined::NoSecret);
    };
    // Meant for this node, from the process at the other end of the
    // socket: checked before anything is proved (the pid is covered by the
    // peer's proof below).
    let target = NodeId(u128::from_le_bytes(
        hello[24..40].try_into().expect("16 bytes"),
    ));
    let said = u32::from_le_bytes(hello[40..44].try_into().expect("4 bytes"));
    if target != auth.me || !is_the_peer(socket, said) {
        return Err(Declined::Misdirected);
    }
    let exchange = async {
        let mut reply = [0; REPLY_LEN];
        reply[..24].copy_from_slice(&header(REPLY, 0, auth.me));
        reply[24..28].copy_from_slice(&std::process::id().to_le_bytes());
        reply[28..28 + TAG_LEN].copy_from_slice(&nonce());
        let tag = secret.server_tag(&[hello, &reply[..28], &reply[28..28 + TAG_LEN]]);
        reply[28 + TAG_LEN..].copy_from_slice(&tag);
        socket.send(&reply, None).await?;
        let mut proof = [0; PROOF_LEN];
        let (n, _) = socket.recv(&mut proof).await?;
        let proved = n == PROOF_LEN
            && kind(&proof) == Some(PROOF)
            && secret.check_client(&[hello, &reply[..28], &reply[28..]], &tag_at(&proof, 8));
        if proved {
            Ok(node_at(hello))
        } else {
            Err(Declined::BadProof)
        }
    };
    tokio::time::timeout(AUTH_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()))
}

/// Whether the process at the other end of `socket` (the kernel's word,
/// `SO_PEERCRED`) is the one that says its pid is `said` (in its own pid
/// namespace: the innermost `NSpid` of its `/proc` status). A peer outside
/// this process's pid namespace (pid 0) cannot be checked, and is not taken.
fn is_the_peer(socket: &Packets, said: u32) -> bool {
    let Some(pid) = socket.peer_pid().filter(|&pid| pid > 0) else {
        return false;
    };
    innermost_pid(pid).is_some_and(|own| own == said)
}

/// Process `pid`'s id in its own pid namespace: the last field of its
/// `NSpid` line (the id itself where the kernel predates that line).
fn innermost_pid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    match status.lines().find_map(|l| l.strip_prefix("NSpid:")) {
        Some(ids) => ids.split_whitespace().last()?.parse().ok(),
        None => u32::try_from(pid).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (Packets, Packets) {
        let name = format!("ferry-auth-test-{}", NodeId::random());
        let listener = crate::socket::Listener::bind(&name).unwrap();
        let peer = Packets::connect(&name).unwrap();
        let owner = listener.accept().await.unwrap();
        (peer, owner)
    }

    async fn run(
        peer_secret: &str,
        owner_secret: Option<&str>,
    ) -> (Result<(), OpError>, Result<NodeId, Declined>) {
        run_to(peer_secret, owner_secret, false).await
    }

    /// `misdirected`: the peer means another node than the owner (a handle
    /// naming another node at this socket).
    async fn run_to(
        peer_secret: &str,
        owner_secret: Option<&str>,
        misdirected: bool,
    ) -> (Result<(), OpError>, Result<NodeId, Declined>) {
        let (peer, owner) = pair().await;
        let me = NodeId::random();
        let owner_id = NodeId::random();
        let owner_addr = NodeAddr {
            id: if misdirected {
                NodeId(owner_id.0 ^ 1)
            } else {
                owner_id
            },
            endpoint: "127.0.0.1:9".parse().unwrap(),
        };
        let auth = SocketAuth {
            me: owner_id,
            secret: SecretCell::new(owner_secret.map(|s| ClusterSecret::new(s).unwrap())),
        };
        let secret = ClusterSecret::new(peer_secret).unwrap();
        let owner_side = async {
            let mut first = [0; 128];
            let (n, _) = owner.recv(&mut first).await.unwrap();
            assert!(is_hello(&first[..n]));
            let checked = check(&owner, &first[..n], &auth).await;
            drop(owner);
            checked
        };
        let peer_side = async move {
            let proved = prove(&peer, me, &secret, owner_addr).await;
            // A peer that refused the owner hangs up (its link is dropped).
            drop(peer);
            proved
        };
        let (proved, checked) = tokio::join!(peer_side, owner_side);
        if let Ok(node) = &checked {
            assert_eq!(*node, me);
        }
        (proved, checked)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn the_same_secret_passes_and_others_are_typed() {
        let good = "one cluster secret, 16+ bytes";
        let (proved, checked) = run(good, Some(good)).await;
        assert!(proved.is_ok() && checked.is_ok(), "{proved:?} {checked:?}");
        let (proved, checked) = run(good, Some("another secret, 16+ bytes")).await;
        assert!(
            matches!(proved, Err(OpError::AuthFailed { .. })),
            "{proved:?}"
        );
        // The peer hung up without a proof: the owner never took it.
        assert!(checked.is_err());
        let (proved, checked) = run(good, None).await;
        assert!(
            matches!(&proved, Err(OpError::AuthFailed { reason, .. }) if reason.contains("peer has none")),
            "{proved:?}"
        );
        assert!(matches!(checked, Err(Declined::NoSecret)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_hello_meant_for_another_node_is_refused_before_any_proof() {
        let good = "one cluster secret, 16+ bytes";
        let (proved, checked) = run_to(good, Some(good), true).await;
        assert!(matches!(checked, Err(Declined::Misdirected)), "{checked:?}");
        assert!(proved.is_err(), "{proved:?}");
    }

    #[test]
    fn a_process_is_its_own_innermost_pid() {
        assert_eq!(
            innermost_pid(std::process::id() as i32),
            Some(std::process::id())
        );
        assert_eq!(innermost_pid(-1), None);
    }
}
