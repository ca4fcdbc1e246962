//! Which transports a node runs, and for each that could not start, why
//! (what NIXL users know as `get_available_plugins`).

use ferry_core::RdmaTransportLevel;

/// One transport of a node: running, or why not.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportStatus {
    /// Which transport.
    pub level: RdmaTransportLevel,
    /// Whether it runs.
    pub state: TransportState,
}

/// Whether a transport runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportState {
    /// It runs; `detail` says on what (device and port, connections).
    Running {
        /// What it runs on.
        detail: String,
    },
    /// It could not start (no device, disabled, not implemented).
    Unavailable {
        /// Why.
        reason: String,
    },
}

impl TransportStatus {
    /// Whether the transport runs.
    pub fn is_running(&self) -> bool {
        matches!(self.state, TransportState::Running { .. })
    }

    /// Why the transport does not run (`None` when it does).
    pub fn unavailable(&self) -> Option<&str> {
        match &self.state {
            TransportState::Running { .. } => None,
            TransportState::Unavailable { reason } => Some(reason),
        }
    }
}

impl std::fmt::Display for TransportStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.state {
            TransportState::Running { detail } => write!(f, "{}: running ({detail})", self.level),
            TransportState::Unavailable { reason } => {
                write!(f, "{}: unavailable: {reason}", self.level)
            }
        }
    }
}
