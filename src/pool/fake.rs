//! A CPU stand-in for the driver, for testing the pool's state machine without a GPU: it hands
//! out address ranges and chunks, counts what is alive, and fails the Nth call of a kind on
//! demand, with the error the real driver would give.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys::CUresult, CudaStream};

use super::backend::{Backend, MappedRange, ReservedRange, Waiter};
use crate::error::{Error, Result};
use crate::fence::FencePolicy;

/// The kinds of driver call the pool makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Reserve,
    Create,
    Map,
    /// The one set-access over a run of mappings.
    Access,
    Wait,
}

#[derive(Debug, Default)]
struct Inner {
    next_base: AtomicU64,
    /// Physical bytes the fake device holds; `create` beyond it is out of memory.
    device_bytes: usize,
    created_bytes: AtomicUsize,
    live_chunks: AtomicUsize,
    live_mappings: AtomicUsize,
    leaked_mappings: AtomicUsize,
    leaked_bytes: AtomicUsize,
    calls: Mutex<Vec<Call>>,
    /// Fail the call of this kind once this many more calls of it have been made.
    fail: Mutex<Option<(Call, usize)>>,
}

impl Inner {
    /// Records a call; `true` if it must fail.
    fn call(&self, call: Call) -> bool {
        self.calls.lock().unwrap().push(call);
        let mut fail = self.fail.lock().unwrap();
        match &mut *fail {
            Some((kind, 0)) if *kind == call => {
                *fail = None;
                true
            }
            Some((kind, n)) if *kind == call => {
                *n -= 1;
                false
            }
            _ => false,
        }
    }
}

/// The fake driver. Clones share the same counters.
#[derive(Clone, Debug)]
pub(crate) struct Fake {
    inner: Arc<Inner>,
}

impl Fake {
    /// A device with `device_bytes` of physical memory.
    pub(crate) fn new(device_bytes: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                next_base: AtomicU64::new(1 << 40),
                device_bytes,
                ..Inner::default()
            }),
        }
    }

    /// Makes the call of kind `call` fail after `skip` more successful ones.
    pub(crate) fn fail(&self, call: Call, skip: usize) {
        *self.inner.fail.lock().unwrap() = Some((call, skip));
    }

    /// Cancels a pending failure; returns whether one was pending.
    pub(crate) fn clear_failure(&self) -> bool {
        self.inner.fail.lock().unwrap().take().is_some()
    }

    pub(crate) fn live_chunks(&self) -> usize {
        self.inner.live_chunks.load(Ordering::SeqCst)
    }

    pub(crate) fn live_mappings(&self) -> usize {
        self.inner.live_mappings.load(Ordering::SeqCst)
    }

    pub(crate) fn leaked_mappings(&self) -> usize {
        self.inner.leaked_mappings.load(Ordering::SeqCst)
    }

    /// Bytes of the chunks kept alive forever by leaked mappings.
    pub(crate) fn leaked_bytes(&self) -> usize {
        self.inner.leaked_bytes.load(Ordering::SeqCst)
    }

    pub(crate) fn created_bytes(&self) -> usize {
        self.inner.created_bytes.load(Ordering::SeqCst)
    }

    /// How many calls of kind `call` were made.
    pub(crate) fn calls(&self, call: Call) -> usize {
        self.inner
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|&&c| c == call)
            .count()
    }
}

#[derive(Debug)]
pub(crate) struct FakeRange {
    base: u64,
    bytes: usize,
}

impl ReservedRange for FakeRange {
    fn base(&self) -> u64 {
        self.base
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
}

#[derive(Debug)]
pub(crate) struct FakeChunk {
    bytes: usize,
    inner: Arc<Inner>,
}

impl Drop for FakeChunk {
    fn drop(&mut self) {
        self.inner.live_chunks.fetch_sub(1, Ordering::SeqCst);
        self.inner
            .created_bytes
            .fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

#[derive(Debug)]
pub(crate) struct FakeMapping {
    ptr: u64,
    bytes: usize,
    _memory: Arc<FakeChunk>,
    inner: Arc<Inner>,
    leaked: bool,
}

impl MappedRange for FakeMapping {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn leak_on_drop(&mut self) {
        self.leaked = true;
    }
}

impl Drop for FakeMapping {
    fn drop(&mut self) {
        self.inner.live_mappings.fetch_sub(1, Ordering::SeqCst);
        if self.leaked {
            // A leaked mapping keeps its chunk forever, as the real one does.
            self.inner.leaked_mappings.fetch_add(1, Ordering::SeqCst);
            self.inner
                .leaked_bytes
                .fetch_add(self._memory.bytes, Ordering::SeqCst);
            std::mem::forget(self._memory.clone());
        }
    }
}

#[derive(Debug)]
pub(crate) struct FakeFence {
    inner: Arc<Inner>,
}

impl Waiter for FakeFence {
    fn wait(&self) -> Result<()> {
        if self.inner.call(Call::Wait) {
            return Err(Error::Driver {
                call: "cuCtxSynchronize",
                result: CUresult::CUDA_ERROR_LAUNCH_FAILED,
                bytes: 0,
            });
        }
        Ok(())
    }
    fn check_not_capturing(&self) -> Result<()> {
        Ok(())
    }
    fn attach(&mut self, _stream: &Arc<CudaStream>) {}
}

impl Backend for Fake {
    type Reservation = FakeRange;
    type Memory = FakeChunk;
    type Mapping = FakeMapping;
    type Fence = FakeFence;

    fn reserve(&self, bytes: usize, alignment: usize) -> Result<FakeRange> {
        if self.inner.call(Call::Reserve) {
            return Err(Error::Driver {
                call: "cuMemAddressReserve",
                result: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                bytes,
            });
        }
        let span = (bytes as u64).div_ceil(alignment as u64) * alignment as u64 + alignment as u64;
        let base = self.inner.next_base.fetch_add(span, Ordering::SeqCst);
        Ok(FakeRange { base, bytes })
    }

    fn create(&self, bytes: usize) -> Result<FakeChunk> {
        let full = self.created_bytes() + bytes > self.inner.device_bytes;
        if self.inner.call(Call::Create) || full {
            return Err(Error::OutOfMemory {
                call: "cuMemCreate",
                bytes,
            });
        }
        self.inner.live_chunks.fetch_add(1, Ordering::SeqCst);
        self.inner.created_bytes.fetch_add(bytes, Ordering::SeqCst);
        Ok(FakeChunk {
            bytes,
            inner: self.inner.clone(),
        })
    }

    fn map_run(
        &self,
        reservation: &FakeRange,
        offset: usize,
        memory: &[Arc<FakeChunk>],
    ) -> Result<Vec<FakeMapping>> {
        let mut made = Vec::with_capacity(memory.len());
        let mut at = offset;
        for chunk in memory {
            let bytes = chunk.bytes;
            assert!(
                at + bytes <= reservation.bytes,
                "mapping past the reservation"
            );
            if self.inner.call(Call::Map) {
                return Err(Error::Driver {
                    call: "cuMemMap",
                    result: CUresult::CUDA_ERROR_INVALID_VALUE,
                    bytes,
                });
            }
            self.inner.live_mappings.fetch_add(1, Ordering::SeqCst);
            made.push(FakeMapping {
                ptr: reservation.base + at as u64,
                bytes,
                _memory: chunk.clone(),
                inner: self.inner.clone(),
                leaked: false,
            });
            at += bytes;
        }
        if self.inner.call(Call::Access) {
            // `made` drops here: everything mapped above is unmapped again.
            return Err(Error::Driver {
                call: "cuMemSetAccess",
                result: CUresult::CUDA_ERROR_INVALID_VALUE,
                bytes: at - offset,
            });
        }
        Ok(made)
    }

    fn fence(&self, _policy: FencePolicy) -> FakeFence {
        FakeFence {
            inner: self.inner.clone(),
        }
    }
}
