//! A box of a tensor's elements walked in the tensor's logical order, as
//! byte runs of one rank's memory: what both sides of a transfer hash to
//! compare what they hold (weight publication's checksums) whatever their
//! layouts. Row-major over the logical axes, so two ranks whose memory
//! orders differ (NHD against HND, rows against columns) read the same
//! elements in the same order, and the same bytes hash the same.

use std::ops::Range;

use crate::layout::TensorLayout;

/// Why a box could not be walked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WalkError {
    /// The box has another number of axes than the tensor.
    #[error("a box of {given} axes for a tensor of {axes}")]
    Axes {
        /// Axes of the box.
        given: usize,
        /// Axes of the tensor.
        axes: usize,
    },
    /// Along `axis` the box is empty or reaches past what the rank holds.
    #[error("along axis {axis} the box {bounds:?} is empty or not held here ({held:?})")]
    NotHeld {
        /// The axis (logical index).
        axis: usize,
        /// The box's global range along it.
        bounds: Range<u64>,
        /// What the rank holds along it.
        held: Range<u64>,
    },
    /// The tensor has a paged axis, whose places come per request from a
    /// block table: there is no one order of its memory to walk.
    #[error("the tensor has a paged axis")]
    Paged,
    /// The layout places no byte for the element at this rank-local index
    /// (a region map shorter than the piece: a layout not validated).
    #[error("the layout places no element at rank-local index {index:?}")]
    Unplaced {
        /// The rank-local index.
        index: Vec<u64>,
    },
}

/// Calls `run(region, offset, len)` for the bytes of the elements of
/// `bounds` (global index ranges, one per axis) in `layout`'s memory, in
/// row-major logical order, elements adjacent in memory in one run.
/// Checks the box first: nothing is called for a box that is refused
/// (short of a layout that places no byte for some element, which ends
/// the walk where it is found).
pub fn walk_box(
    layout: &TensorLayout,
    bounds: &[Range<u64>],
    mut run: impl FnMut(u32, u64, u64),
) -> Result<(), WalkError> {
    let axes = layout.tensor.axes.len();
    if bounds.len() != axes || layout.strides.len() != axes || axes == 0 {
        return Err(WalkError::Axes {
            given: bounds.len(),
            axes,
        });
    }
    if layout.paged.is_some() {
        return Err(WalkError::Paged);
    }
    let mut local = Vec::with_capacity(axes);
    for (axis, b) in bounds.iter().enumerate() {
        let held = layout.range(axis).unwrap_or(0..0);
        if b.start >= b.end || b.start < held.start || b.end > held.end {
            return Err(WalkError::NotHeld {
                axis,
                bounds: b.clone(),
                held,
            });
        }
        local.push(b.start - held.start..b.end - held.start);
    }
    let elem = u64::from(layout.tensor.elem_size);
    let last = axes - 1;
    let row = local[last].end - local[last].start;
    // The innermost axis in one run when its elements follow each other.
    let contiguous = layout.strides[last] == elem
        && layout
            .region_map
            .as_ref()
            .is_none_or(|m| m.axis as usize != last);
    let mut pending: Option<(u32, u64, u64)> = None;
    let mut emit = |region: u32, offset: u64, len: u64| match &mut pending {
        Some((r, o, l)) if *r == region && *o + *l == offset => *l += len,
        _ => {
            if let Some((r, o, l)) = pending.replace((region, offset, len)) {
                run(r, o, l);
            }
        }
    };
    let mut x: Vec<u64> = local.iter().map(|r| r.start).collect();
    loop {
        let place = |x: &[u64]| {
            (layout.locate(x, None)).ok_or_else(|| WalkError::Unplaced { index: x.to_vec() })
        };
        if contiguous {
            let (region, offset) = place(&x)?;
            emit(region, offset, row * elem);
        } else {
            for i in local[last].clone() {
                x[last] = i;
                let (region, offset) = place(&x)?;
                emit(region, offset, elem);
            }
            x[last] = local[last].start;
        }
        // The next row: the odometer over every axis but the innermost.
        let mut axis = last;
        loop {
            if axis == 0 {
                if let Some((r, o, l)) = pending {
                    run(r, o, l);
                }
                return Ok(());
            }
            axis -= 1;
            x[axis] += 1;
            if x[axis] < local[axis].end {
                break;
            }
            x[axis] = local[axis].start;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Part, Tensor};

    /// A 4 x 6 tensor of 2-byte elements, split in two along `split`, the
    /// piece laid out row-major or (`transposed`) column-major.
    fn piece(split: usize, index: u64, transposed: bool) -> TensorLayout {
        let tensor = Tensor::new("w", 2, &[("row", 4), ("col", 6)]);
        let mut parts = vec![Part::Full, Part::Full];
        parts[split] = Part::Split { parts: 2, index };
        let (rows, cols) = if split == 0 { (2, 6) } else { (4, 3) };
        let strides = if transposed {
            vec![2, 2 * rows]
        } else {
            vec![2 * cols, 2]
        };
        TensorLayout {
            tensor,
            parts,
            replicated: false,
            region: 0,
            offset: 8,
            strides,
            region_map: None,
            paged: None,
        }
    }

    fn runs(layout: &TensorLayout, bounds: &[Range<u64>]) -> Vec<(u32, u64, u64)> {
        let mut out = Vec::new();
        walk_box(layout, bounds, |r, o, l| out.push((r, o, l))).unwrap();
        out
    }

    #[test]
    fn row_major_rows_merge_and_column_major_goes_element_by_element() {
        // Rows 2..4 (the second half), every column: one run of 2 x 6 x 2.
        let rows = piece(0, 1, false);
        assert_eq!(runs(&rows, &[2..4, 0..6]), [(0, 8, 24)]);
        // Columns 1..3 of that piece: a run per row.
        assert_eq!(runs(&rows, &[2..4, 1..3]), [(0, 10, 4), (0, 22, 4)]);
        // Column-major: row-major order steps by a column's length.
        let cols = piece(0, 1, true);
        assert_eq!(
            runs(&cols, &[2..3, 0..3]),
            [(0, 8, 2), (0, 12, 2), (0, 16, 2)]
        );
    }

    #[test]
    fn a_box_outside_the_piece_or_of_other_rank_is_refused() {
        let rows = piece(0, 1, false);
        let refused = walk_box(&rows, &[0..3, 0..6], |_, _, _| panic!("nothing walked"));
        assert!(matches!(refused, Err(WalkError::NotHeld { axis: 0, .. })));
        let one_axis = std::slice::from_ref(&(2..4));
        let refused = walk_box(&rows, one_axis, |_, _, _| panic!("nothing walked"));
        assert!(matches!(
            refused,
            Err(WalkError::Axes { given: 1, axes: 2 })
        ));
        let refused = walk_box(&rows, &[2..2, 0..6], |_, _, _| panic!("nothing walked"));
        assert!(matches!(refused, Err(WalkError::NotHeld { axis: 0, .. })));
    }

    /// The element values (global row * 10 + col) at each byte run, read
    /// from a rank's memory image: the same sequence from every layout.
    #[test]
    fn every_layout_walks_a_box_in_the_same_element_order() {
        let image = |layout: &TensorLayout| {
            let mut mem = vec![0u8; 64];
            let (r0, c0) = (layout.range(0).unwrap(), layout.range(1).unwrap());
            for r in r0.clone() {
                for c in c0.clone() {
                    let (_, at) = layout.locate(&[r - r0.start, c - c0.start], None).unwrap();
                    let v = (r * 10 + c) as u16;
                    mem[at as usize..at as usize + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            mem
        };
        let read = |layout: &TensorLayout, bounds: &[Range<u64>]| {
            let mem = image(layout);
            let mut values = Vec::new();
            walk_box(layout, bounds, |_, o, l| {
                for e in (o..o + l).step_by(2) {
                    values.push(u16::from_le_bytes([mem[e as usize], mem[e as usize + 1]]));
                }
            })
            .unwrap();
            values
        };
        // The box rows 2..4, columns 3..6: held by row piece 1 and column
        // piece 1, each laid out both ways.
        let bounds = [2..4, 3..6];
        let want = [23, 24, 25, 33, 34, 35];
        for layout in [
            piece(0, 1, false),
            piece(0, 1, true),
            piece(1, 1, false),
            piece(1, 1, true),
        ] {
            assert_eq!(read(&layout, &bounds), want, "{layout:?}");
        }
    }
}
