//! Where an agent's node runs, as far as loopback goes, carried in its
//! connection info: a node listening on loopback (FERRY's default, since
//! NIXL users set no address) is reachable only from the same network
//! namespace of the same kernel boot. An agent of another host, or of
//! another container with its own namespace on this host, that kept the
//! default is refused at `add_remote_agent`, with a log line naming the
//! option, rather than found out by a failed transfer.

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;

use ferry::NodeAddr;
use serde_json::{Value, json};

/// A kernel boot and a network namespace; either may be unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Place {
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: Option<u128>,
    /// The inode of `/proc/self/ns/net`: unique among one boot's namespaces.
    pub netns: Option<u64>,
}

impl Place {
    /// This process's place.
    pub fn here() -> Place {
        Place {
            boot_id: ferry::memory::boot_id(),
            netns: std::fs::metadata("/proc/self/ns/net").ok().map(|m| m.ino()),
        }
    }

    /// Whether loopback here is known not to be loopback at `other`: another
    /// boot, or another namespace of this boot. Unknown is not refused.
    fn apart_from(&self, other: &Place) -> bool {
        let differ =
            |a: Option<u64>, b: Option<u64>| matches!((a, b), (Some(a), Some(b)) if a != b);
        match (self.boot_id, other.boot_id) {
            (Some(a), Some(b)) if a != b => true,
            (Some(_), Some(_)) => differ(self.netns, other.netns),
            _ => false,
        }
    }
}

/// Whether a node listening at `endpoint`, at place `theirs`, is out of
/// reach from `ours`: on loopback, and apart.
pub(crate) fn on_loopback_elsewhere(endpoint: SocketAddr, theirs: &Place, ours: &Place) -> bool {
    endpoint.ip().to_canonical().is_loopback() && theirs.apart_from(ours)
}

/// `getConnInfo`'s blob: the node's address and its place.
pub(crate) fn conn_info(addr: &NodeAddr, place: &Place) -> String {
    let mut info = json!({ "addr": addr });
    if let Some(boot_id) = place.boot_id {
        // As ferry's handles write it.
        info["boot_id"] = format!("{boot_id:032x}").into();
    }
    if let Some(netns) = place.netns {
        info["netns"] = netns.into();
    }
    info.to_string()
}

/// Reads [`conn_info`]'s blob; an error says what is wrong with it.
pub(crate) fn parse_conn_info(blob: &[u8]) -> Result<(NodeAddr, Place), String> {
    let Value::Object(mut info) = serde_json::from_slice(blob).map_err(|e| e.to_string())? else {
        return Err("not a JSON object".to_string());
    };
    let addr = info.remove("addr").ok_or("no addr")?;
    let addr = serde_json::from_value(addr).map_err(|e| format!("addr: {e}"))?;
    let boot_id = match info.get("boot_id") {
        None => None,
        Some(Value::String(hex))
            if hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            Some(u128::from_str_radix(hex, 16).map_err(|e| format!("boot_id: {e}"))?)
        }
        Some(other) => return Err(format!("boot_id: {other} is not 32 hex digits")),
    };
    let netns = match info.get("netns") {
        None => None,
        Some(other) => Some(
            other
                .as_u64()
                .ok_or(format!("netns: {other} is not a number"))?,
        ),
    };
    Ok((addr, Place { boot_id, netns }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(boot_id: Option<u128>, netns: Option<u64>) -> Place {
        Place { boot_id, netns }
    }

    #[test]
    fn only_a_loopback_endpoint_of_another_boot_or_namespace_is_unreachable() {
        let lo: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let lo6: SocketAddr = "[::1]:4000".parse().unwrap();
        let lan: SocketAddr = "10.1.2.3:4000".parse().unwrap();
        let here = at(Some(1), Some(7));
        assert!(on_loopback_elsewhere(lo, &at(Some(2), Some(7)), &here));
        assert!(on_loopback_elsewhere(lo6, &at(Some(2), None), &here));
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:4000".parse().unwrap();
        assert!(on_loopback_elsewhere(mapped, &at(Some(2), None), &here));
        // Another container of this host, in its own namespace.
        assert!(on_loopback_elsewhere(lo, &at(Some(1), Some(8)), &here));
        // The same namespace, a routable address, or a place not known.
        assert!(!on_loopback_elsewhere(lo, &here, &here));
        assert!(!on_loopback_elsewhere(lan, &at(Some(2), Some(8)), &here));
        assert!(!on_loopback_elsewhere(lo, &at(None, Some(8)), &here));
        assert!(!on_loopback_elsewhere(lo, &at(Some(1), None), &here));
        assert!(!on_loopback_elsewhere(lo, &here, &at(None, None)));
    }

    #[test]
    fn conn_info_reads_back_and_bad_fields_are_named() {
        let addr: NodeAddr = serde_json::from_value(json!({
            "id": "0123456789abcdef0123456789abcdef",
            "endpoint": "127.0.0.1:4000"
        }))
        .unwrap();
        for place in [at(Some(u128::MAX - 5), Some(4026531992)), at(None, None)] {
            let blob = conn_info(&addr, &place);
            assert_eq!(parse_conn_info(blob.as_bytes()).unwrap(), (addr, place));
        }
        let bad = |blob: Value| parse_conn_info(blob.to_string().as_bytes()).unwrap_err();
        let good = serde_json::to_value(addr).unwrap();
        assert!(bad(json!({ "addr": 5 })).starts_with("addr"));
        assert!(bad(json!({})).contains("addr"));
        assert!(bad(json!(5)).contains("object"));
        assert!(bad(json!([])).contains("object"));
        let plus = format!("+{}", "0".repeat(31));
        assert!(bad(json!({ "addr": good, "boot_id": plus })).starts_with("boot_id"));
        assert!(bad(json!({ "addr": good, "boot_id": "12" })).starts_with("boot_id"));
        assert!(bad(json!({ "addr": good, "netns": "x" })).starts_with("netns"));
        assert!(parse_conn_info(b"garbage").is_err());
    }
}
