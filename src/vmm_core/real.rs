//! [`Vmm`]: the real driver behind [`Backend`], VMM calls on one context.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::backend::{Backend, MappedRange, PhysicalMemory, ReservedRange, Waiter};
use crate::driver;
use crate::driver::vmm::{granularity, Location, Mapping, Physical, Reservation};
use crate::error::Result;
use crate::fence::{Fence, FencePolicy};
use crate::host::{self, HostCopy, HostStorage, Piece, StorageUsed};

/// The real driver on one context; mappings grant access to `access` (device ordinals).
#[derive(Clone, Debug)]
pub(crate) struct Vmm {
    ctx: Arc<CudaContext>,
    access: Vec<usize>,
}

impl Vmm {
    /// Mappings readable and writable by `ctx`'s device.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Self {
        Self::with_access(ctx, &[ctx.ordinal()])
    }

    /// Mappings readable and writable by the devices `access` lists.
    pub(crate) fn with_access(ctx: &Arc<CudaContext>, access: &[usize]) -> Self {
        Self {
            ctx: ctx.clone(),
            access: access.to_vec(),
        }
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl ReservedRange for Arc<Reservation> {
    fn base(&self) -> u64 {
        Reservation::base(self)
    }

    fn bytes(&self) -> usize {
        Reservation::bytes(self)
    }
}

impl PhysicalMemory for Physical {
    fn bytes(&self) -> usize {
        Physical::bytes(self)
    }
}

impl MappedRange for Mapping {
    fn ptr(&self) -> u64 {
        Mapping::ptr(self)
    }

    fn bytes(&self) -> usize {
        Mapping::bytes(self)
    }

    fn leak_on_drop(&mut self) {
        Mapping::leak_on_drop(self)
    }
}

impl Waiter for Fence {
    fn wait(&self) -> Result<()> {
        Fence::wait(self)
    }

    fn check_not_capturing(&self) -> Result<()> {
        Fence::check_not_capturing(self)
    }

    fn attach(&mut self, stream: &Arc<CudaStream>) {
        Fence::attach(self, stream)
    }

    fn note_use(&mut self, stream_key: u64) -> Result<()> {
        Fence::note_use(self, stream_key)
    }
}

impl Backend for Vmm {
    type Reservation = Arc<Reservation>;
    type Memory = Physical;
    type Mapping = Mapping;
    type Fence = Fence;
    type Stream = Arc<CudaStream>;
    type HostCopy = HostCopy;

    fn granularity(&self, shareable: bool) -> Result<usize> {
        granularity(&self.ctx, shareable)
    }

    fn reserve(&self, bytes: usize, alignment: usize) -> Result<Self::Reservation> {
        Ok(Arc::new(Reservation::new(&self.ctx, bytes, alignment)?))
    }

    fn create_memory(&self, bytes: usize, shareable: bool) -> Result<Self::Memory> {
        if shareable {
            Physical::new(&self.ctx, bytes, true)
        } else {
            Physical::reusable(&self.ctx, bytes)
        }
    }

    fn create_at(&self, bytes: usize, shareable: bool, at: Location) -> Result<Self::Memory> {
        Physical::owned_at(&self.ctx, bytes, shareable, at)
    }

    fn map_run(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &[Arc<Self::Memory>],
    ) -> Result<Vec<Self::Mapping>> {
        Mapping::new_many(reservation, offset, memory, &self.access)
    }

    fn map(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &Arc<Self::Memory>,
        bytes: usize,
    ) -> Result<Self::Mapping> {
        Mapping::new(reservation, offset, memory, 0, bytes, &self.access)
    }

    fn map_read_only(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &Arc<Self::Memory>,
        count: usize,
    ) -> Result<Vec<Self::Mapping>> {
        Mapping::read_only_run(reservation, offset, memory, count, &self.access)
    }

    fn map_alone(&self, memory: &Arc<Self::Memory>) -> Result<(Self::Reservation, Self::Mapping)> {
        let mapping = Mapping::alone(&self.ctx, memory, &self.access)?;
        Ok((mapping.reservation().clone(), mapping))
    }

    fn fence(&self, policy: FencePolicy) -> Self::Fence {
        Fence::new(&self.ctx, policy)
    }

    fn attach(&self, fence: &mut Self::Fence, stream: &Self::Stream) {
        fence.attach(stream);
    }

    fn order_before(&self, fence: &mut Self::Fence, stream: &Self::Stream) -> Result<()> {
        fence.order_before(stream)
    }

    fn new_stream(&self) -> Result<Self::Stream> {
        driver::traced("cuStreamCreate", 0, || self.ctx.new_stream())
    }

    fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    fn copy_device(
        &self,
        stream: &Self::Stream,
        source: u64,
        destination: u64,
        bytes: usize,
    ) -> Result<()> {
        driver::copy_device(stream, source, destination, bytes)
    }

    fn fill_zero(&self, stream: &Self::Stream, destination: u64, bytes: usize) -> Result<()> {
        driver::fill_zero(stream, destination, bytes)
    }

    fn write_host(&self, stream: &Self::Stream, destination: u64, data: &[u8]) -> Result<()> {
        driver::write_device(stream, destination, data)
    }

    fn synchronize(&self, stream: &Self::Stream) -> Result<()> {
        driver::synchronize_stream(stream)
    }

    fn synchronize_device(&self) -> Result<()> {
        driver::synchronize_context(&self.ctx)
    }

    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool> {
        driver::is_capturing(stream)
    }

    fn stream_key(&self, stream: &Self::Stream) -> u64 {
        stream.cu_stream() as usize as u64
    }

    fn free_memory(&self) -> usize {
        // Memory held for release is free to stablebuf's next allocation of its size.
        driver::memory_info(&self.ctx).map_or(0, |(free, _)| free)
            + driver::deferred::held_bytes(self.ctx.ordinal())
    }

    fn save(
        &self,
        storage: &HostStorage,
        stream: &Self::Stream,
        pieces: &[Piece],
    ) -> Result<Self::HostCopy> {
        host::copy::save_pieces(storage, stream, pieces)
    }

    fn load(&self, copy: &Self::HostCopy, stream: &Self::Stream, pieces: &[Piece]) -> Result<()> {
        host::copy::load_pieces(copy, stream, pieces)
    }

    fn release_held(&self) {
        driver::deferred::trim(self.ctx.ordinal());
    }

    fn storage_used(copy: &Self::HostCopy) -> StorageUsed {
        copy.storage()
    }
}
