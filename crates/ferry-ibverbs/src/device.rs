//! The opened device and the port parameters every queue pair uses.

use std::sync::Arc;

use crate::verbs::{Context, ProtectionDomain, QpTiming, VerbsError, device_names};

/// The owner's notification coalescing on a software RDMA device when
/// [`IbvConfig::notify_coalesce`] leaves it to the device.
pub const SOFTWARE_NOTIFY_COALESCE: std::time::Duration = std::time::Duration::from_millis(5);

/// How the ibverbs backend picks and uses its device.
#[derive(Clone, Debug)]
pub struct IbvConfig {
    /// Device name (e.g. `mlx5_0`, `rxe0`); the first device when `None`.
    pub device: Option<String>,
    /// Port number, from 1 (the default); opening fails unless it is active.
    pub port: u8,
    /// GID table index; the first IPv4-mapped (RoCE v2) GID when `None`.
    pub gid_index: Option<u32>,
    /// Send-queue depth per queue pair (capped by the device): how many work
    /// requests may be outstanding to one peer. Larger batches stream
    /// through it.
    pub max_send_wr: u32,
    /// Largest piece of an op one work request carries; larger ops are
    /// split. The port's maximum message size when `None`, and never more.
    /// A smaller cap keeps one huge op from holding the send queue alone.
    pub max_wr_bytes: Option<u32>,
    /// Receive buffers this node posts, per initiator, for notifications
    /// that ride the initiator's queue pair: how many it may have in flight
    /// (its credits). 0 takes every notification over the control session.
    pub notify_slots: u16,
    /// Bytes per notification receive buffer: larger notifications (up to
    /// the node's message limit) go over the control session.
    pub notify_slot_len: u32,
    /// How long the owner waits, after handing notifications to its inbox,
    /// before it looks for more, instead of sleeping until the next one
    /// raises an event; it goes back to sleeping on events once a look
    /// finds none. Zero delivers each notification on its own event.
    /// `None` (the default) picks by device: zero on a hardware NIC,
    /// [`SOFTWARE_NOTIFY_COALESCE`] on a software one (soft-RoCE, siw).
    ///
    /// Each event wakes the owner's thread as the notification lands. On
    /// a hardware NIC that costs the sender nothing: the NIC acknowledges
    /// the SEND. A software device acknowledges it with the owner's own
    /// CPU, so the woken thread competes with that work: in the two-VM
    /// harness (one vCPU each) a notified 4 KiB write cost 314-402 µs more
    /// than a plain one with zero, 196-275 µs with 5 ms (1 ms is too short
    /// there: notifications come about 1 ms apart, so a look 1 ms later
    /// often finds none and the owner goes back to events). The price is
    /// that notifications arriving in a stream reach the inbox up to this much
    /// later; the first after a quiet spell still comes at once, and an
    /// idle owner does not poll.
    pub notify_coalesce: Option<std::time::Duration>,
    /// How queue pairs retransmit (see [`QpTiming`] for the defaults).
    pub qp_timing: QpTiming,
    /// Whether a region registered inside a registered one, with the same
    /// access, shares its memory region instead of registering its pages
    /// again (on by default; see the `mr_cache` module docs for what a peer
    /// holding the inner region's handle can then reach).
    pub share_registrations: bool,
}

impl Default for IbvConfig {
    fn default() -> Self {
        IbvConfig {
            device: None,
            port: 1,
            gid_index: None,
            max_send_wr: 1024,
            max_wr_bytes: None,
            notify_slots: 32,
            notify_slot_len: 4096,
            notify_coalesce: None,
            share_registrations: true,
            qp_timing: QpTiming::default(),
        }
    }
}

pub(crate) struct Device {
    pub context: Arc<Context>,
    pub pd: Arc<ProtectionDomain>,
    pub port: u8,
    pub gid_index: u32,
    pub gid: [u8; 16],
    pub lid: u16,
    /// `ibv_mtu` value of the port.
    pub mtu: u32,
    /// Largest message one work request may carry on this port.
    pub max_msg: u32,
    pub max_send_wr: u32,
    /// Notification receive buffers per initiator, and their size.
    pub notify_slots: u16,
    pub notify_slot_len: u32,
    /// [`IbvConfig::notify_coalesce`], resolved for this device.
    pub notify_coalesce: std::time::Duration,
    pub qp_timing: QpTiming,
    /// See [`IbvConfig::share_registrations`].
    pub share_registrations: bool,
}

impl Device {
    pub fn open(config: &IbvConfig) -> Result<Device, VerbsError> {
        // Distinguishes "no device at all" (the normal TCP-only host) from a
        // named device that is missing.
        device_names()?;
        let context = Context::open(config.device.as_deref())?;
        let port = context.port(config.port)?;
        if !port.active {
            return Err(VerbsError::Call {
                call: "port state",
                source: std::io::Error::other(format!(
                    "{} port {} is not active",
                    context.name(),
                    config.port
                )),
            });
        }
        let (gid_index, gid) = match config.gid_index {
            Some(index) => (index, context.gid(config.port, index)?),
            None => context.ipv4_gid(config.port)?,
        };
        if gid == [0; 16] {
            // An unused table entry: queue pairs addressed with it never connect.
            return Err(VerbsError::Call {
                call: "ibv_query_gid",
                source: std::io::Error::other(format!(
                    "GID index {gid_index} of {} port {} is empty",
                    context.name(),
                    config.port
                )),
            });
        }
        let limits = context.limits()?;
        let pd = ProtectionDomain::new(&context)?;
        Ok(Device {
            pd,
            port: config.port,
            gid_index,
            gid,
            lid: port.lid,
            mtu: port.active_mtu,
            max_msg: config
                .max_wr_bytes
                .map_or(port.max_msg_size, |cap| cap.min(port.max_msg_size))
                .max(1),
            max_send_wr: config
                .max_send_wr
                .clamp(1, limits.max_qp_wr.saturating_sub(1).max(1)),
            notify_slots: config
                .notify_slots
                .min(limits.max_qp_wr.min(u32::from(u16::MAX)) as u16),
            notify_slot_len: config.notify_slot_len,
            notify_coalesce: config.notify_coalesce.unwrap_or(if context.is_software() {
                SOFTWARE_NOTIFY_COALESCE
            } else {
                std::time::Duration::ZERO
            }),
            share_registrations: config.share_registrations,
            qp_timing: config.qp_timing,
            context,
        })
    }
}
