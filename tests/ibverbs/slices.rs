//! Over RDMA a slice is no boundary, as `docs/security.md` says: a handle
//! carries the region's rkey, which the NIC checks against the whole
//! registration, so a slice handed over and widened in its JSON reaches
//! the rest of the region, and a read-only slice of a read-write region
//! edited back writes. This test pins that statement: when memory windows
//! bound to a slice's range make it a boundary here too, it fails, and
//! the docs change with it. TCP and the same-host transport do refuse
//! such handles (`tests/tcp/slices.rs`, `tests/memory/slices.rs`).

use ferry::RdmaTransportLevel;
use ferry::prelude::*;

use crate::common::{PeerProcess, digest, forge, pattern};
use crate::{DEADLINE, rdma_node};

/// `handle` as another process receives it: through its serialized form.
fn handed_over(handle: &RemoteBuffer) -> RemoteBuffer {
    serde_json::from_str(&serde_json::to_string(handle).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn over_rdma_a_slice_is_not_a_boundary_as_documented() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let len = 64 * 1024;
    let target = peer.alloc(len, Access::ReadWrite, 3).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 0xEE)).unwrap();

    let slice = handed_over(&target.handle.slice(4096..8192).unwrap());
    assert!(!slice.scopes().is_empty(), "TCP credentials narrowed");
    assert_eq!(
        slice.transports().ibverbs,
        target.handle.transports().ibverbs,
        "the region's rkeys"
    );
    let widened = forge(&slice, |j| {
        j["addr"] = target.handle.addr().into();
        j["len"] = (len as u64).into();
    });
    let write = RdmaOp::write(src.whole(), widened);
    assert_eq!(node.route(&write), Some(RdmaTransportLevel::Nic));
    node.submit(vec![write], DEADLINE).await.unwrap();
    assert_eq!(
        peer.digest(&target).await,
        digest(&pattern(len, 0xEE)),
        "the whole region written through a widened slice"
    );

    let read_only = handed_over(&target.handle.slice(0..4096).unwrap().read_only());
    let upgraded = forge(&read_only, |j| j["access"] = "ReadWrite".into());
    src.write_at(0, &[0x11; 4096]).unwrap();
    let write = RdmaOp::write(src.slice(0..4096).unwrap(), upgraded);
    node.submit(vec![write], DEADLINE).await.unwrap();
    let mut expected = pattern(len, 0xEE);
    expected[..4096].fill(0x11);
    assert_eq!(
        peer.digest(&target).await,
        digest(&expected),
        "a read-only slice edited back wrote"
    );
}
