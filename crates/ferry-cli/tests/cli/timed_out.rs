//! `ferry serve` under a submit that times out: it must stop using the
//! wire (over TCP, here and in the soft-RoCE VM). Shares the serve harness
//! of `under_load.rs`.

use std::time::{Duration, Instant};

use ferry::prelude::*;

use super::under_load::{Served, fill, free_local_addr, pattern, runtime, shut_down, tcp_node};
use super::{http_get, metric};

/// Bytes of served reads or writes serve's metrics show now.
fn served_bytes(metrics: &str, op: &str) -> u64 {
    let page = http_get(metrics, "/metrics");
    metric(
        &page,
        &format!("ferry_served_bytes_total{{transport=\"tcp\",op=\"{op}\"}}"),
    )
}

/// Polls until two readings 300 ms apart agree (within a deadline).
fn settled_served_bytes(metrics: &str, op: &str) -> u64 {
    let started = Instant::now();
    let mut last = served_bytes(metrics, op);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = served_bytes(metrics, op);
        if now == last {
            return now;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "served {op} bytes still moving after 30 s: {now}"
        );
        last = now;
    }
}

/// A submit of 2 GiB with a deadline far too short for it returns
/// `Timeout`, and from then on the owner serves no more than what was
/// already in flight: the rest is never sent.
///
/// Why `connections × (window + chunk)`: each data connection lets at most
/// `window` bytes of requests be sent and not yet answered (its writer takes
/// room from the window before a chunk goes on the wire, and gets it back
/// only once the response has been read), except that a chunk larger than
/// the window still goes, alone: so at most `max(window, chunk)` per
/// connection, which `window + chunk` covers whatever the configuration.
/// When the deadline passes the submit is marked abandoned, and every chunk
/// still queued, or waiting for room, is dropped unsent. So what the owner
/// serves after the submit returned (its counter moves as it serves each
/// request) is at most what held window room at that moment, however large
/// the batch. Nothing here is timed: a slow machine moves fewer bytes before
/// the deadline, never more after it.
#[test]
fn a_timed_out_submit_stops_using_the_wire() {
    const LEN: u64 = 256 << 20;
    const OPS: u64 = 8;
    let deadline = Duration::from_millis(100);
    let rt = runtime();
    let metrics = free_local_addr();
    let (serve, remote) = Served::start(
        "timeout",
        None,
        &["--no-ibverbs", "--size", "256M", "--metrics", &metrics],
    );
    assert_eq!(remote.len(), LEN);
    let node = rt.block_on(tcp_node());
    let info = rt.block_on(node.tcp().transport_info()).unwrap();
    let in_flight =
        info.connections_per_peer as u64 * (u64::from(info.window) + info.chunk_size as u64);
    assert_eq!(in_flight, 4 * ((8 << 20) + (1 << 20)), "{info:?}");

    // The remote region and the local one hold the same pattern, so reads
    // and writes cut short anywhere leave both as they were.
    let local = rt.block_on(node.alloc(LEN, Access::ReadWrite)).unwrap();
    fill(&local, 7);
    rt.block_on(node.submit(
        vec![RdmaOp::write(local.whole(), remote.clone())],
        Duration::from_secs(60),
    ))
    .unwrap();

    for (op, kind) in [("read", OpKind::Read), ("write", OpKind::Write)] {
        let s0 = served_bytes(&metrics, op);
        let ops = (0..OPS)
            .map(|_| match kind {
                OpKind::Read => RdmaOp::read(local.whole(), remote.clone()),
                OpKind::Write => RdmaOp::write(local.whole(), remote.clone()),
            })
            .collect();
        let result = rt.block_on(node.submit(ops, deadline));
        let s1 = served_bytes(&metrics, op);
        let s2 = settled_served_bytes(&metrics, op);
        eprintln!(
            "{op}: {result:?}; served by the timeout {} MiB (S1 - S0), after it {} KiB (S2 - S1), \
             bound {} KiB, of {} MiB submitted",
            (s1 - s0) >> 20,
            (s2 - s1) >> 10,
            in_flight >> 10,
            (OPS * LEN) >> 20
        );
        assert!(
            matches!(result, Err(SubmitError::Timeout { .. })),
            "{op}: {result:?}"
        );
        assert!(s1 > s0, "{op}: nothing moved before the deadline");
        assert!(
            s2 - s1 <= in_flight,
            "{op}: {} bytes served after the submit timed out; at most {in_flight} were in flight",
            s2 - s1
        );
        // Far below 2 GiB: at least a quarter of it never went on the wire
        // (a 2-core host moves 2-5 MiB per ms here; it would take over
        // 15 GB/s to serve 1.5 GiB before a 100 ms deadline).
        assert!(
            s2 - s0 <= OPS * LEN / 4 * 3,
            "{op}: {} of {} bytes served: the unsent rest was not dropped",
            s2 - s0,
            OPS * LEN
        );
    }

    // The node still works: 4 KiB reads return the pattern.
    let probe = rt.block_on(node.alloc(4096, Access::ReadWrite)).unwrap();
    for offset in [0, 100 << 20, LEN - 4096] {
        rt.block_on(node.submit(
            vec![RdmaOp::read(
                probe.whole(),
                remote.slice(offset..offset + 4096).unwrap(),
            )],
            Duration::from_secs(10),
        ))
        .unwrap();
        assert!(
            probe.to_vec() == pattern(offset, 4096, 7),
            "4 KiB at {offset}"
        );
    }
    drop((probe, local));
    rt.block_on(shut_down(node));
    serve.stop();
}
