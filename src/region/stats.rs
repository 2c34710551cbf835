//! What a region holds, for reports: its own file so that the state machine and the public
//! handle both use it without importing each other.

/// What a region holds, for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegionStats {
    /// The region's tag.
    pub tag: String,
    /// Virtual bytes reserved.
    pub reserved: usize,
    /// Bytes of live allocations (granule-rounded).
    pub allocated: usize,
    /// Live allocations.
    pub allocations: usize,
    /// End of the highest live allocation, from the base.
    pub span: usize,
    /// Physical bytes mapped under the region now.
    pub mapped: usize,
    /// Mappings that takes.
    pub mappings: usize,
    /// Whether the region is asleep.
    pub asleep: bool,
    /// Bytes held on the host while asleep.
    pub host_bytes: usize,
}
