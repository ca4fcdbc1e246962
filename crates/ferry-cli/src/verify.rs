//! `bench --verify`: the check that follows each block size's measured run,
//! in pieces of at most [`VERIFY_PIECE`] bytes, each transfer with its own
//! deadline, so that a slow or lossy link fails one piece with an error
//! that says where, not the whole region with one deadline. And the typed
//! error every `bench` failure is, saying which part of the run it came
//! from.

use std::ops::Range;

use ferry::prelude::*;

use crate::Failure;
use crate::bench::{Op, SUBMIT_TIMEOUT, Share, first_difference};

/// Largest transfer of the verification: its bytes are checked a piece
/// at a time, each piece's transfer given [`SUBMIT_TIMEOUT`] on its own.
pub const VERIFY_PIECE: u64 = 1 << 20;

/// Why `ferry bench` failed, by the part of the run it failed in.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Before anything was measured: the node, the target, the regions.
    #[error("{0}")]
    Setup(String),
    /// The measured run (its warm-up included) of one block size.
    #[error("measured run of the {block}-byte-block {op} run failed: {error}")]
    Run {
        /// The op measured.
        op: &'static str,
        /// Its block size.
        block: u64,
        /// What failed.
        error: String,
    },
    /// The verification of one block size's run (after it was measured, or,
    /// for reads, the known bytes written before it).
    #[error("verification of the {block}-byte-block {op} run failed: {error}")]
    Verify {
        /// The op measured.
        op: &'static str,
        /// Its block size.
        block: u64,
        /// What failed.
        error: VerifyError,
    },
}

impl From<Failure> for BenchError {
    fn from(Failure(e): Failure) -> Self {
        BenchError::Setup(e)
    }
}

/// What failed in a verification.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Writing the known bytes that a verified read run reads back failed
    /// (before the measured run).
    #[error("writing the known bytes {}..{} of the target before the run: {error}", range.start, range.end)]
    Prepare {
        /// The target's bytes the piece covered.
        range: Range<u64>,
        /// Why the write failed.
        error: SubmitError,
    },
    /// Reading a piece of the target back failed.
    #[error("reading back bytes {}..{} of the target: {error}", range.start, range.end)]
    ReadBack {
        /// The target's bytes the piece covered.
        range: Range<u64>,
        /// Why the read failed.
        error: SubmitError,
    },
    /// A byte is not what the run put there.
    #[error("byte {at} of the target differs from what the run wrote")]
    Mismatch {
        /// Its offset in the target region.
        at: u64,
    },
    /// A local region could not be allocated, sliced or read.
    #[error("{0}")]
    Local(String),
}

impl From<Failure> for VerifyError {
    fn from(Failure(e): Failure) -> Self {
        VerifyError::Local(e)
    }
}

/// `range` in consecutive pieces of at most [`VERIFY_PIECE`] bytes.
fn pieces(range: Range<u64>) -> impl Iterator<Item = Range<u64>> {
    range
        .clone()
        .step_by(VERIFY_PIECE as usize)
        .map(move |at| at..(at + VERIFY_PIECE).min(range.end))
}

/// Before a verified read run: writes the pattern (in `share.local`) into
/// the share's range of the target, a piece at a time.
pub async fn prepare(node: &Node, share: &Share) -> Result<(), VerifyError> {
    for range in pieces(share.range()) {
        let from = share.local.slice(range.clone()).map_err(local)?;
        let remote = share.remote.slice(range.clone()).map_err(local)?;
        node.submit(vec![RdmaOp::write(from, remote)], SUBMIT_TIMEOUT)
            .await
            .map_err(|error| VerifyError::Prepare { range, error })?;
    }
    Ok(())
}

/// After writes: reads each worker's range of the target back, a piece at
/// a time into one piece-sized region, and compares each with what was
/// written. After reads: compares what arrived. `Ok` once every byte
/// matched.
pub async fn verify(node: &Node, shares: &[Share], seed: u8, op: Op) -> Result<(), VerifyError> {
    let back = match op {
        Op::Write => {
            let longest = shares.iter().map(|s| s.range().end - s.range().start);
            let len = longest.max().unwrap_or(0).min(VERIFY_PIECE);
            Some(
                node.alloc(len.max(1), Access::ReadWrite)
                    .await
                    .map_err(local)?,
            )
        }
        _ => None,
    };
    for share in shares {
        let range = share.range();
        let difference = match (op, &back) {
            (Op::Read, _) => first_difference(&share.local, 0, range, seed)?,
            (Op::Write, Some(back)) => read_back(node, share, back, seed).await?,
            // Not transfers: nothing in memory to compare.
            _ => None,
        };
        if let Some(at) = difference {
            return Err(VerifyError::Mismatch { at });
        }
    }
    Ok(())
}

/// Reads `share`'s range back into `back` a piece at a time; the first
/// offset that differs from the pattern.
async fn read_back(
    node: &Node,
    share: &Share,
    back: &Region,
    seed: u8,
) -> Result<Option<u64>, VerifyError> {
    for range in pieces(share.range()) {
        let len = range.end - range.start;
        let into = back.slice(0..len).map_err(local)?;
        let remote = share.remote.slice(range.clone()).map_err(local)?;
        node.submit(vec![RdmaOp::read(into, remote)], SUBMIT_TIMEOUT)
            .await
            .map_err(|error| VerifyError::ReadBack {
                range: range.clone(),
                error,
            })?;
        if let Some(at) = first_difference(back, range.start, range, seed)? {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

fn local(e: impl std::fmt::Display) -> VerifyError {
    VerifyError::Local(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_in_order_none_over_the_bound() {
        for range in [0..1, 5..VERIFY_PIECE + 5, 4096..3 * VERIFY_PIECE + 1, 7..7] {
            let pieces: Vec<_> = pieces(range.clone()).collect();
            assert!(
                pieces
                    .iter()
                    .all(|p| p.end - p.start <= VERIFY_PIECE && p.start < p.end)
            );
            let mut at = range.start;
            for piece in &pieces {
                assert_eq!(piece.start, at);
                at = piece.end;
            }
            assert_eq!(at, range.end.max(range.start));
        }
        assert_eq!(pieces(0..3 * VERIFY_PIECE + 1).count(), 4);
    }
}
