//! A ferry node in a separate OS process, driven over stdin/stdout.
//!
//! The peer is this same test binary, re-executed to run only the
//! `ferry_peer` test with `FERRY_TEST_PEER=1`. It answers one line per command,
//! prefixed with `FERRY `; everything else on its stdout (libtest's chatter)
//! is ignored. A peer whose node fails to start answers every command with
//! `FERRY spawn-failed <error>`. A peer in another machine (the two-VM
//! suite) speaks the same lines over a TCP stream instead of pipes.

use std::ffi::OsStr;
use std::io::{BufRead, Write};
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

use ferry::NodeAddr;
use ferry::prelude::*;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, Command};

/// Peer commands on memory ferry did not allocate (`MemoryBlock::from_raw`).
#[path = "raw.rs"]
pub mod raw;

pub const PEER_ENV: &str = "FERRY_TEST_PEER";
/// The address a peer's node listens on (`IP:PORT`); default `127.0.0.1:0`.
/// What it advertises comes from `FERRY_ADVERTISE`, which the node builder
/// reads itself.
pub const LISTEN_ENV: &str = "FERRY_TEST_LISTEN";
/// The peer node's name (`NodeBuilder::name`); none by default.
pub const NAME_ENV: &str = "FERRY_TEST_NAME";
/// The peer node's peer timeout and silent grace, in milliseconds
/// (`NodeBuilder::peer_timeout`, `silent_grace`); the defaults if unset.
pub const PEER_TIMEOUT_ENV: &str = "FERRY_TEST_PEER_TIMEOUT_MS";
pub const SILENT_GRACE_ENV: &str = "FERRY_TEST_SILENT_GRACE_MS";
const PREFIX: &str = "FERRY ";
/// A peer's answer to every command when its node did not start.
const SPAWN_FAILED: &str = "spawn-failed ";
/// Upper bound for any one harness command, including 256 MiB digests.
pub const COMMAND_DEADLINE: Duration = Duration::from_secs(60);
/// Deadline of a peer's own submit (`write`, `read`): shorter than the
/// command's, so a stuck transfer is answered with its error.
const PEER_OP_DEADLINE: Duration = Duration::from_secs(30);

/// Deterministic bytes for `len`, different for each seed.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed ^ (i >> 12) as u8)
        })
        .collect()
}

/// A 64-bit digest that changes with any byte's value or position.
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap()))
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Bytes per batch of the notified-batch commands: batch `i` covers
/// `[i * SLOT, (i + 1) * SLOT)` of both regions.
pub const SLOT: usize = 4096;

/// What batch `i` writes into its slot (or finds in an untouched one).
pub fn slot_bytes(i: usize) -> Vec<u8> {
    (0..SLOT)
        .map(|j| ((j * 131 + i * 7919) % 251) as u8)
        .collect()
}

pub struct PeerProcess {
    /// The peer's process, when it is this host's child (killed when this
    /// drops).
    #[allow(dead_code)] // read only by `kill`, which not every suite uses
    child: Option<Child>,
    stdin: Pin<Box<dyn AsyncWrite + Send>>,
    lines: Lines<BufReader<Pin<Box<dyn AsyncRead + Send>>>>,
}

/// A region allocated in the peer, filled with `pattern(len, seed)`.
pub struct PeerRegion {
    pub index: usize,
    pub handle: RemoteBuffer,
    pub seed: u8,
}

impl PeerRegion {
    /// What the region holds if nothing touched it.
    pub fn original(&self) -> Vec<u8> {
        pattern(self.handle.len() as usize, self.seed)
    }
}

impl PeerProcess {
    pub async fn spawn() -> PeerProcess {
        Self::spawn_with_env(&[]).await
    }

    /// A peer process with extra environment variables.
    pub async fn spawn_with_env(env: &[(&str, &str)]) -> PeerProcess {
        let exe = std::env::current_exe().expect("test binary path");
        Self::start(Command::new(exe), env)
    }

    /// A peer process inside network namespace `ns` (`ip netns exec`, so
    /// this needs root), with extra environment variables, e.g.
    /// [`LISTEN_ENV`] and `FERRY_ADVERTISE`. Neither is inherited from this
    /// process: a peer advertises only what `env` says.
    #[allow(dead_code)] // tests/ibverbs shares this file and uses no namespaces
    pub async fn spawn_in_namespace(ns: &str, env: &[(&str, &str)]) -> PeerProcess {
        let exe = std::env::current_exe().expect("test binary path");
        let mut command = Command::new("ip");
        command
            .args([OsStr::new("netns"), OsStr::new("exec"), OsStr::new(ns)])
            .arg(exe)
            .env_remove(LISTEN_ENV)
            .env_remove(NAME_ENV)
            .env_remove(ferry::ADVERTISE_ENV);
        Self::start(command, env)
    }

    /// Starts `command` (which runs this test binary) as a peer.
    fn start(mut command: Command, env: &[(&str, &str)]) -> PeerProcess {
        let mut child = command
            .args(["--exact", "ferry_peer", "--nocapture", "--test-threads=1"])
            .env(PEER_ENV, "1")
            // These tests are about the network transports: a peer on this
            // host shares nothing through memory unless `env` says so.
            .env(ferry::DISABLE_MEMORY_ENV, "1")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn peer process");
        let stdin = Box::pin(child.stdin.take().unwrap());
        let stdout: Pin<Box<dyn AsyncRead + Send>> = Box::pin(child.stdout.take().unwrap());
        PeerProcess {
            child: Some(child),
            stdin,
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// A peer running on another machine, whose stdin and stdout are
    /// `stream` (e.g. started by `nc -l -e`). Its host kills it.
    #[allow(dead_code)] // only the two-VM suite has peers elsewhere
    pub fn over_stream(stream: tokio::net::TcpStream) -> PeerProcess {
        let (read, write) = stream.into_split();
        let read: Pin<Box<dyn AsyncRead + Send>> = Box::pin(read);
        PeerProcess {
            child: None,
            stdin: Box::pin(write),
            lines: BufReader::new(read).lines(),
        }
    }

    /// Sends one command line; its answer, whatever it is.
    async fn exchange(&mut self, line: &str) -> String {
        let exchange = async {
            self.stdin
                .write_all(format!("{line}\n").as_bytes())
                .await
                .expect("peer stdin");
            while let Some(out) = self.lines.next_line().await.expect("peer stdout") {
                // libtest may print "test ferry_peer ... " on the same line.
                if let Some(at) = out.find(PREFIX) {
                    return out[at + PREFIX.len()..].to_string();
                }
            }
            panic!("peer exited during `{line}`");
        };
        tokio::time::timeout(COMMAND_DEADLINE, exchange)
            .await
            .unwrap_or_else(|_| panic!("peer did not answer `{line}`"))
    }

    /// Sends one command line to a peer whose node runs; its answer.
    async fn command(&mut self, line: &str) -> String {
        let reply = self.exchange(line).await;
        if let Some(error) = reply.strip_prefix(SPAWN_FAILED) {
            panic!("peer node did not start (during `{line}`): {error}");
        }
        reply
    }

    /// The peer node's address (id and advertised endpoint), or the error
    /// its node failed to start with (its `Display`).
    #[allow(dead_code)] // tests/ibverbs shares this file and does not use it
    pub async fn node_addr(&mut self) -> Result<NodeAddr, String> {
        let reply = self.exchange("addr").await;
        match reply.strip_prefix(SPAWN_FAILED) {
            Some(error) => Err(error.to_string()),
            None => Ok(serde_json::from_str(&reply).expect("peer address")),
        }
    }

    /// The peer serves RPC `name` with a handler that never answers.
    #[allow(dead_code)] // tests/ibverbs shares this file and does not use it
    pub async fn serve_forever(&mut self, name: &str) {
        assert_eq!(
            self.command(&format!("serve-forever {name}")).await,
            "serving"
        );
    }

    /// The peer writes its whole region `local` to `remote` (a handle to
    /// another node's memory) in one op: `Err` holds the error's `Display`.
    #[allow(dead_code)] // tests/ibverbs shares this file and does not use it
    pub async fn write_to(
        &mut self,
        local: &PeerRegion,
        remote: &RemoteBuffer,
    ) -> Result<(), String> {
        self.transfer("write", local, remote).await
    }

    /// The peer reads `remote` into its whole region `local` in one op.
    #[allow(dead_code)] // tests/ibverbs shares this file and does not use it
    pub async fn read_from(
        &mut self,
        local: &PeerRegion,
        remote: &RemoteBuffer,
    ) -> Result<(), String> {
        self.transfer("read", local, remote).await
    }

    async fn transfer(
        &mut self,
        kind: &str,
        local: &PeerRegion,
        remote: &RemoteBuffer,
    ) -> Result<(), String> {
        let json = serde_json::to_string(remote).unwrap();
        let reply = self
            .command(&format!("{kind} {} {json}", local.index))
            .await;
        if reply == "ok" { Ok(()) } else { Err(reply) }
    }

    /// Allocates `len` bytes in the peer, filled with `pattern(len, seed)`.
    pub async fn alloc(&mut self, len: usize, access: Access, seed: u8) -> PeerRegion {
        let access = match access {
            Access::ReadOnly => "ro",
            Access::ReadWrite => "rw",
        };
        let reply = self.command(&format!("alloc {len} {access} {seed}")).await;
        let (index, json) = reply.split_once(' ').expect("index and handle");
        PeerRegion {
            index: index.parse().unwrap(),
            handle: serde_json::from_str(json).unwrap(),
            seed,
        }
    }

    /// Publishes the peer's region under `name`.
    #[allow(dead_code)] // tests/ibverbs shares this file and names nothing
    pub async fn publish(&mut self, region: &PeerRegion, name: &str) {
        let reply = self
            .command(&format!("publish {} {name}", region.index))
            .await;
        assert_eq!(reply, "published");
    }

    /// Digest of the peer region's whole current contents.
    pub async fn digest(&mut self, region: &PeerRegion) -> u64 {
        self.command(&format!("digest {}", region.index))
            .await
            .parse()
            .unwrap()
    }

    /// The peer region's whole current contents, byte for byte.
    #[allow(dead_code)] // tests/ibverbs and tests/memory share this file
    pub async fn contents(&mut self, region: &PeerRegion) -> Vec<u8> {
        let hex = self.command(&format!("contents {}", region.index)).await;
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex contents"))
            .collect()
    }

    /// How many panics the peer process has seen, on any of its threads
    /// (its node's tasks included): a panic there means a bug, even when
    /// tokio contains it and the node goes on.
    #[allow(dead_code)] // tests/ibverbs and tests/memory share this file
    pub async fn panics(&mut self) -> usize {
        self.command("panics").await.parse().unwrap()
    }

    /// Drops the peer's handle to the region, deregistering it.
    pub async fn drop_region(&mut self, region: &PeerRegion) {
        assert_eq!(
            self.command(&format!("drop {}", region.index)).await,
            "dropped"
        );
    }

    /// Has the peer run `batches` notified batches against `remote`, at
    /// most `in_flight` at once: batch `i` writes [`slot_bytes`]`(i)` into
    /// slot `i` (`"write"`), or reads slot `i` back (`"read"`), in two ops
    /// of half a slot each, with the notification `i` as 4 bytes LE. For
    /// reads, the peer then checks that it read [`slot_bytes`]`(i)` in every
    /// slot. Answers `ok`, or the first error.
    #[allow(dead_code)] // tests/ibverbs shares this file and may not use it
    pub async fn notified_batches(
        &mut self,
        kind: &str,
        batches: usize,
        in_flight: usize,
        remote: &RemoteBuffer,
    ) -> Result<(), String> {
        let json = serde_json::to_string(remote).unwrap();
        let reply = self
            .command(&format!("notified {kind} {batches} {in_flight} {json}"))
            .await;
        if reply == "ok" { Ok(()) } else { Err(reply) }
    }

    #[allow(dead_code)] // not every suite kills its peers this way
    pub async fn kill(&mut self) {
        let child = self
            .child
            .as_mut()
            .expect("a peer elsewhere is killed by its host");
        child.kill().await.expect("kill peer");
    }
}

/// The peer side: a node plus a table of regions, driven by stdin.
pub fn peer_main() {
    static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        report(info)
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let stdin = std::io::stdin();
        let mut stdout = std::io::stdout();
        let mut builder = Node::builder();
        if let Some(listen) = std::env::var_os(LISTEN_ENV) {
            let listen = listen.to_string_lossy();
            builder = builder.listen(
                listen
                    .parse()
                    .unwrap_or_else(|_| panic!("{LISTEN_ENV}={listen:?} is not IP:PORT")),
            );
        }
        if let Some(name) = std::env::var_os(NAME_ENV) {
            builder = builder.name(name.to_string_lossy());
        }
        let millis = |var: &str| {
            std::env::var(var).ok().map(|ms| {
                Duration::from_millis(
                    ms.parse()
                        .unwrap_or_else(|_| panic!("{var}={ms:?} is not milliseconds")),
                )
            })
        };
        if let Some(timeout) = millis(PEER_TIMEOUT_ENV) {
            builder = builder.peer_timeout(timeout);
        }
        if let Some(grace) = millis(SILENT_GRACE_ENV) {
            builder = builder.silent_grace(grace);
        }
        let node = match builder.spawn().await {
            Ok(node) => node,
            Err(error) => {
                // Every command gets the error, so the test can see it.
                let reply = format!("{SPAWN_FAILED}{error}").replace('\n', " ");
                for line in stdin.lock().lines() {
                    line.expect("stdin");
                    writeln!(stdout, "{PREFIX}{reply}").unwrap();
                    stdout.flush().unwrap();
                }
                return;
            }
        };
        let mut regions: Vec<Option<Region>> = Vec::new();
        let mut raws = raw::Raws::default();
        for line in stdin.lock().lines() {
            let line = line.expect("stdin");
            let words: Vec<&str> = line.split_whitespace().collect();
            let reply = match words.as_slice() {
                ["alloc", len, access, seed] => {
                    let access = if *access == "ro" {
                        Access::ReadOnly
                    } else {
                        Access::ReadWrite
                    };
                    let len: u64 = len.parse().unwrap();
                    let region = node.alloc(len, access).await.expect("peer alloc");
                    region
                        .write_at(0, &pattern(len as usize, seed.parse().unwrap()))
                        .unwrap();
                    let json = serde_json::to_string(&region.remote()).unwrap();
                    regions.push(Some(region));
                    format!("{} {json}", regions.len() - 1)
                }
                ["digest", index] => {
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    digest(&region.to_vec()).to_string()
                }
                ["contents", index] => {
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    region.to_vec().iter().map(|b| format!("{b:02x}")).collect()
                }
                ["panics"] => PANICS.load(std::sync::atomic::Ordering::SeqCst).to_string(),
                ["drop", index] => {
                    regions[index.parse::<usize>().unwrap()] = None;
                    "dropped".to_string()
                }
                ["addr"] => serde_json::to_string(&node.addr()).unwrap(),
                ["publish", index, name] => {
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    match node.publish(*name, region) {
                        Ok(()) => "published".to_string(),
                        Err(e) => e.to_string(),
                    }
                }
                // An RPC handler that never answers (until the process dies).
                ["serve-forever", name] => {
                    node.serve_rpc(name, |_| std::future::pending())
                        .expect("serve");
                    "serving".to_string()
                }
                ["notified", kind, batches, in_flight, _, ..] => {
                    let handle = line.trim().splitn(5, ' ').nth(4).unwrap_or_default();
                    let remote: RemoteBuffer = serde_json::from_str(handle).expect("handle JSON");
                    notified_batches(
                        &node,
                        kind,
                        batches.parse().unwrap(),
                        in_flight.parse().unwrap(),
                        remote,
                    )
                    .await
                }
                // One op over the whole local region; the rest of the line
                // is the remote handle as JSON.
                [kind @ ("write" | "read"), index, _, ..] => {
                    let handle = line.trim().splitn(3, ' ').nth(2).unwrap_or_default();
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    let remote: RemoteBuffer = serde_json::from_str(handle).expect("handle JSON");
                    let op = if *kind == "write" {
                        RdmaOp::write(region.whole(), remote)
                    } else {
                        RdmaOp::read(region.whole(), remote)
                    };
                    match node.submit(vec![op], PEER_OP_DEADLINE).await {
                        Ok(()) => "ok".to_string(),
                        Err(error) => error.to_string().replace('\n', " "),
                    }
                }
                other => raw::command(&node, &mut regions, &mut raws, other, &line)
                    .await
                    .unwrap_or_else(|| panic!("unknown peer command {other:?}")),
            };
            writeln!(stdout, "{PREFIX}{reply}").unwrap();
            stdout.flush().unwrap();
        }
    });
    // stdin closed: the test is over.
    std::process::exit(0);
}

/// The peer's side of [`PeerProcess::notified_batches`].
async fn notified_batches(
    node: &Node,
    kind: &str,
    batches: usize,
    in_flight: usize,
    remote: RemoteBuffer,
) -> String {
    use futures_util::StreamExt;

    let local = node
        .alloc((batches * SLOT) as u64, Access::ReadWrite)
        .await
        .expect("peer alloc");
    if kind == "write" {
        for i in 0..batches {
            local.write_at((i * SLOT) as u64, &slot_bytes(i)).unwrap();
        }
    }
    let half = (SLOT / 2) as u64;
    let results: Vec<Result<(), String>> = futures_util::stream::iter(0..batches)
        .map(|i| {
            let ops: Vec<RdmaOp> = [0, half]
                .into_iter()
                .map(|at| {
                    let range = (i * SLOT) as u64 + at..(i * SLOT) as u64 + at + half;
                    let (local, remote) = (
                        local.slice(range.clone()).unwrap(),
                        remote.slice(range).unwrap(),
                    );
                    if kind == "write" {
                        RdmaOp::write(local, remote)
                    } else {
                        RdmaOp::read(local, remote)
                    }
                })
                .collect();
            async move {
                node.submit_with_notification(
                    ops,
                    PEER_OP_DEADLINE,
                    (i as u32).to_le_bytes().to_vec(),
                )
                .await
                .map_err(|e| format!("batch {i}: {e}"))
            }
        })
        .buffer_unordered(in_flight)
        .collect()
        .await;
    if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
        return e;
    }
    if kind == "read" {
        let read = local.to_vec();
        for i in 0..batches {
            if read[i * SLOT..(i + 1) * SLOT] != slot_bytes(i)[..] {
                return format!("batch {i} read bytes the owner had already overwritten");
            }
        }
    }
    "ok".to_string()
}

/// Runs one batch of `sizes.len()` ops against a fresh peer region, covering
/// it back to back: even ops write local bytes there, odd ops read the
/// peer's bytes here (disjoint ranges, since ops of a batch run
/// concurrently). Checks both sides byte for byte.
#[allow(dead_code)] // tests/memory shares this file and does not use it
pub async fn mixed_batch_round_trip(
    node: &Node,
    peer: &mut PeerProcess,
    sizes: &[usize],
    seed: u8,
) {
    let total: usize = sizes.iter().sum();
    let target = peer.alloc(total, Access::ReadWrite, seed).await;
    let local = node.alloc(total as u64, Access::ReadWrite).await.unwrap();
    let outgoing = pattern(total, seed.wrapping_add(100));
    local.write_at(0, &outgoing).unwrap();
    let original = target.original();
    let (mut expected_remote, mut expected_local) = (original.clone(), outgoing.clone());
    let mut ops = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let range = at..at + len;
        let bytes = range.start as u64..range.end as u64;
        let remote = target.handle.slice(bytes.clone()).unwrap();
        let slice = local.slice(bytes).unwrap();
        if i % 2 == 0 {
            ops.push(RdmaOp::write(slice, remote));
            expected_remote[range.clone()].copy_from_slice(&outgoing[range]);
        } else {
            ops.push(RdmaOp::read(slice, remote));
            expected_local[range.clone()].copy_from_slice(&original[range]);
        }
        at += len;
    }
    let batch = sizes.len();
    node.submit(ops, COMMAND_DEADLINE)
        .await
        .unwrap_or_else(|e| panic!("batch of {batch}: {e}"));
    assert!(
        local.to_vec() == expected_local,
        "batch of {batch}: local bytes"
    );
    assert_eq!(
        peer.digest(&target).await,
        digest(&expected_remote),
        "batch of {batch}: remote bytes"
    );
    peer.drop_region(&target).await;
}

/// Edits a handle through its serialized form, as a forger on the wire would.
pub fn forge(handle: &RemoteBuffer, edit: impl FnOnce(&mut serde_json::Value)) -> RemoteBuffer {
    let mut json = serde_json::to_value(handle).unwrap();
    edit(&mut json);
    serde_json::from_value(json).unwrap()
}

/// The handle with its TCP token off by one bit: what a guesser would send.
#[allow(dead_code)] // tests/memory shares this file and does not use it
pub fn with_wrong_token(handle: &RemoteBuffer) -> RemoteBuffer {
    forge(handle, |j| {
        let token =
            u128::from_str_radix(j["transports"]["tcp"]["token"].as_str().unwrap(), 16).unwrap();
        j["transports"]["tcp"]["token"] = format!("{:032x}", token ^ 1).into();
    })
}

/// Writes `len` bytes into the middle of a fresh peer region and reads them
/// back: the write must land with the margins around it untouched, the read
/// must return it, and the source must be unchanged. `route` is the
/// transport the op must take, where the test knows it.
#[allow(dead_code)] // the two-VM suite moves its own sizes
pub async fn write_then_read_back(
    node: &Node,
    peer: &mut PeerProcess,
    len: usize,
    seed: u8,
    route: Option<RdmaTransportLevel>,
) {
    let margin = 16;
    let target = peer.alloc(len + 2 * margin, Access::ReadWrite, seed).await;
    let remote = target
        .handle
        .slice(margin as u64..(margin + len) as u64)
        .unwrap();
    let data = pattern(len, seed.wrapping_add(50));
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    let op = RdmaOp::write(src.whole(), remote.clone());
    if let Some(route) = route {
        assert_eq!(
            node.route(&op),
            Some(route),
            "{len} B write takes the expected transport"
        );
    }
    node.submit(vec![op], COMMAND_DEADLINE).await.unwrap();
    let mut expected = target.original();
    expected[margin..margin + len].copy_from_slice(&data);
    assert_eq!(
        peer.digest(&target).await,
        digest(&expected),
        "{len} B write landed, margins untouched"
    );

    let back = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), remote)], COMMAND_DEADLINE)
        .await
        .unwrap();
    assert!(back.to_vec() == data, "{len} B read back differs");
    assert!(src.to_vec() == data, "{len} B source changed");
    peer.drop_region(&target).await;
}
