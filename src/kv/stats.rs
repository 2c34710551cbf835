//! What a cache holds: mapped, shared and free granules and their bytes.

use std::sync::Arc;

use super::state::KvState;
use crate::vmm_core::Backend;

/// A snapshot of a [`KvCache`](super::KvCache)'s memory ([`KvCache::stats`](super::KvCache::stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Granule slots (of every row) that map a data granule rather than the zero granule.
    pub mapped_granules: usize,
    /// Distinct physical data granules mapped (a shared granule counts once).
    pub physical_granules: usize,
    /// Distinct physical granules mapped by more than one row (shared prefixes).
    pub shared_granules: usize,
    /// Granules kept for reuse after releases (unmapped, or retiring: zeroed, mapped at a free
    /// slot until a later step maps the zero granule there).
    pub free_granules: usize,
    /// Of the free granules, those known to hold zeros and unmapped: a gated layer takes one
    /// as it is when a row opens a granule ([`KvCache::zero_ahead`](super::KvCache::zero_ahead)).
    pub zeroed_granules: usize,
    /// Bytes of device memory the cache holds: data and free granules, the zero granule and the
    /// lengths array.
    pub bytes: usize,
    /// Bytes an unshared cache would map for the same rows (`mapped_granules` granules).
    pub unshared_bytes: usize,
    /// Bytes of one granule.
    pub granule: usize,
    /// Sequences with a non-zero length.
    pub sequences: usize,
    /// Whether the cache sleeps (its data is on the host).
    pub asleep: bool,
}

impl<B: Backend> KvState<B> {
    pub fn stats(&self) -> KvStats {
        let granule = self.geometry.granule;
        let distinct = self.table.distinct();
        let mapped_granules = distinct.iter().map(|(slots, _)| slots.len()).sum();
        let shared_granules = distinct.iter().filter(|(slots, _)| slots.len() > 1).count();
        let lengths_bytes = (self.geometry.layout.max_batch * 4).div_ceil(granule) * granule;
        let retiring = self.table.retiring().len();
        let held = distinct.len() + self.free.len() + retiring + 1;
        debug_assert!(distinct
            .iter()
            .all(|(s, g)| Arc::strong_count(g) == s.len() + 1));
        KvStats {
            mapped_granules,
            physical_granules: distinct.len(),
            shared_granules,
            free_granules: self.free.len() + retiring,
            zeroed_granules: self.free.zeroed_len(),
            bytes: held * granule + lengths_bytes,
            unshared_bytes: mapped_granules * granule,
            granule,
            sequences: self.lengths.iter().filter(|&&len| len > 0).count(),
            asleep: self.sleeping.is_some(),
        }
    }
}
