//! The seam every driver call goes through: [`traced`] (a tracing span, the failure mapped to a
//! typed [`Error`], and with the `fault-injection` feature the place where tests make a chosen
//! call fail), releases from a `Drop`, and binding a context to the thread first.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, DriverError as CudarcError};

#[cfg(any(test, feature = "fault-injection"))]
use super::inject;
use crate::error::{DriverError, Error, Result};

/// Runs one driver call inside a tracing span and maps its failure to a typed [`Error`].
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn traced<T>(
    call: &'static str,
    bytes: usize,
    f: impl FnOnce() -> Result<T, CudarcError>,
) -> Result<T> {
    if !QUIET.get() {
        ACTIVITY.fetch_add(1, Ordering::Relaxed);
    }
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
        Err(CudarcError(result)) => {
            tracing::debug!(call, bytes, micros, ?result, "failed");
            Err(driver_error(call, bytes, result))
        }
    }
}

/// Driver calls made so far by threads that are not quiet: the idle hook of the background
/// release ([`super::held`]) waits until it stops moving.
static ACTIVITY: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the background release thread: its own calls are not activity.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Driver calls made so far outside the background release threads.
pub(crate) fn activity() -> u64 {
    ACTIVITY.load(Ordering::Relaxed)
}

/// Marks this thread's driver calls as not activity (the background release thread).
pub(crate) fn mark_quiet() {
    QUIET.set(true);
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

fn driver_error(call: &'static str, bytes: usize, result: sys::CUresult) -> Error {
    match result {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            Error::Driver(DriverError::OutOfMemory { call, bytes })
        }
        result => Error::Driver(DriverError::Failed {
            call,
            result,
            bytes,
        }),
    }
}

/// Makes `ctx` current on this thread: raw `sys` calls do not do it themselves.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub(crate) fn bind_context(ctx: &CudaContext) -> Result<()> {
    traced("cuCtxSetCurrent", 0, || ctx.bind_to_thread())
}
