//! Page-locked host memory and raw host↔device copies, for offload and restore.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::{bind_context, traced, traced_raw};
use crate::error::{Error, Result};

/// Page-locked (pinned) host memory from `cuMemHostAlloc`, freed on drop. Copies to and from it
/// run at full PCIe speed and can be asynchronous.
#[derive(Debug)]
pub(crate) struct PinnedHost {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the allocation is plain host memory owned by this value; access to its bytes goes
// through `&self`/`&mut self` methods, so the usual borrow rules apply across threads.
unsafe impl Send for PinnedHost {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::InvalidShape(
                "a pinned buffer needs at least one byte".into(),
            ));
        }
        bind_context(ctx)?;
        let ptr = traced("cuMemHostAlloc", bytes, || {
            // SAFETY: allocates `bytes` of host memory; PORTABLE makes it pinned for every context.
            unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr: ptr.cast(),
            bytes,
        })
    }

    /// The host address of byte `offset` (checked against the size).
    pub(crate) fn at(&self, offset: usize, len: usize) -> Result<*mut u8> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(Error::InvalidShape(format!(
                "{len} bytes at {offset} of a {} byte pinned buffer",
                self.bytes
            )));
        }
        // SAFETY: in bounds of the allocation (checked above).
        Ok(unsafe { self.ptr.add(offset) })
    }

    /// Bytes `[offset, offset + len)` as a slice (for host-side copies into pageable memory).
    pub(crate) fn slice(&self, offset: usize, len: usize) -> Result<&[u8]> {
        let ptr = self.at(offset, len)?;
        // SAFETY: in bounds; the memory is initialised by cuMemHostAlloc's caller or by copies
        // into it before it is read (the arena hands out regions only after writing them).
        Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// Mutable bytes `[offset, offset + len)`.
    pub(crate) fn slice_mut(&mut self, offset: usize, len: usize) -> Result<&mut [u8]> {
        let ptr = self.at(offset, len)?;
        // SAFETY: in bounds and exclusively borrowed through `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let (ptr, bytes) = (self.ptr, self.bytes);
        super::release(&self.ctx, "cuMemFreeHost", bytes, || {
            // SAFETY: allocated by cuMemHostAlloc and freed once; owners wait for their
            // copies before dropping it.
            unsafe { sys::cuMemFreeHost(ptr.cast()) }
        });
    }
}

/// Enqueues a copy of `bytes` from device address `device` to host address `host`.
///
/// # Contract (checked by callers, which are all in this crate)
/// `host` is valid for `bytes` and stays valid, untouched by the host, until the stream is
/// synchronised; `device` is a mapped range of at least `bytes`.
pub(crate) fn copy_to_host(
    stream: &CudaStream,
    host: *mut u8,
    device: sys::CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    traced_raw("cuMemcpyDtoHAsync", bytes, || {
        // SAFETY: see the contract above.
        unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), device, bytes, stream.cu_stream()) }
    })
}

/// Enqueues a copy of `bytes` from host address `host` to device address `device`, under the same
/// contract as [`copy_to_host`].
pub(crate) fn copy_to_device(
    stream: &CudaStream,
    device: sys::CUdeviceptr,
    host: *const u8,
    bytes: usize,
) -> Result<()> {
    traced_raw("cuMemcpyHtoDAsync", bytes, || {
        // SAFETY: see the contract of `copy_to_host`.
        unsafe { sys::cuMemcpyHtoDAsync_v2(device, host.cast(), bytes, stream.cu_stream()) }
    })
}

/// A zeroed host buffer of `bytes`, or `None` if the allocator refuses. Large buffers come from
/// `calloc`/`mmap`, so no page is touched (or zero-filled) until it is written.
pub(crate) fn zeroed_host_buffer(bytes: usize) -> Option<Vec<u8>> {
    if bytes == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(bytes).ok()?;
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with this exact layout (align 1,
    // `bytes` long), every byte is initialised (zeroed), and length = capacity = `bytes`.
    Some(unsafe { Vec::from_raw_parts(ptr, bytes, bytes) })
}
