//! The same-host memory transport between two processes: copies byte for
//! byte at every size, batches mixed with a TCP-only peer, forged and stale
//! handles refused with typed errors and nothing changed, an owner killed
//! mid-transfer; memory ferry did not allocate going over `process_vm`
//! or, where the kernel refuses, the next transport (`process_vm.rs`); and
//! notified batches, whose notifications ride a lane in shared memory
//! (`notified.rs`); and a node with TCP off (`tcp_off.rs`).

#[path = "../tcp/common.rs"]
mod common;
mod flood;
mod notified;
mod pairs;
mod plans;
mod process_vm;
mod raw_drop;
mod shutdown;
mod slices;
mod tcp_off;
mod weights;
mod xfers;

use std::time::Duration;

use common::{LISTEN_ENV, PeerProcess, digest, forge, pattern, write_then_read_back};
use ferry::prelude::*;
use ferry::{DISABLE_MEMORY_ENV, NotifyError};

const DEADLINE: Duration = Duration::from_secs(30);

/// Entry point of the peer process; does nothing in a normal test run.
#[test]
fn ferry_peer() {
    if std::env::var_os(common::PEER_ENV).is_some() {
        common::peer_main();
    }
}

/// A peer process sharing its regions through memory.
async fn sharing_peer() -> PeerProcess {
    PeerProcess::spawn_with_env(&[(DISABLE_MEMORY_ENV, "0")]).await
}

async fn node() -> Node {
    Node::builder().ibverbs(false).spawn().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_every_size_go_through_shared_memory_byte_for_byte() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let sizes = [1, 8, 4095, 4096, 65537, 1 << 20, 16 << 20, 256 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        let route = Some(RdmaTransportLevel::Memory);
        write_then_read_back(&node, &mut peer, len, i as u8, route).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_mix_a_same_host_peer_and_a_tcp_only_one() {
    let node = node().await;
    let mut shared = sharing_peer().await;
    let mut tcp_only = PeerProcess::spawn().await;
    for batch in [1usize, 2, 7, 64, 1024] {
        let slot = 64;
        let a = shared.alloc(batch * slot, Access::ReadWrite, 1).await;
        let b = tcp_only.alloc(batch * slot, Access::ReadWrite, 2).await;
        let src = node
            .alloc((2 * batch * slot) as u64, Access::ReadWrite)
            .await
            .unwrap();
        let data = pattern(2 * batch * slot, batch as u8);
        src.write_at(0, &data).unwrap();
        let mut ops = Vec::new();
        for i in 0..batch {
            let range = |k: usize| (k * slot) as u64..((k + 1) * slot) as u64;
            ops.push(RdmaOp::write(
                src.slice(range(2 * i)).unwrap(),
                a.handle.slice(range(i)).unwrap(),
            ));
            ops.push(RdmaOp::write(
                src.slice(range(2 * i + 1)).unwrap(),
                b.handle.slice(range(i)).unwrap(),
            ));
        }
        assert_eq!(node.route(&ops[0]), Some(RdmaTransportLevel::Memory));
        assert_eq!(node.route(&ops[1]), Some(RdmaTransportLevel::Tcp));
        node.submit(ops, DEADLINE).await.unwrap();
        let (mut want_a, mut want_b) = (Vec::new(), Vec::new());
        for i in 0..batch {
            want_a.extend_from_slice(&data[2 * i * slot..(2 * i + 1) * slot]);
            want_b.extend_from_slice(&data[(2 * i + 1) * slot..(2 * i + 2) * slot]);
        }
        assert_eq!(
            shared.digest(&a).await,
            digest(&want_a),
            "batch {batch}: same-host bytes"
        );
        assert_eq!(
            tcp_only.digest(&b).await,
            digest(&want_b),
            "batch {batch}: TCP bytes"
        );
        // And back, in one mixed batch of reads.
        let back = node
            .alloc((2 * batch * slot) as u64, Access::ReadWrite)
            .await
            .unwrap();
        let reads = vec![
            RdmaOp::read(
                back.slice(0..(batch * slot) as u64).unwrap(),
                a.handle.clone(),
            ),
            RdmaOp::read(
                back.slice((batch * slot) as u64..(2 * batch * slot) as u64)
                    .unwrap(),
                b.handle.clone(),
            ),
        ];
        node.submit(reads, DEADLINE).await.unwrap();
        assert!(back.to_vec()[..batch * slot] == want_a[..]);
        assert!(back.to_vec()[batch * slot..] == want_b[..]);
    }
}

fn assert_op_error(result: Result<(), SubmitError>, check: impl FnOnce(&OpError) -> bool) {
    match result {
        Err(SubmitError::Op { index: 0, error }) if check(&error) => {}
        other => panic!("expected a typed op error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_stale_handles_are_refused_and_change_nothing() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let len = 64 * 1024;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    local.write_at(0, &pattern(len, 0xEE)).unwrap();
    let write = |remote: RemoteBuffer| vec![RdmaOp::write(local.whole(), remote)];
    let read = |remote: RemoteBuffer| vec![RdmaOp::read(local.whole(), remote)];

    // A read-only region: a handle forged to read-write gets a read-only
    // descriptor from the owner, and the write is refused.
    let ro = peer.alloc(len, Access::ReadOnly, 3).await;
    let forged_rw = forge(&ro.handle, |j| j["access"] = "ReadWrite".into());
    assert_eq!(
        node.route(&write(forged_rw.clone())[0]),
        Some(RdmaTransportLevel::Memory)
    );
    assert_op_error(node.submit(write(forged_rw), DEADLINE).await, |e| {
        *e == OpError::ReadOnly
    });
    // Reading it is fine.
    node.submit(read(ro.handle.clone()), DEADLINE)
        .await
        .unwrap();
    assert!(local.to_vec() == ro.original());
    local.write_at(0, &pattern(len, 0xEE)).unwrap();
    assert_eq!(
        peer.digest(&ro).await,
        digest(&ro.original()),
        "read-only region changed"
    );

    let rw = peer.alloc(len, Access::ReadWrite, 4).await;
    // A wrong token.
    let wrong_token = with_wrong_memory_token(&rw.handle);
    assert_op_error(node.submit(write(wrong_token), DEADLINE).await, |e| {
        *e == OpError::AccessDenied
    });
    // Past the region's end.
    let too_long = forge(&rw.handle, |j| {
        j["addr"] = (rw.handle.addr() + 4096).into();
    });
    assert_op_error(node.submit(write(too_long), DEADLINE).await, |e| {
        matches!(e, OpError::OutOfBounds { .. })
    });
    // A slot that holds nothing: its token was not issued for it, which
    // is all a stranger hears (`slices.rs` probes further).
    let unknown = forge(&rw.handle, |j| j["region"] = 999.into());
    assert_op_error(node.submit(write(unknown), DEADLINE).await, |e| {
        *e == OpError::AccessDenied
    });
    assert_eq!(
        peer.digest(&rw).await,
        digest(&rw.original()),
        "refused ops changed the region"
    );
    assert!(
        local.to_vec() == pattern(len, 0xEE),
        "refused ops changed the local region"
    );

    // Stale: this node has the region mapped (one read), then the owner
    // drops it and registers a new one in the same slot.
    node.submit(read(rw.handle.clone()), DEADLINE)
        .await
        .unwrap();
    local.write_at(0, &pattern(len, 0xEE)).unwrap();
    peer.drop_region(&rw).await;
    peer.drop_region(&ro).await;
    let mut reused = peer.alloc(len, Access::ReadWrite, 5).await;
    let mut tries = 0;
    while reused.handle.region() != rw.handle.region() {
        // The slot of `ro` may come first; the next takes `rw`'s.
        reused = peer.alloc(len, Access::ReadWrite, 5).await;
        tries += 1;
        assert!(tries < 4, "the freed slot was not reused");
    }
    let stale = |e: &OpError| matches!(e, OpError::StaleGeneration { handle, current } if handle == &rw.handle.generation() && current == &reused.handle.generation());
    assert_op_error(node.submit(write(rw.handle.clone()), DEADLINE).await, stale);
    // A node that never mapped it hears the same from the owner.
    let fresh = crate::node().await;
    let src = fresh.alloc(len as u64, Access::ReadWrite).await.unwrap();
    assert_op_error(
        fresh
            .submit(
                vec![RdmaOp::write(src.whole(), rw.handle.clone())],
                DEADLINE,
            )
            .await,
        stale,
    );
    assert_eq!(
        peer.digest(&reused).await,
        digest(&reused.original()),
        "a stale write landed"
    );
    assert!(local.to_vec() == pattern(len, 0xEE));
}

/// `handle` with its same-host token off by one bit.
fn with_wrong_memory_token(handle: &RemoteBuffer) -> RemoteBuffer {
    forge(handle, |j| {
        let token = &mut j["transports"]["memory"]["token"];
        let value = u128::from_str_radix(token.as_str().unwrap(), 16).unwrap();
        *token = format!("{:032x}", value ^ 1).into();
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_token_is_refused_on_a_region_already_mapped_here() {
    // The region is mapped here by a first, honest read; every later op is
    // still checked against its own handle's token: alone, as op 1 of a
    // batch, and in a notified batch (which then notifies nobody).
    let node = node().await;
    let owner = crate::node().await;
    let mut inbox = owner.inbox().unwrap();
    let len = 64 * 1024;
    let target = owner.alloc(len, Access::ReadWrite).await.unwrap();
    target.write_at(0, &pattern(len as usize, 9)).unwrap();
    let handle = target.remote();
    let local = node.alloc(len, Access::ReadWrite).await.unwrap();
    // An honest write maps it here writable.
    local.write_at(0, &pattern(len as usize, 9)).unwrap();
    node.submit(vec![RdmaOp::write(local.whole(), handle.clone())], DEADLINE)
        .await
        .unwrap();
    local.write_at(0, &pattern(len as usize, 0xA5)).unwrap();
    let forged = with_wrong_memory_token(&handle);
    let write = RdmaOp::write(local.whole(), forged.clone());
    let read = RdmaOp::read(local.whole(), forged.clone());
    assert_eq!(node.route(&write), Some(RdmaTransportLevel::Memory));

    for op in [write, read] {
        assert_op_error(node.submit(vec![op], DEADLINE).await, |e| {
            *e == OpError::AccessDenied
        });
    }
    assert!(
        local.to_vec() == pattern(len as usize, 0xA5),
        "a forged read"
    );
    let half = len / 2;
    let honest_read = RdmaOp::read(
        local.slice(0..half).unwrap(),
        handle.slice(0..half).unwrap(),
    );
    let forged_write = RdmaOp::write(
        local.slice(half..len).unwrap(),
        forged.slice(half..len).unwrap(),
    );
    let batch = node
        .submit(vec![honest_read.clone(), forged_write.clone()], DEADLINE)
        .await;
    let denied = SubmitError::Op {
        index: 1,
        error: OpError::AccessDenied,
    };
    assert_eq!(batch, Err(denied.clone()));
    let notified = node
        .submit_with_notification(
            vec![honest_read.clone(), forged_write],
            DEADLINE,
            &b"forged"[..],
        )
        .await;
    assert_eq!(notified, Err(NotifyError::Submit(denied)));
    assert!(
        target.to_vec() == pattern(len as usize, 9),
        "a forged write landed"
    );
    // Notifications from one sender on one path arrive in order: the
    // first the owner hears is the honest batch's, sent after.
    node.submit_with_notification(vec![honest_read], DEADLINE, &b"honest"[..])
        .await
        .unwrap();
    let first = tokio::time::timeout(DEADLINE, inbox.recv())
        .await
        .expect("no notification")
        .expect("inbox closed");
    assert_eq!(&first.body[..], b"honest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_restarted_at_its_address_refuses_old_handles_as_unknown_node_at_once() {
    let node = node().await;
    let listen = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let env = [(DISABLE_MEMORY_ENV, "0"), (LISTEN_ENV, listen.as_str())];
    let mut peer = PeerProcess::spawn_with_env(&env).await;
    let len = 4096;
    let old = peer.alloc(len, Access::ReadWrite, 10).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    // Mapped here: the link to the first incarnation is up.
    node.submit(
        vec![RdmaOp::read(local.whole(), old.handle.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    peer.kill().await;
    let mut again = PeerProcess::spawn_with_env(&env).await;
    let new = again.alloc(len, Access::ReadWrite, 11).await;
    assert_eq!(new.handle.owner().endpoint, old.handle.owner().endpoint);
    // The first op after the restart, and every one after it: the same
    // typed error, whose text says what happened.
    for _ in 0..3 {
        let result = node
            .submit(
                vec![RdmaOp::write(local.whole(), old.handle.clone())],
                DEADLINE,
            )
            .await;
        match result {
            Err(SubmitError::Op {
                index: 0,
                error: error @ OpError::UnknownNode { expected, .. },
            }) => {
                assert_eq!(expected, old.handle.owner().id);
                assert!(error.to_string().contains("restarted"), "{error}");
            }
            other => panic!("expected UnknownNode, got {other:?}"),
        }
    }
    assert_eq!(again.digest(&new).await, digest(&new.original()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_gives_a_result_and_a_restarted_one_works() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let len = 64 << 20;
    let target = peer.alloc(len, Access::ReadWrite, 6).await;
    let src = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let writer = {
        let (node, remote) = (node.clone(), target.handle.clone());
        let op = RdmaOp::write(src.whole(), remote);
        tokio::spawn(async move {
            let mut results = Vec::new();
            for _ in 0..40 {
                results.push(node.submit(vec![op.clone()], DEADLINE).await);
            }
            results
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    peer.kill().await;
    // Every submit has a result (no SIGBUS took this process down); once
    // the owner is gone, they fail with a typed error.
    let results = writer.await.expect("the writer did not crash");
    let last = results.last().unwrap();
    assert!(
        matches!(
            last,
            Err(SubmitError::Op {
                error: OpError::ConnectionLost { .. } | OpError::PeerUnreachable { .. },
                ..
            })
        ),
        "{last:?}"
    );
    // A restarted owner is reached afresh.
    let mut again = sharing_peer().await;
    write_then_read_back(
        &node,
        &mut again,
        1 << 20,
        7,
        Some(RdmaTransportLevel::Memory),
    )
    .await;
}

/// The `(address range, inode)` of each `ferry-region` memfd mapping in
/// process `pid`, from its `/proc/PID/maps`.
fn memfd_mappings(pid: &str) -> Vec<(std::ops::Range<u64>, u64)> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|line| line.contains("memfd:ferry-region"))
        .map(|line| {
            // start-end perms offset dev inode path
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (start, end) = fields[0].split_once('-').unwrap();
            let hex = |h| u64::from_str_radix(h, 16).unwrap();
            (hex(start)..hex(end), fields[4].parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_its_owner_dropped_is_unmapped_here_soon() {
    // A mapping keeps the owner's pages alive: it must not outlive the
    // region by more than the sweep period. Other tests in this process
    // map and unmap regions meanwhile, so the region's own memfd is
    // followed, by its inode in the owner's process.
    let node = node().await;
    let mut peer = sharing_peer().await;
    let local = node.alloc(1 << 20, Access::ReadWrite).await.unwrap();
    let target = peer.alloc(1 << 20, Access::ReadWrite, 8).await;
    let owner_pid = peer.pid().expect("a child process").to_string();
    let inode = memfd_mappings(&owner_pid)
        .into_iter()
        .find(|(range, _)| range.contains(&target.handle.addr()))
        .map(|(_, inode)| inode)
        .expect("the owner maps its region from a ferry-region memfd");
    let mapped_here = || {
        memfd_mappings("self")
            .iter()
            .any(|&(_, mapped)| mapped == inode)
    };
    assert!(!mapped_here(), "not mapped before any op named it");
    node.submit(
        vec![RdmaOp::read(local.whole(), target.handle.clone())],
        DEADLINE,
    )
    .await
    .unwrap();
    assert!(mapped_here(), "the peer's region is mapped here");
    peer.drop_region(&target).await;
    let start = std::time::Instant::now();
    while mapped_here() {
        assert!(start.elapsed() < Duration::from_secs(5), "still mapped");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[path = "../shared/descs.rs"]
mod descs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_100_000_descriptors_same_host_is_verified_byte_for_byte() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    descs::descriptors_round_trip(&node, &mut peer, RdmaTransportLevel::Memory, 100_000).await;
}
