//! Where offloaded bytes go ([`HostStorage`]), which path a transfer took ([`StorageUsed`]) and
//! what it did ([`TransferReport`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arena::HostArena;
use crate::error::Result;

/// Where an offloaded dataset's bytes go.
#[derive(Clone, Debug)]
pub enum HostStorage {
    /// A pinned arena, allocated once and reused (see the module table).
    Pinned(Arc<HostArena>),
    /// Ordinary host memory, allocated per offload. It streams through a pinned staging buffer
    /// of 128 MiB that the process pins on its first pageable transfer and keeps.
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
    /// Pageable memory, staged through the process's pinned buffer (copied directly when the
    /// transfer is under 1 MiB or another transfer holds the buffer).
    Pageable,
    /// Not copied.
    Discarded,
}

/// What one offload or restore (of a dataset, or a region's sleep or wake) did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TransferReport {
    /// Id of the dataset ([`Dataset::id`](crate::Dataset::id)) or region moved.
    pub dataset: u64,
    /// Bytes moved; 0 when there was nothing to do (already offloaded, already resident).
    pub bytes: usize,
    /// Wall-clock time of the whole operation, from the call until the copies were complete
    /// (waiting for the GPU and releasing or mapping memory included).
    pub elapsed: Duration,
    /// Which path the bytes took.
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
