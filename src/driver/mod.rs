//! The driver layer: the only module of the crate with `unsafe`.
//!
//! Like cudarc's `result` level, it turns raw `cudarc::driver::sys` calls into owned values with
//! `Drop` and every `CUresult` into an [`Error`] that names the call. Everything above it is safe.
//!
//! Every driver call goes through [`traced`]: a `debug` span named after the call, with the bytes
//! it concerns, and a `debug` event with its duration and result. With the `fault-injection`
//! feature, [`traced`] is also the seam where tests make a chosen call fail ([`inject`]); the
//! wrappers here are then `#[track_caller]`, so a call is known by the line that made it.

#[cfg(feature = "demo-kernels")]
pub(crate) mod blas;
mod call;
pub(crate) mod context;
pub(crate) mod deferred;
pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod gate;
pub(crate) mod graph;
pub(crate) mod held;
pub(crate) mod host;
#[cfg(any(test, feature = "fault-injection"))]
pub mod inject;
pub(crate) mod interop;
#[cfg(feature = "demo-kernels")]
pub(crate) mod launch;
pub(crate) mod linear;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod share;
pub(crate) mod vmm;

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::error::{DriverError, Error, Result};

pub(crate) use call::{activity, bind_context, mark_quiet, release, traced, traced_raw};
pub use device::driver_present;

/// Opens device `ordinal` (its primary context) the way stablebuf wants it.
///
/// Returns [`DriverError::NoDriver`](crate::error::DriverError::NoDriver) instead of panicking
/// where no CUDA driver is installed. cudarc's
/// per-buffer event tracking is switched off, because its events make stream capture fail
/// (errors 905/907) as soon as a `CudaSlice` is touched inside a capture; stablebuf orders its
/// own memory with explicit fences instead.
///
/// A context made elsewhere (candle's `CudaDevice`) may keep tracking on. stablebuf's memory never
/// takes part in it, and captures work while they touch only stablebuf memory; touching a
/// tracked `CudaSlice` inside a capture fails as above (`compat/README.md` has the details).
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(Error::Driver(DriverError::NoDriver));
    }
    let count = device::device_count()?;
    if ordinal >= count {
        return Err(Error::Driver(DriverError::NoSuchDevice { ordinal, count }));
    }
    let ctx = traced("cuDevicePrimaryCtxRetain", 0, || CudaContext::new(ordinal))?;
    // SAFETY: called before this context creates any stream or buffer of ours; cudarc documents
    // that tracking must not be switched while tracked buffers are in flight.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// Free and total device memory of `ctx`'s device, in bytes (`cuMemGetInfo`).
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub fn memory_info(ctx: &CudaContext) -> Result<(usize, usize)> {
    traced("cuMemGetInfo", 0, || ctx.mem_get_info())
}

/// Whether `stream` is capturing right now.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn is_capturing(stream: &CudaStream) -> Result<bool> {
    let status = traced("cuStreamIsCapturing", 0, || stream.capture_status())?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Whether the raw stream `stream` (a `CUstream` of `ctx` as a number; 0: the legacy default
/// stream) is in an active capture: what decides whether work enqueued now becomes a node.
pub(crate) fn capture_active(ctx: &Arc<CudaContext>, stream: u64) -> Result<bool> {
    bind_context(ctx)?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    traced_raw("cuStreamIsCapturing", 0, || {
        // SAFETY: valid out-pointer; the stream is one the caller says is live on this
        // context (a destroyed one is the caller's error, which the driver reports).
        unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) }
    })?;
    Ok(status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
}

#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn synchronize_stream(stream: &CudaStream) -> Result<()> {
    traced("cuStreamSynchronize", 0, || stream.synchronize())
}

/// Enqueues a device-to-device copy of `bytes` from `source` to `target` on `stream`.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn copy_device(
    stream: &CudaStream,
    source: sys::CUdeviceptr,
    target: sys::CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    bind_context(stream.context())?;
    traced("cuMemcpyDtoDAsync", bytes, || {
        // SAFETY: callers pass ranges inside live mappings they hold (a dataset's home mapping
        // and a space's resident mapping) that stay mapped until the stream is fenced.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(target, source, bytes, stream.cu_stream())
        }
    })
}

/// Enqueues a fill of `[target, target + bytes)` with zero bytes on `stream` (`cuMemsetD8Async`).
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn fill_zero(stream: &CudaStream, target: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    bind_context(stream.context())?;
    traced_raw("cuMemsetD8Async", bytes, || {
        // SAFETY: callers pass a range inside live read-write mappings they hold, kept mapped
        // until the stream is fenced.
        unsafe { sys::cuMemsetD8Async(target, 0, bytes, stream.cu_stream()) }
    })
}

/// Copies `data` from the host to `target` on `stream` and waits for it, so `data` may go at
/// once (`cuMemcpyHtoDAsync` from pageable memory, then `cuStreamSynchronize`).
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn write_device(
    stream: &CudaStream,
    target: sys::CUdeviceptr,
    data: &[u8],
) -> Result<()> {
    bind_context(stream.context())?;
    host::copy_to_device(stream, target, data.as_ptr(), data.len())?;
    synchronize_stream(stream)
}

#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn synchronize_context(ctx: &CudaContext) -> Result<()> {
    traced("cuCtxSynchronize", 0, || ctx.synchronize())
}
