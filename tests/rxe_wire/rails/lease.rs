//! Queue pairs leased to code that posts itself, in the two-rail VMs: a
//! thread posting through them beside ferry's own traffic, a lease dropped
//! with work in flight, and one whose peer is killed.

use std::time::{Duration, Instant};

use ferry::prelude::*;

use super::{STEP_SHORT, mgmt_node, mgmt_peer, require_two_rails};
use crate::common::{digest, pattern};
use crate::ops;

/// `len` bytes of `src` written to `dst` through `lease`'s queue pairs in
/// 64 KiB RDMA WRITEs, alternating between the pairs, each signaled; waits
/// for every completion and returns how many failed. Runs on its own
/// thread, with plain verbs calls, as a proxy thread would.
fn write_through_lease(
    lease: &ferry::ibverbs::IbvLease,
    keys: &ferry::ibverbs::IbvRegionKeys,
    src: &Region,
    dst: &RemoteBuffer,
    len: u64,
) -> usize {
    use ferry::ibverbs::sys;
    let piece = 64u64 << 10;
    let rkeys = dst.transports().ibverbs.expect("an ibverbs handle").rkeys;
    let pairs = lease.pairs();
    let mut outstanding = vec![0u32; pairs.len()];
    let mut failed = 0;
    let poll = |i: usize, outstanding: &mut [u32], failed: &mut usize| {
        let mut wc: [sys::ibv_wc; 8] = unsafe { std::mem::zeroed() };
        // SAFETY: the CQ is the lease's, alive while `lease` is; `wc` has
        // room for 8 entries.
        let n = unsafe { sys::ibv_poll_cq(pairs[i].cq(), 8, wc.as_mut_ptr()) };
        assert!(n >= 0, "ibv_poll_cq");
        for wc in &wc[..n as usize] {
            outstanding[i] -= 1;
            if wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS {
                *failed += 1;
            }
        }
    };
    for (k, at) in (0..len).step_by(piece as usize).enumerate() {
        let i = k % pairs.len();
        let pair = &pairs[i];
        while outstanding[i] >= pair.depth {
            poll(i, &mut outstanding, &mut failed);
        }
        let mut sge = sys::ibv_sge {
            addr: src.memory().addr() + at,
            length: piece.min(len - at) as u32,
            lkey: keys.lkeys.get(usize::from(pair.rail)).unwrap(),
        };
        // SAFETY: plain data; the QP is the lease's and alive; the source
        // memory stays registered (`src` lives) until every completion
        // below has been polled.
        unsafe {
            let mut wr: sys::ibv_send_wr = std::mem::zeroed();
            wr.wr_id = k as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr.rdma = sys::rdma_t {
                remote_addr: dst.addr() + at,
                rkey: rkeys.get(usize::from(pair.remote_rail)).unwrap(),
            };
            let mut bad = std::ptr::null_mut();
            assert_eq!(
                sys::ibv_post_send(pair.qp(), &mut wr, &mut bad),
                0,
                "ibv_post_send"
            );
        }
        outstanding[i] += 1;
    }
    let until = Instant::now() + STEP_SHORT;
    while outstanding.iter().any(|&n| n > 0) {
        assert!(Instant::now() < until, "leased writes never completed");
        for i in 0..pairs.len() {
            poll(i, &mut outstanding, &mut failed);
        }
    }
    failed
}

/// Shares a lease with the thread that posts through it.
struct SendLease<'a>(&'a ferry::ibverbs::IbvLease);
// SAFETY: the lease's raw handles are thread-safe verbs objects; the
// thread is joined before the lease is dropped.
unsafe impl Send for SendLease<'_> {}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs two VMs with two rails: run by tests/rxe/wire-tests.sh --rails 2"]
async fn a_lease_posts_beside_ferry_and_breaks_when_the_peer_dies() {
    require_two_rails();
    let node = mgmt_node().await;
    let mut peer = mgmt_peer().await;
    let addr = peer.process.node_addr().await.unwrap();
    let len = 8u64 << 20;
    let leased_target = peer.process.alloc(len as usize, Access::ReadWrite, 1).await;
    let ferry_target = peer.process.alloc(len as usize, Access::ReadWrite, 2).await;
    let (leased_data, ferry_data) = (pattern(len as usize, 21), pattern(len as usize, 22));
    let leased_src = node.alloc(len, Access::ReadWrite).await.unwrap();
    leased_src.write_at(0, &leased_data).unwrap();
    let ferry_src = node.alloc(len, Access::ReadWrite).await.unwrap();
    ferry_src.write_at(0, &ferry_data).unwrap();
    let ibverbs = node.ibverbs().unwrap();
    let lease = ibverbs.lease(addr, None, 64, STEP_SHORT).await.unwrap();
    assert_eq!(
        lease
            .pairs()
            .iter()
            .map(|p| (p.rail, p.remote_rail))
            .collect::<Vec<_>>(),
        [(0, 0), (1, 1)]
    );
    let info = ibverbs.transport_info().await.unwrap();
    let keys = *info
        .regions
        .iter()
        .find(|k| (k.id, k.generation) == (leased_src.id(), leased_src.generation()))
        .unwrap();
    // A thread posts through the lease while ferry writes the other region
    // to the same peer: both land.
    let shared = SendLease(&lease);
    let (leased, ferry_write) = std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            let lease = shared;
            write_through_lease(lease.0, &keys, &leased_src, &leased_target.handle, len)
        });
        let ferry_write = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(node.submit(
                ops(&ferry_src, &ferry_target.handle, 1 << 20, true),
                STEP_SHORT,
            ))
        });
        (thread.join().unwrap(), ferry_write)
    });
    assert_eq!(leased, 0, "leased writes failed");
    ferry_write.unwrap();
    assert_eq!(
        peer.process.digest(&leased_target).await,
        digest(&leased_data)
    );
    assert_eq!(
        peer.process.digest(&ferry_target).await,
        digest(&ferry_data)
    );
    // Dropped with work in flight: 32 writes posted, none waited for.
    {
        let pair = &lease.pairs()[0];
        for k in 0..32u64 {
            use ferry::ibverbs::sys;
            let mut sge = sys::ibv_sge {
                addr: leased_src.memory().addr() + k * 4096,
                length: 4096,
                lkey: keys.lkeys.get(0).unwrap(),
            };
            let rkeys = leased_target.handle.transports().ibverbs.unwrap().rkeys;
            // SAFETY: as in `write_through_lease`; the lease's drop drains
            // the queue pair before `leased_src` goes.
            unsafe {
                let mut wr: sys::ibv_send_wr = std::mem::zeroed();
                wr.wr_id = k;
                wr.sg_list = &mut sge;
                wr.num_sge = 1;
                wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
                wr.wr.rdma = sys::rdma_t {
                    remote_addr: leased_target.handle.addr() + k * 4096,
                    rkey: rkeys.get(0).unwrap(),
                };
                let mut bad = std::ptr::null_mut();
                assert_eq!(sys::ibv_post_send(pair.qp(), &mut wr, &mut bad), 0);
            }
        }
    }
    drop(lease);
    // Ferry's own traffic is untouched, and a new lease works.
    node.submit(
        ops(&ferry_src, &ferry_target.handle, 1 << 20, true),
        STEP_SHORT,
    )
    .await
    .unwrap();
    let lease = ibverbs
        .lease(addr, Some(&[1]), 16, STEP_SHORT)
        .await
        .unwrap();
    assert_eq!(lease.pairs().len(), 1);
    assert_eq!(lease.pairs()[0].rail, 1);
    // The peer killed under a lease: marked broken within the bound a
    // killed peer's host reports it (its kernel resets the session).
    peer.kill_9();
    let killed = Instant::now();
    while !lease.is_broken() {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the lease outlived its peer"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "lease broken {:.2} s after kill -9 of its peer",
        killed.elapsed().as_secs_f64()
    );
}
