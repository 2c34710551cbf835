//! Moving a dataset's bytes to host memory and back (the copies only; `Dataset::offload` and
//! `Dataset::restore` handle binding, release and identity).
//!
//! | storage | offload / restore speed | host cost | use when |
//! | --- | --- | --- | --- |
//! | [`HostStorage::Pinned`] arena, dataset fits | PCIe speed (~50 GB/s on the H100 host), async | the arena, pinned once | the fast path: size the arena for what sleeps |
//! | arena, dataset does not fit | close to PCIe speed: chunks stream through two staging regions, GPU copy of one chunk overlapping the host copy of the last | pageable memory of the dataset's size | datasets larger than the arena |
//! | [`HostStorage::Pageable`] | measured on the H100 host: ~1.5 GB/s out (each offload writes freshly faulted pages), ~8 GB/s back | pageable memory, no pinning | rare sleeps, no arena |
//! | [`HostStorage::Discard`] | nothing copied | none | data you can regenerate (weights on disk): restore leaves memory uninitialised or calls the dataset's refill |

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaStream};

use crate::arena::{chunk_plan, ArenaRegion, HostArena, ARENA_ALIGN};
use crate::driver::{self, host};
use crate::error::{Error, Result};

/// Where an offloaded dataset's bytes go.
#[derive(Clone, Debug)]
pub enum HostStorage {
    /// A pinned arena, allocated once and reused (see the module table).
    Pinned(Arc<HostArena>),
    /// Ordinary host memory, allocated per offload.
    Pageable,
    /// Nothing is kept; restore gives uninitialised memory, or runs the dataset's refill.
    Discard,
}

/// Which path a transfer took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageUsed {
    /// A region of the pinned arena.
    Arena,
    /// Pageable memory, streamed in chunks through the arena.
    ArenaStaged,
    /// Pageable memory, copied directly.
    Pageable,
    /// Not copied.
    Discarded,
}

/// What one offload or restore did.
#[derive(Clone, Debug)]
pub struct TransferReport {
    pub dataset: u64,
    pub bytes: usize,
    pub elapsed: Duration,
    pub storage: StorageUsed,
}

impl TransferReport {
    /// Decimal gigabytes per second (0 for discarded data).
    pub fn gb_per_s(&self) -> f64 {
        if self.storage == StorageUsed::Discarded || self.elapsed.is_zero() {
            return 0.0;
        }
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e9
    }
}

/// An offloaded dataset's bytes.
#[derive(Debug)]
pub(crate) enum HostCopy {
    Arena(ArenaRegion),
    Staged {
        data: Vec<u8>,
        arena: Arc<HostArena>,
    },
    Pageable(Vec<u8>),
    Discarded,
}

impl HostCopy {
    pub(crate) fn storage(&self) -> StorageUsed {
        match self {
            HostCopy::Arena(_) => StorageUsed::Arena,
            HostCopy::Staged { .. } => StorageUsed::ArenaStaged,
            HostCopy::Pageable(_) => StorageUsed::Pageable,
            HostCopy::Discarded => StorageUsed::Discarded,
        }
    }
}

/// Largest staging chunk; two are used at once.
const STAGING_CHUNK: usize = 64 << 20;
/// Below this, chunking costs more than it saves: copy pageable directly.
const MIN_STAGING_CHUNK: usize = 1 << 20;

fn pageable(bytes: usize) -> Result<Vec<u8>> {
    host::zeroed_host_buffer(bytes).ok_or(Error::HostOutOfMemory { bytes })
}

/// Two staging regions of the arena, if it has room for useful ones.
fn staging(arena: &Arc<HostArena>) -> Option<[ArenaRegion; 2]> {
    let chunk = (arena.largest_free() / 2 / ARENA_ALIGN * ARENA_ALIGN).min(STAGING_CHUNK);
    if chunk < MIN_STAGING_CHUNK {
        return None;
    }
    Some([arena.region(chunk)?, arena.region(chunk)?])
}

/// Copies `bytes` at `device` into new host storage; returns once the copy is complete. Host
/// memory is acquired before anything is copied, so a refusal changes nothing.
pub(crate) fn save(
    storage: &HostStorage,
    stream: &Arc<CudaStream>,
    device: sys::CUdeviceptr,
    bytes: usize,
) -> Result<HostCopy> {
    let copy = match storage {
        HostStorage::Discard => HostCopy::Discarded,
        HostStorage::Pageable => {
            let mut data = pageable(bytes)?;
            host::copy_to_host(stream, data.as_mut_ptr(), device, bytes)?;
            driver::synchronize_stream(stream)?;
            HostCopy::Pageable(data)
        }
        HostStorage::Pinned(arena) => match arena.region(bytes) {
            Some(region) => {
                host::copy_to_host(stream, region.ptr(0, bytes)?, device, bytes)?;
                driver::synchronize_stream(stream)?;
                HostCopy::Arena(region)
            }
            None => {
                let mut data = pageable(bytes)?;
                match staging(arena) {
                    Some(halves) => save_staged(stream, device, &mut data, &halves)?,
                    None => {
                        host::copy_to_host(stream, data.as_mut_ptr(), device, bytes)?;
                        driver::synchronize_stream(stream)?;
                    }
                }
                HostCopy::Staged {
                    data,
                    arena: arena.clone(),
                }
            }
        },
    };
    Ok(copy)
}

/// Device → staging half `i % 2` (async) while the host empties the other half into `data`.
fn save_staged(
    stream: &Arc<CudaStream>,
    device: sys::CUdeviceptr,
    data: &mut [u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let chunks = chunk_plan(data.len(), halves[0].len());
    let mut done: [Option<cudarc::driver::CudaEvent>; 2] = [None, None];
    let drain = |i: usize,
                 done: &mut [Option<cudarc::driver::CudaEvent>; 2],
                 data: &mut [u8]|
     -> Result<()> {
        let (offset, len) = chunks[i];
        let half = &halves[i % 2];
        if let Some(event) = done[i % 2].take() {
            driver::traced("cuEventSynchronize", len, || event.synchronize())?;
        }
        half.arena().with_memory(|m| {
            m.slice(half.offset(), len)
                .map(|s| data[offset..offset + len].copy_from_slice(s))
        })
    };
    for (i, &(offset, len)) in chunks.iter().enumerate() {
        host::copy_to_host(
            stream,
            halves[i % 2].ptr(0, len)?,
            device + offset as u64,
            len,
        )?;
        done[i % 2] = Some(driver::traced("cuEventRecord", 0, || {
            stream.record_event(None)
        })?);
        if i > 0 {
            drain(i - 1, &mut done, data)?;
        }
    }
    if !chunks.is_empty() {
        drain(chunks.len() - 1, &mut done, data)?;
    }
    Ok(())
}

/// Copies `copy` back to `device`; returns once the copy is complete.
pub(crate) fn load(
    copy: &HostCopy,
    stream: &Arc<CudaStream>,
    device: sys::CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    match copy {
        HostCopy::Discarded => return Ok(()),
        HostCopy::Arena(region) => {
            host::copy_to_device(stream, device, region.ptr(0, bytes)?, bytes)?
        }
        HostCopy::Pageable(data) => host::copy_to_device(stream, device, data.as_ptr(), bytes)?,
        HostCopy::Staged { data, arena } => match staging(arena) {
            Some(halves) => return load_staged(stream, device, data, &halves),
            None => host::copy_to_device(stream, device, data.as_ptr(), bytes)?,
        },
    }
    driver::synchronize_stream(stream)
}

/// The host fills staging half `i % 2` (once its previous copy is done) while the GPU copies the
/// other half to the device.
fn load_staged(
    stream: &Arc<CudaStream>,
    device: sys::CUdeviceptr,
    data: &[u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let chunks = chunk_plan(data.len(), halves[0].len());
    let mut done: [Option<cudarc::driver::CudaEvent>; 2] = [None, None];
    for (i, &(offset, len)) in chunks.iter().enumerate() {
        let half = &halves[i % 2];
        if let Some(event) = done[i % 2].take() {
            driver::traced("cuEventSynchronize", len, || event.synchronize())?;
        }
        half.arena().with_memory(|m| {
            m.slice_mut(half.offset(), len)
                .map(|s| s.copy_from_slice(&data[offset..offset + len]))
        })?;
        host::copy_to_device(stream, device + offset as u64, half.ptr(0, len)?, len)?;
        done[i % 2] = Some(driver::traced("cuEventRecord", 0, || {
            stream.record_event(None)
        })?);
    }
    driver::synchronize_stream(stream)
}

/// Times `f` and logs the transfer.
pub(crate) fn timed(
    dataset: u64,
    bytes: usize,
    what: &str,
    f: impl FnOnce() -> Result<StorageUsed>,
) -> Result<TransferReport> {
    let start = Instant::now();
    let storage = f()?;
    let report = TransferReport {
        dataset,
        bytes,
        elapsed: start.elapsed(),
        storage,
    };
    tracing::info!(
        dataset,
        bytes,
        gb_per_s = report.gb_per_s(),
        ?storage,
        "{what}"
    );
    Ok(report)
}

/// Offloads every dataset tagged `tag` (see [`Dataset::set_tag`]), one after the other: each copy
/// already runs at full PCIe bandwidth, so copies in the same direction gain nothing from being
/// overlapped. Stops at the first error; datasets offloaded before it stay offloaded.
pub fn offload_tagged<'a>(
    datasets: impl IntoIterator<Item = &'a mut crate::Dataset>,
    tag: &str,
    storage: &HostStorage,
    stream: &Arc<CudaStream>,
) -> Result<Vec<TransferReport>> {
    datasets
        .into_iter()
        .filter(|d| d.tag() == Some(tag))
        .map(|d| d.offload(storage, stream))
        .collect()
}

/// Restores every dataset tagged `tag`. Stops at the first error (say, out of memory); those
/// restored stay restored and the rest keep their host copies, so a retry continues.
pub fn restore_tagged<'a>(
    datasets: impl IntoIterator<Item = &'a mut crate::Dataset>,
    tag: &str,
    stream: &Arc<CudaStream>,
) -> Result<Vec<TransferReport>> {
    datasets
        .into_iter()
        .filter(|d| d.tag() == Some(tag))
        .map(|d| d.restore(stream))
        .collect()
}
