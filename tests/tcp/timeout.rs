//! A submit whose deadline passes returns `Timeout`, and the local memory it
//! touches stays registered until no chunk can touch it any more.
//!
//! The remote side is a scripted fake owner speaking the wire protocol, so the
//! test decides exactly when the outstanding chunk finishes.

use std::time::Duration;

use ferry::control::HelloStatus;
use ferry::control::hello::{Hello, HelloReply, VERSION};
use ferry::prelude::*;
use ferry::tcp::frame::{REQUEST_LEN, Request, Response};
use ferry::{Generation, NodeId, RegionId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LEN: u64 = 256 * 1024;

/// Accepts one data connection as node `id` and returns it with the first
/// request the initiator sent.
async fn accept_as(listener: &TcpListener, id: NodeId) -> (TcpStream, Request) {
    let (mut s, _) = listener.accept().await.unwrap();
    let mut hello = [0; Hello::LEN];
    s.read_exact(&mut hello).await.unwrap();
    assert_eq!(Hello::decode(&hello).unwrap().version, VERSION);
    let reply = HelloReply {
        version: VERSION,
        status: HelloStatus::Ok,
        node: id,
        proves: false,
        nonce: [2; 32],
        tag: [0; 32],
    };
    s.write_all(&reply.encode()).await.unwrap();
    let mut req = [0; REQUEST_LEN];
    s.read_exact(&mut req).await.unwrap();
    (s, Request::decode(&req).unwrap())
}

/// A handle that points at the fake owner, built from a real one.
fn handle_at(real: &RemoteBuffer, fake: &TcpListener, id: NodeId) -> RemoteBuffer {
    let mut json = serde_json::to_value(real).unwrap();
    json["owner"]["endpoint"] = fake.local_addr().unwrap().to_string().into();
    json["owner"]["id"] = serde_json::to_value(id).unwrap();
    serde_json::from_value(json).unwrap()
}

async fn is_registered(node: &Node, region: (RegionId, Generation)) -> bool {
    node.registered_regions().await.contains(&region)
}

/// Waits, with a deadline, until the region is deregistered.
async fn deregistered(node: &Node, region: (RegionId, Generation)) {
    for _ in 0..500 {
        if !is_registered(node, region).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("region {region:?} never deregistered");
}

/// Sets up an initiator node with one local region and a fake owner, and
/// runs a one-chunk read that times out, submitted to the node or (if
/// `via_actor`) to its actor. Returns what the test needs to finish the
/// chunk; every user handle to the region is gone by then.
async fn timed_out_read(via_actor: bool) -> (Node, (RegionId, Generation), TcpStream, Request) {
    let node = Node::builder().tcp_connections(1).spawn().await.unwrap();
    let other = Node::builder().spawn().await.unwrap();
    let template = other.alloc(LEN, Access::ReadWrite).await.unwrap().remote();
    let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_id = NodeId::random();
    let remote = handle_at(&template, &fake, fake_id);

    let local = node.alloc(LEN, Access::ReadWrite).await.unwrap();
    let key = (local.id(), local.generation());
    let submit = tokio::spawn({
        let (node, op) = (node.clone(), RdmaOp::read(local.whole(), remote));
        async move {
            let timeout = Duration::from_millis(300);
            if via_actor {
                let submit = Submit {
                    ops: vec![op],
                    timeout,
                };
                node.actor().ask(submit).await.map_err(SubmitError::from)
            } else {
                node.submit(vec![op], timeout).await
            }
        }
    });
    drop(local);
    let (stream, request) = accept_as(&fake, fake_id).await;
    assert_eq!(request.len, LEN);

    let result = submit.await.unwrap();
    assert_eq!(
        result,
        Err(SubmitError::Timeout {
            timeout: Duration::from_millis(300),
            unfinished: 1,
            total: 1
        })
    );
    // Every user handle is gone, but the chunk may still write into the region.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        is_registered(&node, key).await,
        "deregistered while a chunk could still land"
    );
    (node, key, stream, request)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_read_keeps_memory_until_its_data_arrives() {
    let (node, key, mut stream, request) = timed_out_read(false).await;
    // Half the data: still in flight.
    stream
        .write_all(
            &Response::ReadData {
                id: request.id,
                len: request.len,
            }
            .encode(),
        )
        .await
        .unwrap();
    stream
        .write_all(&vec![0x5A; LEN as usize / 2])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        is_registered(&node, key).await,
        "deregistered with half the payload outstanding"
    );
    // The rest: now nothing can touch the region, and it goes.
    stream
        .write_all(&vec![0x5A; LEN as usize / 2])
        .await
        .unwrap();
    deregistered(&node, key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_read_keeps_memory_until_the_connection_is_gone() {
    let (node, key, stream, _) = timed_out_read(false).await;
    drop(stream);
    deregistered(&node, key).await;
}

/// The node actor answers TCP submits from the connection that finishes
/// them, with no task waiting per submit: its deadline still answers
/// `Timeout` (asserted inside), and the data arriving later answers
/// nothing more and frees the memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_read_through_the_node_actor() {
    let (node, key, mut stream, request) = timed_out_read(true).await;
    let answer = Response::ReadData {
        id: request.id,
        len: request.len,
    };
    stream.write_all(&answer.encode()).await.unwrap();
    stream.write_all(&vec![0x5A; LEN as usize]).await.unwrap();
    deregistered(&node, key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_after_the_last_handle_when_idle() {
    let node = Node::builder().spawn().await.unwrap();
    let region = node.alloc(LEN, Access::ReadWrite).await.unwrap();
    let key = (region.id(), region.generation());
    let clone = region.clone();
    drop(region);
    assert!(is_registered(&node, key).await, "a clone still holds it");
    drop(clone);
    assert!(!is_registered(&node, key).await);
}

/// A peer that accepts but stops reading: the socket and the connection's
/// queue fill up, and the submit waits for room until its deadline. That is
/// a timeout, not a lost connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_pressure_until_the_deadline_is_a_timeout() {
    let node = Node::builder()
        .tcp_connections(1)
        .tcp_chunk_size(4096)
        .spawn()
        .await
        .unwrap();
    let other = Node::builder().spawn().await.unwrap();
    let len = 64 << 20;
    let template = other.alloc(len, Access::ReadWrite).await.unwrap().remote();
    let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_id = NodeId::random();
    let remote = handle_at(&template, &fake, fake_id);
    let local = node.alloc(len, Access::ReadWrite).await.unwrap();
    let submit = tokio::spawn({
        let (node, op) = (node.clone(), RdmaOp::write(local.whole(), remote));
        async move { node.submit(vec![op], Duration::from_millis(500)).await }
    });
    let (_stalled, _) = accept_as(&fake, fake_id).await;
    assert_eq!(
        submit.await.unwrap(),
        Err(SubmitError::Timeout {
            timeout: Duration::from_millis(500),
            unfinished: 1,
            total: 1
        })
    );
}
