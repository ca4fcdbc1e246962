//! Giving `MemoryBlock::from_raw` memory back while a TCP chunk is still
//! arriving into it (issue 24): the region's drop returns at once, but the
//! memory stays held, in the sending peer's name, until the chunk has all
//! arrived; `Region::closing` says so, then says the memory is the
//! caller's; nothing lands in it after that, and the next chunk is refused.
//! A raw client stalls the chunk half way, so this does not depend on
//! timing.

use std::time::Duration;

use ferry::control::Channel;
use ferry::control::hello::{HELLO_LEN, Hello, HelloReply};
use ferry::prelude::*;
use ferry::tcp::frame::{RESPONSE_LEN, Refusal, Request, RequestKind, Response};
use ferry::{CloseError, MemoryHolder, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::pattern;
use crate::common::raw::{raw_region, scribble_and_watch};

const DEADLINE: Duration = Duration::from_secs(20);

/// A data connection to `node` from a client calling itself `me`.
async fn data_connection(node: &Node, me: NodeId) -> TcpStream {
    let mut s = TcpStream::connect(node.addr().endpoint).await.unwrap();
    let hello = Hello::new(Channel::TCP_DATA, me, node.addr().id);
    s.write_all(&hello.encode()).await.unwrap();
    let mut reply = [0; HelloReply::LEN];
    s.read_exact(&mut reply).await.unwrap();
    let header = reply[..HELLO_LEN].try_into().unwrap();
    assert_eq!(HelloReply::decode(header).unwrap().node, node.addr().id);
    s
}

async fn response(s: &mut TcpStream) -> Response {
    let mut bytes = [0; RESPONSE_LEN];
    tokio::time::timeout(DEADLINE, s.read_exact(&mut bytes))
        .await
        .expect("a response")
        .unwrap();
    Response::decode(&bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_chunk_still_arriving_holds_a_dropped_region_in_its_peers_name() {
    let owner = Node::builder().ibverbs(false).spawn().await.unwrap();
    let len = 256 * 1024;
    let (region, memory, released) = raw_region(&owner, len).await;
    let remote = region.remote();
    let me = NodeId::random();
    let mut s = data_connection(&owner, me).await;
    let request = |id| Request {
        kind: RequestKind::Write,
        id,
        region: remote.region(),
        generation: remote.generation(),
        addr: remote.addr(),
        len: len as u64,
        token: remote.transports().tcp.unwrap().token,
        scopes: Default::default(),
        tag: 0,
    };
    // Half a chunk: the owner writes what came and waits for the rest.
    let payload = pattern(len, 7);
    let half = len / 2;
    s.write_all(&request(1).encode()).await.unwrap();
    s.write_all(&payload[..half]).await.unwrap();
    let start = std::time::Instant::now();
    while memory.snapshot()[..half] != payload[..half] {
        assert!(start.elapsed() < DEADLINE, "the first half does not land");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    let closing = region.closing();
    let early = closing
        .wait(tokio::time::Instant::now() + Duration::from_millis(300))
        .await;
    if early.is_ok() {
        // Released: the memory is ours, and the rest must not land in it
        // (once the owner answered, it has served the chunk).
        memory.fill(&vec![0xA5; len]);
        s.write_all(&payload[half..]).await.unwrap();
        let _ = response(&mut s).await;
        let landed = memory.snapshot().iter().position(|&b| b != 0xA5);
        assert_eq!(landed, None, "a write landed once the memory was released");
    }
    let client = s.local_addr().unwrap();
    assert_eq!(
        early,
        Err(CloseError::Held {
            holders: vec![MemoryHolder::TcpPeer {
                node: me,
                remote: client
            }]
        }),
        "the chunk still arriving holds the memory, and says whose it is"
    );
    assert!(!released.load(std::sync::atomic::Ordering::SeqCst));

    // The rest arrives: the chunk is served whole, then the memory is ours.
    s.write_all(&payload[half..]).await.unwrap();
    assert_eq!(response(&mut s).await, Response::WriteAck { id: 1 });
    closing
        .wait(tokio::time::Instant::now() + DEADLINE)
        .await
        .unwrap();
    assert!(released.load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        memory.snapshot() == payload,
        "the chunk landed whole before"
    );

    // Nothing lands after: the next chunk is refused, its bytes discarded.
    memory.fill(&vec![0xA5; len]);
    s.write_all(&request(2).encode()).await.unwrap();
    s.write_all(&payload).await.unwrap();
    assert_eq!(
        response(&mut s).await,
        Response::Refused {
            id: 2,
            range: 0,
            refusal: Refusal::UnknownRegion,
            len: len as u64
        }
    );
    assert_eq!(
        scribble_and_watch(&memory, Duration::from_millis(100)).await,
        None,
        "a refused chunk landed"
    );
}
