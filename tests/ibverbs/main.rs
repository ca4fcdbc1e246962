//! Two ferry nodes in separate processes over a real RDMA device.
//!
//! These need an RDMA device, so they are `#[ignore]`d with that reason on a
//! normal host. The soft-RoCE harness (`tests/rxe/run.sh`) runs them inside a
//! VM with `--include-ignored`, where they must pass.

#[path = "../tcp/common.rs"]
mod common;
mod counters;
#[path = "../shared/descs.rs"]
mod descs;
mod flood;
mod node_actor;
#[path = "../shared/notified_batches.rs"]
mod notified_batches;
mod notify;
mod plans;
mod raw_handles;
mod registrations;
mod shutdown;
mod slices;
mod slots;
#[path = "../shared/workers.rs"]
mod workers;
#[path = "../shared/xfers.rs"]
mod xfers;

use std::time::{Duration, Instant};

use common::{PeerProcess, digest, forge, pattern, reads_back, submit_until_it_fails};
use ferry::prelude::*;
use ferry::{RdmaTransportLevel, ibverbs};

const DEADLINE: Duration = Duration::from_secs(120);
const NEEDS_DEVICE: &str = "needs an RDMA device: run by tests/rxe/run.sh";

/// Entry point of the peer process; does nothing in a normal test run.
#[test]
fn ferry_peer() {
    if std::env::var_os(common::PEER_ENV).is_some() {
        common::peer_main();
    }
}

/// The handle with a wrong rkey on every rail: the NIC must refuse it.
fn with_wrong_rkey(handle: &RemoteBuffer) -> RemoteBuffer {
    forge(handle, |j| {
        for rkey in j["transports"]["ibverbs"]["rkeys"].as_array_mut().unwrap() {
            *rkey = (rkey.as_u64().unwrap() ^ 0x5a5a).into();
        }
    })
}

async fn rdma_node() -> Node {
    rdma_node_with(ibverbs::IbvConfig::default()).await
}

/// A node whose region bytes only ibverbs carries (no same-host memory, no
/// TCP); fails unless it has a device.
async fn rdma_only() -> Node {
    let node = Node::builder()
        .memory(false)
        .tcp(false)
        .spawn()
        .await
        .unwrap();
    assert!(node.ibverbs().is_some(), "{NEEDS_DEVICE}");
    node
}

/// A node whose ibverbs transport runs with `config`; fails unless it has one.
async fn rdma_node_with(config: ibverbs::IbvConfig) -> Node {
    let node = Node::builder()
        .memory(false)
        .ibverbs_config(config)
        .spawn()
        .await
        .unwrap();
    assert!(
        node.ibverbs().is_some(),
        "{NEEDS_DEVICE}; here: {}",
        node.unavailable(RdmaTransportLevel::Nic).unwrap_or("?")
    );
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn write_then_read_back_over_rdma_1_byte_to_64_mib() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    for (i, len) in [1usize, 4096, (1 << 20) + 3, 64 << 20]
        .into_iter()
        .enumerate()
    {
        let nic = Some(RdmaTransportLevel::Nic);
        common::write_then_read_back(&node, &mut peer, len, i as u8, nic).await;
    }
}

/// 4096 ops in one submit: more than the send queue holds, so posting has to
/// stream through its credits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn batches_up_to_4096_mixed_ops_stream_through_the_send_queue() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    for (round, batch) in [1usize, 7, 1024, 4096].into_iter().enumerate() {
        let sizes: Vec<usize> = (0..batch).map(|i| [1, 64, 4096, 3000][i % 4]).collect();
        common::mixed_batch_round_trip(&node, &mut peer, &sizes, round as u8).await;
    }
}

/// Ops bigger than one work request may carry are split, and the pieces of
/// one op stream through a send queue much smaller than their number: 4 KiB
/// pieces, 16 credits, a 1 MiB + 3 op (257 pieces) and a 700-op batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn ops_larger_than_a_work_request_are_split_and_stream_through_few_credits() {
    let config = ibverbs::IbvConfig {
        max_wr_bytes: Some(4096),
        max_send_wr: 16,
        ..Default::default()
    };
    let node = rdma_node_with(config).await;
    let mut peer = PeerProcess::spawn().await;
    let nic = Some(RdmaTransportLevel::Nic);
    for (i, len) in [4096usize, 4097, (1 << 20) + 3].into_iter().enumerate() {
        common::write_then_read_back(&node, &mut peer, len, i as u8, nic).await;
    }
    let sizes: Vec<usize> = (0..700).map(|i| [1, 5000, 4096, 12289][i % 4]).collect();
    common::mixed_batch_round_trip(&node, &mut peer, &sizes, 9).await;
}

/// One batch to an RDMA peer and a TCP-only peer: each op takes its own
/// transport, both shares run, every byte lands, and a failure in either
/// share is reported by its index in the whole batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn one_batch_over_both_transports_reports_errors_by_batch_index() {
    let node = rdma_node().await;
    let mut nic_peer = PeerProcess::spawn().await;
    let mut tcp_peer = PeerProcess::spawn_with_env(&[(ferry::DISABLE_IBVERBS_ENV, "1")]).await;
    let len = 64 << 10;
    let on_nic = nic_peer.alloc(len, Access::ReadWrite, 1).await;
    let on_tcp = tcp_peer.alloc(len, Access::ReadWrite, 2).await;
    let src = node
        .alloc((4 * len) as u64, Access::ReadWrite)
        .await
        .unwrap();
    src.write_at(0, &pattern(4 * len, 3)).unwrap();
    let slice = |i: usize| src.slice((i * len) as u64..((i + 1) * len) as u64).unwrap();

    // Interleaved, so that each share's indices differ from the batch's.
    let ops = vec![
        RdmaOp::write(slice(0), on_tcp.handle.clone()),
        RdmaOp::write(slice(1), on_nic.handle.clone()),
    ];
    let routes: Vec<_> = ops.iter().map(|op| node.route(op)).collect();
    assert_eq!(
        routes,
        [Some(RdmaTransportLevel::Tcp), Some(RdmaTransportLevel::Nic)]
    );
    node.submit(ops, DEADLINE).await.unwrap();
    let sent = pattern(4 * len, 3);
    assert_eq!(tcp_peer.digest(&on_tcp).await, digest(&sent[..len]));
    assert_eq!(nic_peer.digest(&on_nic).await, digest(&sent[len..2 * len]));

    // A wrong rkey (the NIC share's op 1 is the batch's op 3), then a wrong
    // token (the TCP share's op 1 is the batch's op 2): each is named by
    // its batch index, and nothing else in the batch is left undone.
    let bad_rkey = with_wrong_rkey(&on_nic.handle);
    let bad_token = common::with_wrong_token(&on_tcp.handle);
    let batch = |nic_target: RemoteBuffer, tcp_target: RemoteBuffer| {
        vec![
            RdmaOp::read(slice(2), on_tcp.handle.clone()),
            RdmaOp::read(slice(3), on_nic.handle.clone()),
            RdmaOp::write(slice(0), tcp_target),
            RdmaOp::write(slice(1), nic_target),
        ]
    };
    for (ops, index) in [
        (batch(bad_rkey, on_tcp.handle.clone()), 3),
        (batch(on_nic.handle.clone(), bad_token), 2),
    ] {
        src.write_at((2 * len) as u64, &vec![0; 2 * len]).unwrap();
        match node.submit(ops, DEADLINE).await {
            Err(SubmitError::Op {
                index: i,
                error: OpError::AccessDenied,
            }) if i == index => {}
            other => panic!("expected op {index} AccessDenied, got {other:?}"),
        }
        // The reads in the same batch completed on both transports, and the
        // refused write changed nothing.
        let mut got = vec![0; 2 * len];
        src.read_at((2 * len) as u64, &mut got).unwrap();
        assert_eq!(digest(&got[..len]), digest(&sent[..len]));
        assert_eq!(digest(&got[len..]), digest(&sent[len..2 * len]));
        assert_eq!(tcp_peer.digest(&on_tcp).await, digest(&sent[..len]));
        assert_eq!(nic_peer.digest(&on_nic).await, digest(&sent[len..2 * len]));
    }
}

/// An explicit GID index is used as given; one the port does not have stops
/// the ibverbs backend from starting, and the node runs on TCP saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn an_explicit_gid_index_is_used_and_a_bad_one_is_reported() {
    let index: u32 = std::env::var("FERRY_RXE_GID_INDEX")
        .expect("the rxe VM exports FERRY_RXE_GID_INDEX")
        .parse()
        .unwrap();
    let config = |gid_index| ibverbs::IbvConfig {
        gid_index: Some(gid_index),
        ..Default::default()
    };
    let node = Node::builder()
        .memory(false)
        .ibverbs_config(config(index))
        .spawn()
        .await
        .unwrap();
    let info = node
        .transport_info()
        .await
        .unwrap()
        .ibverbs
        .expect(NEEDS_DEVICE);
    assert_eq!(info.rails[0].gid_index, index);
    let mut peer = PeerProcess::spawn().await;
    let nic = Some(RdmaTransportLevel::Nic);
    common::write_then_read_back(&node, &mut peer, 4096, 1, nic).await;

    // Past the table, and an unused entry of it.
    let ctx = ibverbs::verbs::Context::open(None).unwrap();
    let empty = (0..ctx.port(1).unwrap().gid_table_len)
        .find(|&i| ctx.gid(1, i).is_ok_and(|gid| gid == [0; 16]))
        .expect("rxe's GID table has unused entries");
    for (gid_index, why) in [(4000, "ibv_query_gid"), (empty, "is empty")] {
        let bad = Node::builder()
            .memory(false)
            .ibverbs_config(config(gid_index))
            .spawn()
            .await
            .unwrap();
        assert!(bad.ibverbs().is_none());
        let reason = bad.unavailable(RdmaTransportLevel::Nic).unwrap();
        assert!(reason.contains(why), "GID index {gid_index}: {reason}");
        assert_eq!(bad.transport_level(), RdmaTransportLevel::Tcp);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn concurrent_submits_to_the_manager_actor() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let slice = 256 * 1024 + 5;
    let workers = 8;
    let target = peer.alloc(workers * slice, Access::ReadWrite, 3).await;
    let manager = node.ibverbs().unwrap().actor().clone();
    let mut expected = target.original();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let range = w * slice..(w + 1) * slice;
        expected[range.clone()].copy_from_slice(&pattern(slice, w as u8));
        let remote = target
            .handle
            .slice(range.start as u64..range.end as u64)
            .unwrap();
        let (node, manager) = (node.clone(), manager.clone());
        tasks.push(tokio::spawn(async move {
            let src = node.alloc(slice as u64, Access::ReadWrite).await.unwrap();
            src.write_at(0, &pattern(slice, w as u8)).unwrap();
            let back = node.alloc(slice as u64, Access::ReadWrite).await.unwrap();
            let submit = |ops| ibverbs::Submit {
                ops,
                timeout: DEADLINE,
            };
            manager
                .ask(submit(vec![RdmaOp::write(src.whole(), remote.clone())]))
                .await?;
            manager
                .ask(submit(vec![RdmaOp::read(back.whole(), remote)]))
                .await?;
            Ok::<_, SubmitError>(back.to_vec())
        }));
    }
    for (w, task) in tasks.into_iter().enumerate() {
        let back = task
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("worker {w}: {e}"));
        assert!(back == pattern(slice, w as u8), "worker {w}");
    }
    assert_eq!(peer.digest(&target).await, digest(&expected));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn the_nic_refuses_bad_keys_out_of_bounds_and_read_only_writes_then_a_new_qp_works() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let len = 64 * 1024;
    let rw = peer.alloc(len, Access::ReadWrite, 1).await;
    let ro = peer.alloc(len, Access::ReadOnly, 2).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(len, 0xEE)).unwrap();

    // Wrong rkey, as the second op of a batch: the error names it.
    let bad_key = with_wrong_rkey(&rw.handle);
    let scratch = node.alloc(16, Access::ReadWrite).await.unwrap();
    let ops = vec![
        RdmaOp::read(scratch.whole(), rw.handle.slice(0..16).unwrap()),
        RdmaOp::write(src.whole(), bad_key),
    ];
    match node.submit(ops, DEADLINE).await {
        Err(SubmitError::Op {
            index: 1,
            error: OpError::AccessDenied,
        }) => {}
        other => panic!("expected op 1 AccessDenied, got {other:?}"),
    }
    assert_eq!(peer.digest(&rw).await, digest(&rw.original()));

    // A read-only handle upgraded on the wire: refused by the NIC itself.
    let upgraded = forge(&ro.handle, |j| j["access"] = "ReadWrite".into());
    match node
        .submit(vec![RdmaOp::write(src.whole(), upgraded)], DEADLINE)
        .await
    {
        Err(SubmitError::Op {
            index: 0,
            error: OpError::AccessDenied,
        }) => {}
        other => panic!("expected AccessDenied from the NIC, got {other:?}"),
    }
    assert_eq!(peer.digest(&ro).await, digest(&ro.original()));

    // Out of bounds: a slice past the handle fails before anything is posted,
    // and a handle widened on the wire is refused by the NIC (the MR's bounds).
    assert!(matches!(
        rw.handle.slice(0..len as u64 + 1),
        Err(OpError::OutOfBounds { .. })
    ));
    let widened = forge(&rw.handle, |j| j["len"] = (len as u64 + 4096).into());
    let big = node
        .alloc(len as u64 + 4096, Access::ReadWrite)
        .await
        .unwrap();
    match node
        .submit(vec![RdmaOp::write(big.whole(), widened)], DEADLINE)
        .await
    {
        Err(SubmitError::Op {
            index: 0,
            error: OpError::AccessDenied,
        }) => {}
        other => panic!("expected the NIC to refuse an out-of-bounds write, got {other:?}"),
    }
    assert_eq!(
        peer.digest(&rw).await,
        digest(&rw.original()),
        "out-of-bounds write changed bytes"
    );

    // The failed QP was replaced: a good write goes through.
    node.submit(
        vec![RdmaOp::write(src.whole(), rw.handle.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    assert_eq!(peer.digest(&rw).await, digest(&pattern(len, 0xEE)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn peer_killed_mid_transfer_fails_before_the_deadline_and_a_restarted_peer_works() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let len = 16 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 4).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    // Far more than soft-RoCE under emulation moves in the time before the
    // kill; and should a batch finish before it, the next one is posted.
    let ops: Vec<_> = (0..256)
        .map(|_| RdmaOp::read(local.whole(), target.handle.clone()))
        .collect();
    let started = Instant::now();
    let transfer = tokio::spawn({
        let node = node.clone();
        async move {
            submit_until_it_fails(&node, &ops, DEADLINE, started + DEADLINE)
                .await
                .0
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // SIGKILL, then the wait for the exit: the dead process's queue pairs
    // and memory regions are torn down by soft-RoCE, with up to 4 GiB of
    // READs in flight, emulated (TCG) and beside the suite's other tests;
    // its control session closes only then.
    let killed = Instant::now();
    peer.kill().await;
    let exited = Instant::now();
    let result = tokio::time::timeout(2 * DEADLINE, transfer)
        .await
        .expect("no hang")
        .unwrap();
    let failed = Instant::now();
    let timing = format!(
        "the peer took {:?} to exit; the batch failed {:?} after it",
        exited - killed,
        failed.saturating_duration_since(exited)
    );
    // A batch posted after the kill may find the queue pair gone already
    // and fail reaching the peer anew.
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
        took >= Duration::from_millis(500),
        "ended before the kill: {result:?}"
    );
    // Alone in the VM the peer exits within 50 ms and the batch fails
    // within 20 ms of that; ferry's part (from the exit on) is bounded
    // far below the deadline, the emulator's only by the deadline.
    assert!(
        failed.saturating_duration_since(exited) < DEADLINE / 4 && took < DEADLINE,
        "took {took:?}: {timing}"
    );

    let mut peer = PeerProcess::spawn().await;
    let target = peer.alloc(4096, Access::ReadWrite, 5).await;
    let back = node.alloc(4096, Access::ReadWrite).await.unwrap();
    reads_back(&node, &back, &target, DEADLINE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_node_with_ibverbs_disabled_talks_over_tcp() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn_with_env(&[(ferry::DISABLE_IBVERBS_ENV, "1")]).await;
    let target = peer.alloc(1 << 20, Access::ReadWrite, 6).await;
    assert!(target.handle.transports().ibverbs.is_none());
    let src = node.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(1 << 20, 7)).unwrap();
    let op = RdmaOp::write(src.whole(), target.handle.clone());
    assert_eq!(node.route(&op), Some(RdmaTransportLevel::Tcp));
    node.submit(vec![op], DEADLINE).await.unwrap();
    assert_eq!(peer.digest(&target).await, digest(&pattern(1 << 20, 7)));
}

/// A submit that outlives its deadline returns `Timeout`; its QP is flushed,
/// the memory its requests touched is released only after that, and the next
/// op runs on a fresh QP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_timed_out_submit_flushes_its_qp_and_the_next_op_reconnects() {
    // Whole 16 MiB ops per work request: with 1 MiB ones (the default) the
    // 1 GiB of loopback READs in this one VM ran in soft-RoCE's softirq
    // path with the CPUs to itself, and the 200 ms timer fired only after
    // all of it had moved (51 s): the test would measure the emulator.
    let node = rdma_node_with(ibverbs::IbvConfig {
        max_wr_bytes: None,
        ..Default::default()
    })
    .await;
    let mut peer = PeerProcess::spawn().await;
    let len = 16 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 9).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let key = (local.id(), local.generation());
    // Connected first: the queue-pair exchange alone may take longer than
    // the deadline below on a loaded host, and this test is about the
    // flush of a connected QP.
    let warm = node.alloc(4096, Access::ReadWrite).await.unwrap();
    let first = target.handle.slice(0..4096).unwrap();
    node.submit(vec![RdmaOp::read(warm.whole(), first)], DEADLINE)
        .await
        .unwrap();
    // Much more than soft-RoCE under emulation moves in 200 ms.
    let ops: Vec<_> = (0..64)
        .map(|_| RdmaOp::read(local.whole(), target.handle.clone()))
        .collect();
    let timeout = Duration::from_millis(200);
    let started = Instant::now();
    let result = node.submit(ops, timeout).await;
    assert!(
        matches!(result, Err(SubmitError::Timeout { total: 64, .. })),
        "got {result:?}"
    );
    assert!(
        started.elapsed() < timeout + Duration::from_secs(5),
        "answered late: {:?}",
        started.elapsed()
    );
    drop(local);
    // Released once the flush completions are in, with a deadline.
    let released = Instant::now();
    while node.registered_regions().await.contains(&key) {
        assert!(
            released.elapsed() < Duration::from_secs(30),
            "region never released after the flush"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let back = node.alloc(4096, Access::ReadWrite).await.unwrap();
    node.submit(
        vec![RdmaOp::read(
            back.whole(),
            target.handle.slice(0..4096).unwrap(),
        )],
        DEADLINE,
    )
    .await
    .unwrap();
    assert!(back.to_vec() == target.original()[..4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_request_of_10_000_descriptors_over_rdma_is_verified_byte_for_byte() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    descs::descriptors_round_trip(&node, &mut peer, RdmaTransportLevel::Nic, 10_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_request_over_rdma_lives_posts_again_and_refuses_bad_input() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    xfers::a_request_lives_posts_again_and_refuses_bad_input(
        &node,
        &mut peer,
        RdmaTransportLevel::Nic,
    )
    .await;
}
