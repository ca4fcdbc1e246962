#![no_main]
//! Fuzzes `handle_json`: see `ferry_fuzz::checks::handle_json` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::handle_json(data);
});
