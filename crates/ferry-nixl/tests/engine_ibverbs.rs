//! The engine NIXL drives, over an RDMA device and nothing else
//! (`transports=ibverbs`: no same-host memory, no TCP to fall back on):
//! two agents in this process move blocks both ways, in NIXL's calls, with
//! a notification behind the data. The Python suite drives the same engine
//! through NIXL itself, over memory and TCP; this is its ibverbs leg.
//!
//! It needs an RDMA device, so it is `#[ignore]`d with that reason on a
//! normal host; `tests/rxe/ferry-tests.sh` runs it inside a soft-RoCE VM
//! with `--include-ignored`, where it must pass.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use plugin_FERRY::descs::Desc;
use plugin_FERRY::engine::{Engine, Request, Status};

/// `nixl_mem_t`'s host memory.
const DRAM: i32 = 0;
const DEADLINE: Duration = Duration::from_secs(60);
const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;

/// An agent whose FERRY backend may use ibverbs only.
fn rdma_only(agent: &str) -> Engine {
    let params = HashMap::from([("transports".to_string(), "ibverbs".to_string())]);
    Engine::new(agent, &params).unwrap_or_else(|e| panic!("needs an RDMA device: {e}"))
}

/// Bytes that differ from block to block and within each.
fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ ((i / BLOCK) as u8).wrapping_add(seed))
        .collect()
}

/// `len` bytes at `addr`, copied out.
///
/// # Safety
/// `addr..addr+len` is live memory no transfer is writing.
unsafe fn bytes_at(addr: u64, len: u64) -> Vec<u8> {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }.to_vec()
}

/// Descriptors of `BLOCKS` blocks from `addr` in registration `md`, in the
/// order `order` gives.
fn blocks(addr: u64, md: u64, order: impl Iterator<Item = u64>) -> Vec<Desc> {
    order
        .map(|k| Desc {
            addr: addr + k * BLOCK,
            len: BLOCK,
            md,
        })
        .collect()
}

/// Posts `request` and polls it as NIXL's callers do, until it leaves
/// `InProgress` or the deadline passes; its last status.
fn post_and_wait(engine: &Engine, request: &Request, notif: Option<&[u8]>) -> Status {
    match engine.post(request, notif) {
        Status::InProgress => {}
        other => return other,
    }
    let deadline = Instant::now() + DEADLINE;
    loop {
        match engine.check(request) {
            Status::InProgress if Instant::now() < deadline => {}
            other => return other,
        }
    }
}

/// The notifications `engine` got: polled until the first comes (or the
/// deadline passes), then for 200 ms more, so that a second copy would be
/// seen.
fn notifs(engine: &Engine) -> Vec<(String, Vec<u8>)> {
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::new();
    let mut until = deadline;
    while Instant::now() < until {
        engine.notifs(|agent, msg| got.push((String::from_utf8_lossy(agent).into(), msg.to_vec())));
        if !got.is_empty() && until == deadline {
            until = Instant::now() + Duration::from_millis(200);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

#[test]
#[ignore = "needs an RDMA device: run by tests/rxe/ferry-tests.sh"]
fn two_agents_move_blocks_over_ibverbs_alone_with_the_notification_behind() {
    let prefill = rdma_only("prefill");
    let decode = rdma_only("decode");
    let len = BLOCK * BLOCKS;
    // Each agent's memory, owned here; the engines see raw addresses, as
    // NIXL's do, and nothing here touches it while a transfer runs.
    let mut theirs = pattern(len, 1);
    let mut ours = pattern(len, 2);
    let (their_addr, our_addr) = (theirs.as_mut_ptr() as u64, ours.as_mut_ptr() as u64);
    let their_md = prefill.register(DRAM, their_addr, len).unwrap();
    let our_md = decode.register(DRAM, our_addr, len).unwrap();

    // Metadata exchange, as NIXL's agents do it.
    let info = prefill.conn_info();
    assert_eq!(
        decode.load_conn_info("prefill", info.as_bytes()),
        Status::Success
    );
    let info = decode.conn_info();
    assert_eq!(
        prefill.load_conn_info("decode", info.as_bytes()),
        Status::Success
    );
    assert_eq!(decode.connect("prefill"), Status::Success);
    let public = prefill.public_data(their_md).unwrap();
    let remote_md = decode
        .load_remote("prefill", DRAM, their_addr, len, public.as_bytes())
        .unwrap();

    // WRITE our block k over their block BLOCKS-1-k, notified.
    let local = blocks(our_addr, our_md, 0..BLOCKS);
    let reversed = blocks(their_addr, remote_md, (0..BLOCKS).rev());
    let write = decode.prep(false, &local, &reversed, "prefill").unwrap();
    assert_eq!(
        post_and_wait(&decode, &write, Some(b"kv ready")),
        Status::Success
    );
    let sent = pattern(len, 2);
    // SAFETY: the write is done; nothing else writes there.
    let landed = unsafe { bytes_at(their_addr, len) };
    for k in 0..BLOCKS as usize {
        let theirs_k = (BLOCKS as usize - 1 - k) * BLOCK as usize;
        let ours_k = k * BLOCK as usize;
        assert!(
            landed[theirs_k..theirs_k + BLOCK as usize] == sent[ours_k..ours_k + BLOCK as usize],
            "block {k} landed wrong"
        );
    }
    assert_eq!(
        notifs(&prefill),
        vec![("decode".to_string(), b"kv ready".to_vec())],
        "the notification, once, named by its agent"
    );

    // READ all of theirs back, in order, over our (different) bytes.
    let straight = blocks(their_addr, remote_md, 0..BLOCKS);
    let read = decode.prep(true, &local, &straight, "prefill").unwrap();
    assert_eq!(post_and_wait(&decode, &read, None), Status::Success);
    // SAFETY: the read is done.
    assert!(
        unsafe { bytes_at(our_addr, len) } == landed,
        "read bytes differ"
    );
    // Posted again: the same request moves the same bytes.
    let cleared = vec![0u8; len as usize];
    // SAFETY: no transfer runs; `ours` is the registration's memory.
    unsafe { std::ptr::copy_nonoverlapping(cleared.as_ptr(), our_addr as *mut u8, len as usize) };
    assert_eq!(post_and_wait(&decode, &read, None), Status::Success);
    // SAFETY: the read is done.
    assert!(
        unsafe { bytes_at(our_addr, len) } == landed,
        "reposted read differs"
    );

    assert_eq!(decode.release(&write), Status::Success);
    assert_eq!(decode.release(&read), Status::Success);
    assert_eq!(decode.unload(remote_md), Status::Success);
    assert_eq!(decode.deregister(our_md), Status::Success);
    assert_eq!(prefill.deregister(their_md), Status::Success);
    drop((decode, prefill));
    drop((theirs, ours));
}
