//! Copies between device ranges and one host copy: batched asynchronous copies and one wait,
//! through the pinned arena when it has room, streamed through two staging regions of it when
//! it does not.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use super::arena::{chunk_plan, ArenaRegion, HostArena, ARENA_ALIGN};
use super::{HostStorage, StorageUsed};
use crate::driver::{self, host};
use crate::error::{Error, Result};

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

/// One device range of a transfer and where its bytes sit in the host copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub device: sys::CUdeviceptr,
    pub host_offset: usize,
    pub bytes: usize,
}

/// Device ranges saved back to back: piece `i` lands right after piece `i - 1` in the host copy.
pub(crate) fn back_to_back(ranges: &[(sys::CUdeviceptr, usize)]) -> Vec<Piece> {
    let mut host_offset = 0;
    ranges
        .iter()
        .map(|&(device, bytes)| {
            let piece = Piece {
                device,
                host_offset,
                bytes,
            };
            host_offset += bytes;
            piece
        })
        .collect()
}

/// The parts of `pieces` that fall into `[at, at + len)` of their concatenation, as
/// `(piece clipped to the window, offset of that part inside the window)`.
fn window(pieces: &[Piece], at: usize, len: usize) -> Vec<(Piece, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for piece in pieces {
        let (lo, hi) = (start.max(at), (start + piece.bytes).min(at + len));
        if lo < hi {
            let skip = lo - start;
            out.push((
                Piece {
                    device: piece.device + skip as u64,
                    host_offset: piece.host_offset + skip,
                    bytes: hi - lo,
                },
                lo - at,
            ));
        }
        start += piece.bytes;
    }
    out
}

/// Ends a transfer: on failure, first waits for the copies it may have left in flight on
/// `stream`, so that the memory on both sides can be let go at once (callers unmap the device
/// range of a failed restore, and the arena hands its regions out again). Without the wait, a
/// failed synchronize would unmap memory a DMA is still writing: a GPU fault. If even the wait
/// fails, the whole context is waited for (a context whose waits fail is beyond saving anyway).
fn settle(stream: &Arc<CudaStream>, outcome: Result<()>) -> Result<()> {
    if outcome.is_err() {
        if let Err(wait) = driver::synchronize_stream(stream) {
            tracing::error!(%wait, "waiting for the copies of a failed transfer failed");
            if let Err(wait) = driver::synchronize_context(stream.context()) {
                tracing::error!(%wait, "waiting for the context after a failed transfer failed");
            }
        }
    }
    outcome
}

/// Copies `bytes` at `device` into new host storage; returns once the copy is complete. Host
/// memory is acquired before anything is copied, so a refusal changes nothing.
pub(crate) fn save(
    storage: &HostStorage,
    stream: &Arc<CudaStream>,
    device: sys::CUdeviceptr,
    bytes: usize,
) -> Result<HostCopy> {
    save_pieces(storage, stream, &back_to_back(&[(device, bytes)]))
}

/// Copies every piece into one new host copy (piece `i` at its `host_offset`, which must lay
/// the pieces back to back from 0): one batch of asynchronous copies and one wait. Host memory
/// is acquired before anything is copied, so a refusal changes nothing.
pub(crate) fn save_pieces(
    storage: &HostStorage,
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
) -> Result<HostCopy> {
    let bytes: usize = pieces.iter().map(|p| p.bytes).sum();
    let direct = |host: &dyn Fn(usize, usize) -> Result<*mut u8>| -> Result<()> {
        let copied = pieces.iter().try_for_each(|piece| {
            let target = host(piece.host_offset, piece.bytes)?;
            host::copy_to_host(stream, target, piece.device, piece.bytes)
        });
        settle(
            stream,
            copied.and_then(|()| driver::synchronize_stream(stream)),
        )
    };
    let copy = match storage {
        HostStorage::Discard => HostCopy::Discarded,
        HostStorage::Pageable => {
            let mut data = pageable(bytes)?;
            let base = data.as_mut_ptr();
            direct(&|offset, len| inside(base, bytes, offset, len))?;
            HostCopy::Pageable(data)
        }
        HostStorage::Pinned(arena) => match arena.region(bytes) {
            Some(region) => {
                direct(&|offset, len| region.ptr(offset, len))?;
                HostCopy::Arena(region)
            }
            None => {
                let mut data = pageable(bytes)?;
                match staging(arena) {
                    Some(halves) => {
                        settle(stream, save_staged(stream, pieces, &mut data, &halves))?
                    }
                    None => {
                        let base = data.as_mut_ptr();
                        direct(&|offset, len| inside(base, bytes, offset, len))?;
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
    pieces: &[Piece],
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
            for (piece, at) in window(pieces, offset, len) {
                let staged = m.slice(half.offset() + at, piece.bytes)?;
                data[piece.host_offset..piece.host_offset + piece.bytes].copy_from_slice(staged);
            }
            Ok(())
        })
    };
    for (i, &(offset, len)) in chunks.iter().enumerate() {
        for (piece, at) in window(pieces, offset, len) {
            host::copy_to_host(
                stream,
                halves[i % 2].ptr(at, piece.bytes)?,
                piece.device,
                piece.bytes,
            )?;
        }
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
    load_pieces(copy, stream, &back_to_back(&[(device, bytes)]))
}

/// Copies the bytes at each piece's `host_offset` of `copy` to its device range; one batch of
/// asynchronous copies and one wait. Pieces may skip parts of the copy (memory freed while it
/// was on the host) but keep the order they were saved in.
pub(crate) fn load_pieces(
    copy: &HostCopy,
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
) -> Result<()> {
    let direct = |host: &dyn Fn(usize, usize) -> Result<*mut u8>| -> Result<()> {
        let copied = pieces.iter().try_for_each(|piece| {
            let source = host(piece.host_offset, piece.bytes)?.cast_const();
            host::copy_to_device(stream, piece.device, source, piece.bytes)
        });
        settle(
            stream,
            copied.and_then(|()| driver::synchronize_stream(stream)),
        )
    };
    match copy {
        HostCopy::Discarded => Ok(()),
        HostCopy::Arena(region) => direct(&|offset, len| region.ptr(offset, len)),
        HostCopy::Pageable(data) => {
            let base = data.as_ptr().cast_mut();
            direct(&|offset, len| inside(base, data.len(), offset, len))
        }
        HostCopy::Staged { data, arena } => match staging(arena) {
            // Settled before the staging halves go back to the arena.
            Some(halves) => settle(stream, load_staged(stream, pieces, data, &halves)),
            None => {
                let base = data.as_ptr().cast_mut();
                direct(&|offset, len| inside(base, data.len(), offset, len))
            }
        },
    }
}

/// The address of byte `offset` of a `total`-byte host buffer at `base`, if `len` bytes from
/// there stay inside it. The pointer is only handed to the driver's copy calls.
fn inside(base: *mut u8, total: usize, offset: usize, len: usize) -> Result<*mut u8> {
    if offset.checked_add(len).is_none_or(|end| end > total) {
        return Err(Error::InvalidShape(format!(
            "{len} host bytes at {offset} of a {total}-byte buffer"
        )));
    }
    Ok(base.wrapping_add(offset))
}

/// The host fills staging half `i % 2` (once its previous copy is done) while the GPU copies the
/// other half to the device.
fn load_staged(
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
    data: &[u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let total = pieces.iter().map(|p| p.bytes).sum();
    let chunks = chunk_plan(total, halves[0].len());
    let mut done: [Option<cudarc::driver::CudaEvent>; 2] = [None, None];
    for (i, &(offset, len)) in chunks.iter().enumerate() {
        let half = &halves[i % 2];
        if let Some(event) = done[i % 2].take() {
            driver::traced("cuEventSynchronize", len, || event.synchronize())?;
        }
        let parts = window(pieces, offset, len);
        half.arena().with_memory(|m| {
            for &(piece, at) in &parts {
                m.slice_mut(half.offset() + at, piece.bytes)?
                    .copy_from_slice(&data[piece.host_offset..piece.host_offset + piece.bytes]);
            }
            Ok::<(), Error>(())
        })?;
        for &(piece, at) in &parts {
            host::copy_to_device(
                stream,
                piece.device,
                half.ptr(at, piece.bytes)?,
                piece.bytes,
            )?;
        }
        done[i % 2] = Some(driver::traced("cuEventRecord", 0, || {
            stream.record_event(None)
        })?);
    }
    driver::synchronize_stream(stream)
}
