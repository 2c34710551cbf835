//! Regions: tagged reservations whose allocations sit side by side, so that sleeping, waking and
//! swapping weight sets each take ONE mapping for the whole used span.
//!
//! A [`Region`] is what a framework's allocator hook allocates from (the Python package's
//! pluggable allocator, the preload layer's tagged `cudaMalloc`). Its allocations are placed from
//! the low end of one reservation, first fit, granule-rounded:
//!
//! ```text
//!   region "weights": base                                              base + capacity
//!   | w1 | w2 |    w3    | (freed) | w4 |                 free addresses ...            |
//!   \______ used span: [base, base + span) ______/
//!
//!   awake, as allocated:   [chunk][chunk][ chunk  ]         [chunk]    one mapping each
//!   after wake / snapshot: [=========== one allocation, one mapping ==========]
//! ```
//!
//! - [`Region::sleep`] copies the live allocations to host memory (a pinned
//!   [`HostArena`](crate::HostArena), pinned once, is the fast path) and releases every byte of
//!   physical memory; addresses stay reserved, so pointers held by tensors or graphs stay valid.
//! - [`Region::wake`] backs the used span with ONE new allocation and ONE mapping and copies the
//!   bytes back. The cost of a mapping is what makes peers slow (one mapping per 2 MiB costs
//!   27.8 ms per GiB on the H100; one mapping for the GiB about 0.1 ms).
//! - [`Region::snapshot`] makes a second backing of the span with the current contents (a
//!   weight set), and [`Region::bind`] swaps backings under the same addresses with one unmap,
//!   one map and one set-access: a graph captured once replays on another weight set.
//! - [`Region::switch_to`] makes the region read a weight set the cheaper way for its size:
//!   below the device's crossover (about 100 MiB on an H100) it copies the set into the
//!   region's own *live* set instead of remapping ([`SwitchStrategy`]); [`Region::load`] is the
//!   bare copy over whatever set is bound.
//! - [`Region::check_replayable`] is the replay guard: `Err(RegionAsleep)` or `Err(Unbound)`
//!   instead of an illegal-address fault.
//!
//! Guarantees: nothing is unmapped before the region's fence has waited for the GPU; every
//! operation is all or nothing; snapshots you hold keep their memory (also across a sleep).

mod allocation_map;
#[cfg(test)]
mod proptests;
mod snapshot;
mod state;
mod stats;
mod switch;

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaStream, DeviceRepr};

use crate::driver;

use crate::error::{Error, LayoutError, Result};
use crate::fence::FencePolicy;
use crate::host::{HostStorage, TransferReport};
use crate::ids::next_id;
use crate::pool::Event;
use crate::strategy::CostModel;
use crate::vmm_core::{Backend, ReservedRange, Vmm};

pub use snapshot::Snapshot;
use state::{Fixed, RegionState};
pub use stats::RegionStats;
pub use switch::{SwitchStrategy, Switched};

/// Options for [`Region::new`].
#[derive(Clone, Debug)]
pub struct RegionOptions {
    /// Virtual bytes reserved (default 1 TiB: reserving costs no memory).
    pub capacity: usize,
    /// How the region waits for the GPU before unmapping (default: the whole context).
    pub fence: FencePolicy,
}

impl Default for RegionOptions {
    fn default() -> Self {
        Self {
            capacity: 1 << 40,
            fence: FencePolicy::Context,
        }
    }
}

impl RegionOptions {
    /// Virtual bytes to reserve.
    pub fn capacity(mut self, bytes: usize) -> Self {
        self.capacity = bytes;
        self
    }

    /// How to wait for the GPU before unmapping.
    pub fn fence(mut self, fence: FencePolicy) -> Self {
        self.fence = fence;
        self
    }
}

/// One tag's reservation. See the module docs. Cheap to clone (a handle); `Send + Sync`, every
/// method locks internally.
#[derive(Clone, Debug)]
pub struct Region {
    inner: Arc<RegionInner>,
}

#[derive(Debug)]
struct RegionInner {
    // Field order is drop order: the state (mappings) goes before the reservation in `fixed`.
    state: Mutex<RegionState<Vmm>>,
    fixed: Fixed<Vmm>,
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        state.release_all(&self.fixed);
    }
}

impl Region {
    /// Reserves `options.capacity` bytes of addresses on `ctx`'s device for tag `tag`.
    pub fn new(ctx: &Arc<CudaContext>, tag: &str, options: RegionOptions) -> Result<Region> {
        if tag.is_empty() {
            return Err(Error::Layout(LayoutError::EmptyName));
        }
        let backend = Vmm::new(ctx);
        let granularity = backend.granularity(false)?;
        let capacity = options.capacity.div_ceil(granularity).max(1) * granularity;
        let reservation = backend.reserve(capacity, granularity)?;
        let fence = backend.fence(options.fence);
        let fixed = Fixed {
            id: next_id(),
            tag: tag.to_string(),
            backend,
            granularity,
            reservation,
        };
        let state = RegionState::new(&fixed, fence);
        tracing::debug!(
            region = fixed.id,
            tag,
            base = fixed.reservation.base(),
            capacity,
            "region created"
        );
        Ok(Region {
            inner: Arc::new(RegionInner {
                state: Mutex::new(state),
                fixed,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, RegionState<Vmm>> {
        // Every operation is all or nothing, so a poisoned lock still guards consistent state.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The tag given at creation.
    pub fn tag(&self) -> &str {
        &self.inner.fixed.tag
    }

    /// Unique for the life of the process.
    pub fn id(&self) -> u64 {
        self.inner.fixed.id
    }

    /// First address of the reservation.
    pub fn base(&self) -> u64 {
        self.inner.fixed.reservation.base()
    }

    /// Virtual bytes reserved.
    pub fn capacity(&self) -> usize {
        self.inner.fixed.reservation.bytes()
    }

    /// Every allocation is a multiple of this (2 MiB on current GPUs).
    pub fn granularity(&self) -> usize {
        self.inner.fixed.granularity
    }

    /// The CUDA context the region lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.inner.fixed.backend.context()
    }

    /// Whether `address` lies in the region's reservation.
    pub fn contains(&self, address: u64) -> bool {
        let base = self.base();
        address >= base && address < base + self.capacity() as u64
    }

    /// The live allocation containing `address`: its start and the bytes asked for.
    pub fn allocation_at(&self, address: u64) -> Option<(u64, usize)> {
        self.lock().allocation_at(&self.inner.fixed, address)
    }

    /// Allocates `bytes` (> 0, rounded up to the granularity) next to the region's other
    /// allocations and returns its address, fixed until it is freed. Inside the consolidated
    /// span this needs no driver call; past it, one `cuMemCreate` and one mapping.
    ///
    /// Errors: [`RegionAsleep`](crate::error::RegionError::RegionAsleep),
    /// [`Unbound`](crate::error::GraphError::Unbound), [`VirtualCapacity`](crate::error::PoolError::VirtualCapacity),
    /// [`OutOfMemory`](crate::error::DriverError::OutOfMemory); nothing changes on any of them.
    pub fn alloc(&self, bytes: usize) -> Result<u64> {
        self.lock().alloc(&self.inner.fixed, bytes)
    }

    /// Frees the allocation starting at `address`; returns the bytes it was asked with. Inside
    /// the consolidated span the memory stays mapped for reuse (no driver call); otherwise the
    /// fence is waited for and its chunk unmapped and released.
    /// [`UnknownAllocation`](crate::error::RegionError::UnknownAllocation) if none starts there.
    pub fn free(&self, address: u64) -> Result<usize> {
        self.lock().free(&self.inner.fixed, address)
    }

    /// Copies `data` to `address`, which must lie with all of `data` inside one live
    /// allocation; returns when the copy is done.
    pub fn write<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        address: u64,
        data: &[T],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        let state = self.lock();
        state.require_mapped(&self.inner.fixed, address, bytes)?;
        driver::host::copy_to_device(stream, address, data.as_ptr().cast(), bytes)?;
        driver::synchronize_stream(stream)
    }

    /// Copies `out.len()` elements from `address` (inside one live allocation) into `out`.
    pub fn read_into<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        address: u64,
        out: &mut [T],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        let state = self.lock();
        state.require_mapped(&self.inner.fixed, address, bytes)?;
        driver::host::copy_to_host(stream, out.as_mut_ptr().cast(), address, bytes)?;
        driver::synchronize_stream(stream)
    }

    /// Records that `stream` may use the region (matters with [`FencePolicy::AttachedStreams`]).
    pub fn attach(&self, stream: &Arc<CudaStream>) {
        self.lock().fence.attach(stream);
    }

    /// Notes that work just enqueued on `stream` (a raw `CUstream` of the region's device, as a
    /// number: PyTorch's `torch.cuda.Stream.cuda_stream`) used the region. With
    /// [`FencePolicy::LastUse`] a later bind, sleep or free waits only up to here on that stream
    /// (an event), so it overlaps work queued after it; a no-op under the other policies.
    pub fn note_use(&self, stream: u64) -> Result<()> {
        self.lock().fence.note_use(stream)
    }

    /// Copies every live allocation to `storage` (one batch of copies, one wait), then unmaps
    /// and releases all physical memory under the region. Addresses stay reserved. No-op if
    /// asleep. [`Unbound`](crate::error::GraphError::Unbound) if unbound.
    pub fn sleep(&self, storage: &HostStorage, stream: &Arc<CudaStream>) -> Result<TransferReport> {
        self.lock().sleep(&self.inner.fixed, storage, stream)
    }

    /// Backs the used span with ONE new allocation under ONE mapping and copies the saved bytes
    /// back (with [`HostStorage::Discard`] the contents are undefined). No-op if awake. On
    /// [`RestoreOutOfMemory`](crate::error::OffloadError::RestoreOutOfMemory) the region stays asleep with its
    /// host copy, and a retry works once memory is free.
    pub fn wake(&self, stream: &Arc<CudaStream>) -> Result<TransferReport> {
        self.lock().wake(&self.inner.fixed, stream)
    }

    /// Whether the region is asleep.
    pub fn is_asleep(&self) -> bool {
        self.lock().is_asleep()
    }

    /// A second backing of the used span holding the current contents: a weight set to fill and
    /// [`bind`](Region::bind). Consolidates the live backing into one allocation first if it is
    /// made of several, so that every later bind is one mapping.
    pub fn snapshot(&self, stream: &Arc<CudaStream>) -> Result<Snapshot> {
        self.lock()
            .snapshot(&self.inner.fixed, stream, false)
            .map(Snapshot::from_set)
    }

    /// [`Region::snapshot`] in memory another process can import
    /// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`): a weight set to publish with
    /// [`share::publish`](crate::share::publish) and [`Snapshot::export`]. Its size is the span
    /// rounded up to the exportable granularity.
    pub fn snapshot_shareable(&self, stream: &Arc<CudaStream>) -> Result<Snapshot> {
        self.lock()
            .snapshot(&self.inner.fixed, stream, true)
            .map(Snapshot::from_set)
    }

    /// Wakes a sleeping region straight onto `snapshot` (say, a weight set another process just
    /// published into): one mapping, no allocation, no copy back; the host copy is dropped.
    /// [`SnapshotMismatch`](crate::error::RegionError::SnapshotMismatch) if the region is awake (bind
    /// instead) or the snapshot is not this region's; all or nothing.
    pub fn wake_onto(&self, snapshot: &Snapshot) -> Result<()> {
        self.lock().wake_onto(&self.inner.fixed, &snapshot.set)
    }

    /// A fingerprint of where the live allocations sit (offsets and sizes): a process importing
    /// a weight set checks it to know the set is laid out like its expectation.
    pub fn layout_fingerprint(&self) -> u64 {
        self.lock().layout_fingerprint()
    }

    /// The snapshot under the span now, if the region is consolidated (after a snapshot or a
    /// wake): keep it to swap back to these contents later. After a copy
    /// [switch](Region::switch_to) it is the region's own live set, which the next copy switch
    /// overwrites: take a [snapshot](Region::snapshot) to keep those contents.
    pub fn bound(&self) -> Option<Snapshot> {
        self.lock().bound().map(Snapshot::from_set)
    }

    /// Puts `snapshot` under the region's addresses: fence, one unmap, one map, one set-access.
    /// All or nothing; binding the bound snapshot is a no-op.
    /// [`SnapshotMismatch`](crate::error::RegionError::SnapshotMismatch) for a snapshot of another region or
    /// one shorter than the region's span.
    pub fn bind(&self, snapshot: &Snapshot) -> Result<()> {
        self.lock().bind(&self.inner.fixed, &snapshot.set)
    }

    /// Copies `snapshot`'s contents (the region's used span) over the weight set bound now,
    /// enqueued on `stream` (one device-to-device copy from the snapshot's
    /// [home address](Snapshot::home_ptr), mapped on first use), so that the region's addresses
    /// read them without a remap. No fence: like any write to the region it is ordered on
    /// `stream` only, so order work of other streams that reads the region yourself. A later
    /// bind, sleep or free waits for it: the default fence waits for the whole device, and the
    /// copy is noted as a use ([`Region::note_use`]) for [`FencePolicy::LastUse`]; with
    /// [`FencePolicy::AttachedStreams`], [attach](Region::attach) `stream` as for any work on
    /// the region.
    ///
    /// It **overwrites the bound weight set**: if that is a set you hold, its old contents are
    /// gone. [`Region::switch_to`] never does that to your sets.
    ///
    /// Refused, with nothing changed:
    /// [`SnapshotMismatch`](crate::error::RegionError::SnapshotMismatch) for a snapshot of another region,
    /// one shorter than the span, or allocations past the bound set;
    /// [`RegionAsleep`](crate::error::RegionError::RegionAsleep); [`Unbound`](crate::error::GraphError::Unbound);
    /// [`BindDuringCapture`](crate::error::GraphError::BindDuringCapture) while `stream` (or an attached
    /// stream, or this thread) is capturing. Loading the bound snapshot is a no-op.
    pub fn load(&self, snapshot: &Snapshot, stream: &Arc<CudaStream>) -> Result<()> {
        self.lock().load(&self.inner.fixed, &snapshot.set, stream)
    }

    /// Makes the region read `snapshot`'s contents the way `strategy` says, and returns which
    /// way it went:
    ///
    /// - [`Switched::Remapped`]: as [`Region::bind`] (fence, one remap); `snapshot` is bound,
    ///   and writes to the region land in it.
    /// - [`Switched::Copied`]: the region's own *live* weight set is bound (made, and bound
    ///   with one remap, on the first copy switch and after a remap switch), and `snapshot`'s
    ///   bytes are copied into it on `stream`, as [`Region::load`] does (no fence; stream
    ///   order). `snapshot` is only read: writes to the region land in the live set, which
    ///   [`Region::bound`] returns and the next copy switch overwrites. The live set costs one
    ///   more allocation of the span's size, made on the first copy switch and kept until the
    ///   region sleeps or is unbound.
    ///
    /// [`SwitchStrategy::Auto`] copies when the calibrated [`CostModel::for_device`] predicts a
    /// copy of the span to be cheaper than a remap (the first call on a device calibrates it:
    /// tens of milliseconds and 1 GiB of device memory for the duration). Switching to the
    /// bound snapshot is a no-op ([`Switched::Remapped`]). An unbound region can be switched.
    ///
    /// Refused, with nothing changed: [`SnapshotMismatch`](crate::error::RegionError::SnapshotMismatch)
    /// (another region's snapshot, one shorter than the span, allocations past the bound set),
    /// [`RegionAsleep`](crate::error::RegionError::RegionAsleep),
    /// [`BindDuringCapture`](crate::error::GraphError::BindDuringCapture) while `stream` (or an attached
    /// stream, or this thread) is capturing, whatever the strategy.
    ///
    /// ```no_run
    /// use stablebuf::region::{Region, RegionOptions, SwitchStrategy};
    ///
    /// # fn main() -> stablebuf::Result<()> {
    /// let ctx = stablebuf::open_device(0)?;
    /// let stream = ctx.new_stream()?;
    /// let region = Region::new(&ctx, "weights", RegionOptions::default())?;
    /// let w = region.alloc(8 << 20)?;
    /// region.write(&stream, w, &vec![1.0f32; 2 << 20])?;
    /// let set_a = region.snapshot(&stream)?; // holds 1.0
    /// let set_b = region.snapshot(&stream)?;
    /// region.bind(&set_b)?;
    /// region.write(&stream, w, &vec![2.0f32; 2 << 20])?; // set B holds 2.0
    ///
    /// // 8 MiB, far below an H100's crossover: Auto copies set A into the region's live set.
    /// let way = region.switch_to(&set_a, SwitchStrategy::Auto, &stream)?;
    /// println!("{way:?}"); // Switched::Copied there
    /// // ... replay graphs over the region on `stream`: they read 1.0; sets A and B are unchanged.
    /// region.switch_to(&set_b, SwitchStrategy::Remap, &stream)?; // set B mapped under it again
    /// # Ok(()) }
    /// ```
    pub fn switch_to(
        &self,
        snapshot: &Snapshot,
        strategy: SwitchStrategy,
        stream: &Arc<CudaStream>,
    ) -> Result<Switched> {
        // First, as calibrating (which synchronizes and allocates) must not run in a capture.
        self.lock().check_not_capturing(&self.inner.fixed, stream)?;
        let model = match strategy {
            // Calibrated outside the region's lock: it takes tens of milliseconds, once.
            SwitchStrategy::Auto => Some(CostModel::for_device(self.context())?),
            SwitchStrategy::Remap | SwitchStrategy::Copy => None,
        };
        self.lock().switch_to(
            &self.inner.fixed,
            &snapshot.set,
            strategy,
            model.as_ref(),
            stream,
        )
    }

    /// Unmaps the span (after the fence) and lets go of its snapshot (keep [`Region::bound`]
    /// first to bind it back later). Replays guarded by the region then fail with
    /// [`Unbound`](crate::error::GraphError::Unbound) until a bind.
    pub fn unbind(&self) -> Result<()> {
        self.lock().unbind(&self.inner.fixed)
    }

    /// `Ok` if a graph over the region may replay now;
    /// [`RegionAsleep`](crate::error::RegionError::RegionAsleep) or [`Unbound`](crate::error::GraphError::Unbound)
    /// otherwise. The replay guard calls this for every tag a graph uses.
    pub fn check_replayable(&self) -> Result<()> {
        self.lock().check_replayable(&self.inner.fixed)
    }

    /// What the region holds now.
    pub fn stats(&self) -> RegionStats {
        self.lock().stats(&self.inner.fixed)
    }

    /// Register, map, unmap, alloc and free events, oldest first (the pool's event format; the
    /// region's id is the tenant id).
    pub fn events(&self) -> Vec<Event> {
        self.lock().events()
    }
}

/// One SVG of several regions' events, one band per region (the pool's timeline renderer).
#[cfg(feature = "timeline")]
pub fn timeline_svg(regions: &[Region], title: &str) -> Result<String> {
    let mut events: Vec<Event> = regions.iter().flat_map(Region::events).collect();
    events.sort_by_key(|e| e.at);
    crate::pool::timeline::render_svg(&events, title)
}
