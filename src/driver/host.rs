//! Page-locked host memory and raw host↔device copies, for offload and restore.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::{bind_context, traced, traced_raw};
use crate::error::{Error, LayoutError, Result};

/// Page-locked (pinned) host memory, freed on drop. Copies to and from it run at full PCIe speed
/// and can be asynchronous.
#[derive(Debug)]
pub(crate) struct PinnedHost {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
    /// `Some` when the memory is an ordinary buffer registered with `cuMemHostRegister` (it is
    /// unregistered, then freed with the buffer); `None` for `cuMemHostAlloc` memory.
    registered: Option<Vec<u8>>,
}

// SAFETY: the allocation is plain host memory owned by this value; access to its bytes goes
// through `&self`/`&mut self` methods, so the usual borrow rules apply across threads.
unsafe impl Send for PinnedHost {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(
                "a pinned buffer needs at least one byte".into(),
            )));
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
            registered: None,
        })
    }

    /// Pins `buffer` in place with `cuMemHostRegister` (portable to every context). Pinning an
    /// already faulted-in buffer is much faster than `cuMemHostAlloc` of the same size (measured
    /// on the H100 host: 0.36 s against 4.3 s for 8 GiB), so callers fault it in first, on
    /// several threads. The buffer is unregistered and freed on drop.
    pub(crate) fn register(ctx: &Arc<CudaContext>, mut buffer: Vec<u8>) -> Result<Self> {
        let bytes = buffer.len();
        if bytes == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(
                "a pinned buffer needs at least one byte".into(),
            )));
        }
        bind_context(ctx)?;
        let ptr = buffer.as_mut_ptr();
        traced_raw("cuMemHostRegister", bytes, || {
            // SAFETY: `buffer` is a live allocation of `bytes` owned by the value returned below,
            // which unregisters it before freeing it.
            unsafe {
                sys::cuMemHostRegister_v2(ptr.cast(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
            }
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
            registered: Some(buffer),
        })
    }

    /// The host address of byte `offset` (checked against the size).
    pub(crate) fn at(&self, offset: usize, len: usize) -> Result<*mut u8> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "{len} bytes at {offset} of a {} byte pinned buffer",
                self.bytes
            ))));
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
        match self.registered.take() {
            Some(buffer) => {
                let mut unregistered = true;
                super::release(&self.ctx, "cuMemHostUnregister", bytes, || {
                    // SAFETY: registered in `register` and unregistered once; owners wait for
                    // their copies before dropping it.
                    let result = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
                    unregistered = result == sys::CUresult::CUDA_SUCCESS;
                    result
                });
                if unregistered {
                    drop(buffer);
                } else {
                    // Still known to the driver: keep the memory rather than free it under it.
                    std::mem::forget(buffer);
                }
            }
            None => super::release(&self.ctx, "cuMemFreeHost", bytes, || {
                // SAFETY: allocated by cuMemHostAlloc and freed once; owners wait for their
                // copies before dropping it.
                unsafe { sys::cuMemFreeHost(ptr.cast()) }
            }),
        }
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

/// A zeroed host buffer of `bytes` to receive a transfer, or `None` if the allocator refuses.
/// Large buffers come from `calloc`/`mmap`, so no page is touched (or zero-filled) until it is
/// written; the kernel is asked to back them with transparent huge pages, so the first write
/// faults once per 2 MiB instead of once per 4 KiB.
pub(crate) fn transfer_buffer(bytes: usize) -> Option<Vec<u8>> {
    let mut buffer = zeroed_host_buffer(bytes)?;
    advise_huge_pages(&mut buffer);
    Some(buffer)
}

/// Below this, a buffer is not worth advising (it may not even be `mmap`ed).
const HUGE_PAGE_ADVICE_MIN: usize = 4 << 20;

/// `madvise(MADV_HUGEPAGE)` on the whole pages inside `buffer`. Advice only: where transparent
/// huge pages are off or the call fails, the buffer works as before, with 4 KiB pages.
fn advise_huge_pages(buffer: &mut [u8]) {
    const PAGE: usize = 4096;
    if buffer.len() < HUGE_PAGE_ADVICE_MIN {
        return;
    }
    let start = buffer.as_mut_ptr() as usize;
    let first = start.next_multiple_of(PAGE);
    let end = (start + buffer.len()) / PAGE * PAGE;
    let Some(address) = std::ptr::NonNull::new(first as *mut std::ffi::c_void) else {
        return;
    };
    if end <= first {
        return;
    }
    // SAFETY: [first, end) is whole pages inside `buffer`, which this thread borrows mutably;
    // MADV_HUGEPAGE changes how the kernel backs the pages, never their contents (it is
    // advice, unlike MADV_DONTNEED/MADV_FREE).
    let advised = unsafe {
        nix::sys::mman::madvise(
            address,
            end - first,
            nix::sys::mman::MmapAdvise::MADV_HUGEPAGE,
        )
    };
    if let Err(errno) = advised {
        tracing::debug!(%errno, "madvise(MADV_HUGEPAGE) refused; keeping 4 KiB pages");
    }
}

/// A zeroed host buffer of `bytes`, or `None` if the allocator refuses. Large buffers come from
/// `calloc`/`mmap`, so no page is touched (or zero-filled) until it is written.
fn zeroed_host_buffer(bytes: usize) -> Option<Vec<u8>> {
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
