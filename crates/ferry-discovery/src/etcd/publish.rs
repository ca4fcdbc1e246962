//! A node's leased key in etcd, kept alive, republished after losses.

use std::time::Duration;

use bytes::Bytes;
use etcd_client::PutOptions;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{Etcd, EtcdError};

/// The first and the longest pause between attempts to reach etcd again.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// A node's metadata published in etcd under a lease, for as long as this
/// lives: the key is kept alive every third of the TTL, rewritten when the
/// metadata changes ([`Publication::update`]), and put back under a new
/// lease whenever etcd was lost (restarted, unreachable, the lease expired).
/// Dropping it revokes the lease in the background, which deletes the key;
/// [`Publication::withdraw`] does so and waits.
pub struct Publication {
    blob: watch::Sender<Bytes>,
    published: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Publication {
    pub(super) fn start(etcd: Etcd, key: String, blob: Bytes) -> Self {
        let (blob, blobs) = watch::channel(blob);
        let (state, published) = watch::channel(false);
        let task = tokio::spawn(keep_published(etcd, key, blobs, state));
        Publication {
            blob,
            published,
            task,
        }
    }

    /// Replaces the published metadata.
    pub fn update(&self, blob: Bytes) {
        self.blob.send_replace(blob);
    }

    /// Whether the key is in etcd now, as far as this node knows.
    pub fn is_published(&self) -> bool {
        *self.published.borrow()
    }

    /// Follows whether the key is in etcd (for waiting on it).
    pub fn watch_published(&self) -> watch::Receiver<bool> {
        self.published.clone()
    }

    /// Deletes the key (revokes its lease), waiting up to `timeout`.
    pub async fn withdraw(self, timeout: Duration) -> Result<(), EtcdError> {
        let Publication { blob, task, .. } = self;
        drop(blob);
        match tokio::time::timeout(timeout, task).await {
            Ok(_) => Ok(()),
            Err(_) => Err(EtcdError::Timeout {
                what: "withdraw",
                after: timeout,
            }),
        }
    }
}

/// How one lease ended.
enum Ended {
    /// The publication was dropped: revoke and stop.
    Withdrawn,
    /// etcd was lost or the lease is gone: publish again.
    Lost(String),
}

async fn keep_published(
    etcd: Etcd,
    key: String,
    mut blobs: watch::Receiver<Bytes>,
    state: watch::Sender<bool>,
) {
    let mut pause = BACKOFF.0;
    loop {
        let blob = blobs.borrow_and_update().clone();
        let lease = match put_leased(&etcd, &key, blob).await {
            Ok(lease) => lease,
            Err(e) => {
                warn!(%key, "etcd: cannot publish, retrying in {pause:?}: {e}");
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    changed = blobs.changed() => if changed.is_err() { return },
                }
                pause = (pause * 2).min(BACKOFF.1);
                continue;
            }
        };
        pause = BACKOFF.0;
        state.send_replace(true);
        info!(%key, lease, "etcd: published");
        let ended = keep_alive(&etcd, &key, lease, &mut blobs).await;
        state.send_replace(false);
        match ended {
            Ended::Withdrawn => {
                // Revoking deletes the key at once; if etcd is gone, the
                // lease runs out instead.
                let revoked = etcd
                    .call("lease revoke", |mut c| async move {
                        c.lease_revoke(lease).await
                    })
                    .await;
                match revoked {
                    Ok(_) => info!(%key, "etcd: withdrawn"),
                    Err(e) => {
                        warn!(%key, "etcd: withdraw failed, the key expires with its lease: {e}")
                    }
                }
                return;
            }
            Ended::Lost(why) => warn!(%key, "etcd: publication lost ({why}); republishing"),
        }
    }
}

/// Grants a lease and puts the key under it.
async fn put_leased(etcd: &Etcd, key: &str, blob: Bytes) -> Result<i64, EtcdError> {
    let ttl = etcd.config.ttl_seconds();
    let lease = etcd
        .call("lease grant", |mut c| async move {
            c.lease_grant(ttl, None).await
        })
        .await?
        .id();
    put(etcd, key, blob, lease).await?;
    Ok(lease)
}

async fn put(etcd: &Etcd, key: &str, blob: Bytes, lease: i64) -> Result<(), EtcdError> {
    let key = key.to_string();
    etcd.call("put", |mut c| async move {
        c.put(
            key,
            blob.to_vec(),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
    })
    .await
    .map(drop)
}

/// Renews `lease` every third of its TTL until the publication is dropped
/// or the lease cannot be kept: no answer for a whole TTL means etcd may
/// already have deleted the key.
async fn keep_alive(
    etcd: &Etcd,
    key: &str,
    lease: i64,
    blobs: &mut watch::Receiver<Bytes>,
) -> Ended {
    let (mut keeper, mut answers) = match etcd
        .call("lease keep-alive", |mut c| async move {
            c.lease_keep_alive(lease).await
        })
        .await
    {
        Ok(stream) => stream,
        Err(e) => return Ended::Lost(e.to_string()),
    };
    let ttl = etcd.config.lease_ttl;
    let mut renew = tokio::time::interval(ttl / 3);
    let mut renewed = Instant::now();
    loop {
        tokio::select! {
            _ = renew.tick() => {
                if renewed.elapsed() > ttl {
                    return Ended::Lost(format!("no keep-alive answer for {ttl:?}"));
                }
                if let Err(e) = keeper.keep_alive().await {
                    return Ended::Lost(e.to_string());
                }
            }
            answer = answers.message() => match answer {
                Ok(Some(answer)) if answer.ttl() > 0 => renewed = Instant::now(),
                Ok(Some(_)) => return Ended::Lost("the lease expired".into()),
                Ok(None) => return Ended::Lost("etcd closed the keep-alive stream".into()),
                Err(e) => return Ended::Lost(e.to_string()),
            },
            changed = blobs.changed() => {
                if changed.is_err() {
                    return Ended::Withdrawn;
                }
                let blob = blobs.borrow_and_update().clone();
                if let Err(e) = put(etcd, key, blob, lease).await {
                    return Ended::Lost(e.to_string());
                }
            }
        }
    }
}
