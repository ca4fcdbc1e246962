//! Each device's port events: a rail whose link goes down is known at
//! once, not only when its queue pairs stop making progress.
//!
//! A port going down (`IBV_EVENT_PORT_ERR`: the cable, the switch port,
//! the netdev under soft-RoCE) marks its rail down. Every link's keeper
//! then fails that rail's pairs on its next tick (100 ms) where the peer
//! has another usable pair, as it fails a stalled one, and does not try
//! to repair them while the rail is down; a port that is active again
//! (`IBV_EVENT_PORT_ACTIVE`) clears the mark, and the next repair probes
//! the pairs. Without events (a driver that sends none) stall detection
//! still finds a dead rail, later.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

use crate::device::{Fabric, Rail};
use crate::verbs::{Context, DeviceEvent};

/// How often a watcher with no events checks that its backend still runs.
const ALIVE_CHECK: Duration = Duration::from_secs(1);

/// A device's event descriptor for tokio's reactor; owning the context
/// keeps the descriptor open for as long as the reactor watches it.
struct EventFd {
    _context: Arc<Context>,
    fd: RawFd,
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// Spawns one watcher per device of `fabric`, each running until `alive`
/// is gone (the backend stopped).
pub(crate) fn watch<T: Send + Sync + 'static>(fabric: &Fabric, alive: Weak<T>) {
    for nic in &fabric.nics {
        let rails: Vec<Arc<Rail>> = fabric
            .rails
            .iter()
            .filter(|r| Arc::ptr_eq(&r.context, &nic.context))
            .cloned()
            .collect();
        tokio::spawn(watch_device(nic.context.clone(), rails, alive.clone()));
    }
}

async fn watch_device<T>(context: Arc<Context>, rails: Vec<Arc<Rail>>, alive: Weak<T>) {
    let name = context.name().to_string();
    let fd = match context.event_fd() {
        Ok(fd) => fd,
        Err(e) => {
            warn!(device = %name, "port events not watched: {e}");
            return;
        }
    };
    // SAFETY: `EventFd` owns the context, so its descriptor stays open and
    // the same for the AsyncFd's whole life, as `register` requires.
    let fd = match unsafe {
        AsyncFd::register_with_interest(
            EventFd {
                _context: context.clone(),
                fd,
            },
            Interest::READABLE,
        )
    } {
        Ok(fd) => fd,
        Err(e) => {
            warn!(device = %name, "port events not watched: {e}");
            return;
        }
    };
    loop {
        let ready = tokio::time::timeout(ALIVE_CHECK, fd.readable()).await;
        if alive.strong_count() == 0 {
            return;
        }
        let Ok(Ok(mut guard)) = ready else { continue };
        loop {
            match context.next_event() {
                Ok(Some(event)) => apply(&rails, event),
                Ok(None) => break,
                Err(e) => {
                    warn!(device = %name, "port events no longer watched: {e}");
                    return;
                }
            }
        }
        guard.clear_ready();
    }
}

fn apply(rails: &[Arc<Rail>], event: DeviceEvent) {
    let (port, down) = match event {
        DeviceEvent::PortDown(port) => (Some(port), true),
        DeviceEvent::PortUp(port) => (Some(port), false),
        DeviceEvent::DeviceFatal => (None, true),
        DeviceEvent::Other(_) => return,
    };
    for rail in rails.iter().filter(|r| port.is_none_or(|p| p == r.port)) {
        if rail.set_down(down) != down {
            if down {
                warn!(rail = %rail.name(), ?event, "rail down: its pairs' work moves to the other rails");
            } else {
                info!(rail = %rail.name(), "rail up again: its pairs are probed and used again");
            }
        }
    }
}
