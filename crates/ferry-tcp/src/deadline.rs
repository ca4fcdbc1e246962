//! One timer task per node for the deadlines of answered-on-completion
//! submits (`Peers::start`): a submit that is answered from the thread
//! that finishes it has no task of its own to race a timer in.
//!
//! The keeper sleeps until the earliest deadline it knows of and is woken
//! only when a submit brings an earlier one. Submits usually share one
//! timeout, so each new deadline lies after the one it sleeps towards and
//! a submit costs a map insert and remove, never a wake-up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::BatchProgress;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Which entry a submit added, to remove it when the submit is answered.
pub(crate) type Key = (Instant, u64);

/// The deadlines of submits in flight; see the module docs.
pub(crate) struct Deadlines {
    inner: Mutex<Inner>,
    /// Wakes the keeper for a deadline earlier than the one it sleeps towards.
    earlier: Notify,
    /// Stops the keeper.
    stop: CancellationToken,
}

#[derive(Default)]
struct Inner {
    entries: BTreeMap<Key, (Arc<BatchProgress>, Duration)>,
    next_id: u64,
    /// What the keeper sleeps towards; `None` while it waits for any entry.
    sleeping_until: Option<Instant>,
}

impl Deadlines {
    /// Spawns the keeper on the current tokio runtime; it runs until
    /// [`Deadlines::stop`].
    pub fn start() -> Arc<Self> {
        let deadlines = Arc::new(Deadlines {
            inner: Mutex::default(),
            earlier: Notify::new(),
            stop: CancellationToken::new(),
        });
        tokio::spawn(keep(deadlines.clone()));
        deadlines
    }

    /// Expires `progress` with `timeout` at `deadline` unless removed first.
    pub fn insert(
        &self,
        deadline: Instant,
        progress: Arc<BatchProgress>,
        timeout: Duration,
    ) -> Key {
        let mut inner = self.lock();
        inner.next_id += 1;
        let key = (deadline, inner.next_id);
        inner.entries.insert(key, (progress, timeout));
        if inner.sleeping_until.is_none_or(|at| deadline < at) {
            inner.sleeping_until = Some(deadline);
            self.earlier.notify_one();
        }
        key
    }

    /// Forgets an answered submit's deadline.
    pub fn remove(&self, key: Key) {
        self.lock().entries.remove(&key);
    }

    /// Ends the keeper; deadlines still pending never expire.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Expires what is due, then sleeps until the next deadline, an earlier
/// one arriving, or the stop.
async fn keep(deadlines: Arc<Deadlines>) {
    loop {
        let (due, next) = {
            let mut inner = deadlines.lock();
            let now = Instant::now();
            let mut due = Vec::new();
            while let Some(entry) = inner.entries.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            let next = inner.entries.first_key_value().map(|(key, _)| key.0);
            inner.sleeping_until = next;
            (due, next)
        };
        // Outside the lock: an answer removes its own key.
        for (progress, timeout) in due {
            progress.expire(timeout);
        }
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = deadlines.stop.cancelled() => return,
            _ = deadlines.earlier.notified() => {}
            _ = sleep => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::SubmitError;

    type Seen = Arc<Mutex<Vec<(&'static str, Result<(), SubmitError>)>>>;

    fn batch(name: &'static str, seen: &Seen) -> Arc<BatchProgress> {
        let progress = Arc::new(BatchProgress::new([1]));
        let seen = seen.clone();
        progress.answer_when_done(Box::new(move |r| seen.lock().unwrap().push((name, r))));
        progress
    }

    fn names(seen: &Seen) -> Vec<&'static str> {
        seen.lock().unwrap().iter().map(|(name, _)| *name).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn expires_what_is_due_and_nothing_removed() {
        let deadlines = Deadlines::start();
        let seen = Seen::default();
        let secs = Duration::from_secs;
        let now = Instant::now();
        let late = batch("late", &seen);
        deadlines.insert(now + secs(10), late, secs(10));
        // Earlier than what the keeper sleeps towards: it is woken for it.
        let early = batch("early", &seen);
        deadlines.insert(now + secs(1), early.clone(), secs(1));
        let removed = batch("removed", &seen);
        let key = deadlines.insert(now + secs(2), removed.clone(), secs(2));
        deadlines.remove(key);

        tokio::time::sleep(secs(5)).await;
        assert_eq!(names(&seen), ["early"]);
        assert!(early.is_abandoned());
        assert!(!removed.is_abandoned());

        tokio::time::sleep(secs(6)).await;
        assert_eq!(names(&seen), ["early", "late"]);
        assert!(matches!(
            seen.lock().unwrap()[1].1,
            Err(SubmitError::Timeout { .. })
        ));
        deadlines.stop();
    }
}
