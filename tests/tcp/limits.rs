//! A client's pool of data connections to an owner: it fills up behind the
//! first transfer. At the owner's connection limit (issue 24) a pool that
//! cannot grow carries on over what it has, one with nothing gets
//! `PeerBusy`, and idle connections are closed (after the idle timeout, or
//! at a bound to make room) so that idle clients cannot lock a well-behaved
//! peer out.

use std::time::{Duration, Instant};

use ferry::control::frame::{ControlCodec, Frame, SESSION_VERSIONS, Service};
use ferry::control::hello::{HELLO_LEN, Hello, HelloReply};
use ferry::control::{Channel, ConnectionLimits, EVICTABLE_AFTER, HelloStatus};
use ferry::prelude::*;
use ferry::tcp::frame::{ClientFrame, Ranges, Request, RequestKind};
use ferry::{Generation, Node, NodeAddr, NodeId, OpError, RegionId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::codec::Encoder;

use crate::common::pattern;

const T: Duration = Duration::from_secs(20);

/// A node moving data over TCP only (no same-host memory, no RDMA).
async fn tcp_node(limits: Option<ConnectionLimits>) -> Node {
    let mut builder = Node::builder()
        .ibverbs(false)
        .memory(false)
        .tcp_chunk_size(64 << 10);
    if let Some(limits) = limits {
        builder = builder.connection_limits(limits);
    }
    builder.spawn().await.unwrap()
}

fn limits(max_per_address: usize, idle_timeout: Duration) -> ConnectionLimits {
    ConnectionLimits {
        max_connections: 64,
        max_per_address,
        hello_timeout: Duration::from_secs(10),
        idle_timeout,
        frame_timeout: idle_timeout,
        session_evictable_after: ferry::control::DEFAULT_SESSION_EVICTABLE_AFTER,
    }
}

/// Writes fresh bytes from `node` into `target` and reads them back, both
/// as one op each of many chunks; the bytes must match.
async fn round_trip(node: &Node, target: &Region, seed: u8) -> Result<(), SubmitError> {
    let len = target.len() as usize;
    let data = pattern(len, seed);
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &data).unwrap();
    let remote = target.remote();
    node.submit(vec![RdmaOp::write(src.whole(), remote.clone())], T)
        .await?;
    assert!(target.to_vec() == data, "seed {seed}: the write landed");
    let back = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(back.whole(), remote)], T)
        .await?;
    assert!(back.to_vec() == data, "seed {seed}: read back");
    Ok(())
}

/// The data connections `node` has open once they stop changing (its pool
/// opens them behind a transfer): the same count for 200 ms, within `T`.
async fn settled_connections(node: &Node) -> usize {
    let open = || async { node.tcp().transport_info().await.unwrap().open_connections };
    let started = Instant::now();
    let mut last = (open().await, Instant::now());
    while last.1.elapsed() < Duration::from_millis(200) {
        assert!(started.elapsed() < T, "the pool never settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = open().await;
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
    last.0
}

/// The first transfer to an owner opens one connection and the rest of
/// the pool behind it, with no further transfer to ask for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_fills_behind_the_first_transfer() {
    let owner = tcp_node(None).await;
    let client = tcp_node(None).await;
    let info = || async { client.tcp().transport_info().await.unwrap() };
    let pool = info().await.connections_per_peer;
    // One chunk each way: the transfer itself needs one connection only.
    let target = owner.alloc(64 << 10, Access::ReadWrite).await.unwrap();
    round_trip(&client, &target, 1).await.unwrap();
    let started = Instant::now();
    loop {
        let open = info().await.open_connections;
        if open == pool {
            break;
        }
        assert!(started.elapsed() < T, "{open} of {pool} open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for seed in 2..6 {
        round_trip(&client, &target, seed).await.unwrap();
    }
    assert_eq!(
        info().await.open_connections,
        pool,
        "the pool stays at its size"
    );
}

/// A client from `from` that says a data-channel hello and then idles:
/// `Some` if the server took it.
async fn hello_only(server: NodeAddr, from: &str) -> Option<TcpStream> {
    hello_on(server, from, Channel::TCP_DATA).await
}

/// A client from `from` that says a hello for `channel`: `Some` if the
/// server took it.
/// The node id raw clients here say hello as, which their control
/// sessions' `Open` must name (the node binds it to the hello's).
const RAW_CLIENT: NodeId = NodeId(0x5e55_1011);

async fn hello_on(server: NodeAddr, from: &str, channel: Channel) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut stream = socket.connect(server.endpoint).await.unwrap();
    let hello = Hello::new(channel, RAW_CLIENT, server.id);
    let exchange = async {
        stream.write_all(&hello.encode()).await?;
        let mut reply = [0; HELLO_LEN];
        stream.read_exact(&mut reply).await?;
        if HelloReply::decode(&reply).unwrap().status == HelloStatus::Ok {
            let mut tail = [0; HelloReply::LEN - HELLO_LEN];
            stream.read_exact(&mut tail).await?;
        }
        Ok::<_, std::io::Error>(reply)
    };
    match tokio::time::timeout(T, exchange)
        .await
        .expect("hello answered")
    {
        Ok(reply) if HelloReply::decode(&reply).unwrap().status == HelloStatus::Ok => Some(stream),
        _ => None,
    }
}

/// Whether the server closes `stream` within `within` (what it sends
/// before, a control session's Open, is read and dropped).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0; 4096];
    let closed = async { while let Ok(1..) = stream.read(&mut buf).await {} };
    tokio::time::timeout(within, closed).await.is_ok()
}

/// The owner takes 3 connections from 127.0.0.1; the client's pool wants 4.
/// The connections it has are in use (idle only between its requests), so
/// none makes room: the pool carries on over them instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_cannot_grow_carries_on_over_the_connections_it_has() {
    let owner = tcp_node(Some(limits(3, Duration::from_secs(60)))).await;
    let client = tcp_node(None).await;
    let target = owner.alloc(4 << 20, Access::ReadWrite).await.unwrap();
    for seed in 0..3 {
        round_trip(&client, &target, seed)
            .await
            .unwrap_or_else(|e| panic!("round trip {seed}: {e}"));
    }
    let open = settled_connections(&client).await;
    assert!((1..=3).contains(&open), "{open} connections open");
}

/// The owner takes one connection from 127.0.0.1, and another node's
/// control session (evictable only once idle for 10 s) holds it: a client with no connection gets
/// one typed error saying the owner is at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_no_connection_to_an_owner_at_its_limit_gets_peer_busy() {
    let owner = tcp_node(Some(limits(1, Duration::from_secs(60)))).await;
    let other = tcp_node(None).await;
    let _session = other.endpoint().session(owner.addr(), T).await.unwrap();
    let client = tcp_node(None).await;
    let target = owner.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    for seed in 0..5 {
        match round_trip(&client, &target, seed).await {
            Err(SubmitError::Op {
                index: 0,
                error: OpError::PeerBusy { endpoint, .. },
            }) => assert_eq!(endpoint, owner.addr().endpoint),
            other => panic!("attempt {seed}: {other:?}"),
        }
    }
}

/// Six idle clients from 127.0.0.1 fill its bound of 6: once they have
/// idled a moment, a peer from the same address is served anyway, the
/// least recently used of them making room for each of its connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_do_not_lock_a_peer_out_of_their_address() {
    let owner = tcp_node(Some(limits(6, Duration::from_secs(60)))).await;
    let server = owner.addr();
    let mut flood = Vec::new();
    for _ in 0..6 {
        flood.push(
            hello_only(server, "127.0.0.1")
                .await
                .expect("within the bound"),
        );
    }
    tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(100)).await;
    let target = owner.alloc(4 << 20, Access::ReadWrite).await.unwrap();
    let peer = tcp_node(None).await;
    for seed in 0..3 {
        round_trip(&peer, &target, seed)
            .await
            .unwrap_or_else(|e| panic!("round trip {seed}: {e}"));
    }
    let open = settled_connections(&peer).await;
    let mut evicted = 0;
    for stream in &mut flood {
        if closed_within(stream, Duration::from_millis(200)).await {
            evicted += 1;
        }
    }
    assert_eq!(evicted, open, "one idle client made room per connection");
}

/// With an idle timeout of 300 ms, an idle client and the peer's own idle
/// data connections are closed; the peer reconnects for its next submit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_data_connections_are_closed_after_the_idle_timeout() {
    let owner = tcp_node(Some(limits(8, Duration::from_millis(300)))).await;
    let mut idle = hello_only(owner.addr(), "127.0.0.2").await.expect("taken");
    assert!(
        closed_within(&mut idle, T).await,
        "the idle client was closed"
    );

    let target = owner.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    let peer = tcp_node(None).await;
    round_trip(&peer, &target, 1).await.unwrap();
    let started = Instant::now();
    while peer.tcp().transport_info().await.unwrap().open_connections > 0 {
        assert!(
            started.elapsed() < T,
            "the peer's idle connections are still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    round_trip(&peer, &target, 2).await.unwrap();
}

/// Where a client stops in the middle of a frame (issue 37).
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// A ranges read: its header and 40 of its table's 64 bytes.
    Table,
    /// A write of 4 KiB: its header and 100 bytes of its payload.
    WritePayload,
    /// A control session: its Open frame, then half of a request frame.
    ControlFrame,
}

const STALLS: [Stall; 3] = [Stall::Table, Stall::WritePayload, Stall::ControlFrame];

/// A client from 127.0.0.1 that begins a frame as `stall` says and then
/// sends nothing: `Some` if the server took it.
async fn stalled_client(server: NodeAddr, stall: Stall) -> Option<TcpStream> {
    let channel = match stall {
        Stall::ControlFrame => Channel::CONTROL,
        Stall::Table | Stall::WritePayload => Channel::TCP_DATA,
    };
    let mut stream = hello_on(server, "127.0.0.1", channel).await?;
    let bytes = match stall {
        Stall::Table => {
            let ranges = Ranges {
                kind: RequestKind::Read,
                id: 1,
                region: RegionId(0),
                generation: Generation(1),
                count: 4,
                len: 4 * 1024,
                token: 1,
                scopes: Default::default(),
                tag: 0,
            };
            assert_eq!(ranges.table_len(), 64);
            let mut bytes = ClientFrame::Ranges(ranges).encode().to_vec();
            bytes.extend([0; 40]);
            bytes
        }
        Stall::WritePayload => {
            let write = Request {
                kind: RequestKind::Write,
                id: 1,
                region: RegionId(0),
                generation: Generation(1),
                addr: 1 << 20,
                len: 4096,
                token: 1,
                scopes: Default::default(),
                tag: 0,
            };
            let mut bytes = ClientFrame::Op(write).encode().to_vec();
            bytes.extend([7; 100]);
            bytes
        }
        Stall::ControlFrame => {
            let mut codec = ControlCodec::new(1 << 20);
            let mut wire = bytes::BytesMut::new();
            let open = Frame::Open {
                min_version: SESSION_VERSIONS.0,
                max_version: SESSION_VERSIONS.1,
                node: NodeAddr {
                    id: RAW_CLIENT,
                    endpoint: "127.0.0.1:9".parse().unwrap(),
                },
            };
            codec.encode(open, &mut wire).unwrap();
            let opened = wire.len();
            let request = Frame::Request {
                id: 1,
                service: Service::RPC,
                deadline: Duration::from_secs(5),
                body: bytes::Bytes::from(vec![1; 200]),
            };
            codec.encode(request, &mut wire).unwrap();
            let half = opened + (wire.len() - opened) / 2;
            wire[..half].to_vec()
        }
    };
    stream.write_all(&bytes).await.unwrap();
    Some(stream)
}

/// Six clients from 127.0.0.1 fill its bound of 6, each stalled in the
/// middle of a frame: once they have been silent a moment, a peer from the
/// same address is served anyway, stalled clients making room as idle ones
/// do. Before issue 37 the peer got `PeerBusy` for as long as they stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_stalled_mid_frame_do_not_lock_a_peer_out() {
    for stall in STALLS {
        let owner = tcp_node(Some(limits(6, Duration::from_secs(60)))).await;
        let server = owner.addr();
        let mut flood = Vec::new();
        for _ in 0..6 {
            let client = stalled_client(server, stall).await;
            flood.push(client.expect("within the bound"));
        }
        tokio::time::sleep(EVICTABLE_AFTER + Duration::from_millis(200)).await;
        let target = owner.alloc(4 << 20, Access::ReadWrite).await.unwrap();
        let peer = tcp_node(None).await;
        for seed in 0..3 {
            round_trip(&peer, &target, seed)
                .await
                .unwrap_or_else(|e| panic!("{stall:?}: round trip {seed}: {e}"));
        }
        let mut evicted = 0;
        for stream in &mut flood {
            if closed_within(stream, Duration::from_millis(200)).await {
                evicted += 1;
            }
        }
        assert!(evicted > 0, "{stall:?}: no stalled client made room");
    }
}

/// With a frame timeout of 300 ms (and an idle timeout of a minute), a
/// client stalled in the middle of a frame is cut within the frame timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stalled_mid_frame_is_cut_after_the_frame_timeout() {
    let frame_timeout = Duration::from_millis(300);
    let owner = tcp_node(Some(ConnectionLimits {
        frame_timeout,
        ..limits(8, Duration::from_secs(60))
    }))
    .await;
    for stall in STALLS {
        let mut client = stalled_client(owner.addr(), stall).await.expect("taken");
        let started = Instant::now();
        assert!(
            closed_within(&mut client, T).await,
            "{stall:?}: the stalled client is still connected"
        );
        // Not cut at once either: the bound is on silence.
        assert!(
            started.elapsed() >= frame_timeout / 2,
            "{stall:?}: cut after {:?}",
            started.elapsed()
        );
    }
}
