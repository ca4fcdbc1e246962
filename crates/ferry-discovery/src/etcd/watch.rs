//! Keeps the peers a node looked up through etcd current: a watch on the
//! namespace drops a peer whose key went and reloads one republished.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use tracing::{info, warn};

use super::{Etcd, EtcdError, next_answer};
use crate::metadata::NodeMetadata;
use crate::peers::{Loaded, Peers};

/// The longest pause between attempts to watch again.
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The watch task; it stops when this is dropped.
pub struct PeerWatch(tokio::task::JoinHandle<()>);

impl Drop for PeerWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PeerWatch {
    pub(super) fn start(
        etcd: Etcd,
        peers: Arc<Peers>,
        tracked: Arc<Mutex<BTreeSet<String>>>,
    ) -> Self {
        PeerWatch(tokio::spawn(watch_peers(etcd, peers, tracked)))
    }
}

fn tracked_names(tracked: &Mutex<BTreeSet<String>>) -> BTreeSet<String> {
    tracked.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Applies one key's state to the cache: `Some` reloads, `None` forgets.
fn apply(peers: &Peers, name: &str, metadata: Option<NodeMetadata>) {
    match metadata {
        Some(metadata) => match peers.load(metadata) {
            Loaded::Restarted { previous } => {
                info!(peer = name, previous = %previous.endpoint, "etcd: peer restarted; cache holds the new incarnation")
            }
            Loaded::New | Loaded::Refreshed => {}
        },
        None => {
            if peers.forget(name) {
                info!(peer = name, "etcd: peer's key is gone; forgotten");
            }
        }
    }
}

async fn watch_peers(etcd: Etcd, peers: Arc<Peers>, tracked: Arc<Mutex<BTreeSet<String>>>) {
    let mut pause = Duration::from_millis(100);
    loop {
        let mut followed = false;
        let Err(e) = watch_once(&etcd, &peers, &tracked, &mut followed).await;
        if followed {
            // It had worked: etcd was lost just now, try again soon.
            pause = Duration::from_millis(100);
        }
        warn!("etcd: peer watch interrupted, again in {pause:?}: {e}");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// Resynchronizes the tracked peers with the namespace, then follows its
/// changes until the stream breaks. Resynchronizing first covers what
/// happened while no watch ran (etcd lost, a new etcd without the keys).
/// Returns only when it stops; `followed` tells whether the watch had
/// started.
async fn watch_once(
    etcd: &Etcd,
    peers: &Peers,
    tracked: &Mutex<BTreeSet<String>>,
    followed: &mut bool,
) -> Result<std::convert::Infallible, EtcdError> {
    let prefix = etcd.config.prefix();
    let (nodes, revision) = etcd.nodes().await?;
    let mut present: BTreeMap<String, Option<NodeMetadata>> = nodes
        .into_iter()
        .map(|node| (node.name, Etcd::decode(&node.key, &node.value).ok()))
        .collect();
    for name in tracked_names(tracked) {
        apply(peers, &name, present.remove(&name).flatten());
    }

    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = etcd.watch(prefix.clone(), options).await?;
    *followed = true;
    loop {
        let answer = next_answer(&mut stream).await?;
        if answer.canceled() {
            return Err(EtcdError::Request {
                what: "watch",
                reason: format!("cancelled by etcd: {}", answer.cancel_reason()),
            });
        }
        let tracked = tracked_names(tracked);
        for event in answer.events() {
            let Some(kv) = event.kv() else { continue };
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let Some(name) = key.strip_prefix(&prefix) else {
                continue;
            };
            if !tracked.contains(name) {
                continue;
            }
            match event.event_type() {
                EventType::Put => match Etcd::decode(&key, kv.value()) {
                    Ok(metadata) => apply(peers, name, Some(metadata)),
                    Err(e) => {
                        warn!("etcd: {e}; forgetting the peer");
                        apply(peers, name, None);
                    }
                },
                EventType::Delete => apply(peers, name, None),
            }
        }
    }
}
