//! Large descriptor arrays kept for the next list of their size.
//!
//! A planned request expands to tens of thousands of descriptors, freed
//! when the request is. glibc then gives those pages back to the kernel
//! (it trims the top of its heap), and the next request of the same shape
//! faults them in again: 200-400 faults per request of 32,768
//! descriptors, 1.1 ms of the runtime's CPU usually and up to 18 ms on a
//! VM whose host takes its pages back. Arrays kept here are reused warm.

use std::sync::Mutex;

/// Arrays for fewer descriptors than this are not kept (the allocator
/// reuses small blocks anyway).
pub(super) const MIN: usize = 4096;
/// At most this many descriptors' arrays are kept in all: 20 bytes each,
/// so 10 MiB, eight requests of 32,768 pairs.
const KEEP: usize = 1 << 19;

/// One explicit list's three arrays.
pub(super) struct Arrays {
    pub region: Vec<u32>,
    pub offset: Vec<u64>,
    pub len: Vec<u64>,
}

impl Arrays {
    /// The descriptors it holds room for.
    fn room(&self) -> usize {
        self.region
            .capacity()
            .min(self.offset.capacity())
            .min(self.len.capacity())
    }
}

/// Kept arrays, largest first.
struct Spare(Mutex<Vec<Arrays>>);

static SPARE: Spare = Spare(Mutex::new(Vec::new()));

/// Empty arrays with room for `n` descriptors: the smallest kept set that
/// fits, else new ones.
pub(super) fn take(n: usize) -> Arrays {
    SPARE.take(n)
}

/// Keeps `arrays` (emptied) for a later [`take`], if large enough, making
/// room by dropping the smallest kept sets; frees them otherwise.
pub(super) fn give(arrays: Arrays) {
    SPARE.give(arrays)
}

impl Spare {
    fn take(&self, n: usize) -> Arrays {
        if n >= MIN {
            let mut spare = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let fits = (spare.iter().enumerate())
                .filter(|(_, a)| a.room() >= n)
                .min_by_key(|(_, a)| a.room())
                .map(|(i, _)| i);
            if let Some(i) = fits {
                return spare.remove(i);
            }
        }
        Arrays {
            region: Vec::with_capacity(n),
            offset: Vec::with_capacity(n),
            len: Vec::with_capacity(n),
        }
    }

    fn give(&self, mut arrays: Arrays) {
        let room = arrays.room();
        if !(MIN..=KEEP).contains(&room) {
            return;
        }
        arrays.region.clear();
        arrays.offset.clear();
        arrays.len.clear();
        let mut spare = self.0.lock().unwrap_or_else(|e| e.into_inner());
        spare.push(arrays);
        spare.sort_unstable_by_key(|a| std::cmp::Reverse(a.room()));
        let mut kept = 0;
        spare.retain(|a| {
            kept += a.room();
            kept <= KEEP
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrays(n: usize) -> Arrays {
        Arrays {
            region: vec![1; n],
            offset: vec![2; n],
            len: vec![3; n],
        }
    }

    #[test]
    fn large_arrays_come_back_empty_the_smallest_that_fits_first() {
        let spare = Spare(Mutex::new(Vec::new()));
        let (small, large) = (arrays(MIN), arrays(4 * MIN));
        let (small_at, large_at) = (small.offset.as_ptr(), large.offset.as_ptr());
        spare.give(large);
        spare.give(small);
        let taken = spare.take(MIN);
        assert_eq!(taken.offset.as_ptr(), small_at, "the smaller set fits");
        assert!(taken.region.is_empty() && taken.offset.is_empty() && taken.len.is_empty());
        assert_eq!(spare.take(MIN + 1).offset.as_ptr(), large_at);
        let fresh = spare.take(MIN);
        assert!(fresh.room() >= MIN && fresh.offset.as_ptr() != small_at);
    }

    #[test]
    fn small_and_huge_arrays_are_not_kept_nor_more_than_the_bound() {
        let spare = Spare(Mutex::new(Vec::new()));
        spare.give(arrays(MIN - 1));
        spare.give(arrays(KEEP + 1));
        assert!(spare.0.lock().unwrap().is_empty());
        for _ in 0..KEEP / MIN + 4 {
            spare.give(arrays(MIN));
        }
        let kept: usize = spare.0.lock().unwrap().iter().map(Arrays::room).sum();
        assert!(kept <= KEEP && kept + MIN > KEEP, "{kept} kept");
    }
}
