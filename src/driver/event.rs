//! Events that mark how far a stream had got when memory was last used on it: the fence's
//! [`FencePolicy::LastUse`](crate::FencePolicy::LastUse) waits for these instead of for whole
//! streams or the whole device. Streams may be foreign (PyTorch's), so they are raw handles.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{bind_context, capture_active, release, traced_raw};
use crate::error::Result;

/// A new event of `ctx` without timing (recording and waiting stay cheap); the caller owns it
/// and destroys it.
fn untimed_event(ctx: &Arc<CudaContext>) -> Result<sys::CUevent> {
    bind_context(ctx)?;
    let mut event: sys::CUevent = std::ptr::null_mut();
    traced_raw("cuEventCreate", 0, || {
        // SAFETY: valid out-pointer; the flags are a valid combination.
        unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        }
    })?;
    Ok(event)
}

/// Blocks until the work before `event`'s most recent record is done (`cuEventSynchronize`).
fn host_wait(ctx: &Arc<CudaContext>, event: sys::CUevent) -> Result<()> {
    bind_context(ctx)?;
    traced_raw("cuEventSynchronize", 0, || {
        // SAFETY: callers pass an event they own and keep live.
        unsafe { sys::cuEventSynchronize(event) }
    })
}

/// Makes `stream`'s later work wait on the GPU for `event`'s most recent record as of now
/// (`cuStreamWaitEvent`).
fn order_after(
    ctx: &Arc<CudaContext>,
    event: sys::CUevent,
    stream: &cudarc::driver::CudaStream,
) -> Result<()> {
    bind_context(ctx)?;
    traced_raw("cuStreamWaitEvent", 0, || {
        // SAFETY: callers pass an event they own and keep live; the stream is borrowed live.
        unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), event, 0) }
    })
}

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
        Ok(Self {
            ctx: ctx.clone(),
            event: untimed_event(ctx)?,
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
        host_wait(&self.ctx, self.event)
    }

    /// Makes `stream`'s later work wait on the GPU for the last use.
    pub(crate) fn order_before(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        order_after(&self.ctx, self.event, stream)
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

/// An event a step records where it is done with one part of some memory (a KV cache's
/// layer), eagerly or inside a stream capture, so the host can change that part's mappings
/// while the step's later work still runs: [`StepMark::wait`] returns once the most recent
/// step that recorded it got that far.
#[derive(Debug)]
pub(crate) struct StepMark {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
    /// Recorded inside a capture at least once: a graph may hold a record node of it.
    captured: std::sync::atomic::AtomicBool,
}

// SAFETY: a CUevent may be recorded, waited for and destroyed from any thread, and the driver
// serialises concurrent calls on one event; the mark owns its event and only destroys it on
// drop, when no reference is left.
unsafe impl Send for StepMark {}
// SAFETY: as above: `record` and `wait` take `&self` and are driver calls that are safe to
// make from several threads at once.
unsafe impl Sync for StepMark {}

impl StepMark {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        Ok(Self {
            ctx: ctx.clone(),
            event: untimed_event(ctx)?,
            captured: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Records the mark at the current end of `stream` (a `CUstream` of this context as a
    /// number; 0: the legacy default stream). Inside a stream capture it becomes an external
    /// event-record node, so every replay of the graph records it at that point; outside, a
    /// plain record (the external flag is invalid there).
    pub(crate) fn record(&self, stream: u64) -> Result<()> {
        let handle = stream as sys::CUstream;
        let flags = if capture_active(&self.ctx, stream)? {
            self.captured
                .store(true, std::sync::atomic::Ordering::Relaxed);
            sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
        } else {
            0
        };
        traced_raw("cuEventRecordWithFlags", 0, || {
            // SAFETY: the event is live; the stream as above.
            unsafe { sys::cuEventRecordWithFlags(self.event, handle, flags) }
        })
    }

    /// Blocks until the work before the mark's most recent record is done (at once if it was
    /// never recorded, or only inside a graph not launched since).
    pub(crate) fn wait(&self) -> Result<()> {
        host_wait(&self.ctx, self.event)
    }

    /// Makes `stream`'s later work wait, on the GPU, for the mark's most recent record as of
    /// now (a later record does not move what it waits for).
    pub(crate) fn order_before(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        order_after(&self.ctx, self.event, stream)
    }
}

impl Drop for StepMark {
    fn drop(&mut self) {
        if self.captured.load(std::sync::atomic::Ordering::Relaxed) {
            // A graph exec may still hold a record node of the event and be replayed after
            // the cache is gone: keep the event (a few bytes) rather than let that replay
            // record a destroyed one.
            return;
        }
        let event = self.event;
        // SAFETY: the event is live, destroyed once, and no graph records it; one still
        // pending is released by the driver when its work completes.
        release(&self.ctx, "cuEventDestroy", 0, || unsafe {
            sys::cuEventDestroy_v2(event)
        });
    }
}
