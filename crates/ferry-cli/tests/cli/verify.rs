//! `bench --verify`: its check runs in pieces (a region of several pieces
//! verifies), and every failure says whether it came from the measured run
//! or from the verification.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry::prelude::*;

use super::{ScratchDir, bench_rows, ferry, spawn_serve};

/// A scratch directory and a `ferry serve` of `size` bytes in it; the
/// handle file's path.
fn served(name: &str, size: &str) -> (ScratchDir, std::process::Child, String) {
    let dir = ScratchDir::new(name);
    let handle = dir.join("handle.json");
    let server = spawn_serve(&["--size", size], &handle);
    let path = handle.to_str().unwrap().to_string();
    (dir, server, path)
}

fn stop(dir: ScratchDir, mut server: std::process::Child) {
    drop(server.stdin.take());
    assert!(server.wait().unwrap().success());
    drop(dir);
}

/// `bench`'s stderr, after checking that it failed.
fn bench_failure(args: &[&str]) -> String {
    let out = ferry(&[&["bench"], args].concat());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

/// A block of 3 MiB, verified after writes and reads: read back (or
/// written first) in three pieces, every byte compared.
#[test]
fn a_region_larger_than_a_piece_verifies_piece_by_piece() {
    let (dir, server, handle) = served("verify-pieces", "3M");
    for op in ["write", "read"] {
        let rows = bench_rows(
            op,
            &[
                "--handle", &handle, "--block", "3M", "--op", op, "--verify", "--json", "--iters",
                "2",
            ],
        );
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["verified"], true, "{op}: {}", rows[0]);
    }
    stop(dir, server);
}

/// Bytes the bench read are not what it wrote before the run, because
/// another writer keeps overwriting the target's first block: the measured
/// reads succeed, and the failure is the verification's, naming the byte.
#[test]
fn a_corrupted_target_fails_the_verification_not_the_run() {
    let (dir, server, handle) = served("verify-corrupt", "1M");
    let remote: RemoteBuffer =
        serde_json::from_str(std::fs::read_to_string(&handle).unwrap().trim()).unwrap();
    let stop_writing = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let corrupter = {
        let (stop_writing, written) = (stop_writing.clone(), written.clone());
        std::thread::spawn(move || corrupt(remote, stop_writing, written))
    };
    let started = Instant::now();
    while written.load(Ordering::Relaxed) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no corrupting write"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // For a second the bench reads the region it wrote the pattern into;
    // the corrupter overwrites the first block all along.
    let stderr = bench_failure(&[
        "--handle",
        &handle,
        "--block",
        "4K",
        "--op",
        "read",
        "--verify",
        "--duration",
        "1",
        "--warmup",
        "0",
    ]);
    stop_writing.store(true, Ordering::Relaxed);
    corrupter.join().unwrap();
    assert!(
        stderr.contains("verification of the 4096-byte-block read run failed: byte ")
            && stderr.contains("differs"),
        "{stderr}"
    );
    assert!(!stderr.contains("measured run"), "{stderr}");
    stop(dir, server);
}

/// Writes 4 KiB of 0xEE into the start of `remote` until told to stop.
fn corrupt(remote: RemoteBuffer, stop: Arc<AtomicBool>, written: Arc<AtomicU64>) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let node = Node::builder()
            .ibverbs(false)
            .memory(false)
            .spawn()
            .await
            .unwrap();
        let junk = node.alloc(4096, Access::ReadWrite).await.unwrap();
        junk.write_at(0, &[0xEE; 4096]).unwrap();
        let target = remote.slice(0..4096).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            let write = RdmaOp::write(junk.whole(), target.clone());
            node.submit(vec![write], Duration::from_secs(10))
                .await
                .unwrap();
            written.fetch_add(1, Ordering::Relaxed);
        }
        node.shutdown().await;
    });
}

/// A handle whose token the owner does not know: the writes of a run fail
/// in the measured run; the known bytes a verified read run writes first
/// fail in the verification. Each says so.
#[test]
fn a_refused_transfer_names_the_part_of_the_run_it_failed_in() {
    let (dir, server, handle) = served("verify-refused", "64K");
    let mut json: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&handle).unwrap().trim()).unwrap();
    let token =
        u128::from_str_radix(json["transports"]["tcp"]["token"].as_str().unwrap(), 16).unwrap();
    json["transports"]["tcp"]["token"] = format!("{:032x}", token ^ 1).into();
    // In the soft-RoCE VM the bench goes over ibverbs: the key must be
    // wrong there too.
    // (`get_mut`, not indexing: indexing a null `ibverbs` would make it an
    // object, and the handle unreadable.)
    if let Some(rkeys) = json["transports"]
        .get_mut("ibverbs")
        .and_then(|ibverbs| ibverbs.get_mut("rkeys"))
        .and_then(|rkeys| rkeys.as_array_mut())
    {
        for rkey in rkeys {
            *rkey = (rkey.as_u64().unwrap() ^ 0x5a5a).into();
        }
    }
    let forged = dir.join("forged.json");
    std::fs::write(&forged, json.to_string()).unwrap();
    let forged = forged.to_str().unwrap();

    let run = bench_failure(&[
        "--handle", forged, "--block", "4K", "--op", "write", "--iters", "1",
    ]);
    assert!(
        run.contains("measured run of the 4096-byte-block write run failed: "),
        "{run}"
    );
    assert!(!run.contains("verification"), "{run}");

    let verify = bench_failure(&[
        "--handle", forged, "--block", "4K", "--op", "read", "--verify", "--iters", "1",
    ]);
    assert!(
        verify.contains(
            "verification of the 4096-byte-block read run failed: writing the known bytes 0..65536"
        ),
        "{verify}"
    );
    assert!(!verify.contains("measured run"), "{verify}");
    stop(dir, server);
}
