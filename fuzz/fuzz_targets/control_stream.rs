#![no_main]
//! Fuzzes `control_stream`: see `ferry_fuzz::checks::control_stream` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::control_stream(data);
});
