//! Sleep and wake: saving every live allocation to host memory and releasing the physical
//! memory under the region; backing the used span again with ONE allocation and copying the
//! bytes back, or waking straight onto a weight set.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{mismatch, Fixed, RegionState, Sleeping, SpanBinding};
use crate::error::{DriverError, Error, OffloadError, Result};
use crate::host::{HostStorage, Piece, StorageUsed, TransferReport};
use crate::ids::next_id;
use crate::region::snapshot::WeightSet;
use crate::vmm_core::{Backend, MappedRange, ReservedRange, Waiter};

impl<B: Backend> RegionState<B> {
    /// Saves every live allocation, then releases all physical memory under the region.
    pub fn sleep(
        &mut self,
        fixed: &Fixed<B>,
        storage: &HostStorage,
        stream: &B::Stream,
    ) -> Result<TransferReport> {
        let start = Instant::now();
        if self.sleeping.is_some() {
            return Ok(report(fixed, 0, start, StorageUsed::Discarded));
        }
        self.require_bound_span(fixed)?;
        self.fence.wait()?;
        let base = fixed.reservation.base();
        let mut runs = Vec::new();
        let mut host_offset = 0;
        for (offset, bytes) in self.allocations.live_runs() {
            runs.push((offset, host_offset, bytes));
            host_offset += bytes;
        }
        let pieces = pieces(base, &runs);
        let copy = fixed.backend.save(storage, stream, &pieces)?;
        let used = B::storage_used(&copy);
        let mut unmapped = Vec::new();
        if let Some(span) = self.span.take() {
            unmapped.push((0, span.mapping.bytes()));
        }
        for (&offset, chunk) in &self.pieces {
            unmapped.push((offset, chunk.mapping.bytes()));
        }
        self.pieces.clear(); // unmaps and releases, after the fence above
        for (offset, bytes) in unmapped {
            self.log_map(fixed, offset, bytes, false);
        }
        self.allocations.set_consolidated(0);
        self.live = None; // its bytes, if it was bound, are in the host copy
        self.sleeping = Some(Sleeping { copy, runs });
        // A sleep is asked for to give the device memory back: nothing stays held for release.
        fixed.backend.release_held();
        Ok(report(fixed, host_offset, start, used))
    }

    /// Backs the used span with ONE new allocation and copies the saved bytes back.
    pub fn wake(&mut self, fixed: &Fixed<B>, stream: &B::Stream) -> Result<TransferReport> {
        let start = Instant::now();
        let Some(sleeping) = &self.sleeping else {
            return Ok(report(fixed, 0, start, StorageUsed::Arena));
        };
        let used = B::storage_used(&sleeping.copy);
        let span = self.allocations.span_end();
        let mut restored = 0;
        if span > 0 {
            let binding = match new_span_binding(fixed, span) {
                Err(Error::Driver(DriverError::OutOfMemory { .. })) => {
                    let free = fixed.backend.free_memory();
                    return Err(Error::Offload(OffloadError::RestoreOutOfMemory {
                        dataset: fixed.id,
                        asked: span,
                        free,
                    }));
                }
                other => other?,
            };
            let base = fixed.reservation.base();
            let pieces = pieces(base, &sleeping.runs);
            restored = pieces.iter().map(|p| p.bytes).sum();
            // On failure `binding` drops here: unmapped at once, nothing used it yet.
            fixed.backend.load(&sleeping.copy, stream, &pieces)?;
            self.span = Some(binding);
            self.allocations.set_consolidated(span);
            self.log_map(fixed, 0, span, true);
        }
        self.sleeping = None; // the host copy goes back to its arena
        Ok(report(fixed, restored, start, used))
    }

    /// Wakes the region straight onto `snapshot` (a published weight set): ONE mapping of
    /// memory that exists already, no allocation and no copy; the host copy (if any) is dropped.
    /// All or nothing: on an error the region stays asleep with its host copy.
    pub fn wake_onto(&mut self, fixed: &Fixed<B>, snapshot: &Arc<WeightSet<B>>) -> Result<()> {
        if self.sleeping.is_none() {
            return Err(mismatch(
                fixed,
                "the region is awake: bind the weight set instead",
            ));
        }
        self.require_bindable(fixed, snapshot)?;
        let bytes = snapshot.bytes();
        let physical = snapshot.memory.clone();
        // Nothing is mapped under the span while asleep, so nothing can be using it.
        let mapping = fixed.backend.map(&fixed.reservation, 0, &physical, bytes)?;
        self.commit_span(fixed, snapshot, mapping);
        self.sleeping = None; // the host copy goes back to its arena
        Ok(())
    }
}

/// The copies of saved `runs` (`(offset in the region, offset in the host copy, bytes)`) for a
/// region at `base`.
fn pieces(base: u64, runs: &[(usize, usize, usize)]) -> Vec<Piece> {
    runs.iter()
        .map(|&(offset, host_offset, bytes)| Piece {
            device: base + offset as u64,
            host_offset,
            bytes,
        })
        .collect()
}

/// One new allocation of `bytes`, mapped at the region's base.
fn new_span_binding<B: Backend>(fixed: &Fixed<B>, bytes: usize) -> Result<SpanBinding<B>> {
    let physical = Arc::new(fixed.backend.create_memory(bytes, false)?);
    let mapping = fixed.backend.map(&fixed.reservation, 0, &physical, bytes)?;
    let snapshot = WeightSet::new(next_id(), fixed.id, &fixed.backend, physical);
    Ok(SpanBinding { snapshot, mapping })
}

fn report<B: Backend>(
    fixed: &Fixed<B>,
    bytes: usize,
    start: Instant,
    storage: StorageUsed,
) -> TransferReport {
    let report = TransferReport {
        dataset: fixed.id,
        bytes,
        elapsed: if bytes == 0 {
            Duration::ZERO
        } else {
            start.elapsed()
        },
        storage,
    };
    tracing::info!(region = %fixed.tag, bytes, gb_per_s = report.gb_per_s(), ?storage, "region transfer");
    report
}
