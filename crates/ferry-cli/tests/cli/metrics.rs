//! Prometheus metrics: what `ferry serve` counts of the bytes a bench
//! moved, its per-peer table gauges, and `ferry bench --metrics`.

use std::process::Command;

use super::{ScratchDir, bench_rows, ferry_bin, spawn_serve};

/// GETs a page from a local HTTP endpoint (no client library needed).
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    page
}

pub fn metric(page: &str, prefix: &str) -> u64 {
    page.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

/// A loopback address no one listens on, for a metrics endpoint.
fn free_loopback_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// The serve side's counters grow by exactly the bytes the bench moved. Over
/// TCP, since over RDMA the owner's CPU never sees one-sided transfers.
#[test]
fn serve_metrics_count_exactly_the_bytes_bench_moved() {
    let metrics = free_loopback_addr();
    let dir = ScratchDir::new("metrics");
    let handle = dir.join("handle.json");
    let mut server = spawn_serve(&["--size", "1M", "--metrics", &metrics], &handle);
    let served = |page: &str, op: &str| {
        metric(
            page,
            &format!("ferry_served_bytes_total{{transport=\"tcp\",op=\"{op}\"}}"),
        )
    };
    let before = http_get(&metrics, "/metrics");
    let mut moved = [0u64; 2];
    for (i, op) in ["write", "read"].into_iter().enumerate() {
        let h = handle.to_str().unwrap();
        let rows = bench_rows(
            op,
            &[
                "--handle",
                h,
                "--transport",
                "tcp",
                "--op",
                op,
                "--block",
                "4K,64K",
                "--warmup",
                "0",
                "--iters",
                "3",
                "--json",
            ],
        );
        moved[i] = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
    }
    let after = http_get(&metrics, "/metrics");
    assert_eq!(
        served(&after, "write") - served(&before, "write"),
        moved[0],
        "{after}"
    );
    assert_eq!(
        served(&after, "read") - served(&before, "read"),
        moved[1],
        "{after}"
    );
    assert!(moved[0] > 0 && moved[1] > 0);
    drop(server.stdin.take());
    assert!(server.wait().unwrap().success());
}

/// The value of the gauge line that starts with `prefix`; panics if the
/// page has none (unlike [`metric`], for which missing reads as 0).
fn gauge(page: &str, prefix: &str) -> u64 {
    let line = page.lines().find(|l| l.starts_with(prefix));
    let line = line.unwrap_or_else(|| panic!("no {prefix} in {page}"));
    line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
}

/// The sizes of serve's per-peer tables `tables`, from its gauges.
fn table_sizes(metrics: &str, tables: &[&str]) -> Vec<u64> {
    let page = http_get(metrics, "/metrics");
    tables
        .iter()
        .map(|t| gauge(&page, &format!("ferry_peer_table_entries{{table=\"{t}\"}}")))
        .collect()
}

/// Polls `tables` (up to 30 s) until `done` says yes; the last sizes.
fn poll_tables(metrics: &str, tables: &[&str], done: impl Fn(&[u64]) -> bool) -> Vec<u64> {
    let started = std::time::Instant::now();
    loop {
        let sizes = table_sizes(metrics, tables);
        if done(&sizes) || started.elapsed().as_secs() > 30 {
            return sizes;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// A bench process sends messages for a few seconds: while it runs,
/// serve's gauges show its session, its connection and its line of
/// messages; once it has exited, none of them.
#[test]
fn serve_per_peer_table_gauges_return_to_zero_after_a_client_leaves() {
    let metrics = free_loopback_addr();
    let dir = ScratchDir::new("tables");
    let handle = dir.join("handle.json");
    let mut server = spawn_serve(&["--size", "1M", "--metrics", &metrics], &handle);
    let tables = ["accepted_connections", "live_sessions", "message_lines"];
    assert_eq!(
        table_sizes(&metrics, &tables),
        [0, 0, 0],
        "before any client"
    );
    let h = handle.to_str().unwrap();
    let mut bench = Command::new(ferry_bin())
        .args(["bench", "--handle", h, "--op", "message", "--block", "64"])
        .args(["--duration", "4", "--json"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let during = poll_tables(&metrics, &tables, |s| s.iter().all(|&n| n > 0));
    assert!(
        during.iter().all(|&n| n > 0),
        "{tables:?} during the bench: {during:?}"
    );
    assert!(bench.wait().unwrap().success());
    let after = poll_tables(&metrics, &tables, |s| s.iter().all(|&n| n == 0));
    assert_eq!(after, [0, 0, 0], "{tables:?} after the bench left");
    drop(server.stdin.take());
    assert!(server.wait().unwrap().success());
}

/// While a bench runs, its own endpoint shows the initiator's counters and
/// the submit latency histogram.
#[test]
fn bench_metrics_expose_initiator_counters_while_it_runs() {
    let metrics = free_loopback_addr();
    let bin = ferry_bin();
    let mut bench = Command::new(&bin)
        .args([
            "bench",
            "--loopback",
            "--transport",
            "tcp",
            "--size",
            "4M",
            "--block",
            "64K",
            "--batch",
            "8",
        ])
        .args(["--duration", "20", "--metrics", &metrics])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let page = loop {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(15),
            "no initiator metrics appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
        let Ok(mut s) = std::net::TcpStream::connect(&metrics) else {
            continue;
        };
        use std::io::{Read, Write};
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").unwrap();
        let mut page = String::new();
        let _ = s.read_to_string(&mut page);
        if metric(&page, "ferry_bytes_total{transport=\"tcp\",op=\"write\"}") > 0 {
            break page;
        }
    };
    let _ = bench.kill();
    let _ = bench.wait();
    let bytes = metric(&page, "ferry_bytes_total{transport=\"tcp\",op=\"write\"}");
    let ops = metric(&page, "ferry_ops_total{transport=\"tcp\",op=\"write\"}");
    // Each submit of 8 blocks adds 8 ops and 8 × 64 KiB, one counter after
    // the other, and the scrape reads them one after the other: they agree
    // up to the few submits that finished in between.
    let blocks = bytes / 65536;
    assert!(
        bytes.is_multiple_of(65536)
            && blocks.is_multiple_of(8)
            && ops.is_multiple_of(8)
            && ops.abs_diff(blocks) <= 64,
        "every counted op moved one 64 KiB block (ops {ops}, bytes {bytes}):\n{page}"
    );
    assert!(
        page.contains("ferry_submit_seconds"),
        "latency histogram missing:\n{page}"
    );
}
