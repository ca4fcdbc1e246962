//! Names and peer-to-peer discovery between processes: a node finds a
//! named peer's published regions from its address alone, moves verified
//! bytes with them, and tells a restarted peer (same name, same address,
//! new node id) from the one it knew.

use std::time::Duration;

use ferry::prelude::*;
use ferry::{DISABLE_IBVERBS_ENV, Loaded, LookupError, NodeMetadata, OpError};

use crate::common::{LISTEN_ENV, NAME_ENV, PeerProcess, digest, pattern};

const DEADLINE: Duration = Duration::from_secs(20);

async fn tcp_node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

/// A loopback address with a port free right now, for a peer that must
/// come back at the same address.
fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

async fn named_peer(listen: &str) -> PeerProcess {
    PeerProcess::spawn_with_env(&[
        (LISTEN_ENV, listen),
        (NAME_ENV, "decode-0"),
        (DISABLE_IBVERBS_ENV, "1"),
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_finds_a_named_peer_from_its_address_and_moves_verified_bytes() {
    let node = tcp_node().await;
    let listen = free_address();
    let mut peer = named_peer(&listen).await;
    let len = 1 << 20;
    let kv = peer.alloc(len, Access::ReadWrite, 1).await;
    peer.publish(&kv, "kv-cache").await;
    let weights = peer.alloc(4096, Access::ReadOnly, 2).await;
    peer.publish(&weights, "weights/layer-3").await;

    let (name, loaded) = node
        .fetch_metadata(listen.parse().unwrap(), DEADLINE)
        .await
        .unwrap();
    assert_eq!((name.as_str(), loaded), ("decode-0", Loaded::New));
    let metadata = node.peer_metadata("decode-0").unwrap();
    assert_eq!(metadata.node, peer.node_addr().await.unwrap());
    assert_eq!(metadata.regions.len(), 2);

    // The handle found by name reaches the peer's region, with its access.
    let remote = node.remote_region("decode-0", "kv-cache").unwrap();
    assert_eq!(remote, kv.handle);
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 9)).unwrap();
    node.submit(vec![RdmaOp::write(src.whole(), remote)], DEADLINE)
        .await
        .unwrap();
    assert_eq!(peer.digest(&kv).await, digest(&pattern(len, 9)));
    let read_only = node.remote_region("decode-0", "weights/layer-3").unwrap();
    assert_eq!(read_only.access(), Access::ReadOnly);

    assert_eq!(
        node.remote_region("decode-0", "nope"),
        Err(LookupError::UnknownRegion {
            peer: "decode-0".into(),
            region: "nope".into()
        })
    );
    assert!(node.forget_peer("decode-0"));
    assert_eq!(
        node.remote_region("decode-0", "kv-cache"),
        Err(LookupError::UnknownPeer("decode-0".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_is_a_new_incarnation_and_old_handles_fail_typed() {
    let node = tcp_node().await;
    let listen = free_address();
    let address = listen.parse().unwrap();
    let mut peer = named_peer(&listen).await;
    let region = peer.alloc(4096, Access::ReadWrite, 1).await;
    peer.publish(&region, "kv-cache").await;
    node.fetch_metadata(address, DEADLINE).await.unwrap();
    let old = node.remote_region("decode-0", "kv-cache").unwrap();
    let first = old.owner();
    peer.kill().await;

    let mut peer = named_peer(&listen).await;
    let region = peer.alloc(4096, Access::ReadWrite, 2).await;
    peer.publish(&region, "kv-cache").await;
    let (_, loaded) = node.fetch_metadata(address, DEADLINE).await.unwrap();
    assert_eq!(loaded, Loaded::Restarted { previous: first });
    let new = node.remote_region("decode-0", "kv-cache").unwrap();
    assert_ne!(new.owner().id, first.id);
    assert_eq!(new.owner().endpoint, first.endpoint);

    let dst = node.alloc(4096, Access::ReadWrite).await.unwrap();
    node.submit(vec![RdmaOp::read(dst.whole(), new)], DEADLINE)
        .await
        .unwrap();
    assert_eq!(dst.to_vec(), pattern(4096, 2));
    // The old incarnation's handle reaches the same address, where another
    // node answers: refused at the hello, never the new process's memory.
    let result = node
        .submit(vec![RdmaOp::write(dst.whole(), old)], DEADLINE)
        .await;
    assert!(
        matches!(
            result,
            Err(SubmitError::Op { index: 0, error: OpError::UnknownNode { expected, .. } })
                if expected == first.id
        ),
        "{result:?}"
    );
    assert_eq!(peer.digest(&region).await, digest(&pattern(4096, 2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_metadata_carries_only_the_named_regions_and_bad_blobs_are_typed() {
    let node = Node::builder()
        .ibverbs(false)
        .name("prefill-0")
        .spawn()
        .await
        .unwrap();
    let a = node.alloc(64, Access::ReadWrite).await.unwrap();
    let b = node.alloc(64, Access::ReadWrite).await.unwrap();
    node.publish("a", &a).unwrap();
    node.publish("b", &b).unwrap();
    assert_eq!(node.publish("a", &b), Err(ferry::NameTaken("a".into())));
    let partial = node.export_metadata(Some(&["b".to_string()]));
    let decoded = NodeMetadata::decode(&partial).unwrap();
    assert_eq!(decoded.name.as_deref(), Some("prefill-0"));
    assert_eq!(decoded.regions.keys().collect::<Vec<_>>(), ["b"]);
    assert_eq!(decoded.regions["b"], b.remote());

    let other = tcp_node().await;
    assert_eq!(other.load_metadata(&partial), Ok(Loaded::New));
    assert_eq!(other.remote_region("prefill-0", "b"), Ok(b.remote()));
    assert!(other.remote_region("prefill-0", "a").is_err());
    assert!(matches!(
        other.load_metadata(&partial[..partial.len() / 2]),
        Err(ferry::MetadataError::Truncated { .. })
    ));
    assert!(matches!(
        other.load_metadata(b"garbage, not metadata"),
        Err(ferry::MetadataError::NotMetadata(_))
    ));
    let mut future = partial.to_vec();
    future[4] = 0xff;
    assert!(matches!(
        other.load_metadata(&future),
        Err(ferry::MetadataError::FutureVersion { .. })
    ));
    assert!(node.unpublish("a"));
    assert!(!node.unpublish("a"));
    assert_eq!(node.metadata().regions.len(), 1);
}
