//! [`Block`]: memory at a fixed address that can grow and shrink in place.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream, DeviceRepr};

use super::events::BlockId;
use super::ledger::TenantId;
use super::shared::Shared;
use super::state::BlockInfo;
use crate::buffer::{require_range, DeviceBuffer};
use crate::driver;
use crate::error::{Error, LayoutError, PoolError, Result};

/// Device memory from an [`crate::ElasticPool`] at an address that never changes while the
/// block lives. It may be made of several physical chunks (stitched); kernels see one
/// contiguous range. Dropping it unmaps it after the tenant's fence and caches its chunks.
pub struct Block {
    shared: Arc<Shared>,
    tenant: TenantId,
    tenant_name: Arc<str>,
    id: BlockId,
    address: u64,
    capacity: usize,
    freed: bool,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("tenant", &self.tenant_name)
            .field("address", &format_args!("{:#x}", self.address))
            .field("info", &self.info().ok())
            .finish()
    }
}

impl Block {
    pub(crate) fn new(
        shared: Arc<Shared>,
        tenant: TenantId,
        tenant_name: Arc<str>,
        id: BlockId,
        address: u64,
        capacity: usize,
    ) -> Self {
        Self {
            shared,
            tenant,
            tenant_name,
            id,
            address,
            capacity,
            freed: false,
        }
    }

    /// The block's name in the pool's [`Event`](super::Event) log and timeline.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// The device address; the same for the block's whole life, through every grow and shrink.
    pub fn address(&self) -> sys::CUdeviceptr {
        self.address
    }

    /// Bytes of addresses reserved: the most the block can grow to.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Length, mapped bytes and mapping count, or
    /// [`PoolError::TenantGone`](crate::error::PoolError::TenantGone).
    pub fn info(&self) -> Result<BlockInfo> {
        self.shared
            .lock()
            .info(self.tenant, self.id)
            .map_err(|_| self.gone())
    }

    /// Usable bytes; 0 once the tenant is gone.
    pub fn len(&self) -> usize {
        self.info().map_or(0, |info| info.len)
    }

    /// Whether [`len`](Self::len) is 0: shrunk to nothing, or its tenant is gone.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn gone(&self) -> Error {
        Error::Pool(PoolError::TenantGone {
            tenant: self.tenant_name.to_string(),
        })
    }

    fn map_gone(&self, error: Error) -> Error {
        match error {
            Error::Pool(PoolError::TenantGone { .. }) => self.gone(),
            other => other,
        }
    }

    /// Grows the block to `new_len` bytes in place: maps more physical memory after what is
    /// mapped (cached chunks first). The address and the existing contents do not change and
    /// nothing is copied.
    pub fn grow(&mut self, new_len: usize) -> Result<()> {
        let mut state = self.shared.lock();
        state
            .grow(self.tenant, self.id, new_len)
            .map_err(|e| self.map_gone(e))?;
        self.shared.after_request(state);
        Ok(())
    }

    /// Shrinks the block to `new_len` bytes: whole chunks past it are unmapped (after the fence)
    /// and go back to the pool's cache. The first `new_len` bytes keep their contents.
    pub fn shrink(&mut self, new_len: usize) -> Result<()> {
        let mut state = self.shared.lock();
        state
            .shrink(self.tenant, self.id, new_len)
            .map_err(|e| self.map_gone(e))
    }

    /// [`Block::grow`] or [`Block::shrink`], whichever `new_len` asks for.
    pub fn resize(&mut self, new_len: usize) -> Result<()> {
        if new_len >= self.len() {
            self.grow(new_len)
        } else {
            self.shrink(new_len)
        }
    }

    /// Maps the memory a block from [`Tenant::alloc_held`](crate::pool::Tenant::alloc_held) holds
    /// unmapped, and gives it its length. Does nothing for a block that holds nothing unmapped
    /// (any other block, or one mapped already).
    pub fn map_held(&mut self) -> Result<()> {
        self.shared
            .lock()
            .map_held(self.tenant, self.id)
            .map_err(|e| self.map_gone(e))
    }

    /// Moves `donor`'s physical memory under the first bytes of this block without copying:
    /// this block's chunks that overlap the donor's mapped bytes are unmapped (after the
    /// tenant's fence) and cached, the donor's chunks are mapped there in order, and whatever
    /// part of the removed chunks' range they do not cover is backed again (cache first, else one
    /// new chunk). Afterwards this block starts with the donor's contents, and the donor holds
    /// nothing: its addresses are freed, its length is 0 and its methods report
    /// [`PoolError::TenantGone`](crate::error::PoolError::TenantGone).
    ///
    /// All or nothing: on an error both blocks are as they were.
    /// [`LayoutError::InvalidShape`](crate::error::LayoutError::InvalidShape) when the
    /// donor is longer than this block, is this block, or belongs to another tenant.
    ///
    /// Onto a block that holds its memory unmapped
    /// ([`Tenant::alloc_held`](crate::pool::Tenant::alloc_held)),
    /// the donor's chunks are mapped first and only the rest of the block's length is backed
    /// (cache first); the held memory goes back to the cache, and the block has the length it
    /// was allocated with. On an error it still holds its memory unmapped.
    pub fn graft(&mut self, donor: &mut Block) -> Result<()> {
        if !Arc::ptr_eq(&self.shared, &donor.shared) || self.tenant != donor.tenant {
            return Err(Error::Layout(LayoutError::InvalidShape(
                "a block can only be grafted onto a block of the same tenant".into(),
            )));
        }
        self.shared
            .lock()
            .graft(self.tenant, self.id, donor.id)
            .map_err(|e| self.map_gone(e))?;
        donor.freed = true;
        Ok(())
    }

    /// Copies `data` to the block at `offset` bytes and waits for the copy.
    pub fn write<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        data: &[T],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        self.copy(stream, offset, bytes, |device| {
            driver::host::copy_to_device(stream, device, data.as_ptr().cast(), bytes)
        })
    }

    /// Copies `out.len()` elements from the block at `offset` bytes into `out` (blocking).
    pub fn read_into<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        out: &mut [T],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        self.copy(stream, offset, bytes, |device| {
            driver::host::copy_to_host(stream, out.as_mut_ptr().cast(), device, bytes)
        })
    }

    /// Checks `[offset, offset + bytes)` against the block, enqueues `enqueue(device address)`
    /// and waits for it. The lock is held until the copy is done, so the range cannot be
    /// unmapped under it.
    fn copy(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        bytes: usize,
        enqueue: impl FnOnce(sys::CUdeviceptr) -> Result<()>,
    ) -> Result<()> {
        let mut state = self.shared.lock();
        let info = state.info(self.tenant, self.id).map_err(|_| self.gone())?;
        require_range("block copy", info.len, offset, bytes)?;
        state.attach(self.tenant, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        enqueue(self.address + offset as u64)?;
        driver::synchronize_stream(stream)
    }

    /// `count` elements from `offset` bytes, as a new vector.
    pub fn read<T: DeviceRepr + Default + Clone>(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        count: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); count];
        self.read_into(stream, offset, &mut out)?;
        Ok(out)
    }

    /// Frees the block now, reporting a failed fence (the memory is then leaked, not unmapped
    /// under running work). Dropping a block does the same and logs the error.
    pub fn free(mut self) -> Result<()> {
        self.freed = true;
        self.free_inner()
    }

    fn free_inner(&self) -> Result<()> {
        match self.shared.lock().free(self.tenant, self.id) {
            Err(Error::Pool(PoolError::TenantGone { .. })) => Ok(()), // the tenant already freed everything
            other => other,
        }
    }
}

impl DeviceBuffer for Block {
    fn device_address(&self) -> sys::CUdeviceptr {
        self.address
    }

    /// The current length: 0 once the tenant is gone, so kernel launchers refuse the block
    /// instead of touching unmapped memory.
    fn byte_len(&self) -> usize {
        self.len()
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.freed {
            return;
        }
        if let Err(error) = self.free_inner() {
            tracing::error!(%error, address = self.address, "freeing a block failed");
        }
    }
}
