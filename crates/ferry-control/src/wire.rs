//! Little-endian field access for fixed-layout frames: the hello here, and
//! the headers of the data channels that build on it.
//!
//! Callers index within frames whose length they have already checked, so an
//! out-of-range offset is a bug in the caller, not bad input.

/// The `u16` at byte `at` of `b`.
pub fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2-byte slice"))
}

/// The `u32` at byte `at` of `b`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}

/// The `u64` at byte `at` of `b`.
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}

/// The `u128` at byte `at` of `b`.
pub fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16-byte slice"))
}
