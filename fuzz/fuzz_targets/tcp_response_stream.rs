#![no_main]
//! Fuzzes `tcp_response_stream`: see `ferry_fuzz::checks::tcp_response_stream` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::tcp_response_stream(data);
});
