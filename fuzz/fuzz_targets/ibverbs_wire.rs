#![no_main]
//! Fuzzes `ibverbs_wire`: see `ferry_fuzz::checks::ibverbs_wire` for the decoder and the
//! invariant it must keep.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferry_fuzz::checks::ibverbs_wire(data);
});
