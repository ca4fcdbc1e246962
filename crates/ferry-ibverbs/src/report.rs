//! What this host's RDMA devices look like, for `ferry info`.

use serde::Serialize;

use crate::verbs::{Context, SYSFS_CLASS, VerbsError, device_names};

/// One RDMA device, as `ferry info` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceReport {
    /// The device's name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Whether it is a software device (soft-RoCE, siw) rather than a NIC.
    pub software: bool,
    /// The NUMA node it sits on, where the platform says (sysfs).
    pub numa_node: Option<u32>,
    /// Every port, numbered from 1.
    pub ports: Vec<PortReport>,
}

/// One port of a device.
#[derive(Clone, Debug, Serialize)]
pub struct PortReport {
    /// The port number, from 1.
    pub port: u8,
    /// Whether the port is up (`IBV_PORT_ACTIVE`); a node cannot use it
    /// otherwise.
    pub active: bool,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: &'static str,
    /// The active MTU, in bytes.
    pub active_mtu: u32,
    /// The link's rate as the kernel words it, e.g. `100 Gb/sec (4X EDR)`.
    pub rate: String,
    /// The netdev behind the port's first IPv4-mapped GID (RoCE), if any.
    pub netdev: Option<String>,
    /// Largest message one work request may carry, in bytes.
    pub max_message: u32,
    /// The port's non-zero GIDs.
    pub gids: Vec<GidReport>,
}

/// One entry of a port's GID table.
#[derive(Clone, Debug, Serialize)]
pub struct GidReport {
    /// Index in the table, as [`IbvConfig::gid_index`](crate::IbvConfig::gid_index) takes it.
    pub index: u32,
    /// The GID written as an IPv6 address.
    pub gid: String,
    /// "RoCE v2", "IB/RoCE v1", ... as the kernel reports it; empty if unknown.
    pub kind: String,
    /// The netdev the GID belongs to (RoCE); empty if none.
    pub netdev: String,
}

/// Every device, port and non-zero GID on this host.
pub fn describe_devices() -> Result<Vec<DeviceReport>, VerbsError> {
    device_names()?
        .into_iter()
        .map(|name| {
            let context = Context::open(Some(&name))?;
            let ports = (1..=context.limits()?.ports)
                .map(|port| {
                    let info = context.port(port)?;
                    let gids = (0..info.gid_table_len)
                        .filter_map(|index| {
                            let gid = context.gid(port, index).ok()?;
                            (gid != [0; 16]).then(|| GidReport {
                                index,
                                gid: format_gid(&gid),
                                kind: sysfs(&name, port, "gid_attrs/types", index),
                                netdev: sysfs(&name, port, "gid_attrs/ndevs", index),
                            })
                        })
                        .collect::<Vec<GidReport>>();
                    let netdev = gids
                        .iter()
                        .find(|g| g.gid.starts_with("::ffff:") && !g.netdev.is_empty())
                        .map(|g| g.netdev.clone());
                    Ok(PortReport {
                        port,
                        active: info.active,
                        link_layer: if info.ethernet {
                            "Ethernet"
                        } else {
                            "InfiniBand"
                        },
                        active_mtu: info.active_mtu_bytes(),
                        rate: read_sysfs(&format!("{SYSFS_CLASS}/{name}/ports/{port}/rate")),
                        netdev,
                        max_message: info.max_msg_size,
                        gids,
                    })
                })
                .collect::<Result<_, VerbsError>>()?;
            let numa = read_sysfs(&format!("{SYSFS_CLASS}/{name}/device/numa_node"));
            Ok(DeviceReport {
                software: context.is_software(),
                numa_node: numa.parse::<i32>().ok().and_then(|n| u32::try_from(n).ok()),
                name,
                ports,
            })
        })
        .collect()
}

fn format_gid(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// A GID's type and netdev are only exposed through sysfs (as rdma-core's
/// tools read them): `what` is `gid_attrs/types` or `gid_attrs/ndevs`.
fn sysfs(device: &str, port: u8, what: &str, index: u32) -> String {
    read_sysfs(&format!(
        "{SYSFS_CLASS}/{device}/ports/{port}/{what}/{index}"
    ))
}

/// A sysfs file's content, trimmed; empty if it cannot be read.
fn read_sysfs(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
