//! The rails this node moves bytes on, and the settings every queue pair
//! uses. A rail is one active port of one RDMA device: a node with four
//! dual-port NICs has up to eight. Each device gets one protection domain,
//! which its ports share, so a region registered once per device has a key
//! on every rail.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ferry_core::MAX_RAILS;
use tracing::info;

use crate::placement::Placement;
use crate::verbs::{Context, ProtectionDomain, QpTiming, SYSFS_CLASS, VerbsError, device_names};

/// The owner's notification coalescing on a software RDMA device when
/// [`IbvConfig::notify_coalesce`] leaves it to the device.
pub const SOFTWARE_NOTIFY_COALESCE: std::time::Duration = std::time::Duration::from_millis(5);

/// Names the rails a node uses, as [`IbvConfig::rails`] and the
/// `FERRY_IBV_RAILS` environment variable give them: a comma-separated
/// list of `device` (every active port of it) or `device:port`.
pub const RAILS_ENV: &str = "FERRY_IBV_RAILS";

/// [`IbvConfig::stall_timeout`] on a hardware NIC: far above the gap
/// between completions of a working pair (ferry signals at least every
/// 256 KiB), short enough that a cut rail's traffic moves within a second.
pub const DEFAULT_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// [`IbvConfig::stall_timeout`] on a software device (soft-RoCE, siw),
/// whose queue pairs are served by the host's CPU: in the two-VM harness
/// (one emulated vCPU each) a working pair went more than 500 ms without a
/// completion while the other pair's traffic had the CPU, and was failed
/// for nothing.
pub const SOFTWARE_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The default [`IbvConfig::stripe_min`].
pub const DEFAULT_STRIPE_MIN: u64 = 128 << 10;

/// The default [`IbvConfig::max_wr_bytes`]: large enough that a NIC moves
/// it at line rate (a 400 Gb/s port takes 10 µs per request), small enough
/// to spread. In the two-VM soft-RoCE harness with rate-limited wires
/// (`scripts/bench-rails.sh 16mbit 24 1`), 16 MiB reads over two rails
/// moved 1.47 times one rail's bytes with 1 MiB requests and 1.98 times
/// with 512 KiB ones; writes and 1 MiB reads were at 1.95-2.04 either way.
pub const DEFAULT_MAX_WR_BYTES: u32 = 512 << 10;

/// Sets [`IbvConfig::max_wr_bytes`] for the nodes of a process that leave
/// it at its default: a number of bytes, or 0 for each port's maximum. For
/// trying another work-request size on a fabric without rebuilding (`ferry
/// bench`, `ferry serve`).
pub const MAX_WR_BYTES_ENV: &str = "FERRY_IBV_MAX_WR_BYTES";

/// [`MAX_WR_BYTES_ENV`]'s value as [`IbvConfig::max_wr_bytes`].
fn parse_max_wr_bytes(value: &str) -> Result<Option<u32>, String> {
    match value.trim().parse::<u32>() {
        Ok(0) => Ok(None),
        Ok(bytes) => Ok(Some(bytes)),
        Err(_) => Err(format!(
            "{MAX_WR_BYTES_ENV}={value:?}: want a number of bytes (0: the port's maximum)"
        )),
    }
}

/// One rail asked for by name: a device, and one port of it or all its
/// active ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailName {
    /// The device, e.g. `mlx5_0` or `rxe1`.
    pub device: String,
    /// The port, from 1; every active port when `None`.
    pub port: Option<u8>,
}

impl RailName {
    /// Parses `mlx5_0:1,mlx5_1` (see [`RAILS_ENV`]).
    pub fn parse_list(list: &str) -> Result<Vec<RailName>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|item| match item.split_once(':') {
                None => Ok(RailName {
                    device: item.to_string(),
                    port: None,
                }),
                Some((device, port)) => match port.parse::<u8>() {
                    Ok(port) if port > 0 && !device.is_empty() => Ok(RailName {
                        device: device.to_string(),
                        port: Some(port),
                    }),
                    _ => Err(format!(
                        "rail {item:?}: want DEVICE or DEVICE:PORT, the port a number from 1"
                    )),
                },
            })
            .collect()
    }
}

/// How the ibverbs backend picks and uses its rails.
#[derive(Clone, Debug)]
pub struct IbvConfig {
    /// The rails to use, in rail order. `None` (the default) takes
    /// [`RAILS_ENV`] if set, else every active port of every device.
    /// Opening fails if a named device is missing or a named port is not
    /// active.
    pub rails: Option<Vec<RailName>>,
    /// GID table index on every rail; each rail's first IPv4-mapped (RoCE
    /// v2) GID when `None`.
    pub gid_index: Option<u32>,
    /// Send-queue depth per queue pair (capped by the device): how many work
    /// requests may be outstanding to one peer on one rail. Larger batches
    /// stream through it.
    pub max_send_wr: u32,
    /// Largest piece of an op one work request carries; larger ops are
    /// split. [`DEFAULT_MAX_WR_BYTES`] by default; the port's maximum
    /// message size when `None`, and never more. A cap keeps one huge op
    /// from holding the send queue alone, gives striping and failover a
    /// grain finer than an op, and keeps a software device's responder from
    /// answering one READ with a burst of thousands of packets (in the
    /// two-VM soft-RoCE harness, 8 MiB READs over two rails lost response
    /// packets to the virtual wire's buffers and never completed; 1 MiB
    /// ones did). [`MAX_WR_BYTES_ENV`] sets it for a process whose nodes
    /// leave the default.
    pub max_wr_bytes: Option<u32>,
    /// An op of at least this many bytes is split across every rail pair to
    /// its peer, by bytes; smaller ops each go whole to the pair with the
    /// fewest bytes outstanding. [`DEFAULT_STRIPE_MIN`] by default.
    pub stripe_min: u64,
    /// Which rails a region prefers: by default those on its memory's NUMA
    /// node (see [`Placement`]). A region can be pinned to rails of its
    /// own with [`crate::IbvBackend::pin_rails`].
    pub placement: Placement,
    /// How long a rail pair with work due may go without a completion
    /// before ferry takes it for stalled, while the peer has other pairs:
    /// it is failed (its queue pair flushed) and its unfinished work is
    /// posted again on the pairs left. A lossy or cut wire can keep a
    /// queue pair retrying for seconds on a NIC, and forever on
    /// soft-RoCE. With a single pair nothing is failed early: the batch's
    /// own deadline and the peer's liveness bound it. `None` (the default)
    /// picks by device: [`DEFAULT_STALL_TIMEOUT`] on a hardware NIC,
    /// [`SOFTWARE_STALL_TIMEOUT`] on a software one.
    pub stall_timeout: Option<std::time::Duration>,
    /// Receive buffers this node posts, per initiator and rail pair, for
    /// notifications that ride the initiator's queue pair: how many it may
    /// have in flight (its credits). 0 takes every notification over the
    /// control session.
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
    /// Queue pairs this node keeps for any one initiator's control session:
    /// ferry's own (one per rail pair it proposes) and its leases'. A pair
    /// asked for beyond it is refused, and the asker gets
    /// `OpError::PeerBusy`. Each costs a queue pair and a completion queue
    /// on the device and a descriptor, and ferry's own a registered ring of
    /// `notify_slots × notify_slot_len` bytes. Any peer with a session may
    /// ask (with a cluster secret, only those that proved it).
    /// [`DEFAULT_MAX_PASSIVE_QPS_PER_SESSION`] by default.
    pub max_passive_qps_per_session: usize,
    /// Queue pairs this node keeps for all initiators together; beyond it
    /// every new one is refused as above, until sessions end and theirs
    /// go. By default an eighth of the process's descriptor limit, at
    /// least 64 and at most [`DEFAULT_MAX_PASSIVE_QPS`].
    pub max_passive_qps: usize,
}

/// Default [`IbvConfig::max_passive_qps_per_session`]: 8 rails at each end
/// pair up 64 ways at most, and leases take as many again.
pub const DEFAULT_MAX_PASSIVE_QPS_PER_SESSION: usize = 128;

/// Upper bound of the default [`IbvConfig::max_passive_qps`]: with
/// ferry's own rings (128 KiB each by default), 128 MiB of registered
/// memory at most, asked for by peers.
pub const DEFAULT_MAX_PASSIVE_QPS: usize = 1024;

/// The default [`IbvConfig::max_passive_qps`]: one descriptor each (their
/// completion channels), in a process whose endpoint takes most of the
/// rest for connections (`ferry_control::ConnectionLimits`).
fn default_max_passive_qps() -> usize {
    let fds = ferry_control::socket::fd_limit().unwrap_or(u64::MAX);
    usize::try_from(fds / 8)
        .unwrap_or(usize::MAX)
        .clamp(64, DEFAULT_MAX_PASSIVE_QPS)
}

impl Default for IbvConfig {
    fn default() -> Self {
        IbvConfig {
            rails: None,
            gid_index: None,
            max_send_wr: 1024,
            max_wr_bytes: Some(DEFAULT_MAX_WR_BYTES),
            stripe_min: DEFAULT_STRIPE_MIN,
            placement: Placement::Numa,
            stall_timeout: None,
            notify_slots: 32,
            notify_slot_len: 4096,
            notify_coalesce: None,
            share_registrations: true,
            qp_timing: QpTiming::default(),
            max_passive_qps_per_session: DEFAULT_MAX_PASSIVE_QPS_PER_SESSION,
            max_passive_qps: default_max_passive_qps(),
        }
    }
}

impl IbvConfig {
    /// A configuration that uses exactly `rails`, otherwise the defaults.
    pub fn with_rails(rails: Vec<RailName>) -> Self {
        IbvConfig {
            rails: Some(rails),
            ..IbvConfig::default()
        }
    }
}

/// One opened device: its context and the protection domain every region
/// and queue pair on its ports belongs to.
pub(crate) struct Nic {
    pub context: Arc<Context>,
    pub pd: Arc<ProtectionDomain>,
}

/// One port of one device, as this node uses it.
pub(crate) struct Rail {
    /// Its place in this node's rail list: handles carry one key per rail
    /// in this order, and peers name rails by it.
    pub index: u8,
    /// Index of its device in [`Fabric::nics`].
    pub nic: usize,
    pub context: Arc<Context>,
    pub pd: Arc<ProtectionDomain>,
    pub port: u8,
    pub gid_index: u32,
    pub gid: [u8; 16],
    pub lid: u16,
    /// Whether the link layer is Ethernet (RoCE): the peer's rail must be too.
    pub ethernet: bool,
    /// `ibv_mtu` value of the port.
    pub mtu: u32,
    /// Largest message one work request may carry on this port.
    pub max_msg: u32,
    pub max_send_wr: u32,
    /// Notification receive buffers per initiator on this rail.
    pub notify_slots: u16,
    /// [`IbvConfig::notify_coalesce`], resolved for this device.
    pub notify_coalesce: std::time::Duration,
    /// [`IbvConfig::stall_timeout`], resolved for this device.
    pub stall_timeout: std::time::Duration,
    /// The netdev behind a RoCE port's GID (sysfs), for `ferry info`.
    pub netdev: Option<String>,
    /// The device's NUMA node (sysfs); `None` where the kernel gives none.
    pub numa_node: Option<u32>,
    /// The port's rate as the kernel words it, e.g. `100 Gb/sec (4X EDR)`.
    pub rate: String,
    /// Whether its port reported its link down (see the `ports` module).
    pub down: AtomicBool,
    /// Work requests and bytes posted on this rail's queue pairs so far.
    pub posted_wrs: AtomicU64,
    pub posted_bytes: AtomicU64,
    /// The same, as `ferry_rail_wrs_total` and `ferry_rail_bytes_total`
    /// (label `rail`, e.g. `mlx5_0:1`): registered when the rail opens, as
    /// the node's other meters are (see `ferry`'s `meters` module).
    pub wrs_metric: metrics::Counter,
    pub bytes_metric: metrics::Counter,
}

impl Rail {
    /// Counts `wrs` work requests of `bytes` in all posted on this rail.
    pub fn count_posted(&self, wrs: u64, bytes: u64) {
        self.posted_wrs.fetch_add(wrs, Ordering::Relaxed);
        self.posted_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.wrs_metric.increment(wrs);
        self.bytes_metric.increment(bytes);
    }

    /// Whether its port reported its link down, and not up since.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Marks the port down or up; returns what it was.
    pub fn set_down(&self, down: bool) -> bool {
        self.down.swap(down, Ordering::AcqRel)
    }

    /// e.g. "rxe0:1"
    pub fn name(&self) -> String {
        format!("{}:{}", self.context.name(), self.port)
    }
}

/// Every rail of this node, and the settings shared by all of them.
pub(crate) struct Fabric {
    pub nics: Vec<Nic>,
    pub rails: Vec<Arc<Rail>>,
    pub notify_slot_len: u32,
    pub stripe_min: u64,
    pub placement: Placement,
    pub qp_timing: QpTiming,
    /// See [`IbvConfig::share_registrations`].
    pub share_registrations: bool,
    /// [`IbvConfig::max_passive_qps_per_session`] and
    /// [`IbvConfig::max_passive_qps`].
    pub passive_caps: (usize, usize),
}

impl Fabric {
    /// Each rail's NUMA node, by rail index.
    pub fn numa_nodes(&self) -> Vec<Option<u32>> {
        self.rails.iter().map(|r| r.numa_node).collect()
    }

    /// Opens the configured rails (see [`IbvConfig::rails`]).
    pub fn open(config: &IbvConfig) -> Result<Fabric, VerbsError> {
        let max_wr_bytes = match std::env::var(MAX_WR_BYTES_ENV) {
            Ok(value) if config.max_wr_bytes == Some(DEFAULT_MAX_WR_BYTES) => {
                parse_max_wr_bytes(&value).map_err(|e| VerbsError::Call {
                    call: MAX_WR_BYTES_ENV,
                    source: std::io::Error::other(e),
                })?
            }
            _ => config.max_wr_bytes,
        };
        let config = &IbvConfig {
            max_wr_bytes,
            ..config.clone()
        };
        // Distinguishes "no device at all" (the normal TCP-only host) from a
        // named device that is missing.
        let devices = device_names()?;
        let from_env = match (&config.rails, std::env::var(RAILS_ENV)) {
            (None, Ok(list)) => {
                Some(RailName::parse_list(&list).map_err(|e| VerbsError::Call {
                    call: RAILS_ENV,
                    source: std::io::Error::other(e),
                })?)
            }
            _ => None,
        };
        let named = config.rails.clone().or(from_env);
        let wanted: Vec<RailName> = match &named {
            Some(names) if !names.is_empty() => names.clone(),
            _ => devices
                .iter()
                .map(|device| RailName {
                    device: device.clone(),
                    port: None,
                })
                .collect(),
        };
        let mut fabric = Fabric {
            nics: Vec::new(),
            rails: Vec::new(),
            notify_slot_len: config.notify_slot_len,
            stripe_min: config.stripe_min.max(1),
            placement: config.placement,
            qp_timing: config.qp_timing,
            share_registrations: config.share_registrations,
            passive_caps: (config.max_passive_qps_per_session, config.max_passive_qps),
        };
        let mut skipped = Vec::new();
        for name in &wanted {
            // A device is kept (in `nics`) only once one of its ports is a rail.
            let (nic, fresh) = match fabric
                .nics
                .iter()
                .position(|n| n.context.name() == name.device)
            {
                Some(nic) => (nic, None),
                None => {
                    let context = Context::open(Some(&name.device))?;
                    let pd = ProtectionDomain::new(&context)?;
                    (fabric.nics.len(), Some(Nic { context, pd }))
                }
            };
            let device = fresh.as_ref().unwrap_or_else(|| &fabric.nics[nic]);
            let ports: Vec<u8> = match name.port {
                Some(port) => vec![port],
                None => (1..=device.context.limits()?.ports).collect(),
            };
            let mut opened = Vec::new();
            for port in ports {
                let taken = |r: &Rail| r.nic == nic && r.port == port;
                if fabric.rails.iter().any(|r| taken(r)) || opened.iter().any(taken) {
                    continue;
                }
                let index = (fabric.rails.len() + opened.len()) as u8;
                match open_rail(device, index, nic, port, config) {
                    Ok(rail) => opened.push(rail),
                    // A port asked for by name must work; of "every port",
                    // the inactive ones are skipped, and said so.
                    Err(e) if name.port.is_some() => return Err(e),
                    Err(e) => skipped.push(format!("{}:{port}: {e}", name.device)),
                }
            }
            if !opened.is_empty() {
                fabric.nics.extend(fresh);
                fabric.rails.extend(opened.into_iter().map(Arc::new));
            }
        }
        if fabric.rails.len() > MAX_RAILS {
            return Err(VerbsError::Call {
                call: "choosing rails",
                source: std::io::Error::other(format!(
                    "{} usable ports, and a node uses at most {MAX_RAILS}: name the rails to use \
                     in {RAILS_ENV} or IbvConfig::rails",
                    fabric.rails.len()
                )),
            });
        }
        if fabric.rails.is_empty() {
            return Err(VerbsError::Call {
                call: "choosing rails",
                source: std::io::Error::other(format!(
                    "no active port: {}",
                    if skipped.is_empty() {
                        "none found".to_string()
                    } else {
                        skipped.join("; ")
                    }
                )),
            });
        }
        if !skipped.is_empty() {
            info!(skipped = %skipped.join("; "), "ports not used as rails");
        }
        Ok(fabric)
    }

    /// The rail at `index`, if there is one.
    pub fn rail(&self, index: u8) -> Option<&Arc<Rail>> {
        self.rails.get(usize::from(index))
    }
}

/// Opens `port` of `device` (the fabric's NIC number `nic`) as rail `index`.
fn open_rail(
    device: &Nic,
    index: u8,
    nic: usize,
    port: u8,
    config: &IbvConfig,
) -> Result<Rail, VerbsError> {
    let Nic { context, pd } = device;
    let info = context.port(port)?;
    if !info.active {
        return Err(VerbsError::Call {
            call: "port state",
            source: std::io::Error::other(format!("{} port {port} is not active", context.name())),
        });
    }
    let (gid_index, gid) = match config.gid_index {
        Some(index) => (index, context.gid(port, index)?),
        None => context.ipv4_gid(port)?,
    };
    if gid == [0; 16] {
        // An unused table entry: queue pairs addressed with it never connect.
        return Err(VerbsError::Call {
            call: "ibv_query_gid",
            source: std::io::Error::other(format!(
                "GID index {gid_index} of {} port {port} is empty",
                context.name()
            )),
        });
    }
    let limits = context.limits()?;
    let sysfs = |path: String| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let device = context.name();
    Ok(Rail {
        index,
        nic,
        context: context.clone(),
        pd: pd.clone(),
        port,
        gid_index,
        gid,
        lid: info.lid,
        ethernet: info.ethernet,
        mtu: info.active_mtu,
        max_msg: config
            .max_wr_bytes
            .map_or(info.max_msg_size, |cap| cap.min(info.max_msg_size))
            .max(1),
        max_send_wr: config
            .max_send_wr
            .clamp(1, limits.max_qp_wr.saturating_sub(1).max(1)),
        notify_slots: config
            .notify_slots
            .min(limits.max_qp_wr.min(u32::from(u16::MAX)) as u16),
        notify_coalesce: config.notify_coalesce.unwrap_or(if context.is_software() {
            SOFTWARE_NOTIFY_COALESCE
        } else {
            std::time::Duration::ZERO
        }),
        stall_timeout: config.stall_timeout.unwrap_or(if context.is_software() {
            SOFTWARE_STALL_TIMEOUT
        } else {
            DEFAULT_STALL_TIMEOUT
        }),
        netdev: sysfs(format!(
            "{SYSFS_CLASS}/{device}/ports/{port}/gid_attrs/ndevs/{gid_index}"
        )),
        // -1 where the platform has no NUMA information.
        numa_node: sysfs(format!("{SYSFS_CLASS}/{device}/device/numa_node"))
            .and_then(|n| n.parse::<i32>().ok())
            .and_then(|n| u32::try_from(n).ok()),
        rate: sysfs(format!("{SYSFS_CLASS}/{device}/ports/{port}/rate")).unwrap_or_default(),
        down: AtomicBool::new(false),
        posted_wrs: AtomicU64::new(0),
        posted_bytes: AtomicU64::new(0),
        wrs_metric: metrics::counter!("ferry_rail_wrs_total", "rail" => format!("{device}:{port}")),
        bytes_metric: metrics::counter!("ferry_rail_bytes_total", "rail" => format!("{device}:{port}")),
    })
}

#[cfg(test)]
mod tests {
    use super::{RailName, parse_max_wr_bytes};

    #[test]
    fn work_request_sizes_from_the_environment_parse_and_bad_ones_say_why() {
        assert_eq!(parse_max_wr_bytes("524288"), Ok(Some(512 << 10)));
        assert_eq!(parse_max_wr_bytes(" 0 "), Ok(None), "0: the port's maximum");
        for bad in ["", "1M", "-1", "5000000000"] {
            let error = parse_max_wr_bytes(bad).unwrap_err();
            assert!(error.contains("FERRY_IBV_MAX_WR_BYTES"), "{bad}: {error}");
        }
    }

    #[test]
    fn rail_lists_parse_and_bad_ones_say_why() {
        let rails = RailName::parse_list("mlx5_0:1, mlx5_1,,rxe0:2").unwrap();
        let name = |device: &str, port| RailName {
            device: device.into(),
            port,
        };
        assert_eq!(
            rails,
            [
                name("mlx5_0", Some(1)),
                name("mlx5_1", None),
                name("rxe0", Some(2))
            ]
        );
        for bad in ["mlx5_0:0", "mlx5_0:x", ":1", "mlx5_0:300"] {
            let error = RailName::parse_list(bad).unwrap_err();
            assert!(error.contains("DEVICE:PORT"), "{bad}: {error}");
        }
    }
}
