//! The pointer ownership table: which device ranges the layer handed out, so that every other
//! pointer passes through to CUDA untouched.

use std::collections::BTreeMap;

/// One allocation the layer owns: `bytes` as the caller asked, and what serves it.
#[derive(Debug)]
pub struct Entry<P> {
    pub bytes: usize,
    pub payload: P,
}

/// Live allocations by start address. Ranges never overlap.
#[derive(Debug)]
pub struct OwnershipTable<P> {
    entries: BTreeMap<u64, Entry<P>>,
    live_bytes: usize,
}

/// Where an address falls.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The start of an allocation of `bytes`.
    Start { bytes: usize },
    /// Inside the allocation that starts at `start`, not at its start.
    Inside { start: u64, bytes: usize },
    /// Not in any allocation of the layer: someone else's pointer.
    Foreign,
}

impl<P> Default for OwnershipTable<P> {
    fn default() -> Self {
        Self {
            entries: BTreeMap::new(),
            live_bytes: 0,
        }
    }
}

impl<P> OwnershipTable<P> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `[start, start + bytes)`. Refuses (and returns the payload) if `bytes` is 0 or
    /// the range overlaps a live one: the layer never hands out the same memory twice, so that
    /// would be a bug upstream, not something to paper over.
    pub fn insert(&mut self, start: u64, bytes: usize, payload: P) -> Result<(), P> {
        let Some(end) = start.checked_add(bytes as u64).filter(|_| bytes > 0) else {
            return Err(payload);
        };
        if let Some((&before, entry)) = self.entries.range(..end).next_back() {
            if before + entry.bytes as u64 > start {
                return Err(payload);
            }
        }
        self.entries.insert(start, Entry { bytes, payload });
        self.live_bytes += bytes;
        Ok(())
    }

    pub fn lookup(&self, address: u64) -> Lookup {
        match self.entries.range(..=address).next_back() {
            Some((&start, entry)) if start == address => Lookup::Start { bytes: entry.bytes },
            Some((&start, entry)) if address < start + entry.bytes as u64 => Lookup::Inside {
                start,
                bytes: entry.bytes,
            },
            _ => Lookup::Foreign,
        }
    }

    /// The allocation containing `address`: `(start, bytes)`.
    pub fn containing(&self, address: u64) -> Option<(u64, usize)> {
        match self.lookup(address) {
            Lookup::Start { bytes } => Some((address, bytes)),
            Lookup::Inside { start, bytes } => Some((start, bytes)),
            Lookup::Foreign => None,
        }
    }

    pub fn get(&self, start: u64) -> Option<&Entry<P>> {
        self.entries.get(&start)
    }

    pub fn get_mut(&mut self, start: u64) -> Option<&mut Entry<P>> {
        self.entries.get_mut(&start)
    }

    /// Forgets the allocation that starts at `start`.
    pub fn remove(&mut self, start: u64) -> Option<Entry<P>> {
        let entry = self.entries.remove(&start)?;
        self.live_bytes -= entry.bytes;
        Some(entry)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of all live allocations, as asked.
    pub fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &Entry<P>)> {
        self.entries.iter().map(|(&start, entry)| (start, entry))
    }

    /// The allocations that share at least one byte with `[start, start + bytes)`, in address
    /// order (none for an empty range).
    pub fn overlapping(&self, start: u64, bytes: usize) -> impl Iterator<Item = (u64, &Entry<P>)> {
        let end = start.saturating_add(bytes as u64);
        let before = self
            .entries
            .range(..start)
            .next_back()
            .filter(|(&at, entry)| bytes > 0 && at + entry.bytes as u64 > start);
        let inside = self.entries.range(start..end.max(start));
        before
            .into_iter()
            .chain(inside)
            .map(|(&at, entry)| (at, entry))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_starts_insides_and_foreign_pointers() {
        let mut table = OwnershipTable::new();
        table.insert(0x1000, 0x100, "a").unwrap();
        table.insert(0x2000, 0x10, "b").unwrap();
        assert_eq!(table.lookup(0x1000), Lookup::Start { bytes: 0x100 });
        assert_eq!(
            table.lookup(0x10ff),
            Lookup::Inside {
                start: 0x1000,
                bytes: 0x100
            }
        );
        assert_eq!(table.lookup(0x1100), Lookup::Foreign, "one past the end");
        assert_eq!(table.lookup(0xfff), Lookup::Foreign);
        assert_eq!(
            table.lookup(0x2008),
            Lookup::Inside {
                start: 0x2000,
                bytes: 0x10
            }
        );
        assert_eq!(table.containing(0x2008), Some((0x2000, 0x10)));
        assert_eq!(table.containing(0x3000), None);
        assert_eq!(table.len(), 2);
        assert_eq!(table.live_bytes(), 0x110);
    }

    #[test]
    fn refuses_overlaps_and_empty_ranges() {
        let mut table = OwnershipTable::new();
        table.insert(0x1000, 0x100, 1).unwrap();
        assert_eq!(table.insert(0x1080, 0x100, 2), Err(2), "starts inside");
        assert_eq!(table.insert(0x0f80, 0x100, 3), Err(3), "ends inside");
        assert_eq!(table.insert(0x0f00, 0x1000, 4), Err(4), "covers it");
        assert_eq!(table.insert(0x1000, 0x100, 5), Err(5), "same start");
        assert_eq!(table.insert(0x5000, 0, 6), Err(6), "empty");
        assert_eq!(table.insert(u64::MAX - 1, 4, 7), Err(7), "wraps around");
        table.insert(0x1100, 0x100, 8).unwrap(); // adjacent is fine
        table.insert(0x0f00, 0x100, 9).unwrap();
        assert_eq!(table.len(), 3);
    }

    #[test]
    fn overlapping_finds_every_allocation_a_range_touches() {
        let mut table = OwnershipTable::new();
        table.insert(0x1000, 0x100, "a").unwrap();
        table.insert(0x1100, 0x100, "b").unwrap();
        table.insert(0x2000, 0x100, "c").unwrap();
        let names = |start, bytes| -> Vec<&str> {
            table
                .overlapping(start, bytes)
                .map(|(_, e)| e.payload)
                .collect()
        };
        assert_eq!(names(0x1080, 0x100), vec!["a", "b"], "from inside a into b");
        assert_eq!(names(0x1000, 0x100), vec!["a"], "exactly a");
        assert_eq!(names(0x10ff, 1), vec!["a"], "a's last byte");
        assert_eq!(names(0x1200, 0xe00), Vec::<&str>::new(), "the gap");
        assert_eq!(names(0x0, 0x10000), vec!["a", "b", "c"]);
        assert_eq!(names(0x1050, 0), Vec::<&str>::new(), "an empty range");
    }

    #[test]
    fn remove_gives_back_the_payload_and_bytes() {
        let mut table = OwnershipTable::new();
        table.insert(0x1000, 0x100, "a").unwrap();
        assert!(table.remove(0x1001).is_none(), "only by start");
        let entry = table.remove(0x1000).unwrap();
        assert_eq!((entry.bytes, entry.payload), (0x100, "a"));
        assert!(table.is_empty());
        assert_eq!(table.live_bytes(), 0);
        assert_eq!(
            table.lookup(0x1000),
            Lookup::Foreign,
            "freed memory is foreign again"
        );
        table.insert(0x1000, 0x80, "again").unwrap();
        assert_eq!(table.get(0x1000).unwrap().payload, "again");
    }
}
