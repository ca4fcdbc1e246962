//! Ranges requests among the data frames: good ones, refused ones (a bad
//! credential, a range out of bounds), each with the exact answer due.

use ferry::tcp::frame::{ClientFrame, Range, Ranges, Refusal, RequestKind, Response};

use super::{Expect, Shadowed, bytes};

/// Bytes a write put at a span of the region.
pub(super) type Write = (std::ops::Range<usize>, Vec<u8>);

/// A ranges request of 1 to 8 ranges of `target` (possibly overlapping), and
/// what the node must answer: one bad credential refuses range 0, one range
/// out of bounds refuses that range, and either way no range moves; else
/// every range moves, in table order. Also returns the writes the region
/// then holds, in order, for its shadow.
pub(super) fn ranges_frame(
    rng: &mut fastrand::Rng,
    id: u64,
    target: &Shadowed,
    read_only: bool,
) -> (Vec<u8>, Expect, Vec<Write>) {
    let handle = target.handle().clone();
    let region_len = target.shadow.len() as u64;
    let kind = [RequestKind::Read, RequestKind::Write][rng.usize(..2)];
    let mut ranges: Vec<Range> = (0..rng.u32(1..=8))
        .map(|_| {
            let len = rng.u64(1..=512);
            let at = rng.u64(0..=region_len - len);
            Range {
                addr: handle.addr() + at,
                len,
            }
        })
        .collect();
    let len = ranges.iter().map(|r| r.len).sum();
    let mut request = Ranges {
        kind,
        id,
        region: handle.region(),
        generation: handle.generation(),
        count: ranges.len() as u32,
        len,
        token: target.token,
        scopes: Default::default(),
        tag: 0,
    };
    let mut refused = match rng.u8(..6) {
        0 => {
            request.token ^= 1 << rng.u32(0..128);
            Some((0, Refusal::AccessDenied))
        }
        1 => {
            // A generation the token was not issued for: a bad credential.
            request.generation.0 = request.generation.0.wrapping_add(rng.u32(1..));
            Some((0, Refusal::AccessDenied))
        }
        2 => {
            let k = rng.usize(..ranges.len());
            let offset = region_len - ranges[k].len + rng.u64(1..=4096);
            ranges[k].addr = handle.addr() + offset;
            let bound = region_len;
            Some((k as u16, Refusal::OutOfBounds { offset, bound }))
        }
        _ => None,
    };
    // Access is checked before any range's bounds.
    if read_only
        && kind == RequestKind::Write
        && matches!(refused, None | Some((_, Refusal::OutOfBounds { .. })))
    {
        refused = Some((0, Refusal::ReadOnly));
    }
    let mut writes = Vec::new();
    let mut wire = ClientFrame::Ranges(request).encode().to_vec();
    ranges
        .iter()
        .for_each(|r| wire.extend_from_slice(&r.encode()));
    let span =
        |r: &Range| (r.addr - handle.addr()) as usize..(r.addr - handle.addr() + r.len) as usize;
    let answer = match (kind, refused) {
        (RequestKind::Write, Some(_)) => {
            // Junk that must land nowhere.
            wire.extend_from_slice(&bytes(rng, len as usize));
            None
        }
        (RequestKind::Write, None) => {
            for range in &ranges {
                let payload = bytes(rng, range.len as usize);
                wire.extend_from_slice(&payload);
                writes.push((span(range), payload));
            }
            Some(Expect::Exactly(Response::WriteAck { id }))
        }
        (RequestKind::Read, refused) => refused.is_none().then(|| {
            let data = ranges.iter().flat_map(|r| &target.shadow[span(r)]);
            Expect::Data(id, data.copied().collect())
        }),
    };
    let answer = answer.unwrap_or_else(|| {
        let (range, refusal) = refused.expect("no answer only for a refusal");
        Expect::Exactly(Response::Refused {
            id,
            range,
            refusal,
            len,
        })
    });
    (wire, answer, writes)
}
