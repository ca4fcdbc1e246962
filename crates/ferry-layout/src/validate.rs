//! Plan-time checks: every layout on its own (parts, placement), then each
//! side as a whole (rank ids, agreement on tensors, coverage, overlap).
//! The planner only ever sees layouts that passed, so its arithmetic
//! cannot leave a region.

use std::collections::BTreeMap;

use crate::error::LayoutError;
use crate::layout::{Part, RankLayout, Tensor, TensorLayout};

/// A validated piece: the layout, its rank, and the global box it holds.
#[derive(Clone, Debug)]
pub(crate) struct Piece<'a> {
    pub rank: u32,
    pub layout: &'a TensorLayout,
    /// Global index of the piece's first element, per axis.
    pub lo: Vec<u64>,
    /// Elements held, per axis.
    pub len: Vec<u64>,
}

/// Identical pieces on one side, held by one or more ranks (several only
/// when all are marked replicated).
#[derive(Clone, Debug)]
pub(crate) struct Group<'a> {
    /// The replicas, by ascending rank id.
    pub replicas: Vec<Piece<'a>>,
}

/// One tensor on one side: its pieces grouped by replication.
#[derive(Clone, Debug)]
pub(crate) struct SideTensor<'a> {
    pub groups: Vec<Group<'a>>,
}

/// A side's tensors by name.
pub(crate) type SideIndex<'a> = BTreeMap<&'a str, SideTensor<'a>>;

/// What differs between two logical tensors of the same name, if anything.
pub(crate) fn tensor_diff(a: &Tensor, b: &Tensor) -> Option<&'static str> {
    if a.elem_size != b.elem_size {
        Some("element size")
    } else if a.axes != b.axes {
        Some("axes")
    } else {
        None
    }
}

/// Checks one rank's layout on its own and returns its pieces.
pub(crate) fn check_rank(rank: &RankLayout) -> Result<Vec<Piece<'_>>, LayoutError> {
    let mut pieces = Vec::with_capacity(rank.tensors.len());
    for (i, layout) in rank.tensors.iter().enumerate() {
        let name = &layout.tensor.name;
        if rank.tensors[..i].iter().any(|t| &t.tensor.name == name) {
            return Err(LayoutError::DuplicateTensor {
                rank: rank.rank,
                tensor: name.clone(),
            });
        }
        pieces.push(check_tensor(rank.rank, &rank.region_lens, layout)?);
    }
    Ok(pieces)
}

/// Checks one piece: its tensor, parts, paging, region map, aliasing and
/// bounds.
fn check_tensor<'a>(
    rank: u32,
    region_lens: &[u64],
    t: &'a TensorLayout,
) -> Result<Piece<'a>, LayoutError> {
    let tensor = || t.tensor.name.clone();
    let dims = t.tensor.axes.len();
    if t.tensor.elem_size == 0 {
        return Err(LayoutError::ZeroElemSize {
            rank,
            tensor: tensor(),
        });
    }
    let mut total = u64::from(t.tensor.elem_size);
    for axis in &t.tensor.axes {
        if axis.size == 0 {
            return Err(LayoutError::EmptyAxis {
                rank,
                tensor: tensor(),
                axis: axis.name.clone(),
            });
        }
        total = total
            .checked_mul(axis.size)
            .ok_or_else(|| LayoutError::TooLarge {
                rank,
                tensor: tensor(),
            })?;
    }
    for (field, found) in [("parts", t.parts.len()), ("strides", t.strides.len())] {
        if found != dims {
            return Err(LayoutError::WrongDims {
                rank,
                tensor: tensor(),
                field,
                expected: dims,
                found,
            });
        }
    }
    let mut lo = Vec::with_capacity(dims);
    let mut len = Vec::with_capacity(dims);
    for (axis, part) in t.tensor.axes.iter().zip(&t.parts) {
        let Some(range) = part.range(axis.size) else {
            return Err(match *part {
                Part::Split { parts, index } => LayoutError::BadSplit {
                    rank,
                    tensor: tensor(),
                    axis: axis.name.clone(),
                    size: axis.size,
                    parts,
                    index,
                },
                Part::Range { start, len } => LayoutError::PartOutOfAxis {
                    rank,
                    tensor: tensor(),
                    axis: axis.name.clone(),
                    size: axis.size,
                    start,
                    len,
                },
                Part::Full => unreachable!("a full part always fits"),
            });
        };
        lo.push(range.start);
        len.push(range.end - range.start);
    }
    let no_axis = |what, axis| LayoutError::NoSuchAxis {
        rank,
        tensor: tensor(),
        what,
        axis,
        dims,
    };
    let no_region = |region| LayoutError::NoSuchRegion {
        rank,
        tensor: tensor(),
        region,
        regions: region_lens.len(),
    };
    let mapped = match &t.region_map {
        Some(map) => {
            let axis = map.axis as usize;
            if axis >= dims {
                return Err(no_axis("region map", map.axis));
            }
            if map.places.len() as u64 != len[axis] {
                return Err(LayoutError::RegionMapLen {
                    rank,
                    tensor: tensor(),
                    axis: t.tensor.axes[axis].name.clone(),
                    expected: len[axis],
                    found: map.places.len(),
                });
            }
            if let Some(place) = map
                .places
                .iter()
                .find(|p| p.region as usize >= region_lens.len())
            {
                return Err(no_region(place.region));
            }
            Some(axis)
        }
        None => {
            if t.region as usize >= region_lens.len() {
                return Err(no_region(t.region));
            }
            None
        }
    };
    let bad_paging = |reason| LayoutError::BadPaging {
        rank,
        tensor: tensor(),
        reason,
    };
    if let Some(paged) = &t.paged {
        let axis = paged.axis as usize;
        if axis >= dims {
            return Err(no_axis("paged axis", paged.axis));
        }
        if paged.block == 0 {
            return Err(bad_paging("blocks of 0 elements"));
        }
        if paged.blocks == 0 {
            return Err(bad_paging("a pool of 0 blocks"));
        }
        if len[axis] != t.tensor.axes[axis].size {
            return Err(bad_paging("the paged axis must be held whole"));
        }
        if mapped == Some(axis) {
            return Err(bad_paging("the paged axis is also region-mapped"));
        }
    }
    // None: the extent overflows u64, past any region.
    let extent = extent(rank, t, &len, mapped)?;
    let out_of = |region: u32, end: Option<u64>| {
        let region_len = region_lens[region as usize];
        match end {
            Some(end) if end <= region_len => Ok(()),
            _ => Err(LayoutError::OutOfRegion {
                rank,
                tensor: tensor(),
                region,
                end: end.unwrap_or(u64::MAX),
                len: region_len,
            }),
        }
    };
    match (&t.region_map, mapped) {
        (Some(map), Some(axis)) => {
            for place in &map.places {
                out_of(
                    place.region,
                    extent.and_then(|e| place.offset.checked_add(e)),
                )?;
            }
            let extent = extent.unwrap_or(u64::MAX);
            let mut places = map.places.clone();
            places.sort_by_key(|p| (p.region, p.offset));
            for pair in places.windows(2) {
                if pair[0].region == pair[1].region && pair[1].offset - pair[0].offset < extent {
                    return Err(LayoutError::Aliased {
                        rank,
                        tensor: tensor(),
                        axis: format!("{} places", t.tensor.axes[axis].name),
                    });
                }
            }
        }
        _ => out_of(t.region, extent.and_then(|e| t.offset.checked_add(e)))?,
    }
    Ok(Piece {
        rank,
        layout: t,
        lo,
        len,
    })
}

/// The byte extent of the piece from its first element (per place of a
/// region map), checking that no two elements can share a byte; `None`
/// when it overflows `u64`.
fn extent(
    rank: u32,
    t: &TensorLayout,
    len: &[u64],
    mapped: Option<usize>,
) -> Result<Option<u64>, LayoutError> {
    // (count, stride, axis, is the block dim of a paged axis)
    let mut dims: Vec<(u64, u64, usize, bool)> = Vec::with_capacity(len.len() + 1);
    for (axis, (&n, &stride)) in len.iter().zip(&t.strides).enumerate() {
        if Some(axis) == mapped {
            continue;
        }
        match &t.paged {
            Some(p) if p.axis as usize == axis => {
                // All `block` slots of a physical block, even past the
                // axis's end: NIXL rows and block strides address them.
                dims.push((p.block, stride, axis, false));
                dims.push((p.blocks, p.block_stride, axis, true));
            }
            _ => dims.push((n, stride, axis, false)),
        }
    }
    dims.retain(|d| d.0 > 1);
    dims.sort_by_key(|d| d.1);
    let mut extent = u64::from(t.tensor.elem_size);
    for (n, stride, axis, blocks) in dims {
        if stride < extent {
            let name = &t.tensor.axes[axis].name;
            return Err(LayoutError::Aliased {
                rank,
                tensor: t.tensor.name.clone(),
                axis: if blocks {
                    format!("{name} blocks")
                } else {
                    name.clone()
                },
            });
        }
        match stride
            .checked_mul(n - 1)
            .and_then(|s| s.checked_add(extent))
        {
            Some(e) => extent = e,
            None => return Ok(None),
        }
    }
    Ok(Some(extent))
}

/// Checks a side: each rank on its own, distinct rank ids, agreement on
/// every tensor, pieces disjoint or identical replicas, and (when `cover`)
/// every element of every tensor held by some rank.
pub(crate) fn check_side(side: &[RankLayout], cover: bool) -> Result<SideIndex<'_>, LayoutError> {
    let mut index: SideIndex<'_> = BTreeMap::new();
    let mut order: Vec<&RankLayout> = side.iter().collect();
    order.sort_by_key(|r| r.rank);
    for pair in order.windows(2) {
        if pair[0].rank == pair[1].rank {
            return Err(LayoutError::DuplicateRank { rank: pair[0].rank });
        }
    }
    for rank in order {
        for piece in check_rank(rank)? {
            let name = piece.layout.tensor.name.as_str();
            let entry = index
                .entry(name)
                .or_insert_with(|| SideTensor { groups: Vec::new() });
            if let Some(first) = entry.groups.first().map(|g| &g.replicas[0])
                && let Some(what) = tensor_diff(&first.layout.tensor, &piece.layout.tensor)
            {
                return Err(LayoutError::TensorMismatch {
                    tensor: name.to_owned(),
                    rank: first.rank,
                    other: piece.rank,
                    what,
                });
            }
            place_piece(entry, piece)?;
        }
    }
    if cover {
        for (name, tensor) in &index {
            check_cover(name, tensor)?;
        }
    }
    Ok(index)
}

/// Adds a piece to its tensor's groups: into the group of identical
/// replicated pieces, or as a new group if it overlaps no other.
fn place_piece<'a>(tensor: &mut SideTensor<'a>, piece: Piece<'a>) -> Result<(), LayoutError> {
    for group in &mut tensor.groups {
        let other = &group.replicas[0];
        if !boxes_meet(&other.lo, &other.len, &piece.lo, &piece.len) {
            continue;
        }
        let identical = other.lo == piece.lo && other.len == piece.len;
        if identical && other.layout.replicated && piece.layout.replicated {
            group.replicas.push(piece);
            return Ok(());
        }
        return Err(LayoutError::Overlap {
            tensor: piece.layout.tensor.name.clone(),
            rank: other.rank,
            other: piece.rank,
        });
    }
    tensor.groups.push(Group {
        replicas: vec![piece],
    });
    Ok(())
}

/// Whether two boxes share an element.
pub(crate) fn boxes_meet(alo: &[u64], alen: &[u64], blo: &[u64], blen: &[u64]) -> bool {
    (0..alo.len()).all(|d| alo[d] < blo[d] + blen[d] && blo[d] < alo[d] + alen[d])
}

/// Errors with an element no group holds, if there is one.
fn check_cover(name: &str, tensor: &SideTensor<'_>) -> Result<(), LayoutError> {
    let Some(first) = tensor.groups.first() else {
        return Ok(());
    };
    let axes = &first.replicas[0].layout.tensor.axes;
    let lo = vec![0; axes.len()];
    let hi: Vec<u64> = axes.iter().map(|a| a.size).collect();
    check_box_cover(name, &lo, &hi, tensor)
}

/// Errors with an element of `piece` (a local rank's) that no group of
/// the remote `tensor` holds, if there is one.
pub(crate) fn check_piece_cover(
    piece: &Piece<'_>,
    tensor: &SideTensor<'_>,
) -> Result<(), LayoutError> {
    let hi: Vec<u64> = (piece.lo.iter().zip(&piece.len))
        .map(|(l, n)| l + n)
        .collect();
    check_box_cover(&piece.layout.tensor.name, &piece.lo, &hi, tensor)
}

/// Errors with an element of the box `lo..hi` of tensor `name` that no
/// group of `tensor` holds, if there is one.
fn check_box_cover(
    name: &str,
    lo: &[u64],
    hi: &[u64],
    tensor: &SideTensor<'_>,
) -> Result<(), LayoutError> {
    // Each group's box, cut to this one (find_gap takes boxes inside its
    // space); groups are disjoint, so their cuts are too.
    let boxes: Vec<(Vec<u64>, Vec<u64>)> = tensor
        .groups
        .iter()
        .map(|g| &g.replicas[0])
        .map(|p| {
            let cut_lo: Vec<u64> = p.lo.iter().zip(lo).map(|(a, b)| *a.max(b)).collect();
            let cut_hi: Vec<u64> = (p.lo.iter().zip(&p.len).map(|(l, n)| l + n))
                .zip(hi)
                .map(|(a, b)| a.min(*b))
                .collect();
            (cut_lo, cut_hi)
        })
        .filter(|(l, h)| l.iter().zip(h).all(|(a, b)| a < b))
        .collect();
    let refs: Vec<(&[u64], &[u64])> = boxes
        .iter()
        .map(|(l, h)| (l.as_slice(), h.as_slice()))
        .collect();
    match find_gap(lo, hi, &refs) {
        Some(index) => Err(LayoutError::Gap {
            tensor: name.to_owned(),
            index,
        }),
        None => Ok(()),
    }
}

/// An element of the box `lo..hi` that none of the disjoint `boxes` (each
/// `(lo, hi)`, already inside the space) holds. Sums of volumes decide
/// whether a box is covered; only an uncovered slab is searched further,
/// so the search is O(dims × boxes²), not O(elements).
fn find_gap(lo: &[u64], hi: &[u64], boxes: &[(&[u64], &[u64])]) -> Option<Vec<u64>> {
    let volume = |lo: &[u64], hi: &[u64]| -> u128 {
        lo.iter().zip(hi).map(|(l, h)| u128::from(h - l)).product()
    };
    let held: u128 = boxes.iter().map(|(l, h)| volume(l, h)).sum();
    if held >= volume(lo, hi) {
        return None;
    }
    if lo.is_empty() {
        return Some(Vec::new());
    }
    let mut cuts: Vec<u64> = vec![lo[0], hi[0]];
    for (l, h) in boxes {
        cuts.push(l[0]);
        cuts.push(h[0]);
    }
    cuts.sort_unstable();
    cuts.dedup();
    for slab in cuts.windows(2) {
        let (a, b) = (slab[0], slab[1]);
        // Every box edge is a cut: a box meeting the slab spans it.
        let inside: Vec<(&[u64], &[u64])> = boxes
            .iter()
            .filter(|(l, h)| l[0] <= a && b <= h[0])
            .map(|(l, h)| (&l[1..], &h[1..]))
            .collect();
        if let Some(rest) = find_gap(&lo[1..], &hi[1..], &inside) {
            let mut index = vec![a];
            index.extend(rest);
            return Some(index);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::find_gap;

    #[test]
    fn gap_in_a_grid() {
        let a: (&[u64], &[u64]) = (&[0, 0], &[2, 4]);
        let b: (&[u64], &[u64]) = (&[2, 0], &[4, 2]);
        assert_eq!(find_gap(&[0, 0], &[4, 4], &[a, b]), Some(vec![2, 2]));
        let c: (&[u64], &[u64]) = (&[2, 2], &[4, 4]);
        assert_eq!(find_gap(&[0, 0], &[4, 4], &[a, b, c]), None);
        assert_eq!(find_gap(&[0, 0], &[4, 4], &[]), Some(vec![0, 0]));
    }
}
