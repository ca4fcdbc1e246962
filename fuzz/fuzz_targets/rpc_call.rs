#![no_main]
//! Fuzzes `rpc_call`: see `ferry_fuzz::checks::rpc_call` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::rpc_call(data);
});
