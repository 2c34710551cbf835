//! The calling thread's current context, for code that calls the crate from another runtime's
//! threads (the Python package, under PyTorch): what is current, putting it back, making a
//! context current, and borrowing that runtime's streams.
//!
//! The crate makes a context current before its driver calls and leaves it current after them;
//! a binding that must leave the caller's context as it was saves it first
//! ([`SavedContext::save`]) and restores it when done ([`SavedContext::restore`]).

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::{bind_context, driver_present, traced, traced_raw};
use crate::error::{DriverError, Error, Result};

/// Whether libcuda loads here, asked once ([`driver_present`] tries to load it at each call):
/// without it no context can be current, and cudarc's context calls would abort instead of
/// failing.
fn driver_loaded() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(driver_present)
}

/// This thread's current context, `None` if none is (`cuCtxGetCurrent`).
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
fn current() -> Result<Option<sys::CUcontext>> {
    if !driver_loaded() {
        return Err(Error::Driver(DriverError::NoDriver));
    }
    traced("cuCtxGetCurrent", 0, result::ctx::get_current)
}

/// Makes `ctx` current on the calling thread (`cuCtxSetCurrent`, skipped when it is current
/// already), as the crate does before its own driver calls.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub fn make_current(ctx: &CudaContext) -> Result<()> {
    bind_context(ctx)
}

/// The context that was current on this thread when it was saved (or that none was), to make
/// current again on the same thread with [`SavedContext::restore`]. Not `Send`: a current
/// context belongs to one thread.
///
/// Save only contexts that outlive the value, such as primary contexts (which stablebuf and
/// PyTorch use, and keep retained for the life of the process).
#[derive(Debug)]
pub struct SavedContext {
    /// `None`: no context was current.
    context: Option<sys::CUcontext>,
    _one_thread: PhantomData<*const ()>,
}

impl SavedContext {
    /// Remembers this thread's current context (`cuCtxGetCurrent`).
    /// [`NoDriver`](crate::error::DriverError::NoDriver) where libcuda does not load.
    #[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
    pub fn save() -> Result<Self> {
        Ok(Self {
            context: current()?,
            _one_thread: PhantomData,
        })
    }

    /// Makes the saved context current again (none, if none was), unless it is current now.
    #[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
    pub fn restore(&self) -> Result<()> {
        if current().ok() == Some(self.context) {
            return Ok(());
        }
        let context = self.context.unwrap_or(std::ptr::null_mut());
        traced("cuCtxSetCurrent", 0, || {
            // SAFETY: `context` was current on this very thread when it was saved (the value is
            // not `Send`), and the saver keeps it alive (see the type's docs: primary contexts,
            // retained for the life of the process); null makes no context current, as it was.
            unsafe { result::ctx::set_current(context) }
        })
    }
}

/// Another runtime's stream `handle` (a raw `CUstream` as a number, PyTorch's
/// `torch.cuda.Stream.cuda_stream`; 0 is the legacy default stream) as a cudarc stream of
/// `ctx`, which must be current; `Ok(None)` when the stream belongs to another context (another
/// device's), whose work must not be mixed with `ctx`'s. Asks the driver with `cuStreamGetCtx`.
///
/// The wrapper never destroys the stream. The stream's owner must keep it alive while the
/// wrapper (or anything holding it) is used: borrow a stream for the length of one call into
/// the crate. Work enqueued through it is the stream's, ordered like the owner's own.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub fn borrow_stream(ctx: &Arc<CudaContext>, handle: u64) -> Result<Option<Arc<CudaStream>>> {
    let stream = handle as sys::CUstream;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    traced_raw("cuStreamGetCtx", 0, || {
        // SAFETY: asks the driver which context `stream` belongs to, into a valid out-pointer;
        // the legacy default stream (0) answers with the current context.
        unsafe { sys::cuStreamGetCtx(stream, &mut owner) }
    })?;
    if owner != ctx.cu_ctx() {
        return Ok(None);
    }
    // SAFETY: `stream` belongs to `ctx`, checked above; its owner keeps it alive while the
    // wrapper is used (this function's contract, in its docs), and a borrowed wrapper never
    // destroys the stream. Work enqueued on it is the stream's like any of its owner's.
    Ok(Some(unsafe { ctx.wrap_borrowed_stream(stream) }))
}
