//! Which granules of one virtual address reservation are taken, one bit per granule.
//!
//! ```text
//!   granule   0   1   2   3   4   5   6   7
//!   bit       1   1   0   0   1   0   0   0      free runs: [2, 2) and [5, 3)
//! ```
//!
//! Freeing a range clears its bits, so it merges with free neighbours with no bookkeeping of its
//! own. Allocation takes the smallest free run that fits (best fit), which keeps the long runs
//! long; that matters here because a block's address range can never move.

use bitvec::prelude::*;

/// Allocation state of the granules of one reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GranuleMap {
    taken: BitVec<u64, Lsb0>,
}

impl GranuleMap {
    /// `granules` granules, all free.
    pub fn new(granules: usize) -> Self {
        Self {
            taken: bitvec![u64, Lsb0; 0; granules],
        }
    }

    /// How many granules the map covers.
    pub fn len(&self) -> usize {
        self.taken.len()
    }

    pub fn taken(&self) -> usize {
        self.taken.count_ones()
    }

    pub fn free(&self) -> usize {
        self.len() - self.taken()
    }

    /// Whether granule `index` is taken (false past the end).
    #[cfg(test)]
    pub fn is_taken(&self, index: usize) -> bool {
        self.taken.get(index).is_some_and(|bit| *bit)
    }

    /// The free runs as `(first granule, length)`, lowest address first.
    pub fn free_runs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let mut position = 0;
        std::iter::from_fn(move || {
            let rest = self.taken.get(position..)?;
            let start = position + rest.first_zero()?;
            let length = self.taken[start..]
                .first_one()
                .unwrap_or(self.len() - start);
            position = start + length;
            Some((start, length))
        })
    }

    /// The longest free run, in granules.
    pub fn largest_free_run(&self) -> usize {
        self.free_runs()
            .map(|(_, length)| length)
            .max()
            .unwrap_or(0)
    }

    /// `1 - largest free run / free granules`: 0 when all free space is one run (or there is
    /// none), approaching 1 as free space splinters into many small runs.
    pub fn fragmentation(&self) -> f64 {
        match self.free() {
            0 => 0.0,
            free => 1.0 - self.largest_free_run() as f64 / free as f64,
        }
    }

    /// Takes `count` (> 0) granules from the smallest free run that holds them, the lowest such
    /// run among equals, and returns the first granule; `None` if no run is long enough.
    pub fn allocate(&mut self, count: usize) -> Option<usize> {
        if count == 0 {
            return None;
        }
        let (start, _) = self
            .free_runs()
            .filter(|&(_, length)| length >= count)
            .min_by_key(|&(start, length)| (length, start))?;
        self.taken[start..start + count].fill(true);
        Some(start)
    }

    /// Takes granules `[start, start + count)` if all of them are free (growing a range in
    /// place); returns whether it did. Nothing changes when it does not.
    pub fn allocate_at(&mut self, start: usize, count: usize) -> bool {
        match self.range(start, count) {
            Some(range) if range.not_any() => {
                range.fill(true);
                true
            }
            _ => false,
        }
    }

    /// Frees granules `[start, start + count)` if all of them are taken; returns whether it did.
    /// Nothing changes when it does not, so a double free is caught, not absorbed.
    pub fn release(&mut self, start: usize, count: usize) -> bool {
        match self.range(start, count) {
            Some(range) if range.all() => {
                range.fill(false);
                true
            }
            _ => false,
        }
    }

    fn range(&mut self, start: usize, count: usize) -> Option<&mut BitSlice<u64, Lsb0>> {
        let end = start.checked_add(count)?;
        if count == 0 || end > self.len() {
            return None;
        }
        Some(&mut self.taken[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_prefers_the_smallest_run_that_fits() {
        let mut map = GranuleMap::new(16);
        assert_eq!(map.allocate(16), Some(0));
        assert!(map.release(2, 3)); // run of 3 at 2
        assert!(map.release(8, 6)); // run of 6 at 8
        assert_eq!(map.free_runs().collect::<Vec<_>>(), vec![(2, 3), (8, 6)]);
        assert_eq!(map.allocate(2), Some(2), "the 3-run is the best fit");
        assert_eq!(map.allocate(4), Some(8));
        assert_eq!(map.allocate(3), None);
        assert_eq!(map.free(), 3);
        assert_eq!(map.largest_free_run(), 2);
    }

    #[test]
    fn freed_neighbours_merge() {
        let mut map = GranuleMap::new(8);
        let a = map.allocate(2).unwrap();
        let b = map.allocate(2).unwrap();
        let c = map.allocate(2).unwrap();
        assert_eq!((a, b, c), (0, 2, 4));
        assert!(map.release(a, 2));
        assert!(map.release(c, 2));
        assert_eq!(map.largest_free_run(), 4, "c merges with the free tail");
        assert!(map.release(b, 2));
        assert_eq!(map.free_runs().collect::<Vec<_>>(), vec![(0, 8)]);
        assert_eq!(map.fragmentation(), 0.0);
    }

    #[test]
    fn double_free_and_out_of_range_change_nothing() {
        let mut map = GranuleMap::new(4);
        assert_eq!(map.allocate(2), Some(0));
        let before = map.clone();
        assert!(!map.release(1, 2), "granule 2 is free");
        assert!(!map.release(3, 5), "past the end");
        assert!(!map.release(0, 0));
        assert!(!map.allocate_at(1, 2), "granule 1 is taken");
        assert_eq!(map, before);
        assert!(map.allocate_at(2, 2));
        assert_eq!(map.free(), 0);
        assert_eq!(map.allocate(1), None);
    }

    #[test]
    fn fragmentation_reflects_splintered_free_space() {
        let mut map = GranuleMap::new(8);
        map.allocate(8).unwrap();
        for start in [0, 2, 4, 6] {
            assert!(map.release(start, 1));
        }
        assert_eq!(map.free(), 4);
        assert_eq!(map.largest_free_run(), 1);
        assert!((map.fragmentation() - 0.75).abs() < 1e-12);
    }
}
