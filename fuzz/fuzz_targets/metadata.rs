#![no_main]
//! Fuzzes `metadata`: see `ferry_fuzz::checks::metadata` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::metadata(data);
});
