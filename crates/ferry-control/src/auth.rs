//! The cluster secret: who may talk to a node.
//!
//! Without one, a node takes any process that reaches its endpoint at its
//! word (the node id in its hello). With one, every connection proves,
//! both ways, that its two ends hold the same secret, before anything
//! else crosses: each side sends a fresh random nonce, and each answers
//! with an HMAC-SHA-256 tag, keyed by the secret, over everything said so
//! far (both nonces, both node ids, the channel). So:
//!
//! - the secret never crosses the wire, and a tag proves nothing outside
//!   the one connection whose nonces it covers: a recorded hello or proof
//!   replayed on another connection fails against that connection's new
//!   nonce;
//! - the node id a peer claims is covered by its tag, so it is the id the
//!   session, its deliveries and its RPC calls carry (a peer that names
//!   another id inside the session is refused, see each channel);
//! - the server tag and the client tag are keyed by the same secret but
//!   over different labels, so one side's tag cannot be reflected back as
//!   the other's.
//!
//! A shared secret authenticates membership of the cluster, not one node
//! against another: a holder of the secret can claim any node id. What it
//! cannot do is reach a node without the secret, or be reached by one.
//!
//! Rotation: a node holds its current secret and, while a new one rolls
//! out, one more it also accepts. It proves the current one when it
//! answers a connection, and as a client accepts a server proving either
//! (then proves that one back). Rolling from A to B, node by node: every
//! node to "A, also B"; then every node to "B, also A"; then to "B".

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a tag.
pub const TAG_LEN: usize = 32;

/// The shortest secret taken: 128 bits, so that recorded handshakes cannot
/// be searched for it offline.
pub const MIN_SECRET_LEN: usize = 16;

/// The environment variable that holds a node's cluster secret (its
/// current one), read by `NodeBuilder`, `ferry serve` and the Python
/// package when none is given in code.
pub const SECRET_ENV: &str = "FERRY_CLUSTER_SECRET";

/// The environment variable that names a file holding the cluster secret
/// (see [`ClusterSecret::from_file`]); ignored when [`SECRET_ENV`] is set.
pub const SECRET_FILE_ENV: &str = "FERRY_CLUSTER_SECRET_FILE";

/// A 32-byte value: a nonce, or a tag.
pub type Tag = [u8; TAG_LEN];

/// The secret a node proves, and the one more it accepts while a new
/// secret rolls out. Its bytes never show in `Debug` output or logs.
#[derive(Clone)]
pub struct ClusterSecret {
    current: Arc<[u8]>,
    also: Option<Arc<[u8]>>,
}

/// A secret that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Shorter than [`MIN_SECRET_LEN`] bytes.
    #[error(
        "a cluster secret needs at least {MIN_SECRET_LEN} bytes, got {0} \
         (e.g. `head -c 32 /dev/urandom | base64`)"
    )]
    TooShort(usize),
    /// Its file could not be read.
    #[error("cannot read the cluster secret file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// The operating system's error.
        reason: String,
    },
}

impl ClusterSecret {
    /// A node's secret: any bytes, at least [`MIN_SECRET_LEN`] of them (a
    /// random string, not a password: a weak one can be guessed from one
    /// recorded handshake).
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        Ok(ClusterSecret {
            current: checked(secret.as_ref())?,
            also: None,
        })
    }

    /// Also accepts `next` from peers (for a rotation; see the module
    /// documentation), while still proving the current secret.
    pub fn also_accept(mut self, next: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        self.also = Some(checked(next.as_ref())?);
        Ok(self)
    }

    /// Reads a secret file: its first line is the current secret, a second
    /// line (if any) the one also accepted. Surrounding whitespace on each
    /// line is ignored, so `echo` and editors can write it.
    pub fn from_file(path: &std::path::Path) -> Result<Self, SecretError> {
        let text = std::fs::read_to_string(path).map_err(|e| SecretError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_lines(&text)
    }

    /// [`ClusterSecret::from_file`]'s parsing: the first non-empty line,
    /// and a second one if present.
    pub fn from_lines(text: &str) -> Result<Self, SecretError> {
        let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
        let secret = Self::new(lines.next().unwrap_or(""))?;
        match lines.next() {
            Some(next) => secret.also_accept(next),
            None => Ok(secret),
        }
    }

    /// The secret from the environment ([`SECRET_ENV`], else the file
    /// [`SECRET_FILE_ENV`] names), if either is set.
    pub fn from_env() -> Result<Option<Self>, SecretError> {
        if let Some(text) = std::env::var_os(SECRET_ENV) {
            return Self::from_lines(&text.to_string_lossy()).map(Some);
        }
        match std::env::var_os(SECRET_FILE_ENV) {
            Some(path) => Self::from_file(std::path::Path::new(&path)).map(Some),
            None => Ok(None),
        }
    }

    /// Whether a second secret is accepted besides the current one.
    pub fn is_rotating(&self) -> bool {
        self.also.is_some()
    }

    fn keys(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(&*self.current).chain(self.also.as_deref())
    }

    /// The server's tag over `transcript`, with the current secret.
    pub fn server_tag(&self, transcript: &[&[u8]]) -> Tag {
        tag(&self.current, SERVER_LABEL, transcript)
    }

    /// Which of this node's secrets (0: the current one, 1: the one also
    /// accepted) made a server's `tag` over `transcript`; `None` if
    /// neither did. Compared in constant time.
    pub fn check_server(&self, transcript: &[&[u8]], tag: &Tag) -> Option<usize> {
        self.keys()
            .position(|key| verify(key, SERVER_LABEL, transcript, tag))
    }

    /// The client's tag over `transcript`, with the secret the server
    /// proved (`key`, from [`ClusterSecret::check_server`]).
    pub fn client_tag(&self, key: usize, transcript: &[&[u8]]) -> Tag {
        let key = self.keys().nth(key).unwrap_or(&self.current);
        tag(key, CLIENT_LABEL, transcript)
    }

    /// Whether a client's `tag` over `transcript` was made with the
    /// current secret (the one this node proved as the server).
    pub fn check_client(&self, transcript: &[&[u8]], tag: &Tag) -> bool {
        verify(&self.current, CLIENT_LABEL, transcript, tag)
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterSecret")
            .field("rotating", &self.is_rotating())
            .finish_non_exhaustive()
    }
}

/// Why a connection to a peer failed its authentication, as its client
/// sees it (a server that refuses a client's proof only hangs up: it
/// tells an impostor nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// The peer requires a cluster secret and this node has none.
    SecretRequired,
    /// This node has a cluster secret and the peer has none.
    PeerHasNoSecret,
    /// The peer proved a secret this node does not hold (another
    /// cluster's, or the roll-out of a new one skipped a step).
    WrongSecret,
}

impl fmt::Display for AuthFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AuthFailure::SecretRequired => "it requires a cluster secret and this node has none",
            AuthFailure::PeerHasNoSecret => {
                "this node requires a cluster secret and the peer has none"
            }
            AuthFailure::WrongSecret => "it proved another cluster secret than this node's",
        })
    }
}

/// Connections refused for the cluster secret: counted, and logged at most
/// once per [`Refusals::LOG_EVERY`] with how many came since, so that a
/// flood of bad hellos costs a line, not a line each.
#[derive(Default)]
pub struct Refusals {
    count: AtomicU64,
    /// When the last line went out, and the count then.
    logged: Mutex<Option<(Instant, u64)>>,
}

impl Refusals {
    /// How often a line is logged at most.
    pub const LOG_EVERY: Duration = Duration::from_secs(10);

    /// Counts one refusal of a connection from `from`, for `why`.
    pub fn refused(&self, from: &dyn fmt::Display, why: &dyn fmt::Display) {
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::counter!("ferry_auth_refusals_total").increment(1);
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.is_some_and(|(at, _)| at.elapsed() < Self::LOG_EVERY) {
            return;
        }
        let since = count - logged.map_or(0, |(_, then)| then);
        *logged = Some((Instant::now(), count));
        drop(logged);
        tracing::warn!(%from, refused_since_last_line = since, "connection refused for the cluster secret: {why}");
    }

    /// Refusals so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// A fresh random nonce.
pub fn nonce() -> Tag {
    let mut n = [0; TAG_LEN];
    // The kernel's CSPRNG; failing to read it leaves nothing to stand on.
    getrandom::fill(&mut n).expect("the operating system's random source");
    n
}

const SERVER_LABEL: &[u8] = b"ferry cluster secret v1: server";
const CLIENT_LABEL: &[u8] = b"ferry cluster secret v1: client";

fn checked(secret: &[u8]) -> Result<Arc<[u8]>, SecretError> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(SecretError::TooShort(secret.len()));
    }
    Ok(secret.into())
}

fn mac(key: &[u8], label: &[u8], transcript: &[&[u8]]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(label);
    for part in transcript {
        // Each part's length first: no two transcripts hash alike.
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}

fn tag(key: &[u8], label: &[u8], transcript: &[&[u8]]) -> Tag {
    mac(key, label, transcript).finalize().into_bytes().into()
}

fn verify(key: &[u8], label: &[u8], transcript: &[&[u8]], tag: &Tag) -> bool {
    mac(key, label, transcript).verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_prove_the_secret_and_bind_the_transcript() {
        let a = ClusterSecret::new("a cluster secret, 16+ bytes").unwrap();
        let b = ClusterSecret::new("another secret, 16+ bytes").unwrap();
        let transcript: &[&[u8]] = &[b"hello", b"reply"];
        let server = a.server_tag(transcript);
        assert_eq!(a.check_server(transcript, &server), Some(0));
        assert_eq!(b.check_server(transcript, &server), None);
        assert_eq!(a.check_server(&[b"hello", b"replY"], &server), None);
        // Parts are length-prefixed: moving a byte between them differs.
        assert_eq!(a.check_server(&[b"hell", b"oreply"], &server), None);
        let client = a.client_tag(0, transcript);
        assert!(a.check_client(transcript, &client));
        assert!(!b.check_client(transcript, &client));
        // A server's tag is no client's (no reflection).
        assert!(!a.check_client(transcript, &server));
    }

    #[test]
    fn a_rotating_node_accepts_both_and_proves_its_current_one() {
        let old = ClusterSecret::new("the old secret, 16+ bytes").unwrap();
        let rolling = ClusterSecret::new("the new secret, 16+ bytes")
            .unwrap()
            .also_accept("the old secret, 16+ bytes")
            .unwrap();
        let t: &[&[u8]] = &[b"t"];
        // A rolled server proves the new secret, which the old node lacks.
        assert_eq!(old.check_server(t, &rolling.server_tag(t)), None);
        // The rolled client accepts an old server, and proves the old one.
        let key = rolling.check_server(t, &old.server_tag(t)).unwrap();
        assert_eq!(key, 1);
        assert!(old.check_client(t, &rolling.client_tag(key, t)));
    }

    #[test]
    fn short_secrets_are_refused_and_files_give_two_lines() {
        assert_eq!(
            ClusterSecret::new("short").unwrap_err(),
            SecretError::TooShort(5)
        );
        let s =
            ClusterSecret::from_lines("\n  current-secret-0123  \nnext-secret-456789\n").unwrap();
        assert!(s.is_rotating());
        assert_eq!(&*s.current, b"current-secret-0123");
        assert!(ClusterSecret::from_lines("").is_err());
        assert!(!format!("{s:?}").contains("secret-0123"));
        assert_ne!(nonce(), nonce());
    }
}
