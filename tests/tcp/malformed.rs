//! A raw-socket client throws thousands of malformed, truncated, oversized
//! and wrong-credential frames at a node in another process, on its TCP
//! data channel, its hello and its control channel, while a well-behaved
//! node keeps moving real bytes through it. The node must answer each bad
//! frame as the protocol says, stay up, keep serving, panic nowhere, and
//! no byte of its regions may change except by legitimate writes: a shadow
//! copy of each region is kept and compared byte for byte at the end.
//!
//! Deterministic: one seeded RNG drives every choice (`FERRY_MALFORMED_SEED`
//! overrides the seed, to explore).

use std::net::SocketAddr;
use std::time::Duration;

use ferry::control::hello::{HELLO_LEN, Hello, HelloReply};
use ferry::control::{Channel, HelloStatus};
use ferry::prelude::*;
use ferry::tcp::frame::{
    ClientFrame, MAX_CHUNK, MAX_RANGES, Notify, NotifyOutcome, REQUEST_LEN, RESPONSE_LEN, Range,
    Ranges, Refusal, Request, RequestKind, Response,
};
use ferry::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{PeerProcess, PeerRegion};

mod control;
mod ranges;

use control::{control_round, hello_round};
use ranges::ranges_frame;

/// Bound on any one wait for the node; it answers in milliseconds.
const WAIT: Duration = Duration::from_secs(10);
const RW_LEN: usize = 64 * 1024;
const RO_LEN: usize = 16 * 1024;

/// A region of the attacked node and what it must hold.
struct Shadowed {
    region: PeerRegion,
    shadow: Vec<u8>,
    token: u128,
}

impl Shadowed {
    fn handle(&self) -> &RemoteBuffer {
        &self.region.handle
    }
}

/// What the attacker sent; printed, and checked against a floor so the test
/// cannot pass by sending nothing.
#[derive(Debug, Default)]
struct Sent {
    data_frames: usize,
    hellos: usize,
    control_frames: usize,
    legit_writes: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_change_nothing_and_the_node_keeps_serving() {
    let seed = std::env::var("FERRY_MALFORMED_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f00d);
    let mut rng = fastrand::Rng::with_seed(seed);
    let good = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let shadowed = |region: PeerRegion| Shadowed {
        token: region.handle.transports().tcp.unwrap().token,
        shadow: region.original(),
        region,
    };
    let mut rw = shadowed(peer.alloc(RW_LEN, Access::ReadWrite, 21).await);
    let ro = shadowed(peer.alloc(RO_LEN, Access::ReadOnly, 22).await);
    let owner = rw.handle().owner();
    let mut sent = Sent::default();

    for round in 0..1000 {
        match round % 4 {
            0 | 1 => data_round(&mut rng, owner, &mut rw, &ro, &mut sent).await,
            2 => hello_round(&mut rng, owner, &mut sent).await,
            _ => control_round(&mut rng, owner, good.addr(), &mut sent).await,
        }
        if round % 50 == 49 {
            well_behaved_transfer(&mut rng, &good, &mut rw).await;
        }
    }

    well_behaved_transfer(&mut rng, &good, &mut rw).await;
    assert!(peer.contents(&rw.region).await == rw.shadow, "rw region");
    assert!(peer.contents(&ro.region).await == ro.shadow, "ro region");
    assert_eq!(peer.panics().await, 0, "the attacked node panicked");
    println!("seed {seed:#x}: {sent:?}");
    assert!(sent.data_frames + sent.control_frames >= 2000, "{sent:?}");
}

/// A real transfer from a well-behaved node: a write of random bytes into
/// the region, then a read of another random range, compared with the
/// shadow (which takes the write).
async fn well_behaved_transfer(rng: &mut fastrand::Rng, node: &Node, rw: &mut Shadowed) {
    let len = rng.usize(1..=8192);
    let at = rng.usize(0..=RW_LEN - len);
    let bytes: Vec<u8> = std::iter::repeat_with(|| rng.u8(..)).take(len).collect();
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &bytes).unwrap();
    let range = at as u64..(at + len) as u64;
    let write = RdmaOp::write(src.whole(), rw.handle().slice(range).unwrap());
    node.submit(vec![write], WAIT).await.unwrap();
    rw.shadow[at..at + len].copy_from_slice(&bytes);

    let len = rng.usize(1..=RW_LEN);
    let at = rng.usize(0..=RW_LEN - len);
    let dst = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let range = at as u64..(at + len) as u64;
    let read = RdmaOp::read(dst.whole(), rw.handle().slice(range).unwrap());
    node.submit(vec![read], WAIT).await.unwrap();
    assert!(dst.to_vec() == rw.shadow[at..at + len], "read back");
}

async fn connect(endpoint: SocketAddr) -> TcpStream {
    tokio::time::timeout(WAIT, TcpStream::connect(endpoint))
        .await
        .expect("the node accepts connections")
        .unwrap()
}

/// Says hello for `channel`; the node's reply.
async fn open(owner: NodeAddr, channel: Channel, me: NodeId) -> (TcpStream, HelloReply) {
    let mut s = connect(owner.endpoint).await;
    let hello = Hello::new(channel, me, owner.id);
    s.write_all(&hello.encode()).await.unwrap();
    let mut reply = [0; HelloReply::LEN];
    tokio::time::timeout(WAIT, s.read_exact(&mut reply))
        .await
        .expect("hello reply")
        .unwrap();
    let reply = HelloReply::decode(reply[..HELLO_LEN].try_into().unwrap()).unwrap();
    assert_eq!(reply.node, owner.id);
    (s, reply)
}

/// Everything the node still sends, until it hangs up.
async fn rest(s: &mut TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    match tokio::time::timeout(WAIT, s.read_to_end(&mut rest)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
        Err(_) => panic!("the node did not hang up"),
    }
    rest
}

fn bytes(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    std::iter::repeat_with(|| rng.u8(..)).take(len).collect()
}

/// Random bytes, fewer than `max` of them.
fn junk(rng: &mut fastrand::Rng, max: usize) -> Vec<u8> {
    let len = rng.usize(..max);
    bytes(rng, len)
}

/// What the node must answer to one frame.
enum Expect {
    Exactly(Response),
    /// Read data with these bytes behind the header.
    Data(u64, Vec<u8>),
    /// A delivered (or not, for a full inbox) notification.
    Notified(u64),
}

/// One data connection: a run of well-framed requests, most refused
/// (wrong token, stale generation, unknown region, out of bounds, read-only),
/// some legitimate, then a clean end or a fatal frame (bad kind, oversized
/// length, bad notification, truncated header or payload). Every answer is
/// checked in order, and the node must then hang up.
async fn data_round(
    rng: &mut fastrand::Rng,
    owner: NodeAddr,
    rw: &mut Shadowed,
    ro: &Shadowed,
    sent: &mut Sent,
) {
    // Under the id its notifications name (the node binds them to the
    // hello's; a hello claiming the owner's own id is refused).
    let client = NodeAddr {
        id: NodeId(0xda7a_c11e),
        endpoint: owner.endpoint,
    };
    let (s, reply) = open(owner, Channel::TCP_DATA, client.id).await;
    assert_eq!(reply.status, HelloStatus::Ok);
    let mut wire = Vec::new();
    let mut expect = Vec::new();
    let mut failed_tag = false;
    for id in 0..rng.u64(1..=24) {
        let read_only = rng.u8(..4) == 0;
        if rng.u8(..4) == 0 {
            let target = if read_only { ro } else { &*rw };
            let (frame, answer, writes) = ranges_frame(rng, id, target, read_only);
            for (span, payload) in writes {
                rw.shadow[span].copy_from_slice(&payload);
                sent.legit_writes += 1;
            }
            wire.extend_from_slice(&frame);
            expect.push(answer);
            sent.data_frames += 1;
            continue;
        }
        let target = if read_only { ro } else { &*rw };
        let (handle, token) = (target.handle().clone(), target.token);
        let region_len = target.shadow.len() as u64;
        let len = rng.u64(0..=4096);
        let at = rng.u64(0..=region_len - len);
        let kind = if rng.bool() {
            RequestKind::Write
        } else {
            RequestKind::Read
        };
        let mut request = Request {
            kind,
            id,
            region: handle.region(),
            generation: handle.generation(),
            addr: handle.addr() + at,
            len,
            token,
            scopes: Default::default(),
            tag: 0,
        };
        // The owner checks credentials (for the slot and generation
        // named), access, bounds: in that order, so a bad credential hides
        // a later problem. A slot or generation the token was not issued
        // for is a bad credential: a stranger learns nothing of which
        // exist.
        let mut refusal = match rng.u8(..8) {
            0 => {
                request.token ^= 1 << rng.u32(0..128);
                Some(Refusal::AccessDenied)
            }
            1 => {
                request.generation.0 = request.generation.0.wrapping_add(rng.u32(1..));
                Some(Refusal::AccessDenied)
            }
            2 => {
                request.region.0 = rng.u32(1000..);
                Some(Refusal::AccessDenied)
            }
            3 => {
                // Past the end, or below the start (the offset wraps).
                let offset = if rng.bool() {
                    region_len - len + rng.u64(1..=4096)
                } else {
                    rng.u64(1..=1 << 40).wrapping_neg()
                };
                request.addr = handle.addr().wrapping_add(offset);
                let bound = region_len;
                Some(Refusal::OutOfBounds { offset, bound })
            }
            _ => None,
        };
        if read_only
            && kind == RequestKind::Write
            && matches!(refusal, None | Some(Refusal::OutOfBounds { .. }))
        {
            refusal = Some(Refusal::ReadOnly);
        }
        if refusal.is_some() && rng.bool() {
            request.tag = 7;
            failed_tag = true;
        }
        wire.extend_from_slice(&request.encode());
        sent.data_frames += 1;
        let range = at as usize..(at + len) as usize;
        expect.push(match (kind, refusal) {
            (_, Some(refusal)) => Expect::Exactly(Response::Refused {
                id,
                range: 0,
                refusal,
                len,
            }),
            (RequestKind::Write, None) => {
                rw.shadow[range].copy_from_slice(&bytes(rng, len as usize));
                sent.legit_writes += 1;
                Expect::Exactly(Response::WriteAck { id })
            }
            (RequestKind::Read, None) => {
                let shadow = if read_only { &ro.shadow } else { &rw.shadow };
                Expect::Data(id, shadow[range].to_vec())
            }
        });
        if kind == RequestKind::Write {
            // A legitimate write's payload is what the shadow now holds;
            // a refused one's is junk that must land nowhere.
            match refusal {
                None => wire.extend_from_slice(&rw.shadow[at as usize..(at + len) as usize]),
                Some(_) => wire.extend_from_slice(&bytes(rng, len as usize)),
            }
        }
    }
    let notify = |id, tag, len, discard| Notify {
        id,
        tag,
        len,
        discard,
        from: client,
    };
    if failed_tag {
        wire.extend_from_slice(&notify(100, 7, 3, false).encode());
        wire.extend_from_slice(b"no!");
        let outcome = NotifyOutcome::BatchFailed;
        expect.push(Expect::Exactly(Response::Notified { id: 100, outcome }));
    }
    if rng.bool() {
        wire.extend_from_slice(&notify(101, 8, 0, true).encode());
        let outcome = NotifyOutcome::Discarded;
        expect.push(Expect::Exactly(Response::Notified { id: 101, outcome }));
    }
    if rng.u8(..4) == 0 {
        wire.extend_from_slice(&notify(102, 9, 4, false).encode());
        wire.extend_from_slice(b"note");
        expect.push(Expect::Notified(102));
    }
    let cut_short = fatal_data_frame(rng, rw, owner, &mut wire, &mut expect);
    sent.data_frames += 1;
    exchange(s, wire, expect, cut_short).await;
}

/// Ends a data connection's frames: cleanly, or with a frame after which
/// framing is lost (the node answers `Malformed` and hangs up), or cut
/// short mid-header or mid-payload (the node just hangs up; returns true).
fn fatal_data_frame(
    rng: &mut fastrand::Rng,
    rw: &Shadowed,
    owner: NodeAddr,
    wire: &mut Vec<u8>,
    expect: &mut Vec<Expect>,
) -> bool {
    let id = rng.u64(..);
    let malformed = Expect::Exactly(Response::Refused {
        id,
        range: 0,
        refusal: Refusal::Malformed,
        len: 0,
    });
    let handle = rw.handle();
    let request = Request {
        kind: RequestKind::Write,
        id,
        region: handle.region(),
        generation: handle.generation(),
        addr: handle.addr(),
        len: rng.u64(2..=4096),
        token: rw.token,
        scopes: Default::default(),
        tag: 0,
    };
    match rng.u8(..8) {
        0 => {}
        6 => {
            // No ranges, or more than a request may carry.
            let count = [0, MAX_RANGES + 1 + rng.u32(..1000)][rng.usize(..2)];
            let ranges = Ranges {
                kind: RequestKind::Write,
                id,
                region: handle.region(),
                generation: handle.generation(),
                count,
                len: 0,
                token: rw.token,
                scopes: Default::default(),
                tag: 0,
            };
            wire.extend_from_slice(&ClientFrame::Ranges(ranges).encode());
            expect.push(malformed);
        }
        7 => {
            // A table that does not add up to the header's length (or holds
            // an empty range): the payload can no longer be delimited.
            let first = rng.u64(1..=64);
            let (lens, claimed) = if rng.bool() {
                let second = rng.u64(1..=64);
                ([first, second], first + second + rng.u64(1..=100))
            } else {
                ([first, 0], first)
            };
            let ranges = Ranges {
                kind: RequestKind::Write,
                id,
                region: handle.region(),
                generation: handle.generation(),
                count: 2,
                len: claimed,
                token: rw.token,
                scopes: Default::default(),
                tag: 0,
            };
            wire.extend_from_slice(&ClientFrame::Ranges(ranges).encode());
            for len in lens {
                let addr = handle.addr();
                wire.extend_from_slice(&Range { addr, len }.encode());
            }
            expect.push(malformed);
        }
        1 => {
            let mut header: [u8; REQUEST_LEN] = bytes(rng, REQUEST_LEN).try_into().unwrap();
            header[0] = [0, rng.u8(4..)][rng.usize(..2)];
            header[8..16].copy_from_slice(&id.to_le_bytes());
            wire.extend_from_slice(&header);
            expect.push(malformed);
        }
        2 => {
            let len = rng.u64(MAX_CHUNK + 1..);
            let kind = [RequestKind::Read, RequestKind::Write][rng.usize(..2)];
            wire.extend_from_slice(
                &Request {
                    kind,
                    len,
                    ..request
                }
                .encode(),
            );
            expect.push(malformed);
        }
        3 => {
            let notify = Notify {
                id,
                tag: 0,
                len: 0,
                discard: false,
                from: owner,
            };
            let mut header = notify.encode();
            match rng.u8(..3) {
                0 => header[4] = [0, 5, rng.u8(7..)][rng.usize(..3)],
                1 => header[1] = rng.u8(2..),
                _ => header[32..40].copy_from_slice(&rng.u64(MAX_CHUNK + 1..).to_le_bytes()),
            }
            wire.extend_from_slice(&header);
            expect.push(malformed);
        }
        4 => {
            wire.extend_from_slice(&request.encode()[..rng.usize(..REQUEST_LEN)]);
            return true;
        }
        _ => {
            // A write cut short may apply a prefix: one of the bytes the
            // region holds already, so that the shadow stays exact.
            wire.extend_from_slice(&request.encode());
            let cut = rng.usize(..request.len as usize);
            wire.extend_from_slice(&rw.shadow[..cut]);
            return true;
        }
    }
    false
}

/// Sends `wire` (then ends the stream) while reading the node's answers;
/// they must be exactly `expect`, in order, and then the node hangs up.
/// A stream `cut_short` inside a frame breaks the connection before the
/// node sends the answers it was still coalescing: then they must be a
/// prefix of `expect` (the client of a broken stream learns nothing more).
async fn exchange(s: TcpStream, wire: Vec<u8>, expect: Vec<Expect>, cut_short: bool) {
    let (mut read, mut write) = s.into_split();
    let writer = tokio::spawn(async move {
        // The node may hang up before reading all of a bad stream.
        let _ = write.write_all(&wire).await;
        let _ = write.shutdown().await;
        write
    });
    let mut answers = Vec::new();
    match tokio::time::timeout(WAIT, read.read_to_end(&mut answers)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
        Err(_) => panic!("the node did not hang up"),
    }
    drop(writer.await.unwrap());
    let mut answers = Answers(&answers);
    for expected in &expect {
        if cut_short && answers.0.is_empty() {
            break;
        }
        let header: &[u8; RESPONSE_LEN] = answers.take(RESPONSE_LEN).try_into().unwrap();
        let response = Response::decode(header).unwrap();
        match expected {
            Expect::Exactly(expected) => assert_eq!(response, *expected),
            Expect::Data(id, data) => {
                let len = data.len() as u64;
                assert_eq!(response, Response::ReadData { id: *id, len });
                assert!(answers.take(data.len()) == &data[..], "read data of {id}");
            }
            Expect::Notified(id) => assert!(
                matches!(response, Response::Notified { id: i, outcome }
                    if i == *id && !matches!(outcome, NotifyOutcome::BatchFailed | NotifyOutcome::Discarded)),
                "{response:?}"
            ),
        }
    }
    assert!(answers.0.is_empty(), "the node said more than expected");
}

/// The node's answers not yet checked.
struct Answers<'a>(&'a [u8]);

impl<'a> Answers<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (bytes, rest) = self
            .0
            .split_at_checked(n)
            .unwrap_or_else(|| panic!("the answers end {} bytes short", n - self.0.len()));
        self.0 = rest;
        bytes
    }
}
