//! A hold on a connection: what keeps it from being evicted while state
//! its client cannot be seen to use depends on it.

use std::sync::Arc;

use super::Admission;

/// A hold on a connection ([`super::ConnectionPermit::hold`]); dropping it lets
/// go. One that holds nothing (for a session this node opened, which no
/// bound counts) may be had from `Session::hold` too.
pub struct ConnectionHold(pub(super) Option<(Arc<Admission>, u64)>);

impl ConnectionHold {
    /// A hold on nothing.
    pub(crate) fn none() -> Self {
        ConnectionHold(None)
    }
}

impl std::fmt::Debug for ConnectionHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ConnectionHold")
            .field(&self.0.as_ref().map(|(_, id)| id))
            .finish()
    }
}

impl Drop for ConnectionHold {
    fn drop(&mut self) {
        if let Some((admission, id)) = &self.0 {
            admission.hold(*id, false);
        }
    }
}
