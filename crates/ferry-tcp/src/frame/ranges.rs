//! [`Ranges`]: many small ranges of one region in one request.

use ferry_control::wire::{u32_at, u64_at, u128_at};
use ferry_core::{Generation, RegionId, Scopes};

use super::{
    FrameError, MAX_CHUNK, MAX_RANGES, RANGE_LEN, RANGES_KIND, REQUEST_LEN, RequestKind, SCOPED,
    mark_scoped, scoped,
};

/// Many ranges of one region, read or written with one header and one
/// response: a table of `count` [`Range`]s follows the header, then, for a
/// write, their payloads back to back in table order. A read's
/// [`super::Response::ReadData`] carries the ranges' bytes back in the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ranges {
    /// Read or write.
    pub kind: RequestKind,
    /// As a [`super::Request`]'s: the response echoes it.
    pub id: u64,
    /// The region's slot on the owner, from the handle.
    pub region: RegionId,
    /// The region's generation, from the handle.
    pub generation: Generation,
    /// Entries in the table that follows, 1 to [`MAX_RANGES`].
    pub count: u32,
    /// Bytes of all ranges together, at most [`MAX_CHUNK`].
    pub len: u64,
    /// The handle's TCP token.
    pub token: u128,
    /// As a [`super::Request`]'s; they follow the header, before the table.
    pub scopes: Scopes,
    /// As a [`super::Request`]'s.
    pub tag: u64,
}

impl Ranges {
    /// The header as sent; the table follows it.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0; REQUEST_LEN];
        b[0] = RANGES_KIND + (self.kind == RequestKind::Write) as u8;
        mark_scoped(&mut b, &self.scopes);
        b[4..8].copy_from_slice(&self.generation.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.region.0.to_le_bytes());
        b[20..24].copy_from_slice(&self.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..56].copy_from_slice(&self.token.to_le_bytes());
        b[56..64].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, (u64, FrameError)> {
        let id = u64_at(b, 8);
        let scopes = scoped(b).map_err(|e| (id, e))?;
        let kind = match b[0] & !SCOPED {
            RANGES_KIND => RequestKind::Read,
            _ => RequestKind::Write,
        };
        let count = u32_at(b, 20);
        if count == 0 || count > MAX_RANGES {
            return Err((id, FrameError::RangeCount(count)));
        }
        let len = u64_at(b, 32);
        if len > MAX_CHUNK {
            return Err((id, FrameError::TooLong(len)));
        }
        Ok(Ranges {
            kind,
            id,
            region: RegionId(u32_at(b, 16)),
            generation: Generation(u32_at(b, 4)),
            count,
            len,
            token: u128_at(b, 40),
            scopes,
            tag: u64_at(b, 56),
        })
    }

    /// Bytes of the table that follows the header.
    pub fn table_len(&self) -> usize {
        self.count as usize * RANGE_LEN
    }

    /// Parses the table that followed this header into `out` (cleared
    /// first): every range non-empty, their lengths adding up to `len`.
    /// Anything else is a framing error: the payload that follows can no
    /// longer be delimited.
    pub fn decode_table(&self, table: &[u8], out: &mut Vec<Range>) -> Result<(), FrameError> {
        out.clear();
        if table.len() != self.table_len() {
            return Err(FrameError::RangeTable("wrong table length"));
        }
        let mut total = 0u64;
        for entry in table.chunks_exact(RANGE_LEN) {
            let range = Range {
                addr: u64_at(entry, 0),
                len: u64_at(entry, 8),
            };
            if range.len == 0 {
                return Err(FrameError::RangeTable("an empty range"));
            }
            total = total.saturating_add(range.len);
            out.push(range);
        }
        if total != self.len {
            return Err(FrameError::RangeTable("lengths do not add up"));
        }
        Ok(())
    }
}

/// One entry of a [`Ranges`] table: `len` bytes at virtual address `addr`
/// in the owner's process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    /// Virtual address of the first byte in the owner's process.
    pub addr: u64,
    /// Bytes, at least 1.
    pub len: u64,
}

impl Range {
    /// The entry as sent.
    pub fn encode(&self) -> [u8; RANGE_LEN] {
        let mut b = [0; RANGE_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}
