//! Plain `cuMemAlloc` memory: what `cudaMalloc` gives. stablebuf does not need it; examples and
//! benches use it as the baseline that elastic memory is measured against.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{bind_context, traced_raw};
use crate::error::{Error, LayoutError, Result};

/// Device memory from `cuMemAlloc`, freed with `cuMemFree` on drop (which, like `cudaFree`,
/// waits for the device before it returns the memory).
#[derive(Debug)]
pub struct LinearBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl LinearBuffer {
    /// Allocates `bytes` (> 0) of device memory;
    /// [`DriverError::OutOfMemory`](crate::error::DriverError::OutOfMemory) if the device has too
    /// little free.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(
                "a LinearBuffer of 0 bytes".into(),
            )));
        }
        bind_context(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        traced_raw("cuMemAlloc", bytes, || {
            // SAFETY: `ptr` is a valid out-pointer for the duration of the call.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The size asked for at allocation, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for LinearBuffer {
    fn drop(&mut self) {
        let (ptr, bytes) = (self.ptr, self.bytes);
        super::release(&self.ctx, "cuMemFree", bytes, || {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once, here. cuMemFree waits
            // for outstanding work on the device before releasing the memory.
            unsafe { sys::cuMemFree_v2(ptr) }
        });
    }
}
