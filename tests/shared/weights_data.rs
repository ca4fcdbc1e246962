//! The matrix weight publication's tests move (over any transport, in
//! one process or across machines): its layouts, split by rows or by
//! columns, and the value of each element in each version, so that any
//! piece of it names the version it holds.

use ferry::LocalLayout;
use ferry::layout::{Part, RankLayout, Tensor, TensorLayout};
use ferry::prelude::*;

const ROWS: u64 = 64;
const COLS: u64 = 256;

/// The value of element `(row, col)` in version `version`.
fn value(version: u64, row: u64, col: u64) -> u32 {
    (version as u32).wrapping_mul(0x9e37_79b9) ^ ((row * COLS + col) as u32)
}

/// Rank `rank` of `parts`, split along `axis` (0: rows, 1: columns), row
/// major over the piece.
pub fn layout(rank: u32, parts: u32, axis: usize) -> RankLayout {
    let tensor = Tensor::new("w", 4, &[("row", ROWS), ("col", COLS)]);
    let mut piece = [ROWS, COLS];
    piece[axis] /= u64::from(parts);
    let mut part = vec![Part::Full, Part::Full];
    part[axis] = Part::Split {
        parts: u64::from(parts),
        index: u64::from(rank),
    };
    let w = TensorLayout::contiguous(tensor, part, &["row", "col"], 0, 0).unwrap();
    RankLayout {
        rank,
        region_lens: vec![piece[0] * piece[1] * 4],
        tensors: vec![w],
    }
}

/// A rank's memory, sized by its layout.
pub async fn local(node: &Node, layout: RankLayout) -> LocalLayout {
    let region = node
        .alloc(layout.region_lens[0], Access::ReadWrite)
        .await
        .unwrap();
    LocalLayout::new(layout, vec![region]).unwrap()
}

/// Writes version `version` into a publisher rank's memory.
pub fn fill(local: &LocalLayout, version: u64) {
    let t = &local.layout().tensors[0];
    let (rows, cols) = (t.range(0).unwrap(), t.range(1).unwrap());
    let mut bytes = Vec::new();
    for row in rows {
        for col in cols.clone() {
            bytes.extend_from_slice(&value(version, row, col).to_le_bytes());
        }
    }
    local.regions()[0].write_at(0, &bytes).unwrap();
}

/// Which version a subscriber rank's buffer holds, if it holds one whole.
pub fn held(local: &LocalLayout) -> Option<u64> {
    let t = &local.layout().tensors[0];
    let (rows, cols) = (t.range(0).unwrap(), t.range(1).unwrap());
    let bytes = local.regions()[0].to_vec();
    let word = |i: usize| u32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
    let first = word(0) ^ ((rows.start * COLS + cols.start) as u32);
    let version = (1..=64).find(|&v| (v as u32).wrapping_mul(0x9e37_79b9) == first)?;
    let mut i = 0;
    for row in rows {
        for col in cols.clone() {
            if word(i) != value(version, row, col) {
                return None;
            }
            i += 1;
        }
    }
    Some(version)
}
