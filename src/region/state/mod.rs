//! A region's state behind its lock, and every operation that maps, unmaps or copies.
//!
//! Each operation checks and plans first, then calls the driver, then commits; on an error it
//! undoes its own driver work, so the region is as it was. The operations are split by job:
//!
//! - [`allocate`]: allocations (alloc, free) and consolidating them under one mapping;
//! - [`sleep`]: saving the region to host memory and waking it (also straight onto a weight set);
//! - [`weights`]: weight sets: snapshot, bind and unbind, load, switch.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::allocation_map::AllocationMap;
use super::snapshot::WeightSet;
use super::stats::RegionStats;
use crate::error::{Error, GraphError, RegionError, Result};
use crate::host::StorageUsed;
use crate::pool::{BlockId, ChunkId, Event, EventKind, EventLog, TenantId};
use crate::vmm_core::{Backend, MappedRange, ReservedRange, Waiter};

mod allocate;
mod sleep;
mod weights;

/// What the consolidated span is backed by while awake and bound.
#[derive(Debug)]
struct SpanBinding<B: Backend> {
    // Field order is drop order: unmapped before the set's handle goes.
    mapping: B::Mapping,
    snapshot: Arc<WeightSet<B>>,
}

/// An allocation the span does not back: its own chunk, mapped at its offset.
#[derive(Debug)]
struct OwnChunk<B: Backend> {
    // Field order is drop order: unmapped before the memory is released.
    mapping: B::Mapping,
    memory: Arc<B::Memory>,
}

/// While asleep: the saved bytes and where they came from.
#[derive(Debug)]
struct Sleeping<B: Backend> {
    copy: B::HostCopy,
    /// `(offset in the region, offset in the host copy, bytes)` of every saved run.
    runs: Vec<(usize, usize, usize)>,
}

/// The fixed facts of a region, shared by its state's operations.
#[derive(Debug)]
pub(super) struct Fixed<B: Backend> {
    pub id: u64,
    pub tag: String,
    pub backend: B,
    pub granularity: usize,
    pub reservation: B::Reservation,
}

#[derive(Debug)]
pub(super) struct RegionState<B: Backend> {
    /// Where the allocations sit, and how far the consolidated span reaches.
    allocations: AllocationMap,
    /// Chunks of the allocations the span does not back, by offset.
    pieces: BTreeMap<usize, OwnChunk<B>>,
    span: Option<SpanBinding<B>>,
    /// Set by `unbind`: the span is deliberately unmapped.
    unbound: bool,
    /// The region's own weight set for copy switches: made and bound on the first one, copied
    /// into by each; never a set a caller made. Dropped on sleep, unbind, and a snapshot after
    /// the region outgrew it, so it holds memory only while copy switches may use it.
    live: Option<Arc<WeightSet<B>>>,
    sleeping: Option<Sleeping<B>>,
    pub(super) fence: B::Fence,
    events: EventLog,
    next_chunk: u32,
}

/// Event times of all regions count from one origin, so regions share a timeline.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl<B: Backend> RegionState<B> {
    pub fn new(fixed: &Fixed<B>, fence: B::Fence) -> Self {
        let mut state = Self {
            allocations: AllocationMap::new(fixed.reservation.bytes(), fixed.granularity),
            pieces: BTreeMap::new(),
            span: None,
            unbound: false,
            live: None,
            sleeping: None,
            fence,
            events: EventLog::new(1 << 14),
            next_chunk: 0,
        };
        let name: Arc<str> = Arc::from(fixed.tag.as_str());
        state.log(
            fixed,
            EventKind::Register { name },
            0,
            fixed.reservation.bytes(),
        );
        state
    }

    fn log(&mut self, fixed: &Fixed<B>, kind: EventKind, offset: usize, bytes: usize) {
        self.events.push(Event {
            at: epoch().elapsed(),
            kind,
            tenant: Some(TenantId(fixed.id as u32)),
            address: fixed.reservation.base() + offset as u64,
            bytes,
        });
    }

    fn log_map(&mut self, fixed: &Fixed<B>, offset: usize, bytes: usize, map: bool) {
        let chunk = ChunkId(self.next_chunk);
        self.next_chunk = self.next_chunk.wrapping_add(1);
        let block = BlockId(offset as u64);
        let kind = if map {
            EventKind::Map {
                chunk,
                block,
                reused: false,
            }
        } else {
            EventKind::Unmap { chunk, block }
        };
        self.log(fixed, kind, offset, bytes);
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.events().cloned().collect()
    }

    /// `Err(RegionAsleep)` or `Err(Unbound)` unless graphs over the region may replay.
    pub fn check_replayable(&self, fixed: &Fixed<B>) -> Result<()> {
        self.require_awake(fixed)?;
        self.require_bound_span(fixed)
    }

    /// `Err(RegionAsleep)` while the region is asleep.
    fn require_awake(&self, fixed: &Fixed<B>) -> Result<()> {
        if self.sleeping.is_some() {
            return Err(Error::Region(RegionError::RegionAsleep {
                tag: fixed.tag.clone(),
            }));
        }
        Ok(())
    }

    /// `Err(Unbound)` from an `unbind` until the next bind.
    fn require_bound_span(&self, fixed: &Fixed<B>) -> Result<()> {
        if self.unbound {
            return Err(Error::Graph(GraphError::Unbound {
                group: fixed.tag.clone(),
            }));
        }
        Ok(())
    }

    pub fn is_asleep(&self) -> bool {
        self.sleeping.is_some()
    }

    pub fn allocation_at(&self, fixed: &Fixed<B>, address: u64) -> Option<(u64, usize)> {
        let offset = offset_of(fixed, address)?;
        self.allocations
            .containing(offset)
            .map(|(start, a)| (fixed.reservation.base() + start as u64, a.asked))
    }

    /// `Ok` if `[address, address + bytes)` lies inside one live allocation and is mapped now.
    pub fn require_mapped(&self, fixed: &Fixed<B>, address: u64, bytes: usize) -> Result<()> {
        self.check_replayable(fixed)?;
        let offset = offset_of(fixed, address)
            .ok_or(Error::Region(RegionError::UnknownAllocation { address }))?;
        let (start, allocation) = self
            .allocations
            .containing(offset)
            .ok_or(Error::Region(RegionError::UnknownAllocation { address }))?;
        crate::buffer::require_range("region copy", allocation.rounded, offset - start, bytes)
    }

    pub fn stats(&self, fixed: &Fixed<B>) -> RegionStats {
        let (allocations, allocated) = self.allocations.allocated();
        let span_mapped = self.span.as_ref().map_or(0, |s| s.mapping.bytes());
        let pieces_mapped: usize = self.pieces.values().map(|c| c.mapping.bytes()).sum();
        RegionStats {
            tag: fixed.tag.clone(),
            reserved: fixed.reservation.bytes(),
            allocated,
            allocations,
            span: self.allocations.span_end(),
            mapped: span_mapped + pieces_mapped,
            mappings: self.pieces.len() + usize::from(self.span.is_some()),
            asleep: self.sleeping.is_some(),
            // Discarded bytes are not held anywhere.
            host_bytes: self
                .sleeping
                .as_ref()
                .filter(|s| B::storage_used(&s.copy) != StorageUsed::Discarded)
                .map_or(0, |s| s.runs.iter().map(|r| r.2).sum()),
        }
    }

    /// Unmaps everything (for the region's drop); leaks it if the GPU may still use it.
    pub fn release_all(&mut self, fixed: &Fixed<B>) {
        if let Err(error) = self.fence.wait() {
            tracing::error!(%error, region = %fixed.tag, "waiting for the GPU before freeing a region failed; leaking it");
            if let Some(span) = &mut self.span {
                span.mapping.leak_on_drop();
            }
            self.pieces
                .values_mut()
                .for_each(|c| c.mapping.leak_on_drop());
        }
        self.span = None;
        self.pieces.clear();
    }
}

/// `SnapshotMismatch` for the region, saying why.
fn mismatch<B: Backend>(fixed: &Fixed<B>, reason: &str) -> Error {
    Error::Region(RegionError::SnapshotMismatch {
        tag: fixed.tag.clone(),
        reason: reason.into(),
    })
}

fn offset_of<B: Backend>(fixed: &Fixed<B>, address: u64) -> Option<usize> {
    let base = fixed.reservation.base();
    (address >= base && address < base + fixed.reservation.bytes() as u64)
        .then(|| (address - base) as usize)
}
