//! Real RDMA through ferry's verbs wrappers: two RC queue pairs on one device,
//! connected to each other (the device loops the traffic back).
//!
//! The RDMA tests need a device, so they are `#[ignore]`d with that reason on
//! a normal host; the soft-RoCE VM harness (`tests/rxe/run.sh`) runs them with
//! `--include-ignored` and sets `FERRY_RXE=1`, under which they must pass.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{Access, MemoryBlock};
use ferry_ibverbs::verbs::{
    Completion, CompletionQueue, Context, MemoryRegion, PathConfig, PostBuffers, ProtectionDomain,
    QpEndpoint, QpTiming, QueuePair, RdmaOpcode, VerbsError, WorkRequest, device_names,
};

const DEADLINE: Duration = Duration::from_secs(60);

fn in_rxe_vm() -> bool {
    std::env::var_os("FERRY_RXE").is_some()
}

/// The device under test, or `None` (after saying why) when there is none.
fn open_device(test: &str) -> Option<Arc<Context>> {
    let name = std::env::var("FERRY_RXE_DEVICE").ok();
    match Context::open(name.as_deref()) {
        Ok(ctx) => Some(ctx),
        Err(e) if !in_rxe_vm() => {
            println!("{test}: skipped: {e} (runs in the soft-RoCE VM: tests/rxe/run.sh)");
            None
        }
        Err(e) => panic!("inside the rxe VM the device must open: {e}"),
    }
}

#[test]
fn device_discovery_reports_the_host_honestly() {
    match device_names() {
        Ok(names) => {
            println!("RDMA devices: {names:?}");
            if in_rxe_vm() {
                assert!(names.iter().any(|n| n.starts_with("rxe")), "{names:?}");
            }
        }
        Err(VerbsError::NoDevice(reason)) => {
            assert!(!in_rxe_vm(), "no device inside the rxe VM: {reason}");
            println!("no RDMA device here, as expected on this host: {reason}");
        }
        Err(e) => panic!("device discovery failed with an unexpected error: {e}"),
    }
}

struct Pair {
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    a: QueuePair,
    b: QueuePair,
}

/// Two RC QPs on one device, connected to each other and in RTS.
fn connected_pair(ctx: &Arc<Context>) -> Pair {
    let port = 1;
    let info = ctx.port(port).unwrap();
    assert!(info.active, "port 1 is not active");
    let (gid_index, gid) = ctx.ipv4_gid(port).unwrap();
    let pd = ProtectionDomain::new(ctx).unwrap();
    let cq = CompletionQueue::new(ctx, 1024, None).unwrap();
    let a = QueuePair::new_rc(&pd, &cq, 128, 16).unwrap();
    let b = QueuePair::new_rc(&pd, &cq, 128, 16).unwrap();
    let path = PathConfig {
        port,
        gid_index,
        mtu: info.active_mtu,
        timing: QpTiming::default(),
    };
    let ep = |qp: &QueuePair, psn| QpEndpoint {
        qpn: qp.qpn(),
        psn,
        gid,
        lid: info.lid,
    };
    let (ea, eb) = (ep(&a, 100), ep(&b, 200));
    for (qp, mine, theirs) in [(&a, ea, eb), (&b, eb, ea)] {
        qp.to_init(port).unwrap();
        qp.to_rtr(&theirs, &path).unwrap();
        qp.to_rts(mine.psn, &path.timing).unwrap();
    }
    Pair {
        ctx: ctx.clone(),
        pd,
        cq,
        a,
        b,
    }
}

fn region(pd: &Arc<ProtectionDomain>, len: usize, access: Access, fill: u8) -> MemoryRegion {
    let block = Arc::new(MemoryBlock::alloc(len as u64).unwrap());
    block.write_at(0, &vec![fill; len]).unwrap();
    MemoryRegion::register(pd, block, access).unwrap()
}

fn wait_for(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        let missing = n - out.len();
        let mut batch = [Completion::default(); 64];
        let got = cq.poll(&mut batch[..missing.min(64)]).unwrap();
        out.extend_from_slice(&batch[..got]);
        assert!(
            started.elapsed() < DEADLINE,
            "only {} of {n} completions",
            out.len()
        );
        std::thread::yield_now();
    }
    out
}

fn wr(
    opcode: RdmaOpcode,
    local: &MemoryRegion,
    remote: &MemoryRegion,
    offset: usize,
    len: usize,
) -> WorkRequest {
    WorkRequest {
        wr_id: offset as u64,
        opcode,
        local_addr: local.memory().addr() + offset as u64,
        len: len as u32,
        lkey: local.lkey(),
        remote_addr: remote.memory().addr() + offset as u64,
        rkey: remote.rkey(),
        signaled: false,
        fence: false,
    }
}

#[test]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
fn rc_write_chain_and_read_move_the_bytes() {
    let Some(ctx) = open_device("rc_write_chain_and_read_move_the_bytes") else {
        return;
    };
    let p = connected_pair(&ctx);
    let len = 1 << 20;
    let src = region(&p.pd, len, Access::ReadWrite, 0);
    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    src.memory().write_at(0, &pattern).unwrap();
    let dst = region(&p.pd, len, Access::ReadWrite, 0xEE);

    // 16 linked WRITEs, one doorbell, only the last signaled: its completion
    // implies all earlier ones on this RC QP are done.
    let piece = len / 16;
    let mut chain: Vec<_> = (0..16)
        .map(|i| wr(RdmaOpcode::Write, &src, &dst, i * piece, piece))
        .collect();
    chain.last_mut().unwrap().signaled = true;
    // SAFETY: both MRs (and their memory) live until after the completion is polled.
    unsafe { p.a.post(&chain, &mut PostBuffers::default()) }.unwrap();
    let done = wait_for(&p.cq, 1);
    assert!(done[0].is_success(), "{}", done[0].status_str());
    assert_eq!(done[0].wr_id, (15 * piece) as u64);
    assert!(
        dst.memory().to_vec() == pattern,
        "RDMA WRITE landed other bytes"
    );

    // READ from b's side: pull dst back into a fresh buffer.
    let back = region(&p.pd, len, Access::ReadWrite, 0);
    let mut read = wr(RdmaOpcode::Read, &back, &dst, 0, len);
    read.signaled = true;
    // SAFETY: as above.
    unsafe { p.b.post(&[read], &mut PostBuffers::default()) }.unwrap();
    let done = wait_for(&p.cq, 1);
    assert!(done[0].is_success(), "{}", done[0].status_str());
    assert!(
        back.memory().to_vec() == pattern,
        "RDMA READ returned other bytes"
    );
    drop(p.ctx);
}

/// A SEND posted behind a WRITE on one RC QP: the peer's posted receive
/// completes with the SEND's length and bytes, and by then the WRITE's
/// bytes are in place. Behind a WRITE the peer refuses, the SEND is never
/// received: the peer's receive only flushes.
#[test]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
fn a_send_behind_writes_is_received_only_after_them() {
    let Some(ctx) = open_device("a_send_behind_writes_is_received_only_after_them") else {
        return;
    };
    for refused in [false, true] {
        let p = connected_pair(&ctx);
        let len = 256 * 1024;
        let src = region(&p.pd, len, Access::ReadWrite, 0x5A);
        let dst = region(&p.pd, len, Access::ReadWrite, 0);
        let message = region(&p.pd, 64, Access::ReadWrite, 0);
        message.memory().write_at(0, b"landed").unwrap();
        let block = Arc::new(MemoryBlock::alloc(4096).unwrap());
        let inbox = MemoryRegion::register_local(&p.pd, block).unwrap();
        // SAFETY: `inbox` outlives the QP's use of it: its completion is
        // polled (or the QP destroyed) before it is dropped at the end.
        unsafe { p.b.post_recv(7, inbox.memory().addr(), 4096, inbox.lkey()) }.unwrap();
        let mut write = wr(RdmaOpcode::Write, &src, &dst, 0, len);
        if refused {
            write.rkey ^= 0x5a5a;
        }
        let mut send = wr(RdmaOpcode::Send, &message, &dst, 0, 6);
        send.wr_id = 99;
        send.signaled = true;
        // SAFETY: every MR lives until after the completions are polled.
        unsafe { p.a.post(&[write, send], &mut PostBuffers::default()) }.unwrap();
        let done = wait_for(&p.cq, if refused { 3 } else { 2 });
        let received = done.iter().find(|c| c.qp_num == p.b.qpn()).unwrap();
        assert_eq!(received.wr_id, 7);
        if refused {
            assert!(received.is_flush(), "{}", received.status_str());
            assert!(done.iter().any(|c| c.is_remote_access_error()));
            continue;
        }
        assert!(received.is_success(), "{}", received.status_str());
        assert_eq!(received.byte_len, 6);
        assert_eq!(&inbox.memory().to_vec()[..6], b"landed");
        assert!(dst.memory().to_vec().iter().all(|&b| b == 0x5A));
        let sent = done.iter().find(|c| c.qp_num == p.a.qpn()).unwrap();
        assert_eq!((sent.wr_id, sent.is_success()), (99, true));
    }
}

#[test]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
fn the_nic_refuses_bad_rkeys_and_writes_to_read_only_regions() {
    let Some(ctx) = open_device("the_nic_refuses_bad_rkeys_and_writes_to_read_only_regions") else {
        return;
    };
    for case in ["wrong rkey", "read-only region"] {
        let p = connected_pair(&ctx);
        let len = 64 * 1024;
        let src = region(&p.pd, len, Access::ReadWrite, 0xAB);
        let target_access = if case == "wrong rkey" {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        let target = region(&p.pd, len, target_access, 0x11);
        let mut write = wr(RdmaOpcode::Write, &src, &target, 0, len);
        write.signaled = true;
        if case == "wrong rkey" {
            write.rkey ^= 0x5a5a;
        }
        // SAFETY: both MRs live until after the completion is polled.
        unsafe { p.a.post(&[write], &mut PostBuffers::default()) }.unwrap();
        let done = wait_for(&p.cq, 1);
        assert!(
            done[0].is_remote_access_error(),
            "{case}: got {}",
            done[0].status_str()
        );
        assert!(
            target.memory().to_vec() == vec![0x11; len],
            "{case}: target changed"
        );
        drop(p.b);
    }
}

#[test]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
fn moving_a_qp_to_error_flushes_outstanding_work() {
    let Some(ctx) = open_device("moving_a_qp_to_error_flushes_outstanding_work") else {
        return;
    };
    let p = connected_pair(&ctx);
    let src = region(&p.pd, 4096, Access::ReadWrite, 1);
    let dst = region(&p.pd, 4096, Access::ReadWrite, 2);
    p.a.to_error().unwrap();
    let mut write = wr(RdmaOpcode::Write, &src, &dst, 0, 4096);
    write.signaled = true;
    // SAFETY: both MRs live until the flush completion is polled. Posting to a
    // QP in the error state is allowed and completes with a flush error.
    unsafe { p.a.post(&[write], &mut PostBuffers::default()) }.unwrap();
    let done = wait_for(&p.cq, 1);
    assert!(done[0].is_flush(), "got {}", done[0].status_str());
    assert!(dst.memory().to_vec() == vec![2; 4096]);
}
