//! Waiting for the GPU before memory under an address goes away.
//!
//! `cuMemUnmap` does not wait for kernels that still use the range (measured on the H100: it
//! returned in 38 µs while a 200 ms kernel ran). So before the bind layer unmaps anything it
//! waits on a [`Fence`]:
//!
//! - [`FencePolicy::Context`] (the default) waits for all work in the CUDA context. It cannot
//!   miss a stream of the space's device, including ones stablebuf never saw (a raw
//!   `launch_builder` on a slot). A context covers one device only, so streams of *other*
//!   devices that used the space (a peer's graph reading it over NVLink) are waited for one by
//!   one: stablebuf attaches every stream a graph over the space is captured or replayed on.
//! - [`FencePolicy::AttachedStreams`] waits only for the streams attached to the space: those
//!   its graphs were captured or replayed on, its views and copies used, and any passed to
//!   [`Space::attach`](crate::Space::attach). That lets one space rebind while another space's
//!   replay runs (pipelining), and makes attaching every stream that touches the space the
//!   caller's duty.
//! - [`FencePolicy::LastUse`] waits for the attached streams and, for streams stablebuf does not
//!   own (PyTorch's), only up to the last use the caller noted on them ([`Fence::note_use`]: an
//!   event recorded after each replay). A bind then overlaps work queued after that use — the
//!   next step's replay on another region — which is what lets a swap hide behind a replay.
//!   Work on the memory that was never noted (an eager kernel) is not waited for: noting every
//!   use is the caller's duty.

use std::cell::Cell;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::driver;
use crate::driver::event::UseMarker;
use crate::error::{Error, GraphError, Result};

thread_local! {
    static CAPTURE_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside a stablebuf graph capture.
pub(crate) fn capturing_on_this_thread() -> bool {
    CAPTURE_DEPTH.with(|d| d.get() > 0)
}

/// Marks this thread as capturing while it lives (also if the captured work panics), so fences
/// refuse to unmap memory a capture may be recording.
pub(crate) struct CaptureGuard;

impl CaptureGuard {
    pub(crate) fn enter() -> Self {
        CAPTURE_DEPTH.with(|d| d.set(d.get() + 1));
        CaptureGuard
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        CAPTURE_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

/// How a space (or dataset) waits for the GPU before unmapping memory. See the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FencePolicy {
    /// Wait for everything in the context (`cuCtxSynchronize`). Always safe.
    #[default]
    Context,
    /// Wait for the attached streams only (`cuStreamSynchronize` on each).
    AttachedStreams,
    /// Wait for the attached streams and for the last noted use on every other stream
    /// (`cuEventSynchronize`); see the module docs.
    LastUse,
}

/// The streams that may hold work on some memory, and how to wait for them.
#[derive(Debug)]
pub(crate) struct Fence {
    ctx: Arc<CudaContext>,
    policy: FencePolicy,
    streams: Vec<Arc<CudaStream>>,
    /// The last noted use on each foreign stream ([`FencePolicy::LastUse`]).
    uses: Vec<UseMarker>,
}

impl Fence {
    pub(crate) fn new(ctx: &Arc<CudaContext>, policy: FencePolicy) -> Self {
        Self {
            ctx: ctx.clone(),
            policy,
            streams: Vec::new(),
            uses: Vec::new(),
        }
    }

    /// Notes that work just enqueued on `stream` (a raw `CUstream` of this fence's device, as a
    /// number) used the memory: [`FencePolicy::LastUse`] waits up to here. A no-op under the
    /// other policies, which wait for more anyway.
    pub(crate) fn note_use(&mut self, stream: u64) -> Result<()> {
        if self.policy != FencePolicy::LastUse {
            return Ok(());
        }
        if let Some(marker) = self.uses.iter().find(|m| m.stream() == stream) {
            return marker.record();
        }
        let marker = UseMarker::new(&self.ctx, stream)?;
        marker.record()?;
        self.uses.push(marker);
        Ok(())
    }

    /// Remembers that `stream` may use the memory.
    pub(crate) fn attach(&mut self, stream: &Arc<CudaStream>) {
        if !self.streams.iter().any(|s| **s == **stream) {
            self.streams.push(stream.clone());
        }
    }

    /// Fails with [`GraphError::BindDuringCapture`](crate::error::GraphError::BindDuringCapture) if
    /// a capture is under way on this thread or on
    /// an attached stream: unmapping then would break the capture or fault at replay.
    pub(crate) fn check_not_capturing(&self) -> Result<()> {
        if capturing_on_this_thread() {
            return Err(Error::Graph(GraphError::BindDuringCapture));
        }
        for stream in &self.streams {
            if driver::is_capturing(stream)? {
                return Err(Error::Graph(GraphError::BindDuringCapture));
            }
        }
        Ok(())
    }

    /// Orders `stream`'s next work after everything this fence covers: on the GPU (an event
    /// wait per attached stream) with `AttachedStreams`, on the host with `Context`.
    pub(crate) fn order_before(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.check_not_capturing()?;
        match self.policy {
            FencePolicy::Context => {
                driver::synchronize_context(&self.ctx)?;
                self.peer_streams()
                    .try_for_each(|s| driver::synchronize_stream(s))
            }
            FencePolicy::AttachedStreams | FencePolicy::LastUse => {
                for other in self.streams.iter().filter(|s| ***s != **stream) {
                    let event = driver::traced("cuEventRecord", 0, || other.record_event(None))?;
                    driver::traced("cuStreamWaitEvent", 0, || stream.wait(&event))?;
                }
                self.uses.iter().try_for_each(|m| m.order_before(stream))
            }
        }
    }

    /// Blocks until the GPU is done with everything this fence covers.
    pub(crate) fn wait(&self) -> Result<()> {
        self.check_not_capturing()?;
        match self.policy {
            FencePolicy::Context => {
                driver::synchronize_context(&self.ctx)?;
                self.peer_streams()
                    .try_for_each(|s| driver::synchronize_stream(s))
            }
            FencePolicy::AttachedStreams => self
                .streams
                .iter()
                .try_for_each(|s| driver::synchronize_stream(s)),
            FencePolicy::LastUse => {
                self.streams
                    .iter()
                    .try_for_each(|s| driver::synchronize_stream(s))?;
                self.uses.iter().try_for_each(UseMarker::wait)
            }
        }
    }

    /// Attached streams of other devices (a peer's graph reading the space): a context
    /// synchronize covers only its own device, so `Context` waits for these one by one.
    fn peer_streams(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        let own = self.ctx.ordinal();
        self.streams
            .iter()
            .filter(move |s| s.context().ordinal() != own)
    }
}
