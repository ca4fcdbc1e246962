//! Runs the real `ferry` binary. Inside the soft-RoCE VM (`FERRY_RXE=1`, with
//! `FERRY_BIN` naming the binary there) the same tests expect the device.

use std::process::{Command, Output};

/// Prometheus metrics of `serve` and `bench`, read over HTTP.
#[path = "cli/metrics.rs"]
mod metrics;
/// `ferry serve` under a timed-out submit: the wire goes quiet.
#[path = "cli/timed_out.rs"]
mod timed_out;
/// `ferry serve` under load: connection bounds. A module of this binary
/// (not a test target of its own) so that it runs in the soft-RoCE VM too;
/// so is the next.
#[path = "cli/under_load.rs"]
mod under_load;
/// `bench --verify` in pieces, and its failures told from the run's.
#[path = "cli/verify.rs"]
mod verify;

use metrics::{http_get, metric};

/// The binary under test: `FERRY_BIN` inside the VM, cargo's build here.
fn ferry_bin() -> String {
    std::env::var("FERRY_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferry").to_string())
}

fn ferry(args: &[&str]) -> Output {
    let bin = ferry_bin();
    Command::new(bin)
        .args(args)
        .output()
        .expect("run the ferry binary")
}

/// Runs `ferry bench` with `args` (which include `--json`): its rows, after
/// checking it succeeded. `what` names the run in failure messages.
fn bench_rows(what: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let out = ferry(&[&["bench"], args].concat());
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A directory of this test process's own, `ferry-cli-NAME-PID` under the
/// system's temporary directory: empty when made, and removed with what is
/// in it when dropped, by a failing test too.
struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("ferry-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        ScratchDir(dir)
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn in_rxe_vm() -> bool {
    std::env::var_os("FERRY_RXE").is_some()
}

/// Starts `ferry serve` with `args`, writing its handle to `handle`, and
/// waits (with a deadline) until the handle is there. Closing the child's
/// stdin stops it.
fn spawn_serve(args: &[&str], handle: &std::path::Path) -> std::process::Child {
    spawn_serve_logging(args, handle, std::process::Stdio::null())
}

/// `spawn_serve`, with its log (stderr) going to `log`: warnings, and a
/// line per delivery its inbox takes.
fn spawn_serve_logging(
    args: &[&str],
    handle: &std::path::Path,
    log: impl Into<std::process::Stdio>,
) -> std::process::Child {
    let bin = ferry_bin();
    let child = Command::new(&bin)
        .arg("serve")
        .args(args)
        .arg("--stdin")
        // About the network transports: nothing shared through memory.
        .env("FERRY_DISABLE_MEMORY", "1")
        .env("RUST_LOG", "warn,ferry::inbox=debug")
        .arg("--handle-file")
        .arg(handle)
        .stdin(std::process::Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !handle.exists() || std::fs::read_to_string(handle).unwrap().is_empty() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "serve wrote no handle"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}

#[test]
fn info_json_lists_the_transports_that_can_start_here() {
    let out = ferry(&["info", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("info --json is JSON");
    let transport = |name: &str| {
        info["transports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(transport("tcp")["available"], true);
    let liveness = &info["liveness"];
    assert_eq!(
        liveness["peer_timeout_s"],
        ferry::DEFAULT_PEER_TIMEOUT.as_secs_f64()
    );
    assert_eq!(
        liveness["silent_grace_s"],
        ferry::DEFAULT_SILENT_GRACE.as_secs_f64()
    );
    let ibverbs = transport("ibverbs");
    let devices = info["devices"].as_array().unwrap();
    if in_rxe_vm() {
        assert_eq!(ibverbs["available"], true, "{ibverbs}");
        let rxe = devices
            .iter()
            .find(|d| d["name"] == "rxe0")
            .expect("rxe0 listed");
        // Soft-RoCE: what picks the owner's notification coalescing.
        assert_eq!(rxe["software"], true, "{rxe}");
        let port = &rxe["ports"][0];
        assert_eq!(port["active"], true);
        assert_eq!(port["link_layer"], "Ethernet");
        let gids = port["gids"].as_array().unwrap();
        assert!(
            gids.iter().any(
                |g| g["kind"] == "RoCE v2" && g["gid"].as_str().unwrap().starts_with("::ffff:")
            ),
            "{gids:?}"
        );
    } else if ibverbs["available"] == false {
        // A host without a NIC: the reason is given, and no device is listed.
        assert!(!ibverbs["detail"].as_str().unwrap().is_empty());
        assert!(devices.is_empty());
    }
}

#[test]
fn info_as_text_says_why_a_transport_cannot_start() {
    let out = ferry(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("tcp      available"), "{text}");
    assert!(
        text.contains("ibverbs  available") || text.contains("ibverbs  unavailable: "),
        "{text}"
    );
}

#[test]
fn disabling_ibverbs_is_reported() {
    let bin = ferry_bin();
    let out = Command::new(bin)
        .args(["info", "--json"])
        .env("FERRY_DISABLE_IBVERBS", "1")
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ibverbs = info["transports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "ibverbs")
        .unwrap()
        .clone();
    assert_eq!(ibverbs["available"], false);
    assert_eq!(ibverbs["detail"], "disabled by FERRY_DISABLE_IBVERBS=1");
}

#[test]
fn bad_arguments_fail_cleanly() {
    for args in [&["info", "--bogus"][..], &["frobnicate"][..], &[][..]] {
        let out = ferry(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: ") || stderr.contains("Usage:"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("backtrace"),
            "{args:?}: {stderr}"
        );
    }
    assert!(ferry(&["info", "--help"]).status.success());
    assert!(ferry(&["--help"]).status.success());
}

/// `ferry serve` in one process, `ferry bench` against its handle file in
/// another: every byte verified, one JSON row per block size.
#[test]
fn serve_and_bench_over_a_handle_file() {
    let dir = ScratchDir::new("test");
    let handle = dir.join("handle.json");
    let mut server = spawn_serve(&["--size", "4M"], &handle);
    for op in ["write", "read"] {
        let h = handle.to_str().unwrap();
        let rows = bench_rows(
            op,
            &[
                "--handle",
                h,
                "--block",
                "4K,64K,1M",
                "--op",
                op,
                "--verify",
                "--json",
                "--iters",
                "3",
            ],
        );
        assert_eq!(
            rows.iter()
                .map(|r| r["block"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            [4096, 65536, 1 << 20]
        );
        for row in &rows {
            assert_eq!(row["op"], op);
            if in_rxe_vm() {
                assert_eq!(row["transport"], "ibverbs", "both ends have rxe0");
            } else if !std::path::Path::new("/sys/class/infiniband").exists() {
                assert_eq!(row["transport"], "tcp");
            }
            assert_eq!(row["verified"], true);
            assert!(
                row["gbps"].as_f64().unwrap() > 0.0 && row["lat_p99_us"].as_f64().unwrap() > 0.0
            );
        }
    }
    drop(server.stdin.take());
    assert!(
        server.wait().unwrap().success(),
        "serve exits when its stdin closes"
    );
}

/// `bench` takes the cluster secret as `serve` does: against a server that
/// requires one, a bench without it is refused, with it verifies its bytes;
/// `--loopback` hands the file to the server it starts.
#[test]
fn bench_takes_the_cluster_secret_file_as_serve_does() {
    let dir = ScratchDir::new("secret");
    let (handle, secret) = (dir.join("handle.json"), dir.join("secret"));
    std::fs::write(&secret, "a cluster secret of at least sixteen bytes\n").unwrap();
    // Readable by its owner alone: ferry refuses a secret others can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let secret = secret.to_str().unwrap();
    let mut server = spawn_serve(&["--size", "1M", "--cluster-secret-file", secret], &handle);
    let h = handle.to_str().unwrap();
    let run = ["--block", "64K", "--verify", "--json", "--iters", "2"];
    let refused = ferry(&[&["bench", "--handle", h][..], &run].concat());
    assert!(
        !refused.status.success(),
        "a bench without the secret got through"
    );
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("requires a cluster secret"), "{why}");
    let rows = bench_rows(
        "with the secret",
        &[&["--handle", h, "--cluster-secret-file", secret][..], &run].concat(),
    );
    assert_eq!(rows[0]["verified"], true);
    drop(server.stdin.take());
    assert!(server.wait().unwrap().success());
    let rows = bench_rows(
        "loopback with the secret",
        &[
            &["--loopback", "--size", "1M", "--transport", "tcp"][..],
            &["--cluster-secret-file", secret],
            &run,
        ]
        .concat(),
    );
    assert_eq!(rows[0]["verified"], true);
}

/// SIGTERM stops `serve` cleanly from the moment its handle is out, and
/// while its stdin (`--stdin`) is still open: the stdin reader never holds
/// the exit up.
#[test]
fn serve_exits_cleanly_on_sigterm_sent_as_soon_as_its_handle_is_out() {
    let dir = ScratchDir::new("term");
    let handle = dir.join("handle.json");
    let mut server = spawn_serve(&["--size", "64K"], &handle);
    let pid = server.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success(), "kill -TERM {pid}");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = server.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(20) {
            let _ = server.kill();
            panic!("serve still runs 20 s after SIGTERM (its stdin still open)");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "serve ends with {status:?} on SIGTERM");
    drop(server.stdin.take());
}

/// `bench --notify` attaches a notification to every submit; the serving
/// process takes each from its inbox exactly once and logs it (count and
/// size), and bench reports the notification's size in its rows.
#[test]
fn bench_notifications_reach_serve_once_each() {
    let dir = ScratchDir::new("notify");
    let handle = dir.join("handle.json");
    let log = dir.join("serve.log");
    let mut server = spawn_serve_logging(
        &["--size", "1M"],
        &handle,
        std::fs::File::create(&log).unwrap(),
    );
    let h = handle.to_str().unwrap();
    let rows = bench_rows(
        "notify",
        &[
            "--handle", h, "--block", "4K", "--op", "write", "--notify", "64", "--verify",
            "--json", "--iters", "50", "--warmup", "2",
        ],
    );
    let [row] = rows.as_slice() else {
        panic!("one block size, one row: {rows:?}")
    };
    assert_eq!(
        (row["notify"].as_u64(), row["verified"].as_bool()),
        (Some(64), Some(true))
    );
    drop(server.stdin.take());
    assert!(server.wait().unwrap().success());
    let log = std::fs::read_to_string(&log).unwrap();
    let taken: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("inbox: delivery taken"))
        .collect();
    // 2 warm-up and 50 measured submits, one notification each.
    assert_eq!(taken.len(), 52, "{log}");
    assert!(
        taken
            .iter()
            .all(|l| l.contains("bytes=64") && l.contains("kind=Notification")),
        "{log}"
    );
    assert!(taken[51].contains("count=52"), "{log}");
}

/// `bench --op rpc` calls serve's echo handler (every answer compared);
/// `--op message` fills serve's inbox, which serve drains.
#[test]
fn bench_calls_and_messages_go_over_the_control_session() {
    for (op, verified) in [("rpc", true), ("message", false)] {
        let rows = bench_rows(
            op,
            &[
                "--loopback",
                "--op",
                op,
                "--block",
                "64,4K",
                "--size",
                "1M",
                "--workers",
                "4",
                "--iters",
                "50",
                "--json",
            ],
        );
        assert_eq!(rows.len(), 2, "{op}");
        for row in rows {
            assert_eq!(row["transport"], "control");
            assert_eq!(row["verified"], verified);
            assert_eq!(
                (row["batch"].as_u64(), row["submits"].as_u64()),
                (Some(1), Some(200))
            );
        }
    }
}

/// `--prepared` runs transfer requests (verified, with the node's estimate
/// learned from the warm-up); `--op register` registers and drops memory.
#[test]
fn bench_runs_prepared_requests_and_registrations() {
    let rows = bench_rows(
        "write",
        &[
            "--loopback",
            "--transport",
            "tcp",
            "--prepared",
            "--strided",
            "--descs",
            "64",
            "--block",
            "4K,64K",
            "--size",
            "4M",
            "--warmup",
            "3",
            "--iters",
            "20",
            "--verify",
            "--json",
        ],
    );
    assert_eq!(rows.len(), 2);
    for row in rows {
        assert_eq!(
            (row["prepared"].as_bool(), row["verified"].as_bool()),
            (Some(true), Some(true))
        );
        assert_eq!(row["batch"].as_u64(), Some(64), "{row}");
        assert_eq!(row["est_method"], "measured", "{row}");
        assert!(row["est_us"].as_f64().unwrap() > 0.0, "{row}");
    }
    let rows = bench_rows(
        "register",
        &[
            "--loopback",
            "--transport",
            "tcp",
            "--op",
            "register",
            "--block",
            "4K,1M",
            "--size",
            "4M",
            "--iters",
            "10",
            "--json",
        ],
    );
    assert_eq!(rows.len(), 2);
    for (row, block) in rows.iter().zip([4096u64, 1 << 20]) {
        assert_eq!(
            (row["op"].as_str(), row["transport"].as_str()),
            (Some("register"), Some("tcp"))
        );
        assert_eq!(row["submits"].as_u64(), Some(10));
        assert_eq!(row["bytes"].as_u64(), Some(10 * block));
    }
}

#[test]
fn bench_errors_are_one_line_and_non_zero() {
    let dir = ScratchDir::new("bad");
    // A handle to a node that is gone: take one from a server, stop it.
    let stale = dir.join("stale.json");
    let mut server = spawn_serve(&["--size", "64K"], &stale);
    drop(server.stdin.take());
    server.wait().unwrap();

    let cases: [(&[&str], &str); 4] = [
        (
            &["bench", "--loopback", "--transport", "carrier-pigeon"],
            "invalid value",
        ),
        (&["bench", "--loopback", "--size", "0"], "at least 1 byte"),
        (
            &["bench", "--handle", "/nonexistent/handle.json"],
            "cannot read handle file",
        ),
        (
            &[
                "bench",
                "--handle",
                stale.to_str().unwrap(),
                "--block",
                "4K",
                "--iters",
                "1",
            ],
            "unreachable",
        ),
    ];
    for (args, expected) in cases {
        let out = ferry(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        if !expected.starts_with("invalid") && !expected.starts_with("at least") {
            assert_eq!(
                stderr.trim().lines().count(),
                1,
                "{args:?}: one line, got {stderr}"
            );
        }
    }
}
