//! The node's actor over RDMA: which transport worker actors' submits take,
//! what `Transports` and `require` say, and what a timed-out submit still
//! moves.

use std::time::Duration;

use ferry::RdmaTransportLevel;
use ferry::prelude::*;

use crate::common::{PeerProcess, digest};
use crate::{DEADLINE, counters, rdma_node, workers};

/// Worker actors holding only the node's actor get RDMA where both ends
/// have a NIC, and TCP to a peer without one: the node's per-transport
/// counters show which transport every op took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn sixteen_worker_actors_go_over_ibverbs_and_over_tcp_to_a_peer_without_it() {
    // Before the node spawns: it registers its counters then.
    counters::install();
    let node = rdma_node().await;
    let slice = 256 * 1024 + 5;
    // 16 workers, one write and one read each.
    let ops = 32;
    for (peer_env, transport) in [
        (&[][..], "ibverbs"),
        (&[(ferry::DISABLE_IBVERBS_ENV, "1")][..], "tcp"),
    ] {
        let mut peer = PeerProcess::spawn_with_env(peer_env).await;
        let target = peer.alloc(16 * slice, Access::ReadWrite, 3).await;
        let before = (counters::ops("ibverbs"), counters::ops("tcp"));
        let expected =
            workers::worker_round_trips(&node, &target.handle, target.original(), 16).await;
        assert_eq!(peer.digest(&target).await, digest(&expected));
        let moved = (
            counters::ops("ibverbs") - before.0,
            counters::ops("tcp") - before.1,
        );
        let want = if transport == "ibverbs" {
            (ops, 0)
        } else {
            (0, ops)
        };
        assert_eq!(
            moved, want,
            "(ibverbs, tcp) ops to a peer that runs {transport}"
        );
    }
}

/// The node's actor answers other messages while an RDMA transfer it took
/// runs: the transfer goes on in a task once the first poll is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn the_node_actor_answers_while_an_rdma_transfer_runs() {
    let node = rdma_node().await;
    let mut peer = PeerProcess::spawn().await;
    let len = 16 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 4).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    // 64 MiB: seconds on soft-RoCE under emulation.
    workers::the_actor_answers_while_a_transfer_runs(&node, &src, &target.handle, 4).await;
}

/// A submit that times out stops moving bytes: its queue pair is failed at
/// once, so work not yet on the wire never gets there. Measured in the
/// owner's memory, not in time: what landed by the timeout, and what landed
/// in the seconds after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_timed_out_rdma_submit_stops_moving_bytes() {
    let initiator = rdma_node().await;
    let owner = rdma_node().await;
    let len: u64 = 64 << 20;
    let target = owner.alloc(len, Access::ReadWrite).await.unwrap();
    let src = initiator.alloc(len, Access::ReadWrite).await.unwrap();
    // No zero byte in the source: a landed byte is a non-zero byte.
    src.write_at(0, &vec![0xA5; len as usize]).unwrap();
    let landed = || target.to_vec().iter().filter(|&&b| b != 0).count() as u64;
    let block: u64 = 1 << 20;
    let ops: Vec<_> = (0..len / block)
        .map(|i| {
            let range = i * block..(i + 1) * block;
            RdmaOp::write(
                src.slice(range.clone()).unwrap(),
                target.remote().slice(range).unwrap(),
            )
        })
        .collect();
    // Soft-RoCE under emulation moves a few tens of MiB/s: far from all
    // 64 MiB within the deadline.
    let result = initiator.submit(ops, Duration::from_millis(300)).await;
    assert!(
        matches!(result, Err(SubmitError::Timeout { total: 64, .. })),
        "got {result:?}"
    );
    let at_timeout = landed();
    // More than the rest would need at the link's speed, had it gone on.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = landed();
    println!(
        "landed by the timeout: {at_timeout} B; after it: {} B",
        after - at_timeout
    );
    assert!(at_timeout < len, "everything landed before the deadline");
    // At most what was on the wire: a work request's packets in flight.
    assert!(
        after - at_timeout <= block,
        "{} bytes landed after the timeout",
        after - at_timeout
    );
    // And the node goes on working, on a fresh queue pair.
    let back = initiator.alloc(4096, Access::ReadWrite).await.unwrap();
    initiator
        .submit(
            vec![RdmaOp::read(
                back.whole(),
                target.remote().slice(0..4096).unwrap(),
            )],
            DEADLINE,
        )
        .await
        .unwrap();
    let mut expect = vec![0u8; 4096];
    target.read_at(0, &mut expect).unwrap();
    assert_eq!(back.to_vec(), expect);
}

/// Without a device (this host) the node starts on TCP and says why; its
/// actor's `Transports` answer lists TCP running and ibverbs with the reason,
/// and a builder that requires the NIC fails with that reason. With a device
/// (the VM), ibverbs runs and may be required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transports_and_require_say_what_runs_and_why() {
    use ferry::{NodeError, TransportState, Transports};
    // With the same-host transport on, it is the node's fastest level.
    let shared = Node::builder().spawn().await.unwrap();
    assert!(
        shared.transports()[0].is_running(),
        "{:?}",
        shared.transports()
    );
    assert_eq!(shared.transport_level(), RdmaTransportLevel::Memory);
    let node = Node::builder().memory(false).spawn().await.unwrap();
    let transports = node.actor().ask(Transports).await.unwrap();
    assert_eq!(transports, node.transports());
    let levels: Vec<_> = transports.iter().map(|t| t.level).collect();
    assert_eq!(
        levels,
        [
            RdmaTransportLevel::Memory,
            RdmaTransportLevel::Nic,
            RdmaTransportLevel::Tcp
        ],
        "fastest first"
    );
    assert!(transports[2].is_running(), "TCP always runs");
    assert!(
        matches!(&transports[0].state, TransportState::Unavailable { reason } if reason == "disabled by the node builder")
    );
    let required = Node::builder()
        .memory(false)
        .require(RdmaTransportLevel::Nic)
        .spawn()
        .await;
    match node.unavailable(RdmaTransportLevel::Nic) {
        Some(reason) => {
            println!("ibverbs unavailable: {reason}");
            assert!(node.ibverbs().is_none());
            assert_eq!(node.transport_level(), RdmaTransportLevel::Tcp);
            assert!(
                matches!(&transports[1].state, TransportState::Unavailable { reason: r } if r == reason)
            );
            match required {
                Err(e @ NodeError::TransportUnavailable { .. }) => {
                    let text = e.to_string();
                    assert!(
                        text.starts_with("ibverbs required but unavailable: ")
                            && text.contains(reason),
                        "{text}"
                    );
                }
                Err(e) => panic!("expected TransportUnavailable, got {e}"),
                Ok(_) => panic!("require(Nic) spawned a node without ibverbs"),
            }
        }
        None => {
            assert_eq!(node.transport_level(), RdmaTransportLevel::Nic);
            assert!(required.is_ok(), "the NIC runs, so it may be required");
        }
    }
    assert!(
        Node::builder()
            .require(RdmaTransportLevel::Tcp)
            .spawn()
            .await
            .is_ok(),
        "TCP can always be required"
    );
    assert!(
        Node::builder()
            .require(RdmaTransportLevel::Memory)
            .spawn()
            .await
            .is_ok(),
        "the memory transport runs wherever /proc and memfd do"
    );
    assert!(matches!(
        Node::builder()
            .memory(false)
            .require(RdmaTransportLevel::Memory)
            .spawn()
            .await,
        Err(NodeError::TransportUnavailable {
            transport: RdmaTransportLevel::Memory,
            ..
        })
    ));
    let disabled = Node::builder().ibverbs(false).spawn().await.unwrap();
    assert_eq!(
        disabled.unavailable(RdmaTransportLevel::Nic),
        Some("disabled by the node builder")
    );
    assert!(matches!(
        Node::builder()
            .ibverbs(false)
            .require(RdmaTransportLevel::Nic)
            .spawn()
            .await,
        Err(NodeError::TransportUnavailable { reason, .. }) if reason == "disabled by the node builder"
    ));
}
