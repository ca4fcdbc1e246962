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
                                kind: gid_kind(&name, port, index),
                            })
                        })
                        .collect();
                    Ok(PortReport {
                        port,
                        active: info.active,
                        link_layer: if info.ethernet {
                            "Ethernet"
                        } else {
                            "InfiniBand"
                        },
                        active_mtu: info.active_mtu_bytes(),
                        max_message: info.max_msg_size,
                        gids,
                    })
                })
                .collect::<Result<_, VerbsError>>()?;
            Ok(DeviceReport {
                software: context.is_software(),
                name,
                ports,
            })
        })
        .collect()
}

fn format_gid(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// The GID type is only exposed through sysfs (as rdma-core's tools read it).
fn gid_kind(device: &str, port: u8, index: u32) -> String {
    let path = format!("{SYSFS_CLASS}/{device}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
