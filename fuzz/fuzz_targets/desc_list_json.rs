#![no_main]
//! Fuzzes `desc_list_json`: see `ferry_fuzz::checks::desc_list_json` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::desc_list_json(data);
});
