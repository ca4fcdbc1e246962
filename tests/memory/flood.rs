//! Issue 55: a local process floods a node's same-host socket (abstract
//! sockets have no permission check, so any local user can). Sockets that
//! never say anything, or say the cluster secret's hello and never prove
//! it, hold no place for long: at the bound, the unproven ones make room
//! for a newcomer, and a good peer (a real node, TCP off on both sides so
//! that only the same-host socket can carry its bytes) is served while
//! the flood goes on.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry::prelude::*;
use ferry::{ClusterSecret, NodeId};

use crate::common::pattern;

/// How long the good peer has to be served while the flood goes on: less
/// than the 10 s the owner gives a hello's proof, so that a flood of
/// hellos that waits it out does not pass for a bounded one.
const SERVED_WITHIN: Duration = Duration::from_secs(8);
/// The most the test waits for any other state.
const T: Duration = Duration::from_secs(30);
/// Sockets the flood keeps open: more than the owner answers at once at
/// most (1,024, the old fixed bound too).
const FLOOD: usize = 1100;

/// What each flood socket says after connecting.
#[derive(Clone, Copy, Debug)]
enum Says {
    /// Nothing.
    Nothing,
    /// The cluster secret's hello (`ferry_memory::auth`), never its proof.
    HelloOnly,
}

/// A hostile local process: keeps `count` sockets to an owner open,
/// replacing each one the owner closes, until dropped.
struct Flood {
    stop: Arc<AtomicBool>,
    /// Sockets the owner closed and the flood opened again.
    replaced: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    fn start(owner: NodeId, says: Says, count: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let replaced = Arc::new(AtomicUsize::new(0));
        let thread = {
            let (stop, replaced) = (stop.clone(), replaced.clone());
            std::thread::spawn(move || {
                let name = ferry::memory::socket_name(owner);
                let mut sockets: Vec<Option<OwnedFd>> = (0..count).map(|_| None).collect();
                while !stop.load(Ordering::Relaxed) {
                    for socket in &mut sockets {
                        if socket.as_ref().is_some_and(|s| !closed(s)) {
                            continue;
                        }
                        if socket.take().is_some() {
                            replaced.fetch_add(1, Ordering::Relaxed);
                        }
                        *socket = connect(&name, owner, says);
                    }
                    // A flood, not a wait for a state: how often it refills.
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        Flood {
            stop,
            replaced,
            thread: Some(thread),
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A seqpacket socket connected to abstract name `name`, having said what
/// `says` says; `None` if the connect failed (a full backlog).
fn connect(name: &str, owner: NodeId, says: Says) -> Option<OwnedFd> {
    // SAFETY: plain syscalls on a descriptor owned here, with a
    // zero-initialized sockaddr_un filled within its bounds.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let fd = OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (slot, &b) in addr.sun_path[1..].iter_mut().zip(name.as_bytes()) {
            *slot = b as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
        let rc = libc::connect(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            len as libc::socklen_t,
        );
        if rc != 0 {
            return None;
        }
        if let Says::HelloOnly = says {
            let hello = hello(owner);
            libc::send(
                fd.as_raw_fd(),
                hello.as_ptr().cast(),
                hello.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            );
        }
        Some(fd)
    }
}

/// A same-host hello (76 bytes: magic, version 2, kind 1, a node id, the
/// owner's id, this process's id, a nonce) as a peer with a secret sends
/// first: meant for `owner`, from the process at this end of the socket,
/// so the owner answers it and waits for the proof that never comes.
fn hello(owner: NodeId) -> [u8; 76] {
    let mut b = [0u8; 76];
    b[0..4].copy_from_slice(b"FMAU");
    b[4..6].copy_from_slice(&2u16.to_le_bytes());
    b[6] = 1;
    b[7] = 1;
    b[8..24].copy_from_slice(&NodeId::random().0.to_le_bytes());
    b[24..40].copy_from_slice(&owner.0.to_le_bytes());
    b[40..44].copy_from_slice(&std::process::id().to_le_bytes());
    b[44..].copy_from_slice(&NodeId::random().0.to_le_bytes().repeat(2));
    b
}

/// Whether the owner closed `socket`, reading (and dropping) what it sent
/// before (a hello's reply), without waiting.
fn closed(socket: &OwnedFd) -> bool {
    let mut buf = [0u8; 128];
    loop {
        // SAFETY: a non-blocking read into a local buffer.
        let n = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return true,
            n if n > 0 => continue,
            _ => {
                return std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock;
            }
        }
    }
}

/// Raises this process's descriptor limit to hold the flood, both of its
/// ends (the owner is in this process too) and the other tests.
fn room_for_the_flood() {
    let want = (4 * FLOOD + 1024) as libc::rlim_t;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit for both calls.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < want {
            limit.rlim_cur = want.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
}

/// A node whose bytes only the same-host socket can carry.
async fn memory_only(secret: Option<&ClusterSecret>) -> Node {
    let mut builder = Node::builder().ibverbs(false).tcp(false);
    if let Some(secret) = secret {
        builder = builder.cluster_secret(secret.clone());
    }
    builder.spawn().await.unwrap()
}

/// Waits (within `T`) until `owner` answers `count` same-host sockets or
/// more; returns how many.
async fn wait_served(owner: &Node, enough: impl Fn(usize) -> bool) -> usize {
    let started = Instant::now();
    loop {
        let served = owner.peer_tables().memory_served;
        if enough(served) {
            return served;
        }
        assert!(started.elapsed() < T, "the owner answers {served} sockets");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes fresh bytes from `peer` into `target` (of `owner`) and reads them
/// back, retrying until `within` has passed: `Ok` with how long it took.
async fn served(
    peer: &Node,
    target: &Region,
    seed: u8,
    within: Duration,
) -> Result<Duration, String> {
    let len = target.len() as usize;
    let data = pattern(len, seed);
    let src = peer.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    let back = peer.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < within {
        let write = vec![RdmaOp::write(src.whole(), target.remote())];
        let read = vec![RdmaOp::read(back.whole(), target.remote())];
        let moved = async {
            peer.submit(write, within).await?;
            peer.submit(read, within).await
        };
        match moved.await {
            Ok(()) => {
                assert!(back.to_vec() == data, "seed {seed}: the bytes came back");
                return Ok(started.elapsed());
            }
            Err(e) => last = e.to_string(),
        }
        // A retry of the good peer's own, not a wait for the owner's state.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("not served within {within:?}: {last}"))
}

async fn a_flood_leaves_a_good_peer_served(says: Says, secret: Option<ClusterSecret>) {
    room_for_the_flood();
    let owner = memory_only(secret.as_ref()).await;
    let peer = memory_only(secret.as_ref()).await;
    let target = owner.alloc(64 << 10, Access::ReadWrite).await.unwrap();
    let before = owner.peer_tables().memory_served;

    // The default bound, after room_for_the_flood (it derives from the
    // descriptor limit), as the nodes took it; the flood goes past it.
    let bound = ferry::memory::SameHostLimits::default().max_peers;
    let flood = Flood::start(owner.addr().id, says, FLOOD.min(bound + bound / 8 + 16));
    // The flood holds every place the owner has.
    let held = wait_served(&owner, |n| n >= bound).await;
    let took = served(&peer, &target, 1, SERVED_WITHIN).await;
    let during = owner.peer_tables().memory_served;
    let replaced = flood.replaced.load(Ordering::Relaxed);
    eprintln!(
        "{says:?}: {before} sockets answered before the flood, {held} with it, {during} once \
         the good peer was served ({took:?}); the flood replaced {replaced} closed sockets"
    );
    let took = took.unwrap_or_else(|e| panic!("{says:?}: the good peer: {e}"));
    assert!(
        during <= held + 2,
        "{says:?}: {during} answered, the bound was {held}"
    );
    // Still served, on the same socket, while the flood goes on.
    served(&peer, &target, 2, SERVED_WITHIN)
        .await
        .unwrap_or_else(|e| panic!("{says:?}: the good peer's second transfer: {e}"));
    drop(flood);
    // The flood's places go with it; the good peer's stay.
    let after = wait_served(&owner, |n| n <= before + 2).await;
    eprintln!("{says:?}: {after} answered after the flood, served within {took:?}");
}

/// Silent sockets (no first packet), no cluster secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_sockets_leaves_a_good_peer_served() {
    a_flood_leaves_a_good_peer_served(Says::Nothing, None).await;
}

/// Hellos never proven, with a cluster secret on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unproven_hellos_leaves_a_good_peer_served() {
    let secret = ClusterSecret::new("the flood test's secret, 16+ bytes").unwrap();
    a_flood_leaves_a_good_peer_served(Says::HelloOnly, Some(secret)).await;
}

/// With an unproven timeout of 300 ms, sockets that send nothing, and
/// sockets that say a hello and never prove it, are closed by then; a
/// good peer's socket, proven before them and idle since, stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unproven_sockets_are_closed_at_their_deadline_proven_ones_stay() {
    let secret = ClusterSecret::new("the deadline test's secret, 16+ bytes").unwrap();
    let unproven_timeout = Duration::from_millis(300);
    let owner = Node::builder()
        .ibverbs(false)
        .tcp(false)
        .cluster_secret(secret.clone())
        .same_host_limits(ferry::memory::SameHostLimits {
            unproven_timeout,
            ..Default::default()
        })
        .spawn()
        .await
        .unwrap();
    let peer = memory_only(Some(&secret)).await;
    let target = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    served(&peer, &target, 1, T).await.unwrap();
    let good = owner.peer_tables().memory_served;
    assert_eq!(good, 1, "the good peer's socket");

    let name = ferry::memory::socket_name(owner.addr().id);
    let started = Instant::now();
    let flood: Vec<OwnedFd> = [Says::Nothing, Says::HelloOnly]
        .iter()
        .flat_map(|&says| (0..40).map(move |_| says))
        .map(|says| connect(&name, owner.addr().id, says).expect("room in the backlog"))
        .collect();
    let held = wait_served(&owner, |n| n >= good + flood.len()).await;
    while !flood.iter().all(closed) {
        assert!(started.elapsed() < T, "unproven sockets are still open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed();
    assert!(took >= unproven_timeout, "closed after {took:?}");
    // Had the good peer's socket been bounded too, it would have gone
    // first: it has been idle longer.
    let after = owner.peer_tables().memory_served;
    eprintln!(
        "{good} answered before the flood, {held} with it, {after} once it was closed ({took:?})"
    );
    assert_eq!(after, good);
    served(&peer, &target, 2, T).await.unwrap();
}
