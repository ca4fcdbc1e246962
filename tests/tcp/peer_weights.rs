//! Weight publication in a peer process: peer commands that make it a
//! publisher rank or a subscriber of the test matrix
//! (`tests/shared/weights_data.rs`), and the harness calls that send them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use ferry::LocalLayout;
use ferry::prelude::*;
use ferry::weights::{Publisher, Subscriber};

use super::PeerProcess;

/// The test matrix, for the suites too (a file is loaded once).
#[path = "../shared/weights_data.rs"]
pub mod data;
use data::{fill, held, layout, local};

/// How long a peer's publish or update may take (soft-RoCE under TCG is
/// slow; only a hang fails it).
const DEADLINE: Duration = Duration::from_secs(60);

/// The peer's publisher ranks and subscribers, by set name.
#[derive(Default)]
pub struct Weights {
    publishers: HashMap<String, (Publisher, LocalLayout)>,
    subscribers: HashMap<String, Subscriber>,
}

/// The weights commands; `None` for any other line.
///
/// - `weights-publish SET RANK PARTS VERSION`: rank RANK of PARTS (rows
///   split) of SET, started at the first one; writes VERSION and publishes
///   it. Answers `published OVERRUN`.
/// - `weights-subscribe SET RANK PARTS ADDR,ADDR...`: a subscriber of SET
///   holding rank RANK of PARTS (columns split), checksums on, planned
///   against the publisher ranks at those addresses. Answers `subscribed`.
/// - `weights-update SET`: one update. Answers `VERSION HELD`, HELD being
///   the version the buffer's bytes hold whole (`none`).
///
/// Errors answer their `Display`.
pub async fn command(node: &Node, weights: &mut Weights, words: &[&str]) -> Option<String> {
    let reply = match words {
        ["weights-publish", set, rank, parts, version] => {
            let key = set.to_string();
            if !weights.publishers.contains_key(&key) {
                let memory = local(node, layout(rank.parse().ok()?, parts.parse().ok()?, 0)).await;
                match Publisher::start(node, set, memory.clone()) {
                    Ok(publisher) => weights.publishers.insert(key.clone(), (publisher, memory)),
                    Err(e) => return Some(e.to_string()),
                };
            }
            let (publisher, memory) = &weights.publishers[&key];
            let version = version.parse().ok()?;
            let (guard, overrun) = publisher.write(DEADLINE).await;
            fill(memory, version);
            match guard.publish(version) {
                Ok(()) => format!("published {overrun}"),
                Err(e) => e.to_string(),
            }
        }
        ["weights-subscribe", set, rank, parts, addrs] => {
            let addrs: Vec<SocketAddr> = addrs
                .split(',')
                .map(|a| a.parse().ok())
                .collect::<Option<_>>()?;
            let buffer = local(node, layout(rank.parse().ok()?, parts.parse().ok()?, 1)).await;
            match Subscriber::new(node, set, &addrs, vec![buffer], DEADLINE).await {
                Ok(mut subscriber) => {
                    subscriber.verify_checksums(true);
                    weights.subscribers.insert(set.to_string(), subscriber);
                    "subscribed".to_string()
                }
                Err(e) => e.to_string(),
            }
        }
        ["weights-update", set] => {
            let subscriber = weights.subscribers.get_mut(*set)?;
            match subscriber.update(DEADLINE).await {
                Ok(update) => {
                    let held = held(&subscriber.buffers()[update.buffer]);
                    let held = held.map_or("none".to_string(), |v| v.to_string());
                    format!("{} {held}", update.version)
                }
                Err(e) => e.to_string(),
            }
        }
        _ => return None,
    };
    Some(reply.replace('\n', " "))
}

#[allow(dead_code)] // only the two-VM suite publishes from a peer
impl PeerProcess {
    /// The peer publishes `version` as rank `rank` of `parts` of `set`
    /// (rows split); how many readers it overran.
    pub async fn weights_publish(&mut self, set: &str, rank: u32, parts: u32, version: u64) -> u64 {
        let reply = self
            .command(&format!("weights-publish {set} {rank} {parts} {version}"))
            .await;
        let overrun = reply
            .strip_prefix("published ")
            .and_then(|n| n.parse().ok());
        overrun.unwrap_or_else(|| panic!("the peer did not publish: {reply}"))
    }

    /// The peer subscribes to `set` as rank `rank` of `parts` (columns
    /// split), checksums on, from the publisher ranks at `publishers`.
    pub async fn weights_subscribe(
        &mut self,
        set: &str,
        rank: u32,
        parts: u32,
        publishers: &[SocketAddr],
    ) {
        let addrs: Vec<String> = publishers.iter().map(ToString::to_string).collect();
        let line = format!("weights-subscribe {set} {rank} {parts} {}", addrs.join(","));
        let reply = self.command(&line).await;
        assert_eq!(reply, "subscribed", "the peer did not subscribe");
    }

    /// One update of the peer's subscriber of `set`: the version it
    /// reports, and the version its buffer's bytes hold whole.
    pub async fn weights_update(&mut self, set: &str) -> (u64, Option<u64>) {
        let reply = self.command(&format!("weights-update {set}")).await;
        let parsed = reply
            .split_once(' ')
            .and_then(|(version, held)| Some((version.parse().ok()?, held.parse().ok())));
        parsed.unwrap_or_else(|| panic!("the peer's update failed: {reply}"))
    }
}
