//! Copies between device ranges and one host copy: batched asynchronous copies and one wait,
//! through the pinned arena when it has room. Pageable host copies (a dataset larger than the
//! arena, or [`HostStorage::Pageable`]) stream through two pinned staging halves (the arena's,
//! or the process's own, `staging.rs`): the GPU copies one chunk while several host threads
//! copy the previous one between the other half and pageable memory (`parallel.rs`).

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::arena::{chunk_plan, ArenaRegion, HostArena, ARENA_ALIGN};
use super::parallel;
use super::staging::{process_staging, STAGING_CHUNK};
use super::storage::{HostStorage, StorageUsed};
use crate::driver::{self, host};
use crate::error::{Error, LayoutError, OffloadError, Result};

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

/// Below this, chunking costs more than it saves: copy pageable directly.
const MIN_STAGING_CHUNK: usize = 1 << 20;

fn pageable(bytes: usize) -> Result<Vec<u8>> {
    host::transfer_buffer(bytes).ok_or(Error::Offload(OffloadError::HostOutOfMemory { bytes }))
}

/// Two staging regions of the arena, if it has room for useful ones.
fn staging(arena: &Arc<HostArena>) -> Option<[ArenaRegion; 2]> {
    let chunk = (arena.largest_free() / 2 / ARENA_ALIGN * ARENA_ALIGN).min(STAGING_CHUNK);
    if chunk < MIN_STAGING_CHUNK {
        return None;
    }
    Some([arena.region(chunk)?, arena.region(chunk)?])
}

/// The process staging halves for a pageable transfer of `bytes`, when staging pays and they
/// are free.
fn process_halves(stream: &CudaStream, bytes: usize) -> Option<[ArenaRegion; 2]> {
    if bytes < MIN_STAGING_CHUNK {
        return None;
    }
    staging(&process_staging(stream.context())?)
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
fn settle<T>(stream: &CudaStream, outcome: Result<T>) -> Result<T> {
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
            match process_halves(stream, bytes) {
                Some(halves) => save_staged(stream, pieces, &mut data, &halves)?,
                None => {
                    let base = data.as_mut_ptr();
                    direct(&|offset, len| inside(base, bytes, offset, len))?;
                }
            }
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

/// Device → staging half `i % 2` (async) while the host threads empty the other half into
/// `data`.
fn save_staged(
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
    data: &mut [u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let saved = save_chunks(stream, pieces, data, halves);
    settle(stream, saved)
}

fn save_chunks(
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
    data: &mut [u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let chunks = chunk_plan(data.len(), halves[0].len());
    let threads = parallel::threads();
    let mut done: [Option<CudaEvent>; 2] = [None, None];
    let drain = |i: usize, done: &mut [Option<CudaEvent>; 2], data: &mut [u8]| -> Result<()> {
        let (offset, len) = chunks[i];
        let half = &halves[i % 2];
        if let Some(event) = done[i % 2].take() {
            driver::traced("cuEventSynchronize", len, || event.synchronize())?;
        }
        half.arena().with_memory(|m| {
            let staged = m.slice(half.offset(), len)?;
            unstage(data, staged, pieces, offset, threads)
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
            let total = pieces.iter().map(|p| p.bytes).sum();
            match process_halves(stream, total) {
                Some(halves) => load_staged(stream, pieces, data, &halves),
                None => {
                    let base = data.as_ptr().cast_mut();
                    direct(&|offset, len| inside(base, data.len(), offset, len))
                }
            }
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
        return Err(Error::Layout(LayoutError::InvalidShape(format!(
            "{len} host bytes at {offset} of a {total}-byte buffer"
        ))));
    }
    Ok(base.wrapping_add(offset))
}

/// The host threads fill staging half `i % 2` (once its previous copy is done) while the GPU
/// copies the other half to the device.
fn load_staged(
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
    data: &[u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let loaded = load_chunks(stream, pieces, data, halves);
    settle(stream, loaded)
}

fn load_chunks(
    stream: &Arc<CudaStream>,
    pieces: &[Piece],
    data: &[u8],
    halves: &[ArenaRegion; 2],
) -> Result<()> {
    let total = pieces.iter().map(|p| p.bytes).sum();
    let chunks = chunk_plan(total, halves[0].len());
    let threads = parallel::threads();
    let mut done: [Option<CudaEvent>; 2] = [None, None];
    for (i, &(offset, len)) in chunks.iter().enumerate() {
        let half = &halves[i % 2];
        if let Some(event) = done[i % 2].take() {
            driver::traced("cuEventSynchronize", len, || event.synchronize())?;
        }
        half.arena().with_memory(|m| {
            let staged = m.slice_mut(half.offset(), len)?;
            stage(staged, data, pieces, offset, threads)
        })?;
        let parts = window(pieces, offset, len);
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

/// The host side of saving one chunk: `staged` holds bytes `[offset, offset + staged.len())` of
/// the pieces' concatenation; each part goes to its piece's place in `data`.
fn unstage(
    data: &mut [u8],
    staged: &[u8],
    pieces: &[Piece],
    offset: usize,
    threads: usize,
) -> Result<()> {
    let parts = window(pieces, offset, staged.len());
    let targets = parallel::carve(data, parts.iter().map(|(p, _)| (p.host_offset, p.bytes)))
        .ok_or_else(|| {
            Error::Layout(LayoutError::InvalidShape(
                "pieces out of order in the host copy".into(),
            ))
        })?;
    let jobs = targets
        .into_iter()
        .zip(&parts)
        .map(|(target, &(piece, at))| (target, &staged[at..at + piece.bytes]))
        .collect();
    parallel::copy_all(jobs, threads);
    Ok(())
}

/// The host side of restoring one chunk: fills `staged` with bytes `[offset, offset +
/// staged.len())` of the pieces' concatenation, each part from its piece's place in `data`.
fn stage(
    staged: &mut [u8],
    data: &[u8],
    pieces: &[Piece],
    offset: usize,
    threads: usize,
) -> Result<()> {
    let parts = window(pieces, offset, staged.len());
    let mut sources = Vec::with_capacity(parts.len());
    for &(piece, _) in &parts {
        let end = piece.host_offset.checked_add(piece.bytes);
        let source = end.and_then(|end| data.get(piece.host_offset..end));
        sources.push(source.ok_or_else(|| {
            Error::Layout(LayoutError::InvalidShape(format!(
                "{} bytes at {} of a {}-byte host copy",
                piece.bytes,
                piece.host_offset,
                data.len()
            )))
        })?);
    }
    let targets =
        parallel::carve(staged, parts.iter().map(|&(p, at)| (at, p.bytes))).ok_or_else(|| {
            Error::Layout(LayoutError::InvalidShape(
                "staging windows out of order".into(),
            ))
        })?;
    parallel::copy_all(targets.into_iter().zip(sources).collect(), threads);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Device ranges of a fake device (a byte vector addressed from 0), saved back to back.
    fn pieces_of(ranges: &[(u64, usize)]) -> Vec<Piece> {
        back_to_back(ranges)
    }

    #[test]
    fn chunked_save_and_load_move_every_piece_to_its_place_through_small_staging() {
        let device: Vec<u8> = (0..4096u32).map(|i| (i * 7 + i / 251) as u8).collect();
        // Gathered ranges of odd sizes, not in address order, crossing chunk boundaries.
        let ranges = [
            (100u64, 333usize),
            (2000, 1),
            (7, 64),
            (1500, 480),
            (3000, 1000),
        ];
        let pieces = pieces_of(&ranges);
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let want: Vec<u8> = ranges
            .iter()
            .flat_map(|&(at, len)| device[at as usize..at as usize + len].to_vec())
            .collect();
        for (chunk, threads) in [(1usize, 1usize), (64, 3), (100, 2), (total, 8), (5000, 4)] {
            // Save: the "GPU" fills each chunk of staging from the device, the host unstages it.
            let mut data = vec![0u8; total];
            for (offset, len) in chunk_plan(total, chunk) {
                let mut staged = vec![0xAAu8; len];
                for (piece, at) in window(&pieces, offset, len) {
                    let from = piece.device as usize;
                    staged[at..at + piece.bytes].copy_from_slice(&device[from..from + piece.bytes]);
                }
                unstage(&mut data, &staged, &pieces, offset, threads).unwrap();
            }
            assert_eq!(data, want, "save, chunk {chunk}");
            // Load: the host stages each chunk, the "GPU" copies it to the device.
            let mut restored = vec![0u8; device.len()];
            for (offset, len) in chunk_plan(total, chunk) {
                let mut staged = vec![0x55u8; len];
                stage(&mut staged, &data, &pieces, offset, threads).unwrap();
                for (piece, at) in window(&pieces, offset, len) {
                    let to = piece.device as usize;
                    restored[to..to + piece.bytes].copy_from_slice(&staged[at..at + piece.bytes]);
                }
            }
            for &(at, len) in &ranges {
                let (at, end) = (at as usize, at as usize + len);
                assert_eq!(restored[at..end], device[at..end], "load, chunk {chunk}");
            }
        }
    }

    #[test]
    fn a_restore_may_skip_freed_parts_of_the_copy() {
        // Saved: 10 bytes then 6; the first piece's middle was freed while on the host.
        let data: Vec<u8> = (0..16).collect();
        let pieces = [
            Piece {
                device: 0,
                host_offset: 0,
                bytes: 3,
            },
            Piece {
                device: 7,
                host_offset: 7,
                bytes: 3,
            },
            Piece {
                device: 20,
                host_offset: 10,
                bytes: 6,
            },
        ];
        let mut staged = vec![0u8; 12];
        stage(&mut staged, &data, &pieces, 0, 2).unwrap();
        assert_eq!(staged, [0, 1, 2, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
        let mut short = [0u8; 3];
        let bad = [Piece {
            device: 0,
            host_offset: 14,
            bytes: 3,
        }];
        assert!(
            stage(&mut short, &data, &bad, 0, 1).is_err(),
            "past the copy"
        );
    }
}
