//! Regions registered inside registered ones share their memory region
//! (MR) over ibverbs: no second pinning of the pages, one device MR.

use std::sync::Arc;

use ferry::prelude::*;
use ferry::{MemoryBlock, RdmaTransportLevel};

use crate::common::{PeerProcess, digest, pattern};
use crate::{DEADLINE, rdma_node};

/// `len` bytes of `outer`'s memory at `at`, as a block of their own that
/// keeps the outer bytes (not the outer registration) alive.
fn view(outer: &Region, at: u64, len: u64) -> MemoryBlock {
    let memory: Arc<MemoryBlock> = outer.memory().clone();
    let ptr = std::ptr::NonNull::new((memory.addr() + at) as *mut u8).unwrap();
    // SAFETY: `at..at + len` lies inside the outer block, which the
    // keep-alive holds for as long as the view is registered.
    unsafe { MemoryBlock::from_raw(ptr, len, Box::new(memory)) }.unwrap()
}

fn rkey(region: &Region) -> u32 {
    let rkeys = region.remote().transports().ibverbs.expect("ibverbs").rkeys;
    rkeys.get(0).expect("a key on rail 0")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_region_inside_a_registered_one_shares_its_registration() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let outer = node.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    let (at, len) = (256u64 << 10, 64u64 << 10);
    let inner = node
        .register(view(&outer, at, len), Access::ReadWrite)
        .await
        .unwrap();
    assert_eq!(rkey(&inner), rkey(&outer), "the same MR");
    // Another access is another MR: a read-only view must not carry a key
    // that allows writes.
    let read_only = node
        .register(view(&outer, at, len), Access::ReadOnly)
        .await
        .unwrap();
    assert_ne!(rkey(&read_only), rkey(&outer));
    let mrs = || node.ibverbs().unwrap().memory_regions();
    assert_eq!(
        mrs(),
        2,
        "one for the outer region and its view, one read-only"
    );

    // The outer registration goes; the view keeps the MR and still moves
    // bytes both ways over the NIC.
    drop(outer);
    let source = peer.alloc(len as usize, Access::ReadWrite, 21).await;
    let op = RdmaOp::read(inner.whole(), source.handle.clone());
    assert_eq!(node.route(&op), Some(RdmaTransportLevel::Nic));
    node.submit(vec![op], DEADLINE).await.unwrap();
    assert!(
        inner.to_vec() == pattern(len as usize, 21),
        "read into the view"
    );
    let from_peer = peer.alloc(len as usize, Access::ReadWrite, 22).await;
    peer.write_to(&from_peer, &inner.remote()).await.unwrap();
    assert!(
        inner.to_vec() == pattern(len as usize, 22),
        "written by the peer"
    );
    // The read-only view's own MR refuses the peer's write.
    assert!(
        peer.write_to(&from_peer, &read_only.remote())
            .await
            .is_err()
    );
    assert_eq!(peer.digest(&from_peer).await, digest(&from_peer.original()));
    // The shared MR goes with the last region using it.
    drop((inner, read_only));
    let start = std::time::Instant::now();
    while mrs() != 0 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{} MRs left",
            mrs()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
