//! Whether the address a node advertises is one of this host's. A made-up
//! or stale address goes unnoticed on one host, where every peer takes the
//! same-host path and never dials it, and only fails once a peer on another
//! host does: the node says so at spawn instead. A warning, not an error:
//! behind NAT, a load balancer or a Kubernetes service, the reachable
//! address is legitimately not the host's own.

use std::net::IpAddr;

use tracing::{debug, warn};

/// Warns when `advertised` is not an address of this host (see the module
/// docs); says nothing when the host's addresses cannot be listed.
pub(crate) fn warn_if_foreign(advertised: IpAddr) {
    match host_addresses() {
        Ok(host) => {
            if is_foreign(advertised, &host) {
                warn!(
                    %advertised,
                    "the advertised address is not an address of this host: peers on other hosts \
                     will dial it and fail unless NAT or a proxy forwards it here; set \
                     NodeBuilder::advertise or FERRY_ADVERTISE to an address of this host"
                );
            }
        }
        Err(e) => {
            debug!(%advertised, "cannot list this host's addresses to check the advertised one: {e}")
        }
    }
}

/// Whether `advertised` is none of `host`'s addresses. Loopback addresses
/// are always this host's (all of 127.0.0.0/8 answers locally, listed or
/// not); an IPv4 address written as IPv4-mapped IPv6 is compared as IPv4.
/// An empty `host` (nothing listed) proves nothing: not foreign.
pub(crate) fn is_foreign(advertised: IpAddr, host: &[IpAddr]) -> bool {
    let advertised = advertised.to_canonical();
    if advertised.is_loopback() || host.is_empty() {
        return false;
    }
    !host.iter().any(|ip| ip.to_canonical() == advertised)
}

/// The addresses of this host's interfaces (`getifaddrs`), up or not.
fn host_addresses() -> std::io::Result<Vec<IpAddr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list it allocated, or
    // fails and leaves it untouched.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, not yet
        // freed; `ifa_addr` is null or points to a sockaddr of the family it
        // names, so the casts below read only what is there.
        unsafe {
            let addr = (*entry).ifa_addr;
            if !addr.is_null() {
                match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let v4 = &*(addr as *const libc::sockaddr_in);
                        let bytes = v4.sin_addr.s_addr.to_ne_bytes();
                        addresses.push(IpAddr::from(bytes));
                    }
                    libc::AF_INET6 => {
                        let v6 = &*(addr as *const libc::sockaddr_in6);
                        addresses.push(IpAddr::from(v6.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
            entry = (*entry).ifa_next;
        }
    }
    // SAFETY: the list came from getifaddrs and is freed once, after its
    // last use.
    unsafe { libc::freeifaddrs(list) };
    Ok(addresses)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn an_address_no_interface_has_is_foreign() {
        let host = [ip("127.0.0.1"), ip("10.0.0.5"), ip("::1"), ip("fd00::5")];
        assert!(!is_foreign(ip("10.0.0.5"), &host));
        assert!(!is_foreign(ip("fd00::5"), &host));
        assert!(!is_foreign(ip("::ffff:10.0.0.5"), &host), "IPv4-mapped");
        assert!(is_foreign(ip("10.0.0.6"), &host), "a made-up address");
        assert!(is_foreign(ip("203.0.113.9"), &host));
        assert!(is_foreign(ip("fd00::6"), &host));
        // Loopback is this host's whether listed or not; nothing listed
        // proves nothing.
        assert!(!is_foreign(ip("127.0.0.2"), &host));
        assert!(!is_foreign(ip("::1"), &[ip("10.0.0.5")]));
        assert!(!is_foreign(ip("10.0.0.6"), &[]));
    }

    #[test]
    fn this_hosts_own_addresses_are_listed() {
        let host = host_addresses().unwrap();
        assert!(host.contains(&ip("127.0.0.1")), "{host:?}");
        for address in &host {
            assert!(!is_foreign(*address, &host));
        }
        assert!(
            is_foreign(ip("192.0.2.1"), &host),
            "TEST-NET-1 is nobody's: {host:?}"
        );
    }
}
