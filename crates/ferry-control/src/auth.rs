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
//! The hello alone would not be enough: a process without the secret that
//! gets a member to dial it (a handle, NIXL connection info or an etcd
//! record naming another member at its address; none of these is signed)
//! could pass the two proofs between the members, then drop one side and
//! speak for itself. So the hello names the node the client means to reach
//! (a node refuses a hello meant for another, and one that claims its own
//! id), and both ends derive [`SessionKeys`] from the secret and the
//! handshake: every later frame of the connection carries a tag under
//! them, with a sequence number, and one that fails its check ends the
//! connection. A relay then only relays.
//!
//! The secret is stretched once, when it is read, with PBKDF2-HMAC-SHA-256
//! ([`KDF_ROUNDS`] rounds): the tags a node sends anyone who connects are
//! keyed by the stretched key, so each guess of a short secret costs an
//! attacker those rounds. The secret's own bytes are not kept.
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

/// Rounds of PBKDF2-HMAC-SHA-256 that turn a secret into its key: about
/// 30 ms once per secret read (with the CPU's SHA extensions), and as much
/// for every guess an attacker tries against a recorded tag.
pub const KDF_ROUNDS: u32 = 100_000;

/// Bytes of the tag every frame after the hello carries (see
/// [`FrameMac`]): HMAC-SHA-256 truncated to 128 bits.
pub const FRAME_TAG_LEN: usize = 16;

/// A secret's key, derived once, and its public id: which secret a
/// connection proved, for revoking it when the secret is replaced.
struct Key {
    bytes: [u8; 32],
    id: KeyId,
}

/// Names a derived key without revealing it (the first 8 bytes of an HMAC
/// under it): what a connection records of the secret it proved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyId(pub u64);

/// The secret a node proves, and the one more it accepts while a new
/// secret rolls out. Only their derived keys are kept (see the module
/// documentation), and those never show in `Debug` output or logs.
#[derive(Clone)]
pub struct ClusterSecret {
    current: Arc<Key>,
    also: Option<Arc<Key>>,
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
    /// Its file can be read by users other than its owner (mode `mode`):
    /// a secret everyone on the host can read is no secret.
    #[error(
        "the cluster secret file {path} is readable by group or others (mode {mode:o}): \
         chmod 600 it"
    )]
    Exposed {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// Its bytes (a file's, or the environment variable's) are not UTF-8
    /// text, which ferry reads line by line: refused rather than replaced.
    #[error("the cluster secret {0} is not UTF-8 text")]
    NotText(String),
}

impl ClusterSecret {
    /// A node's secret: any bytes, at least [`MIN_SECRET_LEN`] of them (a
    /// random string, not a password). Stretched into its key here, once
    /// ([`KDF_ROUNDS`]).
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        Ok(ClusterSecret {
            current: derive(secret.as_ref())?,
            also: None,
        })
    }

    /// Also accepts `next` from peers (for a rotation; see the module
    /// documentation), while still proving the current secret.
    pub fn also_accept(mut self, next: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        self.also = Some(derive(next.as_ref())?);
        Ok(self)
    }

    /// Reads a secret file: its first line is the current secret, a second
    /// line (if any) the one also accepted. Surrounding whitespace on each
    /// line is ignored, so `echo` and editors can write it. A file that
    /// group or others may read is refused ([`SecretError::Exposed`]), as
    /// ssh refuses such a key; so is one that is not UTF-8 text.
    pub fn from_file(path: &std::path::Path) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = || path.display().to_string();
        let unreadable = |e: std::io::Error| SecretError::File {
            path: shown(),
            reason: e.to_string(),
        };
        let bytes = std::fs::read(path).map_err(unreadable)?;
        let mode = std::fs::metadata(path)
            .map_err(unreadable)?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(SecretError::Exposed {
                path: shown(),
                mode: mode & 0o7777,
            });
        }
        let text = String::from_utf8(bytes)
            .map_err(|_| SecretError::NotText(format!("file {}", shown())))?;
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
    /// [`SECRET_FILE_ENV`] names), if either is set. The variable stays in
    /// the environment (its children inherit it, and `/proc/PID/environ`
    /// shows it to the same user): a program that can, removes it before
    /// it starts threads, as `ferry` and the Python package do (see
    /// [`ClusterSecret::take_from_env`]).
    pub fn from_env() -> Result<Option<Self>, SecretError> {
        if let Some(text) = std::env::var_os(SECRET_ENV) {
            let text = text
                .into_string()
                .map_err(|_| SecretError::NotText(format!("in {SECRET_ENV}")))?;
            return Self::from_lines(&text).map(Some);
        }
        match std::env::var_os(SECRET_FILE_ENV) {
            Some(path) => Self::from_file(std::path::Path::new(&path)).map(Some),
            None => Ok(None),
        }
    }

    /// [`ClusterSecret::from_env`], then [`SECRET_ENV`] removed from the
    /// environment, so that neither the processes this one starts nor
    /// anyone reading its environment see the secret.
    ///
    /// # Safety
    ///
    /// Changing the environment races with any other thread reading or
    /// changing it (`getenv` in C libraries included): call this before
    /// the process starts threads, as `main` of a command does.
    pub unsafe fn take_from_env() -> Result<Option<Self>, SecretError> {
        let secret = Self::from_env()?;
        // SAFETY: the caller's guarantee: no other thread runs yet.
        unsafe { std::env::remove_var(SECRET_ENV) };
        Ok(secret)
    }

    /// Whether a second secret is accepted besides the current one.
    pub fn is_rotating(&self) -> bool {
        self.also.is_some()
    }

    fn keys(&self) -> impl Iterator<Item = &Key> {
        std::iter::once(&*self.current).chain(self.also.as_deref())
    }

    /// The id of the key this node proves now.
    pub fn key_id(&self) -> KeyId {
        self.current.id
    }

    /// Whether a connection that proved key `id` may go on under this
    /// secret: `id` is the current key or the one also accepted. A
    /// connection that proved a key no longer accepted is closed when
    /// the secret is replaced (revocation).
    pub fn accepts(&self, id: KeyId) -> bool {
        self.keys().any(|key| key.id == id)
    }

    /// The server's tag over `transcript`, with the current secret.
    pub fn server_tag(&self, transcript: &[&[u8]]) -> Tag {
        tag(&self.current.bytes, SERVER_LABEL, transcript)
    }

    /// Which of this node's secrets (0: the current one, 1: the one also
    /// accepted) made a server's `tag` over `transcript`; `None` if
    /// neither did. Compared in constant time.
    pub fn check_server(&self, transcript: &[&[u8]], tag: &Tag) -> Option<usize> {
        self.keys()
            .position(|key| verify(&key.bytes, SERVER_LABEL, transcript, tag))
    }

    /// The client's tag over `transcript`, with the secret the server
    /// proved (`key`, from [`ClusterSecret::check_server`]).
    pub fn client_tag(&self, key: usize, transcript: &[&[u8]]) -> Tag {
        tag(&self.key(key).bytes, CLIENT_LABEL, transcript)
    }

    /// Whether a client's `tag` over `transcript` was made with the
    /// current secret (the one this node proved as the server).
    pub fn check_client(&self, transcript: &[&[u8]], tag: &Tag) -> bool {
        verify(&self.current.bytes, CLIENT_LABEL, transcript, tag)
    }

    fn key(&self, index: usize) -> &Key {
        self.keys().nth(index).unwrap_or(&self.current)
    }

    /// The keys of one connection whose handshake `transcript` (the whole
    /// of it: hello, reply and the client's proof) proved key `key` (as
    /// [`ClusterSecret::check_server`] numbers them; the server's is 0),
    /// for this node's `side` of it.
    pub fn session_keys(&self, key: usize, transcript: &[&[u8]], side: Side) -> SessionKeys {
        let key = self.key(key);
        let master = tag(&key.bytes, SESSION_LABEL, transcript);
        let to_server = FrameMac::new(&tag(&master, TO_SERVER_LABEL, &[]));
        let to_client = FrameMac::new(&tag(&master, TO_CLIENT_LABEL, &[]));
        let (send, recv) = match side {
            Side::Client => (to_server, to_client),
            Side::Server => (to_client, to_server),
        };
        SessionKeys {
            send,
            recv,
            key: key.id,
        }
    }
}

/// Which end of a connection a node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// It dialed.
    Client,
    /// It accepted.
    Server,
}

/// The keys of one authenticated connection: one per direction, each with
/// its own sequence of frames. Made by the hello where both ends prove a
/// cluster secret; every frame after it is sealed with [`FrameMac::seal`]
/// by its sender and checked with [`FrameMac::open`] by its receiver.
#[derive(Clone)]
pub struct SessionKeys {
    /// Seals what this end sends.
    pub send: FrameMac,
    /// Checks what this end receives.
    pub recv: FrameMac,
    /// The secret's key the handshake proved (see [`ClusterSecret::accepts`]).
    pub key: KeyId,
}

impl fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionKeys")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// One direction's frame authentication: HMAC-SHA-256 under a key of that
/// direction, over a sequence number and the frame's parts, truncated to
/// [`FRAME_TAG_LEN`] bytes. The sequence number counts frames, so a frame
/// replayed, dropped, reordered or moved to the other direction fails its
/// check as surely as an altered one.
#[derive(Clone)]
pub struct FrameMac {
    /// Keyed once: each frame clones it (no key schedule per frame).
    mac: Hmac<Sha256>,
    seq: u64,
}

impl FrameMac {
    fn new(key: &[u8]) -> Self {
        FrameMac {
            mac: <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length"),
            seq: 0,
        }
    }

    fn next(&mut self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = self.mac.clone();
        mac.update(&self.seq.to_le_bytes());
        self.seq += 1;
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// The tag of the next frame sent, made of `parts`.
    pub fn seal(&mut self, parts: &[&[u8]]) -> [u8; FRAME_TAG_LEN] {
        let full = self.next(parts).finalize().into_bytes();
        full[..FRAME_TAG_LEN].try_into().expect("32 bytes")
    }

    /// Whether `tag` is the next frame's, received as `parts` (compared in
    /// constant time). A connection whose frame fails this is closed:
    /// nothing after it can be trusted.
    pub fn open(&mut self, parts: &[&[u8]], tag: &[u8]) -> bool {
        tag.len() == FRAME_TAG_LEN && self.next(parts).verify_truncated_left(tag).is_ok()
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

const SERVER_LABEL: &[u8] = b"ferry cluster secret v2: server";
const CLIENT_LABEL: &[u8] = b"ferry cluster secret v2: client";
const SESSION_LABEL: &[u8] = b"ferry cluster secret v2: session";
const TO_SERVER_LABEL: &[u8] = b"ferry cluster secret v2: to the server";
const TO_CLIENT_LABEL: &[u8] = b"ferry cluster secret v2: to the client";
const KEY_ID_LABEL: &[u8] = b"ferry cluster secret v2: key id";
/// PBKDF2's salt: one for every cluster, since both ends derive the key
/// alone; what it buys is that ferry's keys are not another program's.
const KDF_SALT: &[u8] = b"ferry cluster secret v2";

/// Checks a secret's length and stretches it into its key.
fn derive(secret: &[u8]) -> Result<Arc<Key>, SecretError> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(SecretError::TooShort(secret.len()));
    }
    let mut bytes = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(secret, KDF_SALT, KDF_ROUNDS, &mut bytes);
    let id = tag(&bytes, KEY_ID_LABEL, &[]);
    Ok(Arc::new(Key {
        bytes,
        id: KeyId(u64::from_le_bytes(id[..8].try_into().expect("8 bytes"))),
    }))
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
    fn session_keys_pair_up_and_frames_fail_out_of_place() {
        let secret = ClusterSecret::new("a cluster secret, 16+ bytes").unwrap();
        let transcript: &[&[u8]] = &[b"hello", b"reply", b"proof"];
        let mut client = secret.session_keys(0, transcript, Side::Client);
        let mut server = secret.session_keys(0, transcript, Side::Server);
        let first = client.send.seal(&[b"frame 1"]);
        let second = client.send.seal(&[b"frame 2"]);
        assert!(server.recv.open(&[b"frame 1"], &first));
        // Replayed: the sequence number moved on.
        assert!(!server.recv.clone().open(&[b"frame 1"], &first));
        assert!(server.recv.clone().open(&[b"frame 2"], &second));
        // Altered, or moved between parts.
        assert!(!server.recv.clone().open(&[b"frame 3"], &second));
        assert!(!server.recv.clone().open(&[b"frame ", b"2"], &second));
        // Reflected: the server's own direction has another key.
        let back = server.send.seal(&[b"frame 1"]);
        assert!(!client.clone().send.open(&[b"frame 1"], &back));
        assert!(client.recv.open(&[b"frame 1"], &back));
        // Another handshake, other keys.
        let mut other = secret.session_keys(0, &[b"hello", b"reply", b"other"], Side::Server);
        assert!(!other.recv.open(&[b"frame 1"], &first));
    }

    #[test]
    fn secret_files_must_be_private_text() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ferry-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "a cluster secret, 16+ bytes\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            ClusterSecret::from_file(&file),
            Err(SecretError::Exposed { mode: 0o644, .. })
        ));
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(ClusterSecret::from_file(&file).is_ok());
        std::fs::write(&file, b"\xff\xfe not text at all, 16+ bytes").unwrap();
        assert!(matches!(
            ClusterSecret::from_file(&file),
            Err(SecretError::NotText(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
        let current = ClusterSecret::new("current-secret-0123").unwrap();
        let next = ClusterSecret::new("next-secret-456789").unwrap();
        assert_eq!(s.key_id(), current.key_id());
        assert!(s.accepts(next.key_id()) && !current.accepts(next.key_id()));
        assert!(ClusterSecret::from_lines("").is_err());
        assert!(!format!("{s:?}").contains("secret-0123"));
        assert_ne!(nonce(), nonce());
    }
}
