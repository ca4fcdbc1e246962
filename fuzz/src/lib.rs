//! ferry's fuzz targets: every decoder that reads bytes from the network or
//! from another node, with the invariant each must keep ([`checks`]), and
//! the seed corpus the fuzzer starts from ([`seeds`]).
//!
//! Run them with `scripts/fuzz.sh`. The targets in `fuzz_targets/` only
//! call into [`checks`]; `tests/fuzz_corpus.rs` in the main workspace
//! includes the same two files to replay every seed and regression input
//! under a plain `cargo test`.

pub mod checks;
pub mod seeds;
