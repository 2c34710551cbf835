//! A CPU stand-in for the driver, for testing the pool's and the regions' state machines
//! without a GPU. It hands out address ranges and chunks, counts what is alive, and fails the
//! Nth call of a kind on demand with the error the real driver would give. It also holds
//! bytes: each chunk's contents, the mappings from addresses to chunks, device-to-device
//! copies and host copies, so a test can check every byte a region reads.
//!
//! It records what the real driver would fault on or refuse as a *violation*
//! ([`Fake::violations`]): a map over a mapped range, a copy touching an unmapped address, and
//! a mapping unmapped while a copy that touched it may still be running (enqueued on a stream
//! that nothing has synchronized or fenced since).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{sys::CUresult, CudaStream};

use super::backend::{Backend, MappedRange, PhysicalMemory, ReservedRange, Waiter};
use crate::driver::vmm::Location;
use crate::error::{DriverError, Error, LayoutError, Result, ShareError};
use crate::fence::FencePolicy;
use crate::host::{HostStorage, Piece, StorageUsed};

/// The kinds of driver call the pool and the regions make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Reserve,
    Create,
    Map,
    /// The one set-access over a run of mappings.
    Access,
    Wait,
    /// A device-to-device copy.
    Copy,
    /// Device to host (a region's sleep).
    Save,
    /// Host to device (a region's wake).
    Load,
    /// `cuMemExportToShareableHandle`: a weight set handed to another process.
    Export,
    /// `cuMemImportFromShareableHandle`: the other process's side.
    Import,
    /// `cuMemsetD8Async`.
    Fill,
    /// Host to device outside a wake (`cuMemcpyHtoDAsync` of a small buffer).
    Write,
    /// `cuStreamCreate`.
    Stream,
}

/// A mapped range of the fake address space.
#[derive(Debug)]
struct Mapped {
    bytes: usize,
    chunk: Weak<FakeChunk>,
    /// Mapped with read access only: a write through it faults.
    read_only: bool,
}

#[derive(Debug, Default)]
struct Inner {
    next_base: AtomicU64,
    next_chunk: AtomicU64,
    next_stream: AtomicU64,
    granularity: usize,
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
    /// Mapped ranges by start address.
    mapped: Mutex<BTreeMap<u64, Mapped>>,
    /// `(stream, start, end)` of copies no synchronize or fence has waited for yet.
    pending: Mutex<Vec<(u64, u64, u64)>>,
    violations: Mutex<Vec<String>>,
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

    fn violation(&self, what: String) {
        self.violations.lock().unwrap().push(what);
    }

    /// The pieces of chunks behind `[address, address + bytes)`: `(chunk, offset in it, bytes)`
    /// in address order. Adjacent mappings of one reservation are one range to the GPU (a copy
    /// or a kernel may run across them, which is what stitching relies on); `None` where any
    /// byte of the range is unmapped, where the real GPU would fault.
    fn resolve(&self, address: u64, bytes: usize) -> Option<Vec<(Arc<FakeChunk>, usize, usize)>> {
        self.resolve_for(address, bytes, false)
    }

    /// [`Inner::resolve`]; with `writing`, `None` also where any byte is mapped read-only.
    fn resolve_for(
        &self,
        address: u64,
        bytes: usize,
        writing: bool,
    ) -> Option<Vec<(Arc<FakeChunk>, usize, usize)>> {
        let mapped = self.mapped.lock().unwrap();
        let end = address + bytes as u64;
        let mut at = address;
        let mut pieces = Vec::new();
        while at < end {
            let (&start, entry) = mapped.range(..=at).next_back()?;
            let entry_end = start + entry.bytes as u64;
            if entry_end <= at || (writing && entry.read_only) {
                return None;
            }
            let upto = entry_end.min(end);
            pieces.push((
                entry.chunk.upgrade()?,
                (at - start) as usize,
                (upto - at) as usize,
            ));
            at = upto;
        }
        Some(pieces)
    }

    fn map(&self, ptr: u64, chunk: &Arc<FakeChunk>, bytes: usize) -> Result<()> {
        self.map_with(ptr, chunk, bytes, false)
    }

    fn map_with(
        &self,
        ptr: u64,
        chunk: &Arc<FakeChunk>,
        bytes: usize,
        read_only: bool,
    ) -> Result<()> {
        let mut mapped = self.mapped.lock().unwrap();
        let end = ptr + bytes as u64;
        let overlaps = mapped
            .range(..end)
            .next_back()
            .is_some_and(|(&start, m)| start + m.bytes as u64 > ptr);
        if overlaps {
            drop(mapped);
            self.violation(format!(
                "cuMemMap over a mapped range at {ptr:#x} ({bytes} bytes)"
            ));
            return Err(Error::Driver(DriverError::Failed {
                call: "cuMemMap",
                result: CUresult::CUDA_ERROR_INVALID_VALUE,
                bytes,
            }));
        }
        mapped.insert(
            ptr,
            Mapped {
                bytes,
                chunk: Arc::downgrade(chunk),
                read_only,
            },
        );
        Ok(())
    }

    fn unmap(&self, ptr: u64, bytes: usize) {
        let end = ptr + bytes as u64;
        let busy = self
            .pending
            .lock()
            .unwrap()
            .iter()
            .any(|&(_, lo, hi)| lo < end && ptr < hi);
        if busy {
            self.violation(format!(
                "cuMemUnmap at {ptr:#x} ({bytes} bytes) while a copy over it may still run"
            ));
        }
        self.mapped.lock().unwrap().remove(&ptr);
    }
}

/// A stream of the fake device: only its number matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FakeStream(pub u64);

/// The fake driver. Clones share the same device.
#[derive(Clone, Debug)]
pub(crate) struct Fake {
    inner: Arc<Inner>,
}

impl Fake {
    /// A device with `device_bytes` of physical memory and 2 MiB granules.
    pub(crate) fn new(device_bytes: usize) -> Self {
        Self::with_granularity(device_bytes, 2 << 20)
    }

    /// A device with `device_bytes` of physical memory in granules of `granularity` bytes.
    pub(crate) fn with_granularity(device_bytes: usize, granularity: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                next_base: AtomicU64::new(1 << 40),
                next_chunk: AtomicU64::new(1),
                next_stream: AtomicU64::new(1 << 20),
                granularity,
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

    /// What the real driver would have faulted on or refused, in order.
    pub(crate) fn violations(&self) -> Vec<String> {
        self.inner.violations.lock().unwrap().clone()
    }

    /// The bytes at `[address, address + bytes)` (a kernel reading them); `None` where the
    /// real GPU would fault.
    pub(crate) fn read(&self, address: u64, bytes: usize) -> Option<Vec<u8>> {
        let pieces = self.inner.resolve(address, bytes)?;
        let mut data = Vec::with_capacity(bytes);
        for (chunk, offset, len) in pieces {
            data.extend_from_slice(&chunk.read(offset, len));
        }
        Some(data)
    }

    /// The id of the chunk mapped at `address` and whether it is mapped read-only; `None` if
    /// the address is unmapped. Two addresses with the same id share physical memory.
    pub(crate) fn chunk_at(&self, address: u64) -> Option<(u64, bool)> {
        let mapped = self.inner.mapped.lock().unwrap();
        let (&start, entry) = mapped.range(..=address).next_back()?;
        if start + entry.bytes as u64 <= address {
            return None;
        }
        Some((entry.chunk.upgrade()?.id, entry.read_only))
    }

    /// Writes `data` at `address` (a kernel writing it); `false` where the real GPU would
    /// fault, and then nothing is written.
    pub(crate) fn write(&self, address: u64, data: &[u8]) -> bool {
        let Some(pieces) = self.inner.resolve_for(address, data.len(), true) else {
            return false;
        };
        let mut from = 0;
        for (chunk, offset, len) in pieces {
            chunk.write(offset, &data[from..from + len]);
            from += len;
        }
        true
    }

    /// `bytes` of `chunk`'s contents from `offset`, wherever (or whether) it is mapped.
    pub(crate) fn contents(&self, chunk: &FakeChunk, offset: usize, bytes: usize) -> Vec<u8> {
        chunk.read(offset, bytes)
    }

    /// A descriptor for `memory`, as `cuMemExportToShareableHandle` makes one: refused for
    /// memory not made exportable, as the real export is (`ShareError::NotShareable`).
    pub(crate) fn export(&self, memory: &Arc<FakeChunk>) -> Result<FakeExport> {
        if !memory.shareable {
            return Err(Error::Share(ShareError::NotShareable));
        }
        if self.inner.call(Call::Export) {
            return Err(Self::driver_error(
                "cuMemExportToShareableHandle",
                memory.bytes,
            ));
        }
        Ok(FakeExport {
            memory: memory.clone(),
        })
    }

    /// The memory behind `export`, as another process imports it
    /// (`cuMemImportFromShareableHandle`): the same bytes, alive while either side holds them.
    pub(crate) fn import(&self, export: &FakeExport) -> Result<Arc<FakeChunk>> {
        if self.inner.call(Call::Import) {
            return Err(Self::driver_error(
                "cuMemImportFromShareableHandle",
                export.memory.bytes,
            ));
        }
        Ok(export.memory.clone())
    }

    fn enqueue(&self, stream: &FakeStream, start: u64, bytes: usize) {
        self.inner
            .pending
            .lock()
            .unwrap()
            .push((stream.0, start, start + bytes as u64));
    }

    fn driver_error(call: &'static str, bytes: usize) -> Error {
        Error::Driver(DriverError::Failed {
            call,
            result: CUresult::CUDA_ERROR_LAUNCH_FAILED,
            bytes,
        })
    }
}

/// An exported descriptor: like a POSIX file descriptor of exported memory, it keeps the
/// memory importable while it is open.
#[derive(Debug)]
pub(crate) struct FakeExport {
    memory: Arc<FakeChunk>,
}

#[derive(Clone, Debug)]
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

/// Physical memory of the fake device. Fresh memory reads as a byte of its own id (never
/// zeros), so a region that shows a new chunk's bytes where saved ones belong is caught.
#[derive(Debug)]
pub(crate) struct FakeChunk {
    id: u64,
    bytes: usize,
    /// Made exportable (`create_memory(_, true)`): only such memory can be exported.
    shareable: bool,
    /// Made on first touch, so the pool's large chunks cost no host memory.
    data: Mutex<Option<Vec<u8>>>,
    inner: Arc<Inner>,
}

impl FakeChunk {
    pub(crate) fn shareable(&self) -> bool {
        self.shareable
    }

    fn fresh_byte(&self) -> u8 {
        0x80 | (self.id as u8 & 0x7f)
    }

    fn read(&self, offset: usize, bytes: usize) -> Vec<u8> {
        let data = self.data.lock().unwrap();
        match data.as_ref() {
            Some(data) => data[offset..offset + bytes].to_vec(),
            None => vec![self.fresh_byte(); bytes],
        }
    }

    fn write(&self, offset: usize, source: &[u8]) {
        let mut data = self.data.lock().unwrap();
        let fresh = self.fresh_byte();
        let data = data.get_or_insert_with(|| vec![fresh; self.bytes]);
        data[offset..offset + source.len()].copy_from_slice(source);
    }
}

impl PhysicalMemory for FakeChunk {
    fn bytes(&self) -> usize {
        self.bytes
    }
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
    memory: Arc<FakeChunk>,
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
            // A leaked mapping keeps its chunk, and its addresses, forever, as the real one does.
            self.inner.leaked_mappings.fetch_add(1, Ordering::SeqCst);
            self.inner
                .leaked_bytes
                .fetch_add(self.memory.bytes, Ordering::SeqCst);
            std::mem::forget(self.memory.clone());
        } else {
            self.inner.unmap(self.ptr, self.bytes);
        }
    }
}

#[derive(Debug)]
pub(crate) struct FakeFence {
    inner: Arc<Inner>,
}

impl Waiter for FakeFence {
    /// Waits for everything, as `FencePolicy::Context` does.
    fn wait(&self) -> Result<()> {
        if self.inner.call(Call::Wait) {
            return Err(Error::Driver(DriverError::Failed {
                call: "cuCtxSynchronize",
                result: CUresult::CUDA_ERROR_LAUNCH_FAILED,
                bytes: 0,
            }));
        }
        self.inner.pending.lock().unwrap().clear();
        Ok(())
    }
    fn check_not_capturing(&self) -> Result<()> {
        Ok(())
    }
    fn attach(&mut self, _stream: &Arc<CudaStream>) {}
    fn note_use(&mut self, _stream_key: u64) -> Result<()> {
        Ok(())
    }
}

/// Bytes a fake region saved while asleep.
#[derive(Debug)]
pub(crate) struct FakeHostCopy {
    used: StorageUsed,
    data: Vec<u8>,
}

impl Backend for Fake {
    type Reservation = FakeRange;
    type Memory = FakeChunk;
    type Mapping = FakeMapping;
    type Fence = FakeFence;
    type Stream = FakeStream;
    type HostCopy = FakeHostCopy;

    fn granularity(&self, _shareable: bool) -> Result<usize> {
        Ok(self.inner.granularity)
    }

    fn reserve(&self, bytes: usize, alignment: usize) -> Result<FakeRange> {
        if self.inner.call(Call::Reserve) {
            return Err(Error::Driver(DriverError::Failed {
                call: "cuMemAddressReserve",
                result: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                bytes,
            }));
        }
        let span = (bytes as u64).div_ceil(alignment as u64) * alignment as u64 + alignment as u64;
        let base = self.inner.next_base.fetch_add(span, Ordering::SeqCst);
        Ok(FakeRange { base, bytes })
    }

    fn create_memory(&self, bytes: usize, shareable: bool) -> Result<FakeChunk> {
        let full = self.created_bytes() + bytes > self.inner.device_bytes;
        if self.inner.call(Call::Create) || full {
            return Err(Error::Driver(DriverError::OutOfMemory {
                call: "cuMemCreate",
                bytes,
            }));
        }
        if bytes == 0 || !bytes.is_multiple_of(self.inner.granularity) {
            self.inner
                .violation(format!("cuMemCreate of {bytes} bytes: not whole granules"));
        }
        self.inner.live_chunks.fetch_add(1, Ordering::SeqCst);
        self.inner.created_bytes.fetch_add(bytes, Ordering::SeqCst);
        Ok(FakeChunk {
            id: self.inner.next_chunk.fetch_add(1, Ordering::SeqCst),
            bytes,
            shareable,
            data: Mutex::new(None),
            inner: self.inner.clone(),
        })
    }

    fn create_at(&self, bytes: usize, shareable: bool, _at: Location) -> Result<FakeChunk> {
        self.create_memory(bytes, shareable)
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
                return Err(Error::Driver(DriverError::Failed {
                    call: "cuMemMap",
                    result: CUresult::CUDA_ERROR_INVALID_VALUE,
                    bytes,
                }));
            }
            let ptr = reservation.base + at as u64;
            self.inner.map(ptr, chunk, bytes)?;
            self.inner.live_mappings.fetch_add(1, Ordering::SeqCst);
            made.push(FakeMapping {
                ptr,
                bytes,
                memory: chunk.clone(),
                inner: self.inner.clone(),
                leaked: false,
            });
            at += bytes;
        }
        if self.inner.call(Call::Access) {
            // `made` drops here: everything mapped above is unmapped again.
            return Err(Error::Driver(DriverError::Failed {
                call: "cuMemSetAccess",
                result: CUresult::CUDA_ERROR_INVALID_VALUE,
                bytes: at - offset,
            }));
        }
        Ok(made)
    }

    fn map(
        &self,
        reservation: &FakeRange,
        offset: usize,
        memory: &Arc<FakeChunk>,
        bytes: usize,
    ) -> Result<FakeMapping> {
        let fits = offset + bytes <= reservation.bytes && bytes <= memory.bytes && bytes > 0;
        if !fits || !bytes.is_multiple_of(self.inner.granularity) {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "fake: mapping {bytes} bytes at offset {offset} of a {} byte reservation from \
                 {} bytes of memory",
                reservation.bytes, memory.bytes
            ))));
        }
        if self.inner.call(Call::Map) {
            return Err(Error::Driver(DriverError::Failed {
                call: "cuMemMap",
                result: CUresult::CUDA_ERROR_INVALID_VALUE,
                bytes,
            }));
        }
        let ptr = reservation.base + offset as u64;
        self.inner.map(ptr, memory, bytes)?;
        self.inner.live_mappings.fetch_add(1, Ordering::SeqCst);
        let mapping = FakeMapping {
            ptr,
            bytes,
            memory: memory.clone(),
            inner: self.inner.clone(),
            leaked: false,
        };
        if self.inner.call(Call::Access) {
            // `mapping` drops here and unmaps.
            return Err(Error::Driver(DriverError::Failed {
                call: "cuMemSetAccess",
                result: CUresult::CUDA_ERROR_INVALID_VALUE,
                bytes,
            }));
        }
        Ok(mapping)
    }

    fn map_read_only(
        &self,
        reservation: &FakeRange,
        offset: usize,
        memory: &Arc<FakeChunk>,
        count: usize,
    ) -> Result<Vec<FakeMapping>> {
        let bytes = memory.bytes;
        let fits = count > 0
            && bytes
                .checked_mul(count)
                .and_then(|total| total.checked_add(offset))
                .is_some_and(|end| end <= reservation.bytes);
        if !fits {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "fake: {count} read-only copies of {bytes} bytes at offset {offset} of a {} byte \
                 reservation",
                reservation.bytes
            ))));
        }
        let mut made = Vec::with_capacity(count);
        for i in 0..count {
            if self.inner.call(Call::Map) {
                return Err(Self::driver_error("cuMemMap", bytes));
            }
            let ptr = reservation.base + (offset + i * bytes) as u64;
            self.inner.map_with(ptr, memory, bytes, true)?;
            self.inner.live_mappings.fetch_add(1, Ordering::SeqCst);
            made.push(FakeMapping {
                ptr,
                bytes,
                memory: memory.clone(),
                inner: self.inner.clone(),
                leaked: false,
            });
        }
        if self.inner.call(Call::Access) {
            return Err(Self::driver_error("cuMemSetAccess", bytes * count));
        }
        Ok(made)
    }

    fn map_alone(&self, memory: &Arc<FakeChunk>) -> Result<(FakeRange, FakeMapping)> {
        let range = self.reserve(memory.bytes, self.inner.granularity)?;
        let mapping = self.map(&range, 0, memory, memory.bytes)?;
        Ok((range, mapping))
    }

    fn fence(&self, _policy: FencePolicy) -> FakeFence {
        FakeFence {
            inner: self.inner.clone(),
        }
    }

    fn attach(&self, _fence: &mut FakeFence, _stream: &FakeStream) {}

    /// As `FencePolicy::Context` does: waits here.
    fn order_before(&self, fence: &mut FakeFence, _stream: &FakeStream) -> Result<()> {
        fence.wait()
    }

    fn new_stream(&self) -> Result<FakeStream> {
        if self.inner.call(Call::Stream) {
            return Err(Self::driver_error("cuStreamCreate", 0));
        }
        Ok(FakeStream(
            self.inner.next_stream.fetch_add(1, Ordering::SeqCst),
        ))
    }

    fn device(&self) -> usize {
        0
    }

    fn copy_device(
        &self,
        stream: &FakeStream,
        source: u64,
        destination: u64,
        bytes: usize,
    ) -> Result<()> {
        if self.inner.call(Call::Copy) {
            return Err(Self::driver_error("cuMemcpyDtoDAsync", bytes));
        }
        let Some(data) = self.read(source, bytes) else {
            self.inner.violation(format!(
                "copy from unmapped {source:#x} ({bytes} bytes): an illegal address"
            ));
            return Err(Self::driver_error("cuMemcpyDtoDAsync", bytes));
        };
        if !self.write(destination, &data) {
            self.inner.violation(format!(
                "copy to unmapped {destination:#x} ({bytes} bytes): an illegal address"
            ));
            return Err(Self::driver_error("cuMemcpyDtoDAsync", bytes));
        }
        self.enqueue(stream, source, bytes);
        self.enqueue(stream, destination, bytes);
        Ok(())
    }

    fn fill_zero(&self, stream: &FakeStream, destination: u64, bytes: usize) -> Result<()> {
        if self.inner.call(Call::Fill) {
            return Err(Self::driver_error("cuMemsetD8Async", bytes));
        }
        if !self.write(destination, &vec![0; bytes]) {
            self.inner.violation(format!(
                "memset of unmapped or read-only {destination:#x} ({bytes} bytes)"
            ));
            return Err(Self::driver_error("cuMemsetD8Async", bytes));
        }
        self.enqueue(stream, destination, bytes);
        Ok(())
    }

    fn write_host(&self, stream: &FakeStream, destination: u64, data: &[u8]) -> Result<()> {
        if self.inner.call(Call::Write) {
            return Err(Self::driver_error("cuMemcpyHtoDAsync", data.len()));
        }
        if !self.write(destination, data) {
            self.inner.violation(format!(
                "write to unmapped or read-only {destination:#x} ({} bytes)",
                data.len()
            ));
            return Err(Self::driver_error("cuMemcpyHtoDAsync", data.len()));
        }
        self.synchronize(stream)
    }

    fn synchronize(&self, stream: &FakeStream) -> Result<()> {
        self.inner
            .pending
            .lock()
            .unwrap()
            .retain(|&(s, _, _)| s != stream.0);
        Ok(())
    }

    fn synchronize_device(&self) -> Result<()> {
        self.inner.pending.lock().unwrap().clear();
        Ok(())
    }

    fn is_capturing(&self, _stream: &FakeStream) -> Result<bool> {
        Ok(false)
    }

    fn stream_key(&self, stream: &FakeStream) -> u64 {
        stream.0
    }

    fn free_memory(&self) -> usize {
        self.inner.device_bytes.saturating_sub(self.created_bytes())
    }

    fn save(
        &self,
        storage: &HostStorage,
        stream: &FakeStream,
        pieces: &[Piece],
    ) -> Result<FakeHostCopy> {
        let used = match storage {
            HostStorage::Pinned(_) => StorageUsed::Arena,
            HostStorage::Pageable => StorageUsed::Pageable,
            HostStorage::Discard => {
                return Ok(FakeHostCopy {
                    used: StorageUsed::Discarded,
                    data: Vec::new(),
                })
            }
        };
        let total: usize = pieces
            .iter()
            .map(|p| p.host_offset + p.bytes)
            .max()
            .unwrap_or(0);
        if self.inner.call(Call::Save) {
            return Err(Self::driver_error("cuMemcpyDtoHAsync", total));
        }
        let mut data = vec![0u8; total];
        for piece in pieces {
            let Some(bytes) = self.read(piece.device, piece.bytes) else {
                self.inner.violation(format!(
                    "save from unmapped {:#x} ({} bytes)",
                    piece.device, piece.bytes
                ));
                return Err(Self::driver_error("cuMemcpyDtoHAsync", piece.bytes));
            };
            data[piece.host_offset..piece.host_offset + piece.bytes].copy_from_slice(&bytes);
        }
        // It returns once the bytes are on the host: the stream is synchronized.
        self.synchronize(stream)?;
        Ok(FakeHostCopy { used, data })
    }

    fn load(&self, copy: &FakeHostCopy, stream: &FakeStream, pieces: &[Piece]) -> Result<()> {
        if copy.used == StorageUsed::Discarded {
            return Ok(());
        }
        let total: usize = pieces.iter().map(|p| p.bytes).sum();
        if self.inner.call(Call::Load) {
            return Err(Self::driver_error("cuMemcpyHtoDAsync", total));
        }
        for piece in pieces {
            let source = &copy.data[piece.host_offset..piece.host_offset + piece.bytes];
            if !self.write(piece.device, source) {
                self.inner.violation(format!(
                    "load to unmapped {:#x} ({} bytes)",
                    piece.device, piece.bytes
                ));
                return Err(Self::driver_error("cuMemcpyHtoDAsync", piece.bytes));
            }
        }
        self.synchronize(stream)
    }

    fn storage_used(copy: &FakeHostCopy) -> StorageUsed {
        copy.used
    }
}
