//! Gates: 32-bit words in pinned host memory that a stream waits on until they read 0
//! (`cuStreamWaitValue32` on the word's device address; inside a stream capture the wait
//! becomes a node of the graph, so every replay waits there) and that the host closes and
//! opens with plain stores. No stream takes part in opening a gate, so an open can never queue
//! behind the work it releases (work of several streams can share one hardware queue, where
//! a stream write would wait behind the waiting step).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::{bind_context, capture_active, release, traced_raw};
use crate::error::Result;

/// `count` gates, all open.
#[derive(Debug)]
pub(crate) struct Gates {
    ctx: Arc<CudaContext>,
    host: *mut u32,
    device: sys::CUdeviceptr,
    count: usize,
    /// Waited on inside a capture at least once: a graph may hold a wait node on the words.
    captured: AtomicBool,
}

// SAFETY: the words are only touched through atomic stores and loads (host) and the driver's
// waits (device); the allocation is owned by the struct and freed once, on drop.
unsafe impl Send for Gates {}
// SAFETY: as above: every method takes `&self` and writes the words atomically.
unsafe impl Sync for Gates {}

impl Gates {
    pub(crate) fn new(ctx: &Arc<CudaContext>, count: usize) -> Result<Self> {
        bind_context(ctx)?;
        let bytes = count.max(1) * 4;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        traced_raw("cuMemHostAlloc", bytes, || {
            // SAFETY: valid out-pointer; the flags are a valid combination.
            unsafe {
                sys::cuMemHostAlloc(
                    &mut host,
                    bytes,
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                )
            }
        })?;
        let host = host.cast::<u32>();
        for i in 0..count.max(1) {
            // SAFETY: `host` holds `count.max(1)` aligned u32 words, just allocated.
            unsafe { host.add(i).write(0) };
        }
        let mut device: sys::CUdeviceptr = 0;
        let mapped = traced_raw("cuMemHostGetDevicePointer", bytes, || {
            // SAFETY: valid out-pointer; `host` was allocated mapped just above.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) }
        });
        let gates = Self {
            ctx: ctx.clone(),
            host,
            device,
            count,
            captured: AtomicBool::new(false),
        };
        mapped.map(|()| gates)
    }

    fn word(&self, index: usize) -> &AtomicU32 {
        assert!(index < self.count, "gate {index} of {}", self.count);
        // SAFETY: `index` is in range of the live allocation, u32-aligned; every access to
        // the word from the host is atomic.
        unsafe { AtomicU32::from_ptr(self.host.add(index)) }
    }

    /// Enqueues on `stream` (a `CUstream` of this context as a number; captured or not) a
    /// wait until gate `index` is open.
    pub(crate) fn wait_open(&self, index: usize, stream: u64) -> Result<()> {
        let handle = stream as sys::CUstream;
        if capture_active(&self.ctx, stream)? {
            self.captured.store(true, Ordering::Relaxed);
        }
        let address = self.device + 4 * self.checked(index)? as u64;
        traced_raw("cuStreamWaitValue32", 0, || {
            // SAFETY: the address is a word of the live mapped allocation; the stream as above.
            unsafe {
                sys::cuStreamWaitValue32_v2(
                    handle,
                    address,
                    0,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
                )
            }
        })
    }

    fn checked(&self, index: usize) -> Result<usize> {
        if index < self.count {
            Ok(index)
        } else {
            Err(crate::error::Error::Layout(
                crate::error::LayoutError::InvalidShape(format!("gate {index} of {}", self.count)),
            ))
        }
    }

    /// Closes gate `index`: a stream that reaches a wait on it from now on waits.
    pub(crate) fn close(&self, index: usize) {
        self.word(index).store(1, Ordering::SeqCst);
    }

    /// Opens gate `index`: waits on it pass.
    pub(crate) fn open(&self, index: usize) {
        self.word(index).store(0, Ordering::SeqCst);
    }
}

impl Drop for Gates {
    fn drop(&mut self) {
        if self.captured.load(Ordering::Relaxed) {
            // A graph exec may still wait on these words and be replayed after the owner is
            // gone: keep them (a few bytes), open.
            for i in 0..self.count {
                self.open(i);
            }
            return;
        }
        let host = self.host;
        // SAFETY: allocated by cuMemHostAlloc, freed once; no graph waits on it and the
        // owner's streams are done with it (the owner fences before it drops).
        release(&self.ctx, "cuMemFreeHost", 0, || unsafe {
            sys::cuMemFreeHost(host.cast())
        });
    }
}
