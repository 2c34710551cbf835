//! Allocations: placing one (inside the consolidated span, or past it on a chunk of its own),
//! freeing one, and consolidating them all under one allocation and one mapping.

use std::sync::Arc;

use super::{offset_of, Fixed, OwnChunk, RegionState, SpanBinding};
use crate::error::{Error, LayoutError, PoolError, RegionError, Result};
use crate::ids::next_id;
use crate::pool::{BlockId, EventKind};
use crate::region::snapshot::WeightSet;
use crate::vmm_core::{Backend, MappedRange, PhysicalMemory, ReservedRange, Waiter};

impl<B: Backend> RegionState<B> {
    pub fn alloc(&mut self, fixed: &Fixed<B>, bytes: usize) -> Result<u64> {
        self.check_replayable(fixed)?;
        if bytes == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "region `{}`: an allocation of 0 bytes",
                fixed.tag
            ))));
        }
        let placement = self.allocations.place(bytes).map_err(|largest| {
            Error::Pool(PoolError::VirtualCapacity {
                tenant: fixed.tag.clone(),
                asked: bytes,
                capacity: fixed.reservation.bytes(),
                largest_free_run: largest,
            })
        })?;
        if !placement.backed {
            let mapped = fixed
                .backend
                .create_memory(placement.rounded, false)
                .and_then(|memory| {
                    let memory = Arc::new(memory);
                    let mapping = fixed.backend.map(
                        &fixed.reservation,
                        placement.offset,
                        &memory,
                        placement.rounded,
                    )?;
                    Ok(OwnChunk { mapping, memory })
                });
            match mapped {
                Ok(chunk) => {
                    self.pieces.insert(placement.offset, chunk);
                    self.log_map(fixed, placement.offset, placement.rounded, true);
                }
                Err(error) => {
                    self.allocations.release(placement.offset);
                    return Err(error);
                }
            }
        }
        let block = BlockId(placement.offset as u64);
        self.log(
            fixed,
            EventKind::Alloc { block },
            placement.offset,
            placement.rounded,
        );
        Ok(fixed.reservation.base() + placement.offset as u64)
    }

    pub fn free(&mut self, fixed: &Fixed<B>, address: u64) -> Result<usize> {
        let unknown = || Error::Region(RegionError::UnknownAllocation { address });
        let offset = offset_of(fixed, address).ok_or_else(unknown)?;
        let allocation = self.allocations.get(offset).ok_or_else(unknown)?;
        let own_chunk = self.pieces.contains_key(&offset);
        if own_chunk {
            // The chunk is unmapped below: nothing may still use it.
            self.fence.wait()?;
        }
        self.allocations.release(offset);
        if let Some(mapping) = self.pieces.remove(&offset) {
            drop(mapping); // unmaps; the chunk is released with its last handle
            self.log_map(fixed, offset, allocation.rounded, false);
        }
        if let Some(sleeping) = &mut self.sleeping {
            // Nothing is restored for it on wake.
            sleeping.runs = clip_runs(&sleeping.runs, &self.allocations.live_runs());
        }
        let block = BlockId(offset as u64);
        self.log(fixed, EventKind::Free { block }, offset, allocation.rounded);
        Ok(allocation.asked)
    }

    /// Folds every piece (and a span shorter than the used span) into one allocation under one
    /// mapping. All or nothing: the old backing is mapped back if the new one cannot be.
    pub(super) fn consolidate(&mut self, fixed: &Fixed<B>, stream: &B::Stream) -> Result<()> {
        let span_end = self.allocations.span_end();
        let current = self.span.as_ref().map_or(0, |s| s.mapping.bytes());
        if self.pieces.is_empty() && current == span_end {
            return Ok(());
        }
        let physical = Arc::new(fixed.backend.create_memory(span_end, false)?);
        let target = WeightSet::new(next_id(), fixed.id, &fixed.backend, physical.clone());
        let home = target.home_ptr()?;
        // Every earlier use of the region must be done before its bytes are read and unmapped.
        self.fence.wait()?;
        let base = fixed.reservation.base();
        for (offset, bytes) in self.allocations.live_runs() {
            fixed
                .backend
                .copy_device(stream, base + offset as u64, home + offset as u64, bytes)?;
        }
        fixed.backend.synchronize(stream)?;
        // Unmap the old backing, keeping its memory to map back on failure.
        let old_span = self.span.take();
        let old_pieces = std::mem::take(&mut self.pieces);
        let keep_span = old_span.as_ref().map(|s| s.snapshot.clone());
        let keep_pieces: Vec<(usize, Arc<B::Memory>)> = old_pieces
            .iter()
            .map(|(&offset, chunk)| (offset, chunk.memory.clone()))
            .collect();
        let unmapped: Vec<(usize, usize)> = old_span
            .iter()
            .map(|s| (0, s.mapping.bytes()))
            .chain(old_pieces.iter().map(|(&o, c)| (o, c.mapping.bytes())))
            .collect();
        drop(old_span);
        drop(old_pieces);
        match fixed
            .backend
            .map(&fixed.reservation, 0, &physical, span_end)
        {
            Ok(mapping) => {
                for (offset, bytes) in unmapped {
                    self.log_map(fixed, offset, bytes, false);
                }
                self.log_map(fixed, 0, span_end, true);
                self.span = Some(SpanBinding {
                    snapshot: target,
                    mapping,
                });
                self.allocations.set_consolidated(span_end);
                Ok(())
            }
            Err(error) => {
                if let Err(restore) = self.map_back(fixed, keep_span, keep_pieces) {
                    tracing::error!(%restore, region = %fixed.tag, "could not map the old backing back");
                }
                Err(error)
            }
        }
    }

    pub(super) fn map_back(
        &mut self,
        fixed: &Fixed<B>,
        span: Option<Arc<WeightSet<B>>>,
        pieces: Vec<(usize, Arc<B::Memory>)>,
    ) -> Result<()> {
        if let Some(snapshot) = span {
            let bytes = snapshot.bytes();
            let physical = snapshot.memory.clone();
            let mapping = fixed.backend.map(&fixed.reservation, 0, &physical, bytes)?;
            self.span = Some(SpanBinding { snapshot, mapping });
        }
        for (offset, physical) in pieces {
            let bytes = physical.bytes();
            let mapping = fixed
                .backend
                .map(&fixed.reservation, offset, &physical, bytes)?;
            self.pieces.insert(
                offset,
                OwnChunk {
                    mapping,
                    memory: physical,
                },
            );
        }
        Ok(())
    }
}

/// The parts of saved `runs` that still hold live allocations.
fn clip_runs(
    runs: &[(usize, usize, usize)],
    live: &[(usize, usize)],
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for &(offset, host, bytes) in runs {
        for &(live_offset, live_bytes) in live {
            let lo = offset.max(live_offset);
            let hi = (offset + bytes).min(live_offset + live_bytes);
            if lo < hi {
                out.push((lo, host + (lo - offset), hi - lo));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::clip_runs;

    #[test]
    fn clipping_keeps_only_live_bytes_with_their_host_offsets() {
        let saved = [(0, 0, 8), (16, 8, 4)];
        assert_eq!(clip_runs(&saved, &[(0, 8), (16, 4)]), saved);
        assert_eq!(
            clip_runs(&saved, &[(2, 2), (18, 2)]),
            [(2, 2, 2), (18, 10, 2)]
        );
        assert!(clip_runs(&saved, &[(8, 8)]).is_empty());
    }
}
