//! The process's pinned staging buffer, for [`HostStorage::Pageable`](super::HostStorage)
//! transfers made without an arena.
//!
//! Pageable memory cannot be copied to or from the device asynchronously; the driver stages it
//! through a small pinned buffer of its own, one thread, and measured on the H100 host that ran
//! at ~1.5 GB/s out (into fresh pages) and ~8 GB/s back. Staging ourselves, through two pinned
//! halves while several threads copy between them and pageable memory, moves the host side off
//! the critical path. The halves are pinned once per process, on the first pageable transfer
//! (pinning is the slow part: ~0.66 s per GiB), and kept for the life of the process.
//! `cuMemHostAlloc` with `PORTABLE` makes them usable from every context.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use super::arena::HostArena;

/// Largest staging chunk; two are used at once. Big enough that starting the host threads for
/// a chunk (tens of µs) is small next to copying it (over a millisecond at PCIe speed).
pub(crate) const STAGING_CHUNK: usize = 64 << 20;
/// Two chunks: the device fills (or drains) one while the host drains (or fills) the other.
pub(crate) const PROCESS_STAGING_BYTES: usize = 2 * STAGING_CHUNK;

static STAGING: Mutex<Option<Arc<HostArena>>> = Mutex::new(None);

/// The process's staging arena, pinned on first use with `ctx`. `None` (after a warning) if it
/// cannot be pinned: callers then copy pageable memory directly, which is slower but works.
///
/// Only one transfer at a time gets its two halves; a concurrent one finds the arena full and
/// copies directly instead of waiting.
pub(crate) fn process_staging(ctx: &Arc<CudaContext>) -> Option<Arc<HostArena>> {
    let mut staging = STAGING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(arena) = staging.as_ref() {
        return Some(arena.clone());
    }
    match HostArena::new(ctx, PROCESS_STAGING_BYTES) {
        Ok(arena) => {
            tracing::info!(
                bytes = PROCESS_STAGING_BYTES,
                "pinned the process staging buffer"
            );
            *staging = Some(arena.clone());
            Some(arena)
        }
        Err(error) => {
            tracing::warn!(%error, "could not pin a staging buffer; pageable copies go direct");
            None
        }
    }
}
