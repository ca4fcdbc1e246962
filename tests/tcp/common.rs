//! A ferry node in a separate OS process, driven over stdin/stdout.
//!
//! The peer is this same test binary, re-executed to run only the
//! `ferry_peer` test with `FERRY_TEST_PEER=1`. It answers one line per command,
//! prefixed with `FERRY `; everything else on its stdout (libtest's chatter)
//! is ignored. A peer whose node fails to start answers every command with
//! `FERRY spawn-failed <error>`. A peer in another machine (the two-VM
//! suite) speaks the same lines over a TCP stream instead of pipes.

use std::ffi::OsStr;
use std::pin::Pin;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ferry::NodeAddr;
use ferry::prelude::*;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, Command};

/// The peer process's side: its node, driven by the commands.
#[path = "peer_side.rs"]
mod peer_side;
/// Peer commands that publish and subscribe to weights.
#[path = "peer_weights.rs"]
pub mod peer_weights;
/// Peer commands on memory ferry did not allocate (`MemoryBlock::from_raw`).
#[path = "raw.rs"]
pub mod raw;
pub use peer_side::peer_main;

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
    #[allow(dead_code)] // read only by `kill` and `pid`, which not every suite uses
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

    /// The peer's process id, when it is this host's child.
    #[allow(dead_code)] // only the memory suite reads the peer's mappings
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
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

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
#[allow(dead_code)] // the suites that stop a peer: tcp and memory
pub fn signal(pid: u32, signal: &str) {
    let sent = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill(1)");
    assert!(sent.success(), "kill -{signal} {pid}");
}

/// Whether every thread of process `pid` is stopped (`T` or `t` in its
/// `/proc` stat).
#[allow(dead_code)] // the suites that stop a peer: tcp and memory
pub fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let state = stat.rsplit_once(") ")?.1.chars().next()?;
                Some(state == 'T' || state == 't')
            })
            .unwrap_or(false)
    })
}

/// Stops `pid` (`SIGSTOP`) and waits, up to [`COMMAND_DEADLINE`], until
/// all its threads are: `kill` returns before a busy thread has stopped.
#[allow(dead_code)] // the suites that stop a peer: tcp and memory
pub async fn stop(pid: u32) {
    signal(pid, "STOP");
    let start = std::time::Instant::now();
    while !stopped(pid) {
        assert!(
            start.elapsed() < COMMAND_DEADLINE,
            "process {pid} does not stop"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
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

/// Reads all of `target` into `back` (of the same length) within
/// `deadline` and asserts it holds the peer's bytes: the check that a path
/// to the peer still works.
#[allow(dead_code)] // not every suite shares this file for it
pub async fn reads_back(node: &Node, back: &Region, target: &PeerRegion, deadline: Duration) {
    node.submit(
        vec![RdmaOp::read(back.whole(), target.handle.clone())],
        deadline,
    )
    .await
    .unwrap();
    assert!(back.to_vec() == target.original());
}

/// Writes all of `src` over `target` (of the same length) within
/// `deadline` and asserts the peer then holds `src`'s bytes there: the
/// write-side twin of [`reads_back`].
#[allow(dead_code)] // not every suite shares this file for it
pub async fn writes_arrive(
    node: &Node,
    peer: &mut PeerProcess,
    src: &Region,
    target: &PeerRegion,
    deadline: Duration,
) {
    node.submit(
        vec![RdmaOp::write(src.whole(), target.handle.clone())],
        deadline,
    )
    .await
    .unwrap();
    assert_eq!(peer.digest(target).await, digest(&src.to_vec()));
}

/// Submits `ops` again and again, each batch within `deadline`, until one
/// fails or `give_up` passes: that batch's result, and when it started.
/// For tests that kill or cut a peer while transfers run: a fast host may
/// finish a batch before the fault lands, and that must not pass for a
/// transfer that moved through it.
#[allow(dead_code)] // the suites that fault peers share this file for it
pub async fn submit_until_it_fails(
    node: &Node,
    ops: &[RdmaOp],
    deadline: Duration,
    give_up: Instant,
) -> (Result<(), SubmitError>, Instant) {
    loop {
        let started = Instant::now();
        let result = node.submit(ops.to_vec(), deadline).await;
        if result.is_err() || Instant::now() >= give_up {
            return (result, started);
        }
    }
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
