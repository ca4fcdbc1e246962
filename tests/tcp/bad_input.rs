//! Bad input gets a typed error and changes no byte on either side.

use std::time::{Duration, Instant};

use ferry::control::hello::{HELLO_LEN, Hello, HelloReply, VERSION};
use ferry::control::{Channel, HelloStatus};
use ferry::prelude::*;
use ferry::tcp::frame::{
    MAX_CHUNK, Notify, NotifyOutcome, RESPONSE_LEN, Refusal, Request, RequestKind, Response,
};
use ferry::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{PeerProcess, PeerRegion, digest, forge, pattern, reads_back};

const DEADLINE: Duration = Duration::from_secs(20);
const LEN: usize = 64 * 1024;

/// A local region holding `pattern(LEN, 0xEE)`: a write source or a read
/// destination whose bytes must not change when an op is refused.
async fn local(node: &Node) -> Region {
    let region = node.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    region.write_at(0, &pattern(LEN, 0xEE)).unwrap();
    region
}

fn assert_op_error(
    result: Result<(), SubmitError>,
    index: usize,
    check: impl FnOnce(&OpError) -> bool,
) {
    match result {
        Err(SubmitError::Op { index: i, error }) if i == index && check(&error) => {}
        other => panic!("expected op {index} to fail with the right error, got {other:?}"),
    }
}

async fn assert_untouched(peer: &mut PeerProcess, target: &PeerRegion, local: &Region) {
    assert_eq!(
        peer.digest(target).await,
        digest(&target.original()),
        "remote bytes changed"
    );
    assert!(local.to_vec() == pattern(LEN, 0xEE), "local bytes changed");
}

async fn setup(access: Access) -> (Node, PeerProcess, PeerRegion, Region) {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let target = peer.alloc(LEN, access, 3).await;
    let local = local(&node).await;
    (node, peer, target, local)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_is_access_denied() {
    let (node, mut peer, target, local) = setup(Access::ReadWrite).await;
    let forged = crate::common::with_wrong_token(&target.handle);
    let write = node
        .submit(vec![RdmaOp::write(local.whole(), forged.clone())], DEADLINE)
        .await;
    assert_op_error(write, 0, |e| *e == OpError::AccessDenied);
    // In a batch, the failing op is named.
    let ok = target.handle.clone();
    let reads = vec![
        RdmaOp::read(local.slice(0..10).unwrap(), ok.slice(0..10).unwrap()),
        RdmaOp::read(local.slice(10..20).unwrap(), ok.slice(10..20).unwrap()),
        RdmaOp::read(
            local.slice(20..LEN as u64).unwrap(),
            forged.slice(20..LEN as u64).unwrap(),
        ),
    ];
    // The valid reads land (they copy the peer's pattern); undo them before the check.
    assert_op_error(node.submit(reads, DEADLINE).await, 2, |e| {
        *e == OpError::AccessDenied
    });
    assert_eq!(local.to_vec()[..20], target.original()[..20]);
    local.write_at(0, &pattern(LEN, 0xEE)[..20]).unwrap();
    assert_untouched(&mut peer, &target, &local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_generation_after_the_region_is_replaced() {
    let (node, mut peer, old, local) = setup(Access::ReadWrite).await;
    peer.drop_region(&old).await;
    let new = peer.alloc(LEN, Access::ReadWrite, 4).await;
    assert_eq!(
        new.handle.region(),
        old.handle.region(),
        "the slot is reused"
    );
    assert_ne!(new.handle.generation(), old.handle.generation());

    let write = node
        .submit(
            vec![RdmaOp::write(local.whole(), old.handle.clone())],
            DEADLINE,
        )
        .await;
    assert_op_error(write, 0, |e| {
        *e == OpError::StaleGeneration {
            handle: old.handle.generation(),
            current: new.handle.generation(),
        }
    });
    let read = node
        .submit(
            vec![RdmaOp::read(local.whole(), old.handle.clone())],
            DEADLINE,
        )
        .await;
    assert_op_error(read, 0, |e| matches!(e, OpError::StaleGeneration { .. }));
    assert_untouched(&mut peer, &new, &local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_slices_are_refused_locally_and_by_the_owner() {
    let (node, mut peer, target, local) = setup(Access::ReadWrite).await;
    let len = LEN as u64;
    assert!(
        matches!(target.handle.slice(1..len + 1), Err(OpError::OutOfBounds { bound, .. }) if bound == len)
    );
    assert!(matches!(
        local.slice(len - 1..len + 1),
        Err(OpError::OutOfBounds { .. })
    ));

    // A handle widened on the wire: the owner checks the region's real bounds.
    let widened = forge(&target.handle, |j| j["len"] = (len + 4096).into());
    let src = node.alloc(len + 4096, Access::ReadWrite).await.unwrap();
    let write = node
        .submit(vec![RdmaOp::write(src.whole(), widened.clone())], DEADLINE)
        .await;
    assert_op_error(
        write,
        0,
        |e| matches!(e, OpError::OutOfBounds { bound, .. } if *bound == len),
    );
    // One whose address range wraps around the end of the address space:
    // refused as a forged handle, before anything is sent and with no
    // overflow anywhere.
    let wrapping = forge(&target.handle, |j| j["addr"] = (u64::MAX - 10).into());
    let overflow = OpError::AddressOverflow {
        addr: u64::MAX - 10,
        len,
    };
    assert_eq!(wrapping.slice(20..30), Err(overflow.clone()));
    let read = node
        .submit(vec![RdmaOp::read(local.whole(), wrapping)], DEADLINE)
        .await;
    assert_op_error(read, 0, |e| *e == overflow);
    // One shifted below the region's start.
    let below = forge(&target.handle, |j| {
        j["addr"] = (target.handle.addr() - 8).into()
    });
    let read = node
        .submit(vec![RdmaOp::read(local.whole(), below)], DEADLINE)
        .await;
    assert_op_error(read, 0, |e| matches!(e, OpError::OutOfBounds { .. }));
    assert_untouched(&mut peer, &target, &local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_mismatch_fails_the_batch_before_anything_moves() {
    let (node, mut peer, target, local) = setup(Access::ReadWrite).await;
    let ops = vec![
        RdmaOp::write(
            local.slice(0..100).unwrap(),
            target.handle.slice(0..100).unwrap(),
        ),
        RdmaOp::write(
            local.slice(100..200).unwrap(),
            target.handle.slice(100..199).unwrap(),
        ),
    ];
    let result = node.submit(ops, DEADLINE).await;
    assert_op_error(result, 1, |e| {
        *e == OpError::LengthMismatch {
            local: 100,
            remote: 99,
        }
    });
    // Op 0 was valid, but a batch with a bad op is not started at all.
    assert_untouched(&mut peer, &target, &local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_read_only_handles_are_refused() {
    let (node, mut peer, target, local) = setup(Access::ReadOnly).await;
    let write = node
        .submit(
            vec![RdmaOp::write(local.whole(), target.handle.clone())],
            DEADLINE,
        )
        .await;
    assert_op_error(write, 0, |e| *e == OpError::ReadOnly);
    // Upgrading the handle on the wire does not help: the owner enforces it.
    let upgraded = forge(&target.handle, |j| j["access"] = "ReadWrite".into());
    let write = node
        .submit(vec![RdmaOp::write(local.whole(), upgraded)], DEADLINE)
        .await;
    assert_op_error(write, 0, |e| *e == OpError::ReadOnly);
    assert_untouched(&mut peer, &target, &local).await;

    // Narrowing a read-write handle works the same way.
    let rw = peer.alloc(LEN, Access::ReadWrite, 5).await;
    let write = node
        .submit(
            vec![RdmaOp::write(local.whole(), rw.handle.read_only())],
            DEADLINE,
        )
        .await;
    assert_op_error(write, 0, |e| *e == OpError::ReadOnly);
    assert_untouched(&mut peer, &rw, &local).await;
    // Nor does upgrading a narrowed one: its token opens reads only, and
    // editing the scope it was narrowed to breaks the token.
    let narrowed = rw.handle.read_only();
    let upgraded = forge(&narrowed, |j| j["access"] = "ReadWrite".into());
    let write = node
        .submit(vec![RdmaOp::write(local.whole(), upgraded)], DEADLINE)
        .await;
    assert_op_error(write, 0, |e| *e == OpError::ReadOnly);
    let upgraded = forge(&narrowed, |j| {
        j["access"] = "ReadWrite".into();
        j["scopes"][0]["access"] = "ReadWrite".into();
    });
    let write = node
        .submit(vec![RdmaOp::write(local.whole(), upgraded)], DEADLINE)
        .await;
    assert_op_error(write, 0, |e| *e == OpError::AccessDenied);
    assert_untouched(&mut peer, &rw, &local).await;

    // Reading through a read-only handle is allowed, narrowed or not.
    let narrowed = PeerRegion {
        handle: rw.handle.read_only(),
        ..rw
    };
    reads_back(&node, &local, &narrowed, DEADLINE).await;
    reads_back(&node, &local, &target, DEADLINE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_unreachable_nodes() {
    let (node, mut peer, target, local) = setup(Access::ReadWrite).await;
    let impostor = NodeId(target.handle.owner().id.0 ^ 1);
    let wrong_node = forge(&target.handle, |j| {
        j["owner"]["id"] = serde_json::to_value(impostor).unwrap()
    });
    let write = node
        .submit(vec![RdmaOp::write(local.whole(), wrong_node)], DEADLINE)
        .await;
    assert_op_error(
        write,
        0,
        |e| matches!(e, OpError::UnknownNode { expected, .. } if *expected == impostor),
    );

    // A port nobody listens on: bind one, then free it.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let nowhere = forge(&target.handle, |j| {
        j["owner"]["endpoint"] = closed.to_string().into()
    });
    let started = Instant::now();
    let read = node
        .submit(vec![RdmaOp::read(local.whole(), nowhere)], DEADLINE)
        .await;
    assert_op_error(
        read,
        0,
        |e| matches!(e, OpError::PeerUnreachable { endpoint, .. } if *endpoint == closed),
    );
    assert!(
        started.elapsed() < DEADLINE,
        "an unreachable peer is reported, not waited out"
    );
    assert_untouched(&mut peer, &target, &local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_transfer_fails_before_the_deadline() {
    let node = Node::builder().spawn().await.unwrap();
    let mut peer = PeerProcess::spawn().await;
    let len = 64 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 6).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    // 8 GiB of reads: far longer than the moment we wait before the kill.
    let ops: Vec<_> = (0..128)
        .map(|_| RdmaOp::read(local.whole(), target.handle.clone()))
        .collect();
    let deadline = Duration::from_secs(120);
    let started = Instant::now();
    let transfer = tokio::spawn({
        let node = node.clone();
        async move { node.submit(ops, deadline).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    peer.kill().await;
    let result = tokio::time::timeout(deadline, transfer)
        .await
        .expect("no hang")
        .unwrap();
    assert!(
        matches!(
            result,
            Err(SubmitError::Op {
                error: OpError::ConnectionLost { .. } | OpError::PeerUnreachable { .. },
                ..
            })
        ),
        "got {result:?}"
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(200),
        "the transfer ended before the kill: {result:?}"
    );
    assert!(took < deadline / 4, "took {took:?}");

    // The node itself is fine: a new peer works.
    let mut peer = PeerProcess::spawn().await;
    let target = peer.alloc(LEN, Access::ReadWrite, 7).await;
    let back = node.alloc(LEN as u64, Access::ReadWrite).await.unwrap();
    node.submit(
        vec![RdmaOp::read(back.whole(), target.handle.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    assert!(back.to_vec() == target.original());
}

/// The node id raw clients here say hello as, which their notifications
/// must name (the node binds a notification's sender to its connection's).
const RAW_CLIENT: NodeId = NodeId(0xc1_1e47);

async fn hello(stream: &mut TcpStream, version: u16, owner: NodeId) -> HelloReply {
    let mut hello = Hello::new(Channel::TCP_DATA, RAW_CLIENT, owner);
    hello.version = version;
    let hello = hello.encode();
    // A node of another version sends another length: its header, which
    // is all a refusal reads.
    let len = if version == VERSION {
        hello.len()
    } else {
        HELLO_LEN
    };
    stream.write_all(&hello[..len]).await.unwrap();
    let mut header = [0; HELLO_LEN];
    stream.read_exact(&mut header).await.unwrap();
    let reply = HelloReply::decode(&header).unwrap();
    if reply.status == HelloStatus::Ok {
        let mut tail = [0; HelloReply::LEN - HELLO_LEN];
        stream.read_exact(&mut tail).await.unwrap();
    }
    reply
}

async fn response(stream: &mut TcpStream) -> Response {
    let mut bytes = [0; RESPONSE_LEN];
    tokio::time::timeout(DEADLINE, stream.read_exact(&mut bytes))
        .await
        .expect("a response")
        .unwrap();
    Response::decode(&bytes).unwrap()
}

/// The server hangs up on a connection whose framing broke.
async fn assert_closed(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    let read = tokio::time::timeout(DEADLINE, stream.read_to_end(&mut rest))
        .await
        .expect("server hangs up");
    assert!(read.is_ok() || read.unwrap_err().kind() == std::io::ErrorKind::ConnectionReset);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_wire_does_not_disturb_the_listener() {
    let (node, mut peer, target, local) = setup(Access::ReadWrite).await;
    let endpoint = target.handle.owner().endpoint;
    let owner = target.handle.owner().id;
    let token = target.handle.transports().tcp.unwrap().token;
    let request = |kind, len, token| Request {
        kind,
        id: 9,
        region: target.handle.region(),
        generation: target.handle.generation(),
        addr: target.handle.addr(),
        len,
        token,
        scopes: Default::default(),
        tag: 0,
    };
    // A silent client holds its connection open through all of this.
    let _silent = TcpStream::connect(endpoint).await.unwrap();

    // Garbage instead of a hello.
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    s.write_all(&pattern(100, 1)).await.unwrap();
    assert_closed(&mut s).await;

    // A hello from an unknown protocol version, newer or older: version 3
    // clients predate the Busy hello status and cannot read it.
    for version in [VERSION + 1, 3] {
        let mut s = TcpStream::connect(endpoint).await.unwrap();
        assert_eq!(
            hello(&mut s, version, owner).await.status,
            HelloStatus::BadVersion,
            "version {version}"
        );
        assert_closed(&mut s).await;
    }

    // A truncated request header, then end of stream.
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    assert_eq!(hello(&mut s, VERSION, owner).await.status, HelloStatus::Ok);
    s.write_all(&request(RequestKind::Write, 8, token).encode()[..30])
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    assert_closed(&mut s).await;

    // An oversized length: refused as malformed, then hung up on.
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    hello(&mut s, VERSION, owner).await;
    s.write_all(&request(RequestKind::Write, u64::MAX, token).encode())
        .await
        .unwrap();
    assert_eq!(
        response(&mut s).await,
        Response::Refused {
            id: 9,
            range: 0,
            refusal: Refusal::Malformed,
            len: 0
        }
    );
    assert_closed(&mut s).await;

    // An unknown request kind.
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    hello(&mut s, VERSION, owner).await;
    let mut bad = request(RequestKind::Read, 8, token).encode();
    bad[0] = 77;
    s.write_all(&bad).await.unwrap();
    assert!(matches!(
        response(&mut s).await,
        Response::Refused {
            refusal: Refusal::Malformed,
            ..
        }
    ));
    assert_closed(&mut s).await;

    // A refused write (wrong token) has its payload skipped; the connection
    // stays usable for a proper request.
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    hello(&mut s, VERSION, owner).await;
    s.write_all(&request(RequestKind::Write, 16, token ^ 1).encode())
        .await
        .unwrap();
    s.write_all(&[0xAB; 16]).await.unwrap();
    assert!(matches!(
        response(&mut s).await,
        Response::Refused {
            refusal: Refusal::AccessDenied,
            len: 16,
            ..
        }
    ));
    s.write_all(&request(RequestKind::Read, 16, token).encode())
        .await
        .unwrap();
    assert_eq!(
        response(&mut s).await,
        Response::ReadData { id: 9, len: 16 }
    );
    let mut data = [0; 16];
    s.read_exact(&mut data).await.unwrap();
    assert_eq!(data[..], target.original()[..16]);

    // Notifications: a refused chunk of batch 5 makes the owner drop
    // batch 5's notification; a discard is only acknowledged; another
    // batch's is delivered. All on one connection, which stays usable.
    let notify = |id, tag, len, discard| Notify {
        id,
        tag,
        len,
        discard,
        from: NodeAddr {
            id: RAW_CLIENT,
            endpoint: node.addr().endpoint,
        },
    };
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    hello(&mut s, VERSION, owner).await;
    let mut refused = request(RequestKind::Write, 16, token ^ 1);
    refused.tag = 5;
    s.write_all(&refused.encode()).await.unwrap();
    s.write_all(&[0xAB; 16]).await.unwrap();
    s.write_all(&notify(10, 5, 3, false).encode())
        .await
        .unwrap();
    s.write_all(b"bad").await.unwrap();
    s.write_all(&notify(11, 6, 0, true).encode()).await.unwrap();
    s.write_all(&notify(12, 7, 2, false).encode())
        .await
        .unwrap();
    s.write_all(b"ok").await.unwrap();
    assert!(matches!(
        response(&mut s).await,
        Response::Refused {
            refusal: Refusal::AccessDenied,
            ..
        }
    ));
    for (id, outcome) in [
        (10, NotifyOutcome::BatchFailed),
        (11, NotifyOutcome::Discarded),
        (12, NotifyOutcome::Delivered),
    ] {
        assert_eq!(response(&mut s).await, Response::Notified { id, outcome });
    }
    // A notification longer than any frame, and one whose sender address
    // has an unknown family: framing is lost, the connection ends.
    for edit in [
        (|b: &mut [u8; 64]| b[32..40].copy_from_slice(&(MAX_CHUNK + 1).to_le_bytes()))
            as fn(&mut [u8; 64]),
        |b| b[4] = 5,
    ] {
        let mut s = TcpStream::connect(endpoint).await.unwrap();
        hello(&mut s, VERSION, owner).await;
        let mut bad = notify(13, 1, 0, false).encode();
        edit(&mut bad);
        s.write_all(&bad).await.unwrap();
        assert_eq!(
            response(&mut s).await,
            Response::Refused {
                id: 13,
                range: 0,
                refusal: Refusal::Malformed,
                len: 0
            }
        );
        assert_closed(&mut s).await;
    }

    // None of it touched the region, and a well-behaved node is still served.
    assert_untouched(&mut peer, &target, &local).await;
    node.submit(
        vec![RdmaOp::write(local.whole(), target.handle.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    assert_eq!(peer.digest(&target).await, digest(&pattern(LEN, 0xEE)));
}
