//! Pool and tenant statistics: plain data to print, compare or plot.

use std::fmt;

/// What a whole pool holds and has done. Byte counts are of physical memory unless named
/// virtual.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Tenants registered now.
    pub tenants: usize,
    /// Virtual address space reserved by all tenants.
    pub reserved_virtual: usize,
    /// Physical memory mapped into blocks.
    pub mapped: usize,
    /// Physical memory kept unmapped for reuse.
    pub cached: usize,
    /// The cap on mapped plus cached memory ([`PoolOptions::budget`](crate::PoolOptions::budget)),
    /// if one was set.
    pub budget: Option<usize>,
    /// Live mappings: each is one `cuMemMap` and costs a `cuMemUnmap` to undo.
    pub mappings: usize,
    /// Physical chunks, mapped or cached.
    pub chunks: usize,
    /// The longest free virtual run in any tenant's reservation, in bytes.
    pub largest_free_run: usize,
    /// The largest cached chunk: the most a block cache that cannot stitch could serve from
    /// the cache in one request.
    pub largest_cached_chunk: usize,
    /// `1 - largest free run / free virtual bytes`, over all reservations: 0 when free address
    /// space is one run, near 1 when it is splintered.
    pub virtual_fragmentation: f64,
    /// `1 - largest cached chunk / cached bytes`: how scattered the cache is. A block cache could
    /// serve at most the largest chunk; stitching can serve all of it.
    pub cache_fragmentation: f64,
    /// The most memory mapped into blocks at any one time since the pool was made.
    pub peak_mapped: usize,
    /// `cuMemCreate` calls that succeeded.
    pub creates: u64,
    /// `cuMemRelease` calls.
    pub releases: u64,
    /// Requests served at least partly from the cache.
    pub reuses: u64,
    /// Requests served by more than one chunk (stitched).
    pub stitched: u64,
    /// Times cached chunks were released: on out-of-memory, to fit the budget, or by
    /// [`ElasticPool::drain`](crate::ElasticPool::drain) (each also an [`EventKind::Drain`](super::EventKind::Drain)).
    pub drains: u64,
    /// Bytes those drains released, in all.
    pub drained_bytes: usize,
    /// Requests refused (budget, memory, virtual capacity).
    pub refusals: u64,
}

/// One tenant's share of a pool.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct TenantStats {
    /// The name given at registration.
    pub name: String,
    /// Bytes of addresses the tenant reserved (its capacity, granule-rounded).
    pub virtual_capacity: usize,
    /// Virtual bytes carved into blocks (including room blocks reserved to grow into).
    pub virtual_in_use: usize,
    /// Physical memory mapped into the tenant's blocks.
    pub mapped: usize,
    /// Live mappings in the tenant's blocks.
    pub mappings: usize,
    /// Live blocks.
    pub blocks: usize,
    /// The tenant's own cap on mapped memory, if registered with one
    /// ([`ElasticPool::register_limited`](crate::ElasticPool::register_limited)).
    pub physical_limit: Option<usize>,
    /// The longest free run of the tenant's reservation, in bytes: the largest block it can
    /// still allocate.
    pub largest_free_run: usize,
    /// `1 - largest free run / free virtual bytes` in this tenant's reservation.
    pub virtual_fragmentation: f64,
    /// The most memory mapped into the tenant's blocks at any one time.
    pub peak_mapped: usize,
}

/// Bytes as a short human figure (binary units).
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tenants, {} virtual; mapped {} in {} mappings, cached {} ({} chunks in all, \
             largest cached {}, cache fragmentation {:.2}); largest free run {}, virtual \
             fragmentation {:.2}; creates {}, releases {}, reuses {}, stitched {}, drains {} ({}), \
             refusals {}",
            self.tenants,
            human_bytes(self.reserved_virtual),
            human_bytes(self.mapped),
            self.mappings,
            human_bytes(self.cached),
            self.chunks,
            human_bytes(self.largest_cached_chunk),
            self.cache_fragmentation,
            human_bytes(self.largest_free_run),
            self.virtual_fragmentation,
            self.creates,
            self.releases,
            self.reuses,
            self.stitched,
            self.drains,
            human_bytes(self.drained_bytes),
            self.refusals,
        )?;
        if let Some(budget) = self.budget {
            write!(f, "; budget {}", human_bytes(budget))?;
        }
        Ok(())
    }
}

impl fmt::Display for TenantStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} blocks, mapped {} in {} mappings (peak {}), virtual {} of {} in use, largest \
             free run {}, fragmentation {:.2}",
            self.name,
            self.blocks,
            human_bytes(self.mapped),
            self.mappings,
            human_bytes(self.peak_mapped),
            human_bytes(self.virtual_in_use),
            human_bytes(self.virtual_capacity),
            human_bytes(self.largest_free_run),
            self.virtual_fragmentation,
        )?;
        if let Some(limit) = self.physical_limit {
            write!(f, ", limit {}", human_bytes(limit))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_picks_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_bytes(64 << 20), "64.00 MiB");
    }
}
