//! Weight publication across the wire: two publisher ranks in VM a,
//! subscribers of another sharding in both VMs, checksums on, every
//! version's bytes checked.

use std::net::SocketAddr;

use ferry::weights::Subscriber;

use crate::peer::{RemotePeer, Wire};
use crate::{STEP, rdma_node};

use crate::common::peer_weights::data::{held, layout, local};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs: run by tests/rxe/wire-tests.sh"]
async fn weights_published_in_one_vm_reach_subscribers_in_both() {
    let _wire = Wire::clean();
    // The ranks split the rows, each in a process of its own in VM a.
    let mut ranks = Vec::new();
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for rank in 0..2 {
        let mut peer = RemotePeer::start().await;
        assert_eq!(peer.process.weights_publish("wire", rank, 2, 1).await, 0);
        addrs.push(peer.process.node_addr().await.unwrap().endpoint);
        ranks.push(peer);
    }
    // Here, two subscribers that split the columns, pulling over RDMA.
    let mut here = Vec::new();
    for rank in 0..2 {
        let node = rdma_node().await;
        let buffer = vec![local(&node, layout(rank, 2, 1)).await];
        let mut sub = Subscriber::new(&node, "wire", &addrs, buffer, STEP)
            .await
            .unwrap();
        sub.verify_checksums(true);
        here.push((node, sub));
    }
    // There, one that holds the whole matrix.
    let mut there = RemotePeer::start().await;
    there.process.weights_subscribe("wire", 0, 1, &addrs).await;
    for version in 1..=3 {
        if version > 1 {
            for (rank, peer) in ranks.iter_mut().enumerate() {
                let overrun = peer
                    .process
                    .weights_publish("wire", rank as u32, 2, version);
                assert_eq!(overrun.await, 0);
            }
        }
        for (_, sub) in &mut here {
            let update = sub.update(STEP).await.unwrap();
            assert_eq!((update.version, update.changed), (version, true));
            assert_eq!(held(&sub.buffers()[0]), Some(version));
        }
        let update = there.process.weights_update("wire").await;
        assert_eq!(update, (version, Some(version)));
        eprintln!("version {version}: in both VMs, checksums checked");
    }
}
