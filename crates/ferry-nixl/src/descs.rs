//! NIXL's descriptors in ferry's terms: each one names its memory by a
//! metadata id; bound, a request's descriptors become a region list and
//! offsets into it, every range checked to lie inside its memory.

use ferry::Descs;
use tracing::warn;

use crate::engine::Status;

/// One descriptor of a transfer: bytes, and the id of the registration or
/// loaded handle NIXL says it lies in (`ferry_desc` in `shim/ferry_nixl.h`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Desc {
    /// First byte's address (in the owner's process).
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Metadata id; 0 for none.
    pub md: u64,
}

/// Descriptors bound to the memory they lie in ([`bind`]).
pub(crate) struct Bound<M> {
    /// Each registration or handle the descriptors name, once, in order of
    /// first use: the list's regions.
    pub(crate) memory: Vec<M>,
    /// The descriptors, as (region index, offset, length) into `memory`.
    pub(crate) descs: Descs,
    /// The metadata id of each of `memory`.
    pub(crate) ids: Vec<u64>,
}

/// Binds `descs`: each descriptor's id looked up by `lookup`, its range
/// checked to lie inside the memory found (whose first address and length
/// `span` gives).
pub(crate) fn bind<M>(
    descs: &[Desc],
    lookup: impl Fn(u64) -> Option<M>,
    span: impl Fn(&M) -> (u64, u64),
) -> Result<Bound<M>, Status> {
    let mut ids: Vec<u64> = Vec::new();
    let mut regions: Vec<M> = Vec::new();
    // One descriptor (a small request's usual shape) needs no arrays: it is
    // a strided list of one.
    let single = descs.len() == 1;
    let mut out = Descs::with_capacity(if single { 0 } else { descs.len() });
    // The last descriptor's memory: most name the one before's.
    let mut last: Option<(usize, u64, u64)> = None;
    for (k, desc) in descs.iter().enumerate() {
        let (index, start, len) = match last {
            Some(last) if ids[last.0] == desc.md => last,
            _ => {
                // Requests name few registrations: a short scan beats a map.
                let index = match ids.iter().position(|&id| id == desc.md) {
                    Some(index) => index,
                    None => {
                        let Some(memory) = lookup(desc.md) else {
                            warn!(
                                "FERRY: descriptor {k} names memory that is not registered or \
                                 loaded (deregistered or unloaded?)"
                            );
                            return Err(Status::NotFound);
                        };
                        ids.push(desc.md);
                        regions.push(memory);
                        ids.len() - 1
                    }
                };
                let (start, len) = span(&regions[index]);
                *last.insert((index, start, len))
            }
        };
        let inside = desc
            .addr
            .checked_sub(start)
            .filter(|offset| offset.checked_add(desc.len).is_some_and(|end| end <= len));
        let Some(offset) = inside else {
            warn!(
                "FERRY: descriptor {k} ({:#x}+{}) lies outside its memory ({start:#x}+{len})",
                desc.addr, desc.len
            );
            return Err(Status::InvalidParam);
        };
        if single {
            out = Descs::strided(index as u32, offset, 0, desc.len, 1);
        } else {
            out.push(index as u32, offset, desc.len);
        }
    }
    Ok(Bound {
        memory: regions,
        descs: out,
        ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_bind_to_their_memory_and_leaving_it_is_refused() {
        let lookup = |md| match md {
            1 => Some(("a", 0x1000, 0x100)),
            2 => Some(("b", 0x9000, 0x10)),
            _ => None,
        };
        let span = |m: &(&str, u64, u64)| (m.1, m.2);
        let descs = [
            Desc {
                addr: 0x1010,
                len: 0x10,
                md: 1,
            },
            Desc {
                addr: 0x9000,
                len: 0x10,
                md: 2,
            },
            Desc {
                addr: 0x1000,
                len: 0x100,
                md: 1,
            },
        ];
        let bound = bind(&descs, lookup, span).unwrap();
        assert_eq!(
            bound.memory.iter().map(|m| m.0).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(bound.ids, [1, 2]);
        let triples: Vec<_> = (bound.descs.iter())
            .map(|d| (d.region, d.offset, d.len))
            .collect();
        assert_eq!(triples, [(0, 0x10, 0x10), (1, 0, 0x10), (0, 0, 0x100)]);
        // One descriptor binds without arrays, to the same triple.
        let one = bind(&descs[1..2], lookup, span).unwrap();
        assert!(one.descs.is_strided());
        let triples: Vec<_> = (one.descs.iter())
            .map(|d| (d.region, d.offset, d.len))
            .collect();
        assert_eq!(triples, [(0, 0, 0x10)]);
        assert_eq!(one.ids, [2]);
        for (desc, status) in [
            (
                Desc {
                    addr: 0x1000,
                    len: 0x101,
                    md: 1,
                },
                Status::InvalidParam,
            ),
            (
                Desc {
                    addr: 0xfff,
                    len: 1,
                    md: 1,
                },
                Status::InvalidParam,
            ),
            (
                Desc {
                    addr: u64::MAX,
                    len: 2,
                    md: 1,
                },
                Status::InvalidParam,
            ),
            (
                Desc {
                    addr: 0x1000,
                    len: 1,
                    md: 3,
                },
                Status::NotFound,
            ),
        ] {
            assert_eq!(bind(&[desc], lookup, span).err(), Some(status), "{desc:?}");
        }
    }
}
