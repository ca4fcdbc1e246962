//! What this host's RDMA devices look like, for `ferry info`.

use serde::Serialize;

use crate::verbs::{Context, VerbsError, device_names};

#[derive(Clone, Debug, Serialize)]
pub struct DeviceReport {
    pub name: String,
    pub ports: Vec<PortReport>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PortReport {
    pub port: u8,
    pub active: bool,
    pub link_layer: &'static str,
    pub active_mtu: u32,
    pub max_message: u32,
    pub gids: Vec<GidReport>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GidReport {
    pub index: u32,
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
            Ok(DeviceReport { name, ports })
        })
        .collect()
}

fn format_gid(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// The GID type is only exposed through sysfs (as rdma-core's tools read it).
fn gid_kind(device: &str, port: u8, index: u32) -> String {
    let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
