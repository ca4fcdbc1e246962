#![no_main]
//! Fuzzes `hello`: see `ferry_fuzz::checks::hello` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::hello(data);
});
