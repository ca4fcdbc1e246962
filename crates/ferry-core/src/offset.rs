//! [`ByteOffset`]: the integer types a slice's range may be given in.

use std::ops::Range;

use crate::OpError;

/// An integer a byte range may be written in: `u64` (ferry's own lengths),
/// `usize` (the lengths of Rust buffers, `vec.len()`), `u32`, and `i32`,
/// which is what an unsuffixed literal range such as `0..4096` becomes
/// when several types would do. A negative `i32` is refused with
/// [`OpError::NegativeOffset`]; a literal above `i32::MAX` needs a suffix
/// (`0..5_000_000_000u64`).
pub trait ByteOffset: Copy {
    /// The offset as `u64`, or the negative value it was.
    fn to_offset(self) -> Result<u64, i64>;
}

impl ByteOffset for u64 {
    fn to_offset(self) -> Result<u64, i64> {
        Ok(self)
    }
}

impl ByteOffset for usize {
    fn to_offset(self) -> Result<u64, i64> {
        // usize is at most 64 bits on every target ferry builds for.
        Ok(self as u64)
    }
}

impl ByteOffset for u32 {
    fn to_offset(self) -> Result<u64, i64> {
        Ok(self.into())
    }
}

impl ByteOffset for i32 {
    fn to_offset(self) -> Result<u64, i64> {
        u64::try_from(self).map_err(|_| self.into())
    }
}

/// `range` in bytes, or why it is none: a negative end, or an end before
/// its start.
pub(crate) fn byte_range<T: ByteOffset>(range: Range<T>) -> Result<Range<u64>, OpError> {
    let start = range.start.to_offset().map_err(OpError::NegativeOffset)?;
    let end = range.end.to_offset().map_err(OpError::NegativeOffset)?;
    if start > end {
        return Err(OpError::InvertedRange { start, end });
    }
    Ok(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[expect(
        clippy::reversed_empty_ranges,
        reason = "inverted ranges are the input under test"
    )]
    fn every_offset_type_gives_the_same_range() {
        let len: usize = 30;
        assert_eq!(byte_range(10..len), Ok(10..30));
        assert_eq!(byte_range(10u64..30), Ok(10..30));
        assert_eq!(byte_range(10u32..30), Ok(10..30));
        assert_eq!(byte_range(10..30), Ok(10..30));
        assert_eq!(
            byte_range(10..5),
            Err(OpError::InvertedRange { start: 10, end: 5 })
        );
        assert_eq!(byte_range(-1..5), Err(OpError::NegativeOffset(-1)));
        assert_eq!(byte_range(0..-8), Err(OpError::NegativeOffset(-8)));
    }
}
