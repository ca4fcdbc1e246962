//! Churn: many peers come to one node, move bytes, and go away (shut down,
//! dropped, or killed), after which the node holds no more per-peer state,
//! descriptors or connections than before; and a 16-process all-to-all of
//! reads, writes, notifications, messages and calls in which every byte is
//! compared and every delivery arrives exactly once.
//!
//! Peers that must be separate processes run in a re-executed copy of this
//! test binary (`churn_child`, with [`ROLE_ENV`] naming what it plays). The
//! tests of this binary run one at a time ([`serial`]): the first counts
//! this process's descriptors, which another test running beside it would
//! change.
//!
//! `scripts/soak.sh` runs the same tests for minutes ([`SOAK_ENV`]).

mod all_to_all;
mod child;
mod thousand;

use std::sync::Mutex;
use std::time::Duration;

use ferry::prelude::*;

/// What a re-executed copy of this binary plays (`member`, `victim`).
pub const ROLE_ENV: &str = "FERRY_CHURN_ROLE";
/// Seconds to keep churning (the soak); unset: the suite's short run.
pub const SOAK_ENV: &str = "FERRY_SOAK_SECONDS";
/// Deadline of any one transfer, message or call.
pub const DEADLINE: Duration = Duration::from_secs(20);
/// Prefix of a child's answers on its stdout (libtest prints there too).
pub const PREFIX: &str = "CHURN ";

/// Entry point of the child processes; does nothing in a normal test run.
#[test]
fn churn_child() {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        child::main(&role);
    }
}

/// Runs `test` on a fresh runtime, never beside another test of this
/// binary.
pub fn serial(test: impl std::future::Future<Output = ()>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(test);
}

/// The soak's duration, when one was asked for.
pub fn soak() -> Option<Duration> {
    let seconds: u64 = std::env::var(SOAK_ENV).ok()?.parse().ok()?;
    Some(Duration::from_secs(seconds))
}

/// Deterministic bytes for `len`, different for each seed.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// This process's resident set, in KiB.
pub fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Writes `bytes` from a fresh local region of `node` into `remote`, reads
/// them back into another, and compares.
pub async fn write_and_check(node: &Node, remote: &RemoteBuffer, bytes: &[u8]) {
    let len = bytes.len() as u64;
    let src = node.alloc(len, Access::ReadWrite).await.unwrap();
    src.write_at(0, bytes).unwrap();
    node.submit(vec![RdmaOp::write(src.whole(), remote.clone())], DEADLINE)
        .await
        .unwrap_or_else(|e| panic!("write to {}: {e}", remote.owner().endpoint));
    read_and_check(node, remote, bytes).await;
}

/// Reads `remote` into a fresh local region of `node` and compares it with
/// `expected`.
pub async fn read_and_check(node: &Node, remote: &RemoteBuffer, expected: &[u8]) {
    let dst = node
        .alloc(expected.len() as u64, Access::ReadWrite)
        .await
        .unwrap();
    node.submit(vec![RdmaOp::read(dst.whole(), remote.clone())], DEADLINE)
        .await
        .unwrap_or_else(|e| panic!("read from {}: {e}", remote.owner().endpoint));
    assert!(
        dst.to_vec() == expected,
        "bytes read from {} differ from those written",
        remote.owner().endpoint
    );
}
