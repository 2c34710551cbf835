//! Statistics: what the pool and each tenant hold, computed from the books.

use super::State;
use crate::error::Result;
use crate::pool::backend::{Backend, ReservedRange};
use crate::pool::ledger::TenantId;
use crate::pool::stats::{PoolStats, TenantStats};

impl<B: Backend> State<B> {
    pub(crate) fn tenant_stats(&self, tenant: TenantId) -> Result<TenantStats> {
        let granularity = self.book.granularity();
        let state = self.tenant(tenant)?;
        let (mapped, _) = self.book.held_by(tenant);
        Ok(TenantStats {
            name: state.name.to_string(),
            virtual_capacity: state.reservation.bytes(),
            virtual_in_use: state.granules.taken() * granularity,
            mapped,
            mappings: state.blocks.values().map(|b| b.segments.len()).sum(),
            blocks: state.blocks.len(),
            physical_limit: self.book.limit_of(tenant),
            largest_free_run: state.granules.largest_free_run() * granularity,
            virtual_fragmentation: state.granules.fragmentation(),
            peak_mapped: state.peak_mapped,
        })
    }

    pub(crate) fn all_tenant_stats(&self) -> Vec<TenantStats> {
        self.tenants
            .keys()
            .filter_map(|&id| self.tenant_stats(id).ok())
            .collect()
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let granularity = self.book.granularity();
        let free_virtual: usize = self.tenants.values().map(|t| t.granules.free()).sum();
        let largest_run = self
            .tenants
            .values()
            .map(|t| t.granules.largest_free_run())
            .max()
            .unwrap_or(0);
        let cached = self.book.cached();
        let largest_cached = self.book.largest_cached_chunk();
        PoolStats {
            tenants: self.tenants.len(),
            reserved_virtual: self.tenants.values().map(|t| t.reservation.bytes()).sum(),
            mapped: self.book.held(),
            cached,
            budget: self.book.budget(),
            mappings: self
                .tenants
                .values()
                .flat_map(|t| t.blocks.values())
                .map(|b| b.segments.len())
                .sum(),
            chunks: self.book.chunk_count(),
            largest_free_run: largest_run * granularity,
            largest_cached_chunk: largest_cached,
            virtual_fragmentation: if free_virtual == 0 {
                0.0
            } else {
                1.0 - largest_run as f64 / free_virtual as f64
            },
            cache_fragmentation: if cached == 0 {
                0.0
            } else {
                1.0 - largest_cached as f64 / cached as f64
            },
            peak_mapped: self.counters.peak_mapped,
            creates: self.counters.creates,
            releases: self.counters.releases,
            reuses: self.counters.reuses,
            stitched: self.counters.stitched,
            drains: self.counters.drains,
            drained_bytes: self.counters.drained_bytes,
            refusals: self.counters.refusals,
        }
    }
}
