//! The one seam between the pool's logic and the driver.
//!
//! The pool reserves address ranges, creates chunks, maps them and waits on fences only through
//! [`Backend`]. [`Vmm`] is the real one; the tests run the same state machine against a fake on
//! the CPU, with failures injected at any call (`pool/fake.rs`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::driver::vmm::{Mapping, Physical, Reservation};
use crate::error::Result;
use crate::fence::{Fence, FencePolicy};

/// A reserved address range.
pub(crate) trait ReservedRange: Send + Sync {
    fn base(&self) -> u64;
    fn bytes(&self) -> usize;
}

/// A chunk mapped into a reserved range; unmapped on drop.
pub(crate) trait MappedRange: Send {
    fn ptr(&self) -> u64;
    fn bytes(&self) -> usize;
    /// Never unmap: the GPU may still use the range.
    fn leak_on_drop(&mut self);
}

/// Waits for the GPU before memory is unmapped.
pub(crate) trait Waiter: Send {
    fn wait(&self) -> Result<()>;
    fn check_not_capturing(&self) -> Result<()>;
    fn attach(&mut self, stream: &Arc<CudaStream>);
}

/// What the pool needs from the driver.
pub(crate) trait Backend: Send + 'static {
    type Reservation: ReservedRange;
    /// A chunk of physical memory; released when its last `Arc` drops.
    type Memory: Send + Sync;
    type Mapping: MappedRange;
    type Fence: Waiter;

    fn reserve(&self, bytes: usize, alignment: usize) -> Result<Self::Reservation>;
    fn create(&self, bytes: usize) -> Result<Self::Memory>;
    /// Maps each of `memory` whole, side by side from `offset` in `reservation`, and grants
    /// access over the whole run (one set-access for all of them). All or nothing: on error
    /// nothing stays mapped.
    fn map_run(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &[Arc<Self::Memory>],
    ) -> Result<Vec<Self::Mapping>>;
    fn fence(&self, policy: FencePolicy) -> Self::Fence;
}

/// The real driver: VMM calls on one context.
#[derive(Debug)]
pub(crate) struct Vmm {
    ctx: Arc<CudaContext>,
    access: Vec<usize>,
}

impl Vmm {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Self {
        Self {
            ctx: ctx.clone(),
            access: vec![ctx.ordinal()],
        }
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
}

impl Backend for Vmm {
    type Reservation = Arc<Reservation>;
    type Memory = Physical;
    type Mapping = Mapping;
    type Fence = Fence;

    fn reserve(&self, bytes: usize, alignment: usize) -> Result<Self::Reservation> {
        Ok(Arc::new(Reservation::new(&self.ctx, bytes, alignment)?))
    }

    fn create(&self, bytes: usize) -> Result<Self::Memory> {
        Physical::new(&self.ctx, bytes, false)
    }

    fn map_run(
        &self,
        reservation: &Self::Reservation,
        offset: usize,
        memory: &[Arc<Self::Memory>],
    ) -> Result<Vec<Self::Mapping>> {
        Mapping::new_many(reservation, offset, memory, &self.access)
    }

    fn fence(&self, policy: FencePolicy) -> Self::Fence {
        Fence::new(&self.ctx, policy)
    }
}
