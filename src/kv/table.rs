//! The granule table: for every (sequence, layer, K/V) row, what each granule slot of its
//! address range maps: the shared read-only zero granule, or a data granule that one or more
//! rows map (shared prefix granules are one [`Granule`] with several owners).

use std::sync::Arc;

use crate::vmm_core::Backend;

/// Physical memory of one granule holding KV bytes. The table's slots hold it by `Arc`: its
/// strong count is the number of rows that map it.
#[derive(Debug)]
pub(crate) struct Granule<B: Backend> {
    pub memory: Arc<B::Memory>,
}

/// One granule-sized address range of the cache.
#[derive(Debug)]
pub(crate) struct Slot<B: Backend> {
    /// `None`: the zero granule (read-only).
    pub data: Option<Arc<Granule<B>>>,
    /// `None` only if restoring a mapping after a driver error failed too; the next operation
    /// maps the zero granule there again ([`super::state::KvState::repair`]).
    pub mapping: Option<B::Mapping>,
    /// Retiring: `data` is a zeroed granule of no sequence, still mapped read-write, on its way
    /// back to the free list (a release behind a step leaves its unshared granules so; the next
    /// fenced operation maps the zero granule there again, and a sequence that grows over the
    /// slot adopts it). Unshared, reads zeros.
    pub retiring: bool,
}

/// Every slot of the cache, in address order (slot `i` is at `i · granule`).
#[derive(Debug)]
pub(crate) struct GranuleTable<B: Backend> {
    pub slots: Vec<Slot<B>>,
}

impl<B: Backend> GranuleTable<B> {
    /// Rows mapping the granule in slot `slot` (0 for the zero granule).
    pub fn owners(&self, slot: usize) -> usize {
        self.slots[slot].data.as_ref().map_or(0, Arc::strong_count)
    }

    /// Another slot that maps the same data granule as `slot`, if any.
    pub fn other_owner(&self, slot: usize) -> Option<usize> {
        let data = self.slots[slot].data.as_ref()?;
        self.slots.iter().enumerate().find_map(|(i, s)| {
            (i != slot && s.data.as_ref().is_some_and(|d| Arc::ptr_eq(d, data))).then_some(i)
        })
    }

    /// The retiring slots, in address order.
    pub fn retiring(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].retiring)
            .collect()
    }

    /// The distinct data granules of sequences (retiring ones apart), each once, with every
    /// slot that maps it (in address order).
    pub fn distinct(&self) -> Vec<(Vec<usize>, Arc<Granule<B>>)> {
        let mut index = std::collections::HashMap::new();
        let mut distinct: Vec<(Vec<usize>, Arc<Granule<B>>)> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.retiring {
                continue;
            }
            if let Some(data) = &slot.data {
                let at = *index.entry(Arc::as_ptr(data) as usize).or_insert_with(|| {
                    distinct.push((Vec::new(), data.clone()));
                    distinct.len() - 1
                });
                distinct[at].0.push(i);
            }
        }
        distinct
    }
}
