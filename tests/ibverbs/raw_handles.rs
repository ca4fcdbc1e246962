//! The raw verbs handles `transport_info()` hands a GPU kernel or a
//! program of its own, used with plain verbs calls beside ferry.

use std::time::{Duration, Instant};

use ferry::ibverbs;
use ferry::prelude::*;

use crate::common::{PeerProcess, digest, pattern};
use crate::{DEADLINE, rdma_node};

/// The raw handles from `transport_info()` are real: a WRITE posted on the
/// QP through them, with plain verbs calls, lands in the peer's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_write_posted_through_the_raw_handles_lands() {
    use ferry::ibverbs::sys;
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let len = 8192;
    let target = peer.alloc(len, Access::ReadWrite, 8).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 0x42)).unwrap();
    // Queue pairs connect on first use: one small ferry op creates it.
    let probe = node.alloc(1, Access::ReadWrite).await.unwrap();
    let read_one_byte = || {
        let op = RdmaOp::read(probe.whole(), target.handle.slice(0..1).unwrap());
        node.submit(vec![op], DEADLINE)
    };
    read_one_byte().await.unwrap();

    let info = node
        .ibverbs()
        .unwrap()
        .transport_info()
        .await
        .expect("backend running");
    let rail = &info.rails[0];
    assert!(!rail.context().is_null() && !rail.pd().is_null());
    let qp = info
        .qps
        .iter()
        .find(|q| q.peer == target.handle.owner())
        .expect("a QP to the peer");
    let keys = info
        .regions
        .iter()
        .find(|k| (k.id, k.generation) == (src.id(), src.generation()))
        .expect("src is registered");
    let rkeys = target.handle.transports().ibverbs.unwrap().rkeys;
    let rkey = rkeys
        .get(usize::from(qp.remote_rail))
        .expect("a key per rail");
    // SAFETY: the QP, PD and context stay alive while `info` does; `src`
    // stays registered until after the write is seen to have landed; the
    // wr_id carries the foreign bit, as the info's docs require.
    unsafe {
        let mut sge = sys::ibv_sge {
            addr: src.memory().addr(),
            length: len as u32,
            lkey: keys
                .lkeys
                .get(usize::from(qp.rail))
                .expect("a key per rail"),
        };
        let mut wr: sys::ibv_send_wr = std::mem::zeroed();
        wr.wr_id = ibverbs::FOREIGN_WR_ID_BIT | 1;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = sys::rdma_t {
            remote_addr: target.handle.addr(),
            rkey,
        };
        let mut bad = std::ptr::null_mut();
        assert_eq!(
            sys::ibv_post_send(qp.qp(), &mut wr, &mut bad),
            0,
            "ibv_post_send"
        );
    }
    let started = Instant::now();
    while peer.digest(&target).await != digest(&pattern(len, 0x42)) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the raw WRITE never landed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(info);
    // ferry's own traffic on that QP is undisturbed by the foreign completion.
    read_one_byte().await.unwrap();
}
