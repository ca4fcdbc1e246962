#![no_main]
//! Fuzzes `memory_wire`: see `ferry_fuzz::checks::memory_wire` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::memory_wire(data);
});
