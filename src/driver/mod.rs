//! The driver layer: the only module of the crate with `unsafe`.
//!
//! Like cudarc's `result` level, it turns raw `cudarc::driver::sys` calls into owned values with
//! `Drop` and every `CUresult` into an [`Error`] that names the call. Everything above it is safe.
//!
//! Every driver call goes through [`traced`]: a `debug` span named after the call, with the bytes
//! it concerns, and a `debug` event with its duration and result. With the `fault-injection`
//! feature, [`traced`] is also the seam where tests make a chosen call fail ([`inject`]); the
//! wrappers here are then `#[track_caller]`, so a call is known by the line that made it.

pub(crate) mod blas;
pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod graph;
pub(crate) mod host;
#[cfg(any(test, feature = "fault-injection"))]
pub mod inject;
pub(crate) mod interop;
pub(crate) mod launch;
pub(crate) mod linear;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod share;
pub(crate) mod vmm;

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};

use crate::error::{Error, Result};

/// Runs one driver call inside a tracing span and maps its failure to a typed [`Error`].
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn traced<T>(
    call: &'static str,
    bytes: usize,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T> {
    let span = tracing::debug_span!("cuda", call, bytes);
    let _entered = span.enter();
    let start = Instant::now();
    #[cfg(any(test, feature = "fault-injection"))]
    let outcome = inject::intercept(call, bytes, std::panic::Location::caller(), f);
    #[cfg(not(any(test, feature = "fault-injection")))]
    let outcome = f();
    let micros = start.elapsed().as_secs_f64() * 1e6;
    match outcome {
        Ok(value) => {
            tracing::debug!(call, bytes, micros, "ok");
            Ok(value)
        }
        Err(DriverError(result)) => {
            tracing::debug!(call, bytes, micros, ?result, "failed");
            Err(driver_error(call, bytes, result))
        }
    }
}

/// [`traced`] for a raw `sys` call that returns a bare `CUresult`.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn traced_raw(
    call: &'static str,
    bytes: usize,
    f: impl FnOnce() -> sys::CUresult,
) -> Result<()> {
    traced(call, bytes, || f().result())
}

/// Makes a release-type call (unmap, release, free, destroy) from a `Drop`, logging a failure.
/// The context is bound first, but the call is made even if binding fails: it either needs no
/// current context or reports its own error, and skipping it would leak the handle for sure.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn release(
    ctx: &CudaContext,
    call: &'static str,
    bytes: usize,
    f: impl FnOnce() -> sys::CUresult,
) {
    if let Err(error) = bind_context(ctx) {
        tracing::warn!(%error, call, "binding the context before a release failed; releasing anyway");
    }
    if let Err(error) = traced_raw(call, bytes, f) {
        tracing::error!(%error, call, bytes, "a release failed");
    }
}

pub(crate) fn driver_error(call: &'static str, bytes: usize, result: sys::CUresult) -> Error {
    match result {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { call, bytes },
        result => Error::Driver {
            call,
            result,
            bytes,
        },
    }
}

// Which of cudarc's modes is on decides how `driver_present` can tell; with none of ours on,
// cudarc may still be loading dynamically through another crate's `fallback-dynamic-loading`.
#[cfg(not(any(
    feature = "dynamic-loading",
    feature = "dynamic-linking",
    feature = "static-linking"
)))]
compile_error!(
    "stablebuf: turn on one of the features `dynamic-loading` (the default), `dynamic-linking` \
     (beside candle-core's `cuda`) or `static-linking`"
);

/// Whether libcuda can be loaded here. Everything else in the crate needs it.
#[cfg(feature = "dynamic-loading")]
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// Whether libcuda can be loaded here. Linked builds only start where the loader found libcuda,
/// so this is always true.
#[cfg(not(feature = "dynamic-loading"))]
pub fn driver_present() -> bool {
    true
}

/// Opens device `ordinal` (its primary context) the way stablebuf wants it.
///
/// Returns [`Error::NoDriver`] instead of panicking where no CUDA driver is installed. cudarc's
/// per-buffer event tracking is switched off, because its events make stream capture fail
/// (errors 905/907) as soon as a `CudaSlice` is touched inside a capture; stablebuf orders its
/// own memory with explicit fences instead.
///
/// A context made elsewhere (candle's `CudaDevice`) may keep tracking on. stablebuf's memory never
/// takes part in it, and captures work while they touch only stablebuf memory; touching a
/// tracked `CudaSlice` inside a capture fails as above (`compat/README.md` has the details).
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    let count = device::device_count()?;
    if ordinal >= count {
        return Err(Error::NoSuchDevice { ordinal, count });
    }
    let ctx = traced("cuDevicePrimaryCtxRetain", 0, || CudaContext::new(ordinal))?;
    // SAFETY: called before this context creates any stream or buffer of ours; cudarc documents
    // that tracking must not be switched while tracked buffers are in flight.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// Makes `ctx` current on this thread: raw `sys` calls do not do it themselves.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn bind_context(ctx: &CudaContext) -> Result<()> {
    traced("cuCtxSetCurrent", 0, || ctx.bind_to_thread())
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

#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn synchronize_context(ctx: &CudaContext) -> Result<()> {
    traced("cuCtxSynchronize", 0, || ctx.synchronize())
}
