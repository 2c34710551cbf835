//! Where a region's allocations sit, and which of them the consolidated span backs. Pure
//! bookkeeping (no driver calls), tested on the CPU.
//!
//! ```text
//!   offset 0                         consolidated                        span end
//!   | a | (free) | b  |  c  |         |  d  |   (free)   |  e  |
//!   \___ one allocation, one mapping __/\_ one chunk each _/
//! ```
//!
//! Inside the consolidated span an allocation needs no driver call: the memory is mapped
//! already. Past it, each allocation is backed by a chunk of its own until the next wake or
//! snapshot folds everything into one allocation again.

use std::collections::BTreeMap;

use crate::pool::GranuleMap;

/// One live allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Allocation {
    /// Bytes the caller asked for.
    pub asked: usize,
    /// Bytes it takes: `asked` rounded up to the granularity.
    pub rounded: usize,
}

/// Where a new allocation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub offset: usize,
    pub rounded: usize,
    /// Inside the consolidated span: already backed, no driver call needed.
    pub backed: bool,
}

/// A region's live allocations by offset, the granules they take, and how far from offset 0
/// the consolidated span reaches.
#[derive(Clone, Debug)]
pub(crate) struct AllocationMap {
    granularity: usize,
    granules: GranuleMap,
    allocations: BTreeMap<usize, Allocation>,
    /// Bytes from offset 0 backed by one consolidated allocation (a multiple of the granularity).
    consolidated: usize,
}

impl AllocationMap {
    pub fn new(capacity: usize, granularity: usize) -> Self {
        Self {
            granularity,
            granules: GranuleMap::new(capacity / granularity),
            allocations: BTreeMap::new(),
            consolidated: 0,
        }
    }

    /// `bytes` rounded up to the granularity; `None` for 0 or on overflow.
    pub fn round(&self, bytes: usize) -> Option<usize> {
        if bytes == 0 {
            return None;
        }
        bytes
            .checked_add(self.granularity - 1)
            .map(|b| b / self.granularity * self.granularity)
    }

    /// Finds room for `bytes` and takes it: the smallest free run inside the consolidated span
    /// that fits (no driver call needed), else the lowest free run past it (so allocations sit
    /// side by side from the low end). `Err(largest free run in bytes)` when nothing fits.
    pub fn place(&mut self, bytes: usize) -> Result<Placement, usize> {
        let rounded = self.round(bytes).ok_or(0usize)?;
        let count = rounded / self.granularity;
        let limit = self.consolidated / self.granularity;
        let inside = self
            .granules
            .free_runs()
            .filter_map(|(start, len)| {
                let end = (start + len).min(limit);
                (start < end && end - start >= count).then(|| (end - start, start))
            })
            .min();
        let (start, backed) = match inside {
            Some((_, start)) => (start, true),
            None => {
                let outside = self.granules.free_runs().find_map(|(start, len)| {
                    let first = start.max(limit);
                    (start + len > first && start + len - first >= count).then_some(first)
                });
                match outside {
                    Some(start) => (start, false),
                    None => return Err(self.granules.largest_free_run() * self.granularity),
                }
            }
        };
        let taken = self.granules.allocate_at(start, count);
        debug_assert!(taken, "the run was free");
        let offset = start * self.granularity;
        self.allocations.insert(
            offset,
            Allocation {
                asked: bytes,
                rounded,
            },
        );
        Ok(Placement {
            offset,
            rounded,
            backed,
        })
    }

    /// Forgets the allocation starting at `offset`; returns it and whether the consolidated
    /// span backs it (then its memory stays mapped). `None` if no allocation starts there.
    pub fn release(&mut self, offset: usize) -> Option<(Allocation, bool)> {
        let allocation = self.allocations.remove(&offset)?;
        let released = self.granules.release(
            offset / self.granularity,
            allocation.rounded / self.granularity,
        );
        debug_assert!(released, "an allocation's granules are taken");
        Some((allocation, self.is_backed(offset)))
    }

    /// Whether the consolidated span backs the allocation at `offset`.
    pub fn is_backed(&self, offset: usize) -> bool {
        offset < self.consolidated
    }

    /// The live allocation containing byte `offset`: `(start, allocation)`.
    pub fn containing(&self, offset: usize) -> Option<(usize, Allocation)> {
        let (&start, &allocation) = self.allocations.range(..=offset).next_back()?;
        (offset < start + allocation.rounded).then_some((start, allocation))
    }

    pub fn get(&self, offset: usize) -> Option<Allocation> {
        self.allocations.get(&offset).copied()
    }

    /// End of the highest live allocation (a multiple of the granularity); 0 when empty.
    pub fn span_end(&self) -> usize {
        self.allocations
            .iter()
            .next_back()
            .map_or(0, |(&offset, a)| offset + a.rounded)
    }

    #[cfg(test)]
    pub fn consolidated(&self) -> usize {
        self.consolidated
    }

    /// From now on `[0, bytes)` is backed by one consolidated allocation.
    pub fn set_consolidated(&mut self, bytes: usize) {
        debug_assert!(bytes.is_multiple_of(self.granularity));
        self.consolidated = bytes;
    }

    /// Live bytes as `(offset, len)` runs, adjacent allocations merged: what sleep must save.
    pub fn live_runs(&self) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (&offset, allocation) in &self.allocations {
            match runs.last_mut() {
                Some((start, len)) if *start + *len == offset => *len += allocation.rounded,
                _ => runs.push((offset, allocation.rounded)),
            }
        }
        runs
    }

    /// FNV-1a over every live allocation's offset and asked size, in address order.
    pub fn fingerprint(&self) -> u64 {
        crate::hash::fnv1a64(
            self.allocations
                .iter()
                .flat_map(|(&offset, a)| [offset as u64, a.asked as u64])
                .flat_map(u64::to_le_bytes),
        )
    }

    /// Live allocations and the bytes they take.
    pub fn allocated(&self) -> (usize, usize) {
        let bytes = self.allocations.values().map(|a| a.rounded).sum();
        (self.allocations.len(), bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;

    #[test]
    fn allocations_sit_side_by_side_from_the_low_end() {
        let mut map = AllocationMap::new(64 * G, G);
        let a = map.place(1).unwrap();
        let b = map.place(3 * G).unwrap();
        let c = map.place(G + 1).unwrap();
        assert_eq!((a.offset, b.offset, c.offset), (0, G, 4 * G));
        assert_eq!((a.rounded, b.rounded, c.rounded), (G, 3 * G, 2 * G));
        assert!(
            !a.backed && !b.backed && !c.backed,
            "nothing consolidated yet"
        );
        assert_eq!(map.span_end(), 6 * G);
        assert_eq!(
            map.live_runs(),
            [(0, 6 * G)],
            "adjacent allocations form one run"
        );
        assert_eq!(map.get(b.offset).unwrap().asked, 3 * G);
    }

    #[test]
    fn a_freed_hole_is_reused_and_runs_split_around_it() {
        let mut map = AllocationMap::new(64 * G, G);
        let offsets: Vec<usize> = (0..4).map(|_| map.place(G).unwrap().offset).collect();
        let (freed, backed) = map.release(offsets[1]).unwrap();
        assert_eq!((freed.rounded, backed), (G, false));
        assert_eq!(map.live_runs(), [(0, G), (2 * G, 2 * G)]);
        assert_eq!(map.place(G).unwrap().offset, G, "first fit takes the hole");
        assert!(
            map.release(offsets[1] + 1).is_none(),
            "not an allocation start"
        );
        assert!(map.release(40 * G).is_none());
    }

    #[test]
    fn inside_the_consolidated_span_best_fit_wins_and_needs_no_backing() {
        let mut map = AllocationMap::new(64 * G, G);
        let placed: Vec<usize> = [2, 1, 3, 1]
            .iter()
            .map(|&n| map.place(n * G).unwrap().offset)
            .collect();
        map.set_consolidated(map.span_end());
        map.release(placed[0]); // 2-granule hole at 0
        map.release(placed[2]); // 3-granule hole at 3G
        let p = map.place(2 * G).unwrap();
        assert_eq!((p.offset, p.backed), (0, true), "the 2-hole fits exactly");
        let q = map.place(G).unwrap();
        assert_eq!((q.offset, q.backed), (3 * G, true));
        let r = map.place(3 * G).unwrap();
        assert_eq!(
            (r.offset, r.backed),
            (7 * G, false),
            "only 2 granules left inside"
        );
    }

    #[test]
    fn a_run_straddling_the_span_end_is_used_only_past_it() {
        let mut map = AllocationMap::new(16 * G, G);
        let a = map.place(4 * G).unwrap();
        map.set_consolidated(4 * G);
        map.release(a.offset);
        let big = map.place(6 * G).unwrap();
        assert_eq!((big.offset, big.backed), (4 * G, false));
        let small = map.place(G).unwrap();
        assert_eq!((small.offset, small.backed), (0, true));
    }

    #[test]
    fn containing_finds_the_allocation_of_any_inner_byte() {
        let mut map = AllocationMap::new(16 * G, G);
        map.place(G).unwrap();
        let b = map.place(3 * G).unwrap();
        assert_eq!(map.containing(b.offset + 5).map(|(o, _)| o), Some(b.offset));
        assert_eq!(map.containing(4 * G - 1).map(|(o, _)| o), Some(b.offset));
        assert_eq!(map.containing(4 * G), None);
    }

    #[test]
    fn fingerprints_follow_offsets_and_sizes_only() {
        let mut a = AllocationMap::new(16 * G, G);
        let mut b = AllocationMap::new(32 * G, G);
        for map in [&mut a, &mut b] {
            map.place(G + 3).unwrap();
            map.place(5).unwrap();
        }
        assert_eq!(a.fingerprint(), b.fingerprint());
        b.place(1).unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
        let mut c = AllocationMap::new(16 * G, G);
        c.place(G + 4).unwrap();
        c.place(5).unwrap();
        assert_ne!(a.fingerprint(), c.fingerprint(), "the asked size counts");
    }

    #[test]
    fn full_capacity_reports_the_largest_run_and_changes_nothing() {
        let mut map = AllocationMap::new(4 * G, G);
        map.place(G).unwrap();
        map.place(2 * G).unwrap();
        assert_eq!(map.place(2 * G), Err(G));
        assert_eq!(map.allocated(), (2, 3 * G));
        assert_eq!(map.place(0), Err(0), "zero bytes is not an allocation");
    }

    #[test]
    fn random_traffic_keeps_allocations_disjoint_and_inside_capacity() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut map = AllocationMap::new(128 * G, G);
        let mut live: Vec<usize> = Vec::new();
        for step in 0..5_000 {
            match next() % 5 {
                0 if !live.is_empty() => {
                    let offset = live.swap_remove(next() as usize % live.len());
                    assert!(map.release(offset).is_some());
                }
                1 if step % 97 == 0 => map.set_consolidated(map.span_end()),
                _ => {
                    let bytes = (next() % (6 * G as u64)) as usize + 1;
                    if let Ok(p) = map.place(bytes) {
                        assert_eq!(p.backed, p.offset + p.rounded <= map.consolidated());
                        live.push(p.offset);
                    }
                }
            }
            let mut spans: Vec<(usize, usize)> = live
                .iter()
                .map(|&o| (o, map.get(o).unwrap().rounded))
                .collect();
            spans.sort();
            assert!(
                spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
                "overlap"
            );
            assert!(spans.last().is_none_or(|&(o, l)| o + l <= 128 * G));
            let runs_total: usize = map.live_runs().iter().map(|r| r.1).sum();
            assert_eq!(runs_total, map.allocated().1);
        }
    }
}
