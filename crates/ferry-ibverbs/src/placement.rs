//! Which of this node's rails a region's ops take.
//!
//! On a machine with several NICs, each sits on one NUMA node's PCIe root:
//! a NIC reading memory attached to another socket crosses the socket
//! interconnect for every byte, which costs bandwidth and latency on both.
//! So by default a region prefers the rails whose NIC is on its memory's
//! NUMA node ([`Placement::Numa`]): its ops are striped over those pairs
//! only, and fall back to the other rails when none of those reaches the
//! peer (or all of them failed), since a slower path beats an error. A
//! region can instead be pinned to rails ([`crate::IbvBackend::pin_rails`]):
//! its ops then never take another rail, and fail when none of the pinned
//! ones reaches the peer. Pinning the whole node is [`IbvConfig::rails`].
//!
//! [`IbvConfig::rails`]: crate::IbvConfig::rails

use ferry_core::MAX_RAILS;

/// A set of this node's rails, by index (at most [`MAX_RAILS`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RailSet(u8);

// A rail index must fit the bit mask.
const _: () = assert!(MAX_RAILS <= u8::BITS as usize);

impl RailSet {
    /// No rail.
    pub const EMPTY: RailSet = RailSet(0);

    /// Rails `0..count`.
    pub fn first(count: usize) -> RailSet {
        RailSet((0..count.min(MAX_RAILS)).fold(0, |set, i| set | 1 << i))
    }

    /// The rails given; `None` if one is not below [`MAX_RAILS`].
    pub fn of(rails: &[u8]) -> Option<RailSet> {
        rails.iter().try_fold(RailSet::EMPTY, |set, &rail| {
            (usize::from(rail) < MAX_RAILS).then(|| RailSet(set.0 | 1 << rail))
        })
    }

    /// Whether `rail` is in the set.
    pub fn contains(self, rail: u8) -> bool {
        usize::from(rail) < MAX_RAILS && self.0 & (1 << rail) != 0
    }

    /// Whether the set has no rail.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The rails in the set, lowest first.
    pub fn iter(self) -> impl Iterator<Item = u8> {
        (0..MAX_RAILS as u8).filter(move |&rail| self.contains(rail))
    }

    /// The rails in both sets.
    pub fn and(self, other: RailSet) -> RailSet {
        RailSet(self.0 & other.0)
    }
}

/// Why [`crate::IbvBackend::pin_rails`] refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PinError {
    /// The region is not registered with this backend (deregistered, or
    /// of another node).
    #[error("the region is not registered with the ibverbs backend")]
    UnknownRegion,
    /// A rail index past this node's rails.
    #[error("rail {rail} does not exist: this node has {rails} rails")]
    NoSuchRail {
        /// The index asked for.
        rail: u8,
        /// How many rails the node has.
        rails: usize,
    },
    /// No rail was named: the region's ops could go nowhere.
    #[error("a region must be pinned to at least one rail")]
    NoRail,
    /// The node runs no ibverbs backend (`Node::pin_rails`).
    #[error("the node runs no ibverbs backend")]
    NoIbverbs,
}

/// Which rails a region prefers by default ([`crate::IbvConfig::placement`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// The rails on the region's memory's NUMA node, when the kernel tells
    /// both (every rail where it tells neither, or no rail is there).
    #[default]
    Numa,
    /// Every rail, whatever the memory's node.
    AnyRail,
}

/// A pair of rails an op may take: one of this node's and one of its
/// peer's, connected by a queue pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RailPair {
    /// This node's rail (an index into `IbvTransportInfo::rails`).
    pub rail: u8,
    /// The peer's rail.
    pub remote_rail: u8,
}

/// The rail pairs an op may take ([`crate::IbvBackend::path`]), kept
/// inline: a link has at most one pair per rail.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RailPairs {
    pairs: [RailPair; MAX_RAILS],
    len: u8,
}

impl RailPairs {
    /// The pairs, in the link's order.
    pub fn as_slice(&self) -> &[RailPair] {
        &self.pairs[..usize::from(self.len)]
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `pair`; past [`MAX_RAILS`] pairs, drops it (a link never has
    /// more).
    fn push(&mut self, pair: RailPair) {
        if let Some(slot) = self.pairs.get_mut(usize::from(self.len)) {
            *slot = pair;
            self.len += 1;
        }
    }
}

impl FromIterator<RailPair> for RailPairs {
    fn from_iter<I: IntoIterator<Item = RailPair>>(pairs: I) -> Self {
        let mut all = RailPairs::default();
        pairs.into_iter().for_each(|pair| all.push(pair));
        all
    }
}

impl std::fmt::Debug for RailPairs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// Which rails a region's ops may take, and which of those they prefer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Route {
    /// A pinned region's rails; every rail otherwise.
    pub allowed: RailSet,
    /// Tried first among the allowed rails: those on the memory's NUMA node.
    pub prefer: RailSet,
}

impl Route {
    /// A region's route: `pinned` if any, else every rail of `rails`
    /// (each rail's NUMA node), preferring those on `memory_node`.
    pub fn new(rails: &[Option<u32>], memory_node: Option<u32>, pinned: Option<RailSet>) -> Route {
        let all = RailSet::first(rails.len());
        let allowed = pinned.unwrap_or(all);
        let local = RailSet(
            rails
                .iter()
                .enumerate()
                .filter(|(_, node)| memory_node.is_some() && **node == memory_node)
                .fold(0, |set, (i, _)| set | 1 << i),
        )
        .and(allowed);
        Route {
            allowed,
            prefer: if local.is_empty() { allowed } else { local },
        }
    }
}

impl Route {
    /// Keeps the `items` (pairs, lanes) on preferred rails, if any is:
    /// others are a fallback, not an error.
    pub fn narrow<T>(&self, items: &mut Vec<T>, rail: impl Fn(&T) -> u8) {
        if items.iter().any(|item| self.prefer.contains(rail(item))) {
            items.retain(|item| self.prefer.contains(rail(item)));
        }
    }
}

/// The NUMA node holding the page at `addr`, which must be mapped (a
/// registered region's pages are pinned); `None` where the kernel has no
/// NUMA support or says nothing.
pub(crate) fn numa_node_of(addr: u64) -> Option<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy(2) with MPOL_F_NODE | MPOL_F_ADDR writes one
    // int (the node of the page at `addr`) into `node`, which lives for the
    // call; no node mask is passed (null, max 0). It reads nothing at `addr`
    // itself, and fails with EFAULT if it is not mapped.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (rc == 0)
        .then_some(node)
        .and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rail_sets_hold_what_they_are_given() {
        let set = RailSet::of(&[0, 3, 7]).unwrap();
        assert_eq!(set.iter().collect::<Vec<_>>(), [0, 3, 7]);
        assert!(set.contains(3) && !set.contains(1) && !set.contains(8));
        assert_eq!(RailSet::of(&[8]), None, "past MAX_RAILS");
        assert_eq!(RailSet::first(3).iter().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(RailSet::first(20), RailSet::first(MAX_RAILS));
        assert!(RailSet::EMPTY.is_empty());
        assert_eq!(set.and(RailSet::first(4)), RailSet::of(&[0, 3]).unwrap());
    }

    /// Four NICs, two per socket (a common 2-socket, 8-GPU layout).
    const TWO_SOCKETS: [Option<u32>; 4] = [Some(0), Some(0), Some(1), Some(1)];

    #[test]
    fn a_region_prefers_the_rails_on_its_memory_node() {
        let route = Route::new(&TWO_SOCKETS, Some(1), None);
        assert_eq!(route.allowed, RailSet::first(4), "may still take any");
        assert_eq!(route.prefer, RailSet::of(&[2, 3]).unwrap());
        let route = Route::new(&TWO_SOCKETS, Some(0), None);
        assert_eq!(route.prefer, RailSet::of(&[0, 1]).unwrap());
    }

    #[test]
    fn without_numa_facts_every_rail_is_preferred() {
        // The memory's node unknown (no NUMA kernel, placement off).
        assert_eq!(
            Route::new(&TWO_SOCKETS, None, None).prefer,
            RailSet::first(4)
        );
        // The NICs' nodes unknown (virtual devices, sysfs says -1).
        assert_eq!(
            Route::new(&[None, None], Some(0), None).prefer,
            RailSet::first(2)
        );
        // Memory on a node with no NIC.
        assert_eq!(
            Route::new(&TWO_SOCKETS, Some(2), None).prefer,
            RailSet::first(4)
        );
    }

    #[test]
    fn a_pin_bounds_both_what_is_allowed_and_what_is_preferred() {
        let pin = RailSet::of(&[1, 2]).unwrap();
        let route = Route::new(&TWO_SOCKETS, Some(1), Some(pin));
        assert_eq!(route.allowed, pin);
        assert_eq!(
            route.prefer,
            RailSet::of(&[2]).unwrap(),
            "node 1 within the pin"
        );
        // Pinned away from the memory's node: the pin wins.
        let pin = RailSet::of(&[0]).unwrap();
        let route = Route::new(&TWO_SOCKETS, Some(1), Some(pin));
        assert_eq!((route.allowed, route.prefer), (pin, pin));
    }

    #[test]
    fn narrowing_keeps_preferred_rails_and_falls_back_to_the_rest() {
        let route = Route::new(&TWO_SOCKETS, Some(1), None);
        let mut pairs = vec![0u8, 1, 2, 3];
        route.narrow(&mut pairs, |&r| r);
        assert_eq!(pairs, [2, 3]);
        // No preferred rail reaches the peer: the others carry it.
        let mut pairs = vec![0u8, 1];
        route.narrow(&mut pairs, |&r| r);
        assert_eq!(pairs, [0, 1]);
    }

    #[test]
    fn the_kernel_names_the_node_of_mapped_memory_only() {
        let page = vec![1u8; 4096];
        // This machine may or may not be NUMA: a node, or nothing, but
        // never a failure that panics.
        if let Some(node) = numa_node_of(page.as_ptr() as u64) {
            assert!(node < 1024, "a plausible node: {node}");
        }
        // The null page is never mapped.
        assert_eq!(numa_node_of(0), None);
    }
}
