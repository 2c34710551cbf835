//! A region's state behind its lock, and every operation that maps, unmaps or copies.
//!
//! Each operation checks and plans first, then calls the driver, then commits; on an error it
//! undoes its own driver work, so the region is as it was.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::book::RegionBook;
use super::snapshot::WeightSet;
use super::stats::RegionStats;
use super::switch::{SwitchStrategy, Switched};
use crate::error::{
    DriverError, Error, GraphError, LayoutError, OffloadError, PoolError, RegionError, Result,
};
use crate::host::{HostStorage, Piece, StorageUsed, TransferReport};
use crate::ids::next_id;
use crate::pool::{BlockId, ChunkId, Event, EventKind, EventLog, TenantId};
use crate::strategy::CostModel;
use crate::vmm_core::{Backend, MappedRange, PhysicalMemory, ReservedRange, Waiter};

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
    book: RegionBook,
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
            book: RegionBook::new(fixed.reservation.bytes(), fixed.granularity),
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
        if self.sleeping.is_some() {
            return Err(Error::Region(RegionError::RegionAsleep {
                tag: fixed.tag.clone(),
            }));
        }
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
        self.book
            .containing(offset)
            .map(|(start, a)| (fixed.reservation.base() + start as u64, a.asked))
    }

    /// `Ok` if `[address, address + bytes)` lies inside one live allocation and is mapped now.
    pub fn require_mapped(&self, fixed: &Fixed<B>, address: u64, bytes: usize) -> Result<()> {
        self.check_replayable(fixed)?;
        let offset = offset_of(fixed, address)
            .ok_or(Error::Region(RegionError::UnknownAllocation { address }))?;
        let (start, allocation) = self
            .book
            .containing(offset)
            .ok_or(Error::Region(RegionError::UnknownAllocation { address }))?;
        crate::buffer::require_range("region copy", allocation.rounded, offset - start, bytes)
    }

    pub fn alloc(&mut self, fixed: &Fixed<B>, bytes: usize) -> Result<u64> {
        self.check_replayable(fixed)?;
        if bytes == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "region `{}`: an allocation of 0 bytes",
                fixed.tag
            ))));
        }
        let placement = self.book.place(bytes).map_err(|largest| {
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
                    self.book.release(placement.offset);
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
        let allocation = self.book.get(offset).ok_or_else(unknown)?;
        let own_chunk = self.pieces.contains_key(&offset);
        if own_chunk {
            // The chunk is unmapped below: nothing may still use it.
            self.fence.wait()?;
        }
        self.book.release(offset);
        if let Some(mapping) = self.pieces.remove(&offset) {
            drop(mapping); // unmaps; the chunk is released with its last handle
            self.log_map(fixed, offset, allocation.rounded, false);
        }
        if let Some(sleeping) = &mut self.sleeping {
            // Nothing is restored for it on wake.
            sleeping.runs = clip_runs(&sleeping.runs, &self.book.live_runs());
        }
        let block = BlockId(offset as u64);
        self.log(fixed, EventKind::Free { block }, offset, allocation.rounded);
        Ok(allocation.asked)
    }

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
        if self.unbound {
            return Err(Error::Graph(GraphError::Unbound {
                group: fixed.tag.clone(),
            }));
        }
        self.fence.wait()?;
        let base = fixed.reservation.base();
        let mut runs = Vec::new();
        let mut host_offset = 0;
        for (offset, bytes) in self.book.live_runs() {
            runs.push((offset, host_offset, bytes));
            host_offset += bytes;
        }
        let pieces: Vec<Piece> = runs
            .iter()
            .map(|&(offset, host_offset, bytes)| Piece {
                device: base + offset as u64,
                host_offset,
                bytes,
            })
            .collect();
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
        self.book.set_consolidated(0);
        self.live = None; // its bytes, if it was bound, are in the host copy
        self.sleeping = Some(Sleeping { copy, runs });
        Ok(report(fixed, host_offset, start, used))
    }

    /// Backs the used span with ONE new allocation and copies the saved bytes back.
    pub fn wake(&mut self, fixed: &Fixed<B>, stream: &B::Stream) -> Result<TransferReport> {
        let start = Instant::now();
        let Some(sleeping) = &self.sleeping else {
            return Ok(report(fixed, 0, start, StorageUsed::Arena));
        };
        let used = B::storage_used(&sleeping.copy);
        let span = self.book.span_end();
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
            let pieces: Vec<Piece> = sleeping
                .runs
                .iter()
                .map(|&(offset, host_offset, bytes)| Piece {
                    device: base + offset as u64,
                    host_offset,
                    bytes,
                })
                .collect();
            restored = pieces.iter().map(|p| p.bytes).sum();
            // On failure `binding` drops here: unmapped at once, nothing used it yet.
            fixed.backend.load(&sleeping.copy, stream, &pieces)?;
            self.span = Some(binding);
            self.book.set_consolidated(span);
            self.log_map(fixed, 0, span, true);
        }
        self.sleeping = None; // the host copy goes back to its arena
        Ok(report(fixed, restored, start, used))
    }

    /// Folds every piece (and a span shorter than the used span) into one allocation under one
    /// mapping. All or nothing: the old backing is mapped back if the new one cannot be.
    fn consolidate(&mut self, fixed: &Fixed<B>, stream: &B::Stream) -> Result<()> {
        let span_end = self.book.span_end();
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
        for (offset, bytes) in self.book.live_runs() {
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
                self.book.set_consolidated(span_end);
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

    fn map_back(
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

    /// A second backing of the span with its contents; `shareable` makes it exportable as a
    /// POSIX file descriptor (its size then rounded up to the shareable granularity).
    pub fn snapshot(
        &mut self,
        fixed: &Fixed<B>,
        stream: &B::Stream,
        shareable: bool,
    ) -> Result<Arc<WeightSet<B>>> {
        self.check_replayable(fixed)?;
        let span_end = self.book.span_end();
        if span_end == 0 {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "region `{}` has no allocations to snapshot",
                fixed.tag
            ))));
        }
        let bytes = if shareable {
            shareable_size(fixed, span_end)?
        } else {
            span_end
        };
        self.consolidate(fixed, stream)?;
        let physical = Arc::new(fixed.backend.create_memory(bytes, shareable)?);
        let snapshot = WeightSet::new(next_id(), fixed.id, &fixed.backend, physical);
        let home = snapshot.home_ptr()?;
        // The span is one mapping now: one copy.
        fixed
            .backend
            .copy_device(stream, fixed.reservation.base(), home, span_end)?;
        fixed.backend.synchronize(stream)?;
        if self.live.as_ref().is_some_and(|l| l.bytes() < span_end) {
            self.live = None; // too short for the span now: the next copy switch makes one
        }
        Ok(snapshot)
    }

    /// Wakes the region straight onto `snapshot` (a published weight set): ONE mapping of
    /// memory that exists already, no allocation and no copy; the host copy (if any) is dropped.
    /// All or nothing: on an error the region stays asleep with its host copy.
    pub fn wake_onto(&mut self, fixed: &Fixed<B>, snapshot: &Arc<WeightSet<B>>) -> Result<()> {
        if self.sleeping.is_none() {
            return Err(Error::Region(RegionError::SnapshotMismatch {
                tag: fixed.tag.clone(),
                reason: "the region is awake: bind the weight set instead".into(),
            }));
        }
        self.require_bindable(fixed, snapshot)?;
        let bytes = snapshot.bytes();
        let physical = snapshot.memory.clone();
        // Nothing is mapped under the span while asleep, so nothing can be using it.
        let mapping = fixed.backend.map(&fixed.reservation, 0, &physical, bytes)?;
        self.log_map(fixed, 0, bytes, true);
        self.span = Some(SpanBinding {
            snapshot: snapshot.clone(),
            mapping,
        });
        self.book.set_consolidated(bytes);
        self.unbound = false;
        self.sleeping = None; // the host copy goes back to its arena
        Ok(())
    }

    /// `Err(SnapshotMismatch)` unless `snapshot` was taken from this region and covers its span.
    fn require_bindable(&self, fixed: &Fixed<B>, snapshot: &Arc<WeightSet<B>>) -> Result<()> {
        let mismatch = |reason: &str| {
            Error::Region(RegionError::SnapshotMismatch {
                tag: fixed.tag.clone(),
                reason: reason.into(),
            })
        };
        if snapshot.region_id != fixed.id {
            return Err(mismatch("the snapshot was taken from another region"));
        }
        if !self.pieces.is_empty() || snapshot.bytes() < self.book.span_end() {
            return Err(mismatch(
                "the region has allocations past the snapshot's span (take a new snapshot)",
            ));
        }
        Ok(())
    }

    /// FNV-1a over every live allocation's offset and asked size: two regions with equal
    /// fingerprints lay their allocations out alike.
    pub fn layout_fingerprint(&self) -> u64 {
        self.book.fingerprint()
    }

    pub fn bound(&self) -> Option<Arc<WeightSet<B>>> {
        self.span.as_ref().map(|s| s.snapshot.clone())
    }

    pub fn bind(&mut self, fixed: &Fixed<B>, snapshot: &Arc<WeightSet<B>>) -> Result<()> {
        let mismatch = |reason: &str| {
            Error::Region(RegionError::SnapshotMismatch {
                tag: fixed.tag.clone(),
                reason: reason.into(),
            })
        };
        if snapshot.region_id != fixed.id {
            return Err(mismatch("the snapshot was taken from another region"));
        }
        if self.sleeping.is_some() {
            return Err(Error::Region(RegionError::RegionAsleep {
                tag: fixed.tag.clone(),
            }));
        }
        if self
            .span
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(&s.snapshot, snapshot))
        {
            return Ok(());
        }
        if !self.pieces.is_empty() || snapshot.bytes() < self.book.span_end() {
            return Err(mismatch(
                "the region has allocations past the snapshot's span (take a new snapshot)",
            ));
        }
        self.fence.wait()?;
        let old = self.span.take();
        let old_bytes = old.as_ref().map(|s| s.mapping.bytes());
        let keep = old.as_ref().map(|s| s.snapshot.clone());
        drop(old); // unmaps, after the fence
        let bytes = snapshot.bytes();
        let physical = snapshot.memory.clone();
        match fixed.backend.map(&fixed.reservation, 0, &physical, bytes) {
            Ok(mapping) => {
                if let Some(old_bytes) = old_bytes {
                    self.log_map(fixed, 0, old_bytes, false);
                }
                self.log_map(fixed, 0, bytes, true);
                self.span = Some(SpanBinding {
                    snapshot: snapshot.clone(),
                    mapping,
                });
                self.book.set_consolidated(bytes);
                self.unbound = false;
                Ok(())
            }
            Err(error) => {
                if let Err(restore) = self.map_back(fixed, keep, Vec::new()) {
                    tracing::error!(%restore, region = %fixed.tag, "could not map the old snapshot back");
                    self.unbound = true;
                }
                Err(error)
            }
        }
    }

    /// Copies `snapshot`'s bytes over the weight set bound now, on `stream`. All checks come
    /// before the copy; loading the bound set is a no-op.
    pub fn load(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        stream: &B::Stream,
    ) -> Result<()> {
        if snapshot.region_id != fixed.id {
            return Err(Error::Region(RegionError::SnapshotMismatch {
                tag: fixed.tag.clone(),
                reason: "the snapshot was taken from another region".into(),
            }));
        }
        self.check_replayable(fixed)?;
        self.require_bindable(fixed, snapshot)?;
        if self.is_bound(snapshot) {
            return Ok(());
        }
        check_not_capturing(&fixed.backend, &self.fence, stream)?;
        self.copy_from(fixed, snapshot, stream)
    }

    /// `Err(BindDuringCapture)` while a capture is under way on this thread, on an attached
    /// stream or on `stream`.
    pub fn check_not_capturing(&self, fixed: &Fixed<B>, stream: &B::Stream) -> Result<()> {
        check_not_capturing(&fixed.backend, &self.fence, stream)
    }

    /// Makes the region read `snapshot`'s contents, by remap or by copy into the live set
    /// (see [`Region::switch_to`](super::Region::switch_to)). The caller checked that no
    /// capture is under way.
    pub fn switch_to(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        strategy: SwitchStrategy,
        model: Option<&CostModel>,
        stream: &B::Stream,
    ) -> Result<Switched> {
        if snapshot.region_id != fixed.id {
            return Err(Error::Region(RegionError::SnapshotMismatch {
                tag: fixed.tag.clone(),
                reason: "the snapshot was taken from another region".into(),
            }));
        }
        if self.sleeping.is_some() {
            return Err(Error::Region(RegionError::RegionAsleep {
                tag: fixed.tag.clone(),
            }));
        }
        if self.is_bound(snapshot) {
            return Ok(Switched::Remapped);
        }
        self.require_bindable(fixed, snapshot)?;
        let way = strategy.resolve(self.book.span_end(), model);
        match way {
            Switched::Remapped => self.bind(fixed, snapshot)?,
            Switched::Copied => self.copy_switch(fixed, snapshot, stream)?,
        }
        tracing::debug!(region = %fixed.tag, snapshot = snapshot.id, ?strategy, ?way, "switched");
        Ok(way)
    }

    /// Binds the live set (making it first if there is none that covers the span), then copies
    /// `snapshot` into it. All or nothing: if the copy cannot be enqueued, what was bound
    /// before is bound again.
    fn copy_switch(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        stream: &B::Stream,
    ) -> Result<()> {
        if self.live.as_ref().is_some_and(|live| self.is_bound(live)) {
            return self.copy_from(fixed, snapshot, stream);
        }
        let span_end = self.book.span_end();
        let live = match &self.live {
            Some(live) if live.bytes() >= span_end => live.clone(),
            _ => {
                let physical = Arc::new(fixed.backend.create_memory(span_end, false)?);
                WeightSet::new(next_id(), fixed.id, &fixed.backend, physical)
            }
        };
        let copy_needed = !Arc::ptr_eq(snapshot, &live);
        if copy_needed {
            // Map the source before anything changes: the region stays as it is if that fails.
            snapshot.home_ptr()?;
        }
        let previous = self.bound();
        self.bind(fixed, &live)?;
        if copy_needed {
            if let Err(error) = self.copy_from(fixed, snapshot, stream) {
                let undo = match &previous {
                    Some(previous) => self.bind(fixed, previous),
                    None => self.unbind(fixed),
                };
                if let Err(undo) = undo {
                    tracing::error!(%undo, region = %fixed.tag, "could not bind the previous weight set back");
                }
                return Err(error);
            }
        }
        self.live = Some(live);
        Ok(())
    }

    /// Enqueues the copy of `snapshot`'s first span bytes over the region's addresses and
    /// notes it as a use of the region (a later unmap waits for it). The span is one mapping:
    /// the caller checked that nothing lies past the bound set.
    fn copy_from(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        stream: &B::Stream,
    ) -> Result<()> {
        let bytes = self.book.span_end();
        if bytes == 0 {
            return Ok(());
        }
        let source = snapshot.home_ptr()?;
        fixed
            .backend
            .copy_device(stream, source, fixed.reservation.base(), bytes)?;
        if let Err(error) = self.fence.note_use(fixed.backend.stream_key(stream)) {
            // The fence cannot cover the copy: wait for it here, so no unmap runs under it.
            if let Err(wait) = fixed.backend.synchronize(stream) {
                tracing::error!(%wait, region = %fixed.tag, "waiting for a weight-set copy failed");
            }
            return Err(error);
        }
        Ok(())
    }

    fn is_bound(&self, snapshot: &Arc<WeightSet<B>>) -> bool {
        self.span
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(&s.snapshot, snapshot))
    }

    pub fn unbind(&mut self, fixed: &Fixed<B>) -> Result<()> {
        if self.sleeping.is_some() {
            return Err(Error::Region(RegionError::RegionAsleep {
                tag: fixed.tag.clone(),
            }));
        }
        if !self.pieces.is_empty() {
            return Err(Error::Region(RegionError::SnapshotMismatch {
                tag: fixed.tag.clone(),
                reason: "allocations past the span have no snapshot to bind back: take one first"
                    .into(),
            }));
        }
        if self.unbound {
            return Ok(());
        }
        self.fence.wait()?;
        if let Some(span) = self.span.take() {
            let bytes = span.mapping.bytes();
            drop(span);
            self.log_map(fixed, 0, bytes, false);
        }
        self.unbound = true;
        self.live = None; // a handle kept with `bound` keeps its memory, as a caller's set
        Ok(())
    }

    pub fn stats(&self, fixed: &Fixed<B>) -> RegionStats {
        let (allocations, allocated) = self.book.allocated();
        let span_mapped = self.span.as_ref().map_or(0, |s| s.mapping.bytes());
        let pieces_mapped: usize = self.pieces.values().map(|c| c.mapping.bytes()).sum();
        RegionStats {
            tag: fixed.tag.clone(),
            reserved: fixed.reservation.bytes(),
            allocated,
            allocations,
            span: self.book.span_end(),
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

/// `Err(BindDuringCapture)` if a capture is under way on this thread, on an attached stream or
/// on `stream`: a copy enqueued now would be recorded into the graph being captured.
fn check_not_capturing<B: Backend>(
    backend: &B,
    fence: &B::Fence,
    stream: &B::Stream,
) -> Result<()> {
    fence.check_not_capturing()?;
    if backend.is_capturing(stream)? {
        return Err(Error::Graph(GraphError::BindDuringCapture));
    }
    Ok(())
}

/// `span_end` rounded up to the granularity of exportable memory, which must be a multiple of
/// the region's own (it is: both are 2 MiB on current GPUs) so the region can bind it.
fn shareable_size<B: Backend>(fixed: &Fixed<B>, span_end: usize) -> Result<usize> {
    let shareable = fixed.backend.granularity(true)?;
    if shareable == 0 || !shareable.is_multiple_of(fixed.granularity) {
        return Err(Error::Layout(LayoutError::InvalidShape(format!(
            "region `{}`: exportable memory comes in {shareable} byte granules, not a multiple \
             of the region's {}",
            fixed.tag, fixed.granularity
        ))));
    }
    Ok(span_end.div_ceil(shareable) * shareable)
}

/// One new allocation of `bytes`, mapped at the region's base.
fn new_span_binding<B: Backend>(fixed: &Fixed<B>, bytes: usize) -> Result<SpanBinding<B>> {
    let physical = Arc::new(fixed.backend.create_memory(bytes, false)?);
    let mapping = fixed.backend.map(&fixed.reservation, 0, &physical, bytes)?;
    let snapshot = WeightSet::new(next_id(), fixed.id, &fixed.backend, physical);
    Ok(SpanBinding { snapshot, mapping })
}

fn offset_of<B: Backend>(fixed: &Fixed<B>, address: u64) -> Option<usize> {
    let base = fixed.reservation.base();
    (address >= base && address < base + fixed.reservation.bytes() as u64)
        .then(|| (address - base) as usize)
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
