//! What the engine needs of one GPU: the seam between the layer's logic (tested on the CPU with
//! a fake device) and stablebuf's pool and regions (`gpu.rs`).

use std::time::Duration;

use stablebuf::pool::Event;

use crate::cuda::codes::Fail;
use crate::engine::elide::PendingCopy;

/// What a pause or resume moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Transfer {
    /// Bytes of allocations paused or resumed (granule-rounded).
    pub bytes: usize,
    /// Bytes copied to or from the host (0 when contents were discarded).
    pub copied: usize,
    pub elapsed: Duration,
}

impl Transfer {
    pub fn add(&mut self, other: Transfer) {
        self.bytes += other.bytes;
        self.copied += other.copied;
        self.elapsed += other.elapsed;
    }
}

/// One device's pool, as numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolView {
    pub mapped: usize,
    pub cached: usize,
    pub peak_mapped: usize,
    pub mappings: usize,
    pub creates: u64,
    pub reuses: u64,
    pub stitched: u64,
    pub drains: u64,
}

impl PoolView {
    pub fn add(&mut self, other: PoolView) {
        self.mapped += other.mapped;
        self.cached += other.cached;
        self.peak_mapped += other.peak_mapped;
        self.mappings += other.mappings;
        self.creates += other.creates;
        self.reuses += other.reuses;
        self.stitched += other.stitched;
        self.drains += other.drains;
    }
}

/// One tag's memory on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagView {
    pub allocated: usize,
    pub mapped: usize,
    pub host_bytes: usize,
    pub asleep: bool,
}

/// One GPU as the engine uses it. Every method may be called from any thread.
pub trait Device: Send + Sync + 'static {
    /// An untagged allocation (a pool block).
    type Block: Send + 'static;

    /// An untagged allocation of `bytes` (> 0): its address and handle.
    fn alloc(&self, bytes: usize) -> Result<(u64, Self::Block), Fail>;
    /// An untagged allocation whose memory is acquired now (out of memory is reported here)
    /// but not mapped yet: nothing may touch it before [`Device::map_held`], or before a
    /// [`Device::graft`] onto it maps the source's memory in front and the rest behind.
    fn alloc_held(&self, bytes: usize) -> Result<(u64, Self::Block), Fail>;
    /// Maps what a held allocation holds. Does nothing for any other block.
    fn map_held(&self, block: &mut Self::Block) -> Result<(), Fail>;
    /// Frees an untagged allocation (after the GPU is done with it).
    fn free(&self, block: Self::Block) -> Result<(), Fail>;
    /// Moves `source`'s physical memory under the start of `target` (copy elision). On failure,
    /// the source comes back if it still holds its memory, so the caller can copy instead.
    fn graft(
        &self,
        target: &mut Self::Block,
        source: Self::Block,
    ) -> Result<(), (Fail, Option<Self::Block>)>;
    /// Performs a deferred copy now, on its stream, and waits for it.
    fn copy_now(&self, copy: &PendingCopy) -> Result<(), Fail>;
    /// Whether the stream (a `cudaStream_t` as a number) is capturing a graph.
    fn is_capturing(&self, stream: u64) -> bool;

    /// An allocation under `tag` (its region on this device, made on first use).
    fn tag_alloc(&self, tag: &str, bytes: usize) -> Result<u64, Fail>;
    fn tag_free(&self, tag: &str, address: u64) -> Result<(), Fail>;
    /// Releases the tag's physical memory on this device, keeping its addresses; `keep`
    /// copies the contents to pinned host memory first.
    fn pause(&self, tag: &str, keep: bool) -> Result<Transfer, Fail>;
    /// Maps memory again under the tag's addresses and restores what was kept. Idempotent.
    fn resume(&self, tag: &str) -> Result<Transfer, Fail>;
    /// Pins `bytes` of host memory for later pauses (once; a larger call replaces a smaller,
    /// unused arena).
    fn reserve_host(&self, bytes: usize) -> Result<(), Fail>;
    /// Bytes of pinned host memory the layer holds.
    fn host_arena_bytes(&self) -> usize;

    fn pool(&self) -> PoolView;
    fn tag(&self, tag: &str) -> Option<TagView>;
    /// Timeline sources: `(offset from the layer's start, tenant base, events)`.
    fn events(&self) -> Vec<(Duration, u32, Vec<Event>)>;
    /// One line about this device's pool and regions.
    fn summary(&self) -> String;
}
