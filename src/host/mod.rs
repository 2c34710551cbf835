//! Host memory for offloaded bytes: where they go ([`HostStorage`]), the pinned [`HostArena`],
//! and the copies to and from the device. [`Dataset::offload`](crate::Dataset::offload) /
//! [`restore`](crate::Dataset::restore), [`Region::sleep`](crate::region::Region::sleep) /
//! [`wake`](crate::region::Region::wake) and [`Space::sleep`](crate::Space::sleep) /
//! [`wake`](crate::Space::wake) handle binding, release and identity on top of this.
//!
//! | storage | offload / restore speed | host cost | use when |
//! | --- | --- | --- | --- |
//! | [`HostStorage::Pinned`] arena, dataset fits | PCIe speed (~50 GB/s on the H100 host), async | the arena, pinned once | the fast path: size the arena for what sleeps |
//! | arena, dataset does not fit | close to PCIe speed: chunks stream through two staging regions, GPU copy of one chunk overlapping the host copy of the last | pageable memory of the dataset's size | datasets larger than the arena |
//! | [`HostStorage::Pageable`] | measured on the H100 host: ~1.5 GB/s out (each offload writes freshly faulted pages), ~8 GB/s back | pageable memory, no pinning | rare sleeps, no arena |
//! | [`HostStorage::Discard`] | nothing copied | none | data you can regenerate (weights on disk): restore leaves memory uninitialised or calls the dataset's refill |

mod arena;
pub(crate) mod copy;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Result;

pub use arena::HostArena;
pub(crate) use copy::{HostCopy, Piece};

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
#[non_exhaustive]
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
