//! The traits: what a memory manager needs from the driver.

use std::fmt::Debug;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::driver::vmm::Location;
use crate::error::Result;
use crate::fence::FencePolicy;
use crate::host::{HostStorage, Piece, StorageUsed};

/// A reserved address range.
pub(crate) trait ReservedRange: Send + Sync {
    fn base(&self) -> u64;
    fn bytes(&self) -> usize;
}

/// A physical allocation; released when its last `Arc` drops.
pub(crate) trait PhysicalMemory: Send + Sync + Debug {
    fn bytes(&self) -> usize;
}

/// Memory mapped into a reserved range; unmapped on drop.
pub(crate) trait MappedRange: Send + Debug {
    fn ptr(&self) -> u64;
    fn bytes(&self) -> usize;
    /// Never unmap: the GPU may still use the range.
    fn leak_on_drop(&mut self);
}

/// Waits for the GPU before memory is unmapped.
pub(crate) trait Waiter: Send + Debug {
    fn wait(&self) -> Result<()>;
    fn check_not_capturing(&self) -> Result<()>;
    fn attach(&mut self, stream: &Arc<CudaStream>);
    /// Work just enqueued on the stream with this key used the memory
    /// ([`Backend::stream_key`]); `FencePolicy::LastUse` waits up to here.
    fn note_use(&mut self, stream_key: u64) -> Result<()>;
}

/// What the pool, the regions, spaces and datasets need from the driver: address ranges, physical memory,
/// mappings, fences, and the copies that move a region's bytes (device to device, and to and
/// from host memory while it sleeps).
pub(crate) trait Backend: Clone + Send + Sync + Debug + 'static {
    type Reservation: ReservedRange + Clone + Debug;
    type Memory: PhysicalMemory;
    type Mapping: MappedRange;
    type Fence: Waiter;
    /// A stream work is ordered on.
    type Stream: Clone + Send + Sync + Debug;
    /// Bytes saved on the host while a region sleeps.
    type HostCopy: Send + Sync + Debug;

    /// Allocation granularity of device memory (exportable memory's, if `shareable`).
    fn granularity(&self, shareable: bool) -> Result<usize>;
    fn reserve(&self, bytes: usize, alignment: usize) -> Result<Self::Reservation>;
    /// `bytes` (a multiple of the granularity) of device memory; exportable as a file
    /// descriptor if `shareable`.
    fn create_memory(&self, bytes: usize, shareable: bool) -> Result<Self::Memory>;
    /// `bytes` of memory at `at` (this device, a peer, pinned host) for a dataset; exportable
    /// if `shareable`.
    fn create_at(&self, bytes: usize, shareable: bool, at: Location) -> Result<Self::Memory>;
    /// A chunk for the pool (never exported).
    fn create(&self, bytes: usize) -> Result<Self::Memory> {
        self.create_memory(bytes, false)
    }
    /// Maps each of `memory` whole, side by side from `offset` in `reservation`, and grants
    /// access over the whole run (one set-access for all of them). All or nothing: on error
    /// nothing stays mapped.
    fn map_run(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &[Arc<Self::Memory>],
    ) -> Result<Vec<Self::Mapping>>;
    /// Maps the first `bytes` of `memory` at `offset` in `reservation` with access. All or
    /// nothing.
    fn map(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &Arc<Self::Memory>,
        bytes: usize,
    ) -> Result<Self::Mapping>;
    /// `memory` mapped whole `count` times side by side from `offset` in `reservation`, with
    /// read-only access over the run (one set-access): the same physical memory at many
    /// addresses, which kernels may read and a write to which faults. All or nothing.
    fn map_read_only(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &Arc<Self::Memory>,
        count: usize,
    ) -> Result<Vec<Self::Mapping>>;
    /// `memory` mapped whole at a fresh reservation of its own (a private address for it).
    fn map_alone(&self, memory: &Arc<Self::Memory>) -> Result<(Self::Reservation, Self::Mapping)>;
    fn fence(&self, policy: FencePolicy) -> Self::Fence;
    /// Records on `fence` that `stream` may use the memory it guards.
    fn attach(&self, fence: &mut Self::Fence, stream: &Self::Stream);
    /// Makes work enqueued next on `stream` wait for what `fence` waits for (on the GPU where
    /// the policy allows, else by waiting here).
    fn order_before(&self, fence: &mut Self::Fence, stream: &Self::Stream) -> Result<()>;
    /// A new stream of the device (`cuStreamCreate`).
    fn new_stream(&self) -> Result<Self::Stream>;
    /// The ordinal of the device the backend allocates on.
    fn device(&self) -> usize;
    /// Enqueues a device-to-device copy on `stream`.
    fn copy_device(
        &self,
        stream: &Self::Stream,
        source: u64,
        destination: u64,
        bytes: usize,
    ) -> Result<()>;
    /// Enqueues a fill of `[destination, destination + bytes)` with zeros on `stream`.
    fn fill_zero(&self, stream: &Self::Stream, destination: u64, bytes: usize) -> Result<()>;
    /// Copies `data` from the host to `destination` on `stream`; returns once it is there.
    fn write_host(&self, stream: &Self::Stream, destination: u64, data: &[u8]) -> Result<()>;
    fn synchronize(&self, stream: &Self::Stream) -> Result<()>;
    /// Waits for all work on the device.
    fn synchronize_device(&self) -> Result<()>;
    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool>;
    /// The stream as a number, for [`Waiter::note_use`].
    fn stream_key(&self, stream: &Self::Stream) -> u64;
    /// Free device memory, for error reports (0 if unknown).
    fn free_memory(&self) -> usize;
    /// Copies the device ranges of `pieces` to host memory of kind `storage`, on `stream`;
    /// returns once they are there.
    fn save(
        &self,
        storage: &HostStorage,
        stream: &Self::Stream,
        pieces: &[Piece],
    ) -> Result<Self::HostCopy>;
    /// Copies saved bytes back to the device ranges of `pieces`; returns once they are there.
    fn load(&self, copy: &Self::HostCopy, stream: &Self::Stream, pieces: &[Piece]) -> Result<()>;
    /// Releases now what the device holds for release (memory given back and kept for reuse,
    /// issue 43): after a sleep, whose point is the free memory.
    fn release_held(&self) {}
    /// Which kind of host memory holds `copy`.
    fn storage_used(copy: &Self::HostCopy) -> StorageUsed;
}
