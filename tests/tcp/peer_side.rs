//! The peer process's side of [`super::PeerProcess`]: a node plus a table
//! of regions, driven by one command per stdin line, answered one line each
//! on stdout.

use std::io::{BufRead, Write};
use std::time::Duration;

use ferry::prelude::*;

use super::*;

/// The peer side: a node plus a table of regions, driven by stdin.
pub fn peer_main() {
    static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        report(info)
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let stdin = std::io::stdin();
        let mut stdout = std::io::stdout();
        let mut builder = Node::builder();
        if let Some(listen) = std::env::var_os(LISTEN_ENV) {
            let listen = listen.to_string_lossy();
            builder = builder.listen(
                listen
                    .parse()
                    .unwrap_or_else(|_| panic!("{LISTEN_ENV}={listen:?} is not IP:PORT")),
            );
        }
        if let Some(name) = std::env::var_os(NAME_ENV) {
            builder = builder.name(name.to_string_lossy());
        }
        let millis = |var: &str| {
            std::env::var(var).ok().map(|ms| {
                Duration::from_millis(
                    ms.parse()
                        .unwrap_or_else(|_| panic!("{var}={ms:?} is not milliseconds")),
                )
            })
        };
        if let Some(timeout) = millis(PEER_TIMEOUT_ENV) {
            builder = builder.peer_timeout(timeout);
        }
        if let Some(grace) = millis(SILENT_GRACE_ENV) {
            builder = builder.silent_grace(grace);
        }
        let node = match builder.spawn().await {
            Ok(node) => node,
            Err(error) => {
                // Every command gets the error, so the test can see it.
                let reply = format!("{SPAWN_FAILED}{error}").replace('\n', " ");
                for line in stdin.lock().lines() {
                    line.expect("stdin");
                    writeln!(stdout, "{PREFIX}{reply}").unwrap();
                    stdout.flush().unwrap();
                }
                return;
            }
        };
        let mut regions: Vec<Option<Region>> = Vec::new();
        let mut raws = raw::Raws::default();
        let mut weights = peer_weights::Weights::default();
        for line in stdin.lock().lines() {
            let line = line.expect("stdin");
            let words: Vec<&str> = line.split_whitespace().collect();
            let reply = match words.as_slice() {
                ["alloc", len, access, seed] => {
                    let access = if *access == "ro" {
                        Access::ReadOnly
                    } else {
                        Access::ReadWrite
                    };
                    let len: u64 = len.parse().unwrap();
                    let region = node.alloc(len, access).await.expect("peer alloc");
                    region
                        .write_at(0, &pattern(len as usize, seed.parse().unwrap()))
                        .unwrap();
                    let json = serde_json::to_string(&region.remote()).unwrap();
                    regions.push(Some(region));
                    format!("{} {json}", regions.len() - 1)
                }
                ["digest", index] => {
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    digest(&region.to_vec()).to_string()
                }
                ["contents", index] => {
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    region.to_vec().iter().map(|b| format!("{b:02x}")).collect()
                }
                ["panics"] => PANICS.load(std::sync::atomic::Ordering::SeqCst).to_string(),
                ["drop", index] => {
                    regions[index.parse::<usize>().unwrap()] = None;
                    "dropped".to_string()
                }
                ["addr"] => serde_json::to_string(&node.addr()).unwrap(),
                ["publish", index, name] => {
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    match node.publish(*name, region) {
                        Ok(()) => "published".to_string(),
                        Err(e) => e.to_string(),
                    }
                }
                // An RPC handler that never answers (until the process dies).
                ["serve-forever", name] => {
                    node.serve_rpc(name, |_| std::future::pending())
                        .expect("serve");
                    "serving".to_string()
                }
                ["notified", kind, batches, in_flight, _, ..] => {
                    let handle = line.trim().splitn(5, ' ').nth(4).unwrap_or_default();
                    let remote: RemoteBuffer = serde_json::from_str(handle).expect("handle JSON");
                    notified_batches(
                        &node,
                        kind,
                        batches.parse().unwrap(),
                        in_flight.parse().unwrap(),
                        remote,
                    )
                    .await
                }
                // One op over the whole local region; the rest of the line
                // is the remote handle as JSON.
                [kind @ ("write" | "read"), index, _, ..] => {
                    let handle = line.trim().splitn(3, ' ').nth(2).unwrap_or_default();
                    let region = regions[index.parse::<usize>().unwrap()]
                        .as_ref()
                        .expect("live region");
                    let remote: RemoteBuffer = serde_json::from_str(handle).expect("handle JSON");
                    let op = if *kind == "write" {
                        RdmaOp::write(region.whole(), remote)
                    } else {
                        RdmaOp::read(region.whole(), remote)
                    };
                    match node.submit(vec![op], PEER_OP_DEADLINE).await {
                        Ok(()) => "ok".to_string(),
                        Err(error) => error.to_string().replace('\n', " "),
                    }
                }
                [word, ..] if word.starts_with("weights-") => {
                    peer_weights::command(&node, &mut weights, &words)
                        .await
                        .unwrap_or_else(|| panic!("bad weights command {line:?}"))
                }
                other => raw::command(&node, &mut regions, &mut raws, other, &line)
                    .await
                    .unwrap_or_else(|| panic!("unknown peer command {other:?}")),
            };
            writeln!(stdout, "{PREFIX}{reply}").unwrap();
            stdout.flush().unwrap();
        }
    });
    // stdin closed: the test is over.
    std::process::exit(0);
}

/// The peer's side of [`PeerProcess::notified_batches`].
async fn notified_batches(
    node: &Node,
    kind: &str,
    batches: usize,
    in_flight: usize,
    remote: RemoteBuffer,
) -> String {
    use futures_util::StreamExt;

    let local = node
        .alloc((batches * SLOT) as u64, Access::ReadWrite)
        .await
        .expect("peer alloc");
    if kind == "write" {
        for i in 0..batches {
            local.write_at((i * SLOT) as u64, &slot_bytes(i)).unwrap();
        }
    }
    let half = (SLOT / 2) as u64;
    let results: Vec<Result<(), String>> = futures_util::stream::iter(0..batches)
        .map(|i| {
            let ops: Vec<RdmaOp> = [0, half]
                .into_iter()
                .map(|at| {
                    let range = (i * SLOT) as u64 + at..(i * SLOT) as u64 + at + half;
                    let (local, remote) = (
                        local.slice(range.clone()).unwrap(),
                        remote.slice(range).unwrap(),
                    );
                    if kind == "write" {
                        RdmaOp::write(local, remote)
                    } else {
                        RdmaOp::read(local, remote)
                    }
                })
                .collect();
            async move {
                node.submit_with_notification(
                    ops,
                    PEER_OP_DEADLINE,
                    (i as u32).to_le_bytes().to_vec(),
                )
                .await
                .map_err(|e| format!("batch {i}: {e}"))
            }
        })
        .buffer_unordered(in_flight)
        .collect()
        .await;
    if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
        return e;
    }
    if kind == "read" {
        let read = local.to_vec();
        for i in 0..batches {
            if read[i * SLOT..(i + 1) * SLOT] != slot_bytes(i)[..] {
                return format!("batch {i} read bytes the owner had already overwritten");
            }
        }
    }
    "ok".to_string()
}
