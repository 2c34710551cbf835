//! Events that mark how far a stream had got when memory was last used on it: the fence's
//! [`FencePolicy::LastUse`](crate::FencePolicy::LastUse) waits for these instead of for whole
//! streams or the whole device. Streams may be foreign (PyTorch's), so they are raw handles.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{bind_context, release, traced_raw};
use crate::error::Result;

/// One event, recorded again at each use; destroyed on drop.
#[derive(Debug)]
pub(crate) struct UseMarker {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
    /// The stream it is recorded on, as a number (0: the legacy default stream).
    stream: u64,
}

// SAFETY: a CUevent may be recorded, waited for and destroyed from any thread; the marker
// owns its event and is only ever used behind the fence's lock.
unsafe impl Send for UseMarker {}

impl UseMarker {
    /// A new marker for `stream` (a `CUstream` of `ctx`'s device, as a number).
    pub(crate) fn new(ctx: &Arc<CudaContext>, stream: u64) -> Result<Self> {
        bind_context(ctx)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        traced_raw("cuEventCreate", 0, || {
            // SAFETY: valid out-pointer; timing off keeps recording and waiting cheap.
            unsafe {
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            }
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            event,
            stream,
        })
    }

    pub(crate) fn stream(&self) -> u64 {
        self.stream
    }

    /// Marks the current end of the stream's work as the last use.
    pub(crate) fn record(&self) -> Result<()> {
        bind_context(&self.ctx)?;
        traced_raw("cuEventRecord", 0, || {
            // SAFETY: the event is live; the stream handle is one the caller says is live on
            // this context (a stream that has been destroyed is the caller's error, which the
            // driver reports rather than faulting).
            unsafe { sys::cuEventRecord(self.event, self.stream as sys::CUstream) }
        })
    }

    /// Blocks until the work before the last [`UseMarker::record`] is done.
    pub(crate) fn wait(&self) -> Result<()> {
        bind_context(&self.ctx)?;
        traced_raw("cuEventSynchronize", 0, || {
            // SAFETY: the event is live.
            unsafe { sys::cuEventSynchronize(self.event) }
        })
    }

    /// Makes `stream`'s later work wait on the GPU for the last use.
    pub(crate) fn order_before(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        bind_context(&self.ctx)?;
        traced_raw("cuStreamWaitEvent", 0, || {
            // SAFETY: both the stream and the event are live.
            unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), self.event, 0) }
        })
    }
}

impl Drop for UseMarker {
    fn drop(&mut self) {
        let event = self.event;
        // SAFETY: the event is live and destroyed once; an event still pending is released
        // by the driver when its work completes.
        release(&self.ctx, "cuEventDestroy", 0, || unsafe {
            sys::cuEventDestroy_v2(event)
        });
    }
}
