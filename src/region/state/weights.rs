//! Weight sets: a snapshot of the span, binding one under the region's addresses (and
//! unbinding), loading one by copy over the bound set, and switching to one by remap or copy.
//!
//! Every operation that puts a weight set under the region checks it with
//! [`RegionState::require_bindable`] (waking onto one too).

use std::sync::Arc;

use super::{mismatch, Fixed, RegionState, SpanBinding};
use crate::error::{Error, GraphError, LayoutError, Result};
use crate::ids::next_id;
use crate::region::snapshot::WeightSet;
use crate::region::switch::{SwitchStrategy, Switched};
use crate::strategy::CostModel;
use crate::vmm_core::{Backend, MappedRange, ReservedRange, Waiter};

impl<B: Backend> RegionState<B> {
    /// A second backing of the span with its contents; `shareable` makes it exportable as a
    /// POSIX file descriptor (its size then rounded up to the shareable granularity).
    pub fn snapshot(
        &mut self,
        fixed: &Fixed<B>,
        stream: &B::Stream,
        shareable: bool,
    ) -> Result<Arc<WeightSet<B>>> {
        self.check_replayable(fixed)?;
        let span_end = self.allocations.span_end();
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

    /// `Err(SnapshotMismatch)` unless `snapshot` was taken from this region and covers its
    /// span: the one check before a weight set goes under the region's addresses (bind, load,
    /// switch, and waking onto it).
    pub(super) fn require_bindable(
        &self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
    ) -> Result<()> {
        require_own(fixed, snapshot)?;
        if !self.pieces.is_empty() || snapshot.bytes() < self.allocations.span_end() {
            return Err(mismatch(
                fixed,
                "the region has allocations past the snapshot's span (take a new snapshot)",
            ));
        }
        Ok(())
    }

    /// FNV-1a over every live allocation's offset and asked size: two regions with equal
    /// fingerprints lay their allocations out alike.
    pub fn layout_fingerprint(&self) -> u64 {
        self.allocations.fingerprint()
    }

    pub fn bound(&self) -> Option<Arc<WeightSet<B>>> {
        self.span.as_ref().map(|s| s.snapshot.clone())
    }

    /// Puts `snapshot` under the region's addresses: fence, one unmap, one map, one set-access.
    /// All or nothing; binding the bound set is a no-op.
    pub fn bind(&mut self, fixed: &Fixed<B>, snapshot: &Arc<WeightSet<B>>) -> Result<()> {
        require_own(fixed, snapshot)?;
        self.require_awake(fixed)?;
        if self.is_bound(snapshot) {
            return Ok(());
        }
        self.require_bindable(fixed, snapshot)?;
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
                self.commit_span(fixed, snapshot, mapping);
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

    /// Notes `mapping` (all of `snapshot`, at the region's base, made just now) as the span's
    /// backing: the region reads the set from here on (a bind, or a wake onto it).
    pub(super) fn commit_span(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        mapping: B::Mapping,
    ) {
        let bytes = snapshot.bytes();
        self.log_map(fixed, 0, bytes, true);
        self.span = Some(SpanBinding {
            snapshot: snapshot.clone(),
            mapping,
        });
        self.allocations.set_consolidated(bytes);
        self.unbound = false;
    }

    /// Unmaps the span (after the fence) and lets go of its weight set; replays are refused
    /// until the next bind.
    pub fn unbind(&mut self, fixed: &Fixed<B>) -> Result<()> {
        self.require_awake(fixed)?;
        if !self.pieces.is_empty() {
            return Err(mismatch(
                fixed,
                "allocations past the span have no snapshot to bind back: take one first",
            ));
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

    fn is_bound(&self, snapshot: &Arc<WeightSet<B>>) -> bool {
        self.span
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(&s.snapshot, snapshot))
    }

    /// Copies `snapshot`'s bytes over the weight set bound now, on `stream`. All checks come
    /// before the copy; loading the bound set is a no-op.
    pub fn load(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        stream: &B::Stream,
    ) -> Result<()> {
        require_own(fixed, snapshot)?;
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
    /// (see [`Region::switch_to`](crate::region::Region::switch_to)). The caller checked that no
    /// capture is under way.
    pub fn switch_to(
        &mut self,
        fixed: &Fixed<B>,
        snapshot: &Arc<WeightSet<B>>,
        strategy: SwitchStrategy,
        model: Option<&CostModel>,
        stream: &B::Stream,
    ) -> Result<Switched> {
        require_own(fixed, snapshot)?;
        self.require_awake(fixed)?;
        if self.is_bound(snapshot) {
            return Ok(Switched::Remapped);
        }
        self.require_bindable(fixed, snapshot)?;
        let way = strategy.resolve(self.allocations.span_end(), model);
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
        let span_end = self.allocations.span_end();
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
        let bytes = self.allocations.span_end();
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
}

/// `Err(SnapshotMismatch)` unless `snapshot` was taken from this region.
fn require_own<B: Backend>(fixed: &Fixed<B>, snapshot: &WeightSet<B>) -> Result<()> {
    if snapshot.region_id != fixed.id {
        return Err(mismatch(
            fixed,
            "the snapshot was taken from another region",
        ));
    }
    Ok(())
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
