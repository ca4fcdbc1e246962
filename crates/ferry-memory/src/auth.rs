//! The cluster secret on the same-host socket: the same challenge-response
//! as the endpoint's hello ([`ferry_control::auth`]), in packets.
//!
//! ```text
//! peer  -> AuthHello (56 B: its node id, its nonce)
//! owner -> AuthReply (88 B: its node id, its nonce, its tag)
//! peer  -> AuthProof (40 B: its tag), then its requests as before
//! ```
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
const VERSION: u16 = 1;
const HELLO: u8 = 1;
const REPLY: u8 = 2;
const PROOF: u8 = 3;
/// An [`REPLY`]'s status: the owner has no secret.
const NO_SECRET: u8 = 1;

const HELLO_LEN: usize = 24 + TAG_LEN;
const REPLY_LEN: usize = 24 + 2 * TAG_LEN;
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
        hello[24..].copy_from_slice(&nonce());
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
                &[&hello, &reply[..24], &reply[24..24 + TAG_LEN]],
                &tag_at(reply, 24 + TAG_LEN),
            )
            .ok_or(failed(AuthFailure::WrongSecret))?;
        let mut proof = [0; PROOF_LEN];
        proof[..8].copy_from_slice(&header(PROOF, 0, me)[..8]);
        proof[8..].copy_from_slice(&secret.client_tag(key, &[&hello, &reply[..24], &reply[24..]]));
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
    let exchange = async {
        let mut reply = [0; REPLY_LEN];
        reply[..24].copy_from_slice(&header(REPLY, 0, auth.me));
        reply[24..24 + TAG_LEN].copy_from_slice(&nonce());
        let tag = secret.server_tag(&[hello, &reply[..24], &reply[24..24 + TAG_LEN]]);
        reply[24 + TAG_LEN..].copy_from_slice(&tag);
        socket.send(&reply, None).await?;
        let mut proof = [0; PROOF_LEN];
        let (n, _) = socket.recv(&mut proof).await?;
        let proved = n == PROOF_LEN
            && kind(&proof) == Some(PROOF)
            && secret.check_client(&[hello, &reply[..24], &reply[24..]], &tag_at(&proof, 8));
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
        let (peer, owner) = pair().await;
        let me = NodeId::random();
        let owner_id = NodeId::random();
        let owner_addr = NodeAddr {
            id: owner_id,
            endpoint: "127.0.0.1:9".parse().unwrap(),
        };
        let auth = SocketAuth {
            me: owner_id,
            secret: SecretCell::new(owner_secret.map(|s| ClusterSecret::new(s).unwrap())),
        };
        let secret = ClusterSecret::new(peer_secret).unwrap();
        let owner_side = async {
            let mut first = [0; 64];
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
}
