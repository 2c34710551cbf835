//! The cache's state machine on [`Backend`]: every slot always mapped (the zero granule
//! read-only, or a data granule read-write), sequences grown granule by granule ahead of their
//! length, released back to a free list, and every change all or nothing: a change is a list of
//! slot assignments applied in order and undone in reverse on the first error.

use std::sync::Arc;
use std::time::Instant;

use super::free::FreeGranules;
use super::layout::{Geometry, KvLayout};
use super::table::{Granule, GranuleTable, Slot};
use super::times::ChangeTimes;
use crate::error::{KvError, Result};
use crate::host::Piece;
use crate::vmm_core::{Backend, MappedRange, ReservedRange, Waiter};

/// The bytes of a sleeping cache: its distinct granules saved back to back, and the slots each
/// one is mapped at again on wake.
#[derive(Debug)]
pub(crate) struct Sleeping<B: Backend> {
    pub copy: B::HostCopy,
    pub groups: Vec<Vec<usize>>,
}

/// One slot assignment: slot index, what it maps afterwards.
pub(crate) type Change<B> = (usize, Option<Arc<Granule<B>>>);

/// One layer's changes behind a step, and the slots among them that map fresh granules.
type LayerChanges<B> = (Vec<Change<B>>, Vec<usize>);

#[derive(Debug)]
pub(crate) struct KvState<B: Backend> {
    pub backend: B,
    pub geometry: Geometry,
    pub table: GranuleTable<B>,
    /// Valid tokens per sequence (what kernels read through [`KvState::lengths_ptr`] once
    /// published).
    pub lengths: Vec<usize>,
    /// Granules mapped per sequence row (the same in every buffer).
    pub backed: Vec<usize>,
    /// Physical granules kept for reuse after a release.
    pub free: FreeGranules<B>,
    pub fence: B::Fence,
    pub lane: B::Stream,
    /// Tokens [`KvState::grow`] maps past the length asked for.
    pub ahead: usize,
    pub sleeping: Option<Sleeping<B>>,
    /// The parts of the last [`KvState::change_behind`] that changed a mapping.
    pub times: ChangeTimes,
    zero: Arc<B::Memory>,
    lengths_mapping: Option<B::Mapping>,
    // Last: the mappings above go first (the fake's ranges are plain numbers; the real
    // `Mapping`s hold their reservation by `Arc`).
    reservation: B::Reservation,
    _lengths_reservation: B::Reservation,
}

impl<B: Backend> KvState<B> {
    /// Reserves the whole cache, maps the zero granule (zeroed first) read-only over all of it,
    /// and a zeroed lengths array.
    pub fn new(
        backend: B,
        layout: KvLayout,
        lane: B::Stream,
        fence: B::Fence,
        ahead: usize,
    ) -> Result<Self> {
        let granule = backend.granularity(false)?;
        let geometry = Geometry::new(layout, granule)?;
        let reservation = backend.reserve(geometry.total_bytes, granule)?;
        let zero = Arc::new(backend.create(granule)?);
        {
            let (_range, scratch) = backend.map_alone(&zero)?;
            backend.fill_zero(&lane, scratch.ptr(), granule)?;
            backend.synchronize(&lane)?;
        }
        let mappings = backend.map_read_only(&reservation, 0, &zero, geometry.slots())?;
        let slots = mappings
            .into_iter()
            .map(|mapping| Slot {
                data: None,
                mapping: Some(mapping),
                retiring: false,
            })
            .collect();
        let lengths_bytes = (layout.max_batch * 4).div_ceil(granule) * granule;
        let lengths_reservation = backend.reserve(lengths_bytes, granule)?;
        let lengths_memory = Arc::new(backend.create(lengths_bytes)?);
        let lengths_mapping =
            backend.map(&lengths_reservation, 0, &lengths_memory, lengths_bytes)?;
        backend.write_host(&lane, lengths_mapping.ptr(), &vec![0; lengths_bytes])?;
        Ok(Self {
            backend,
            geometry,
            table: GranuleTable { slots },
            lengths: vec![0; layout.max_batch],
            backed: vec![0; layout.max_batch],
            free: FreeGranules::default(),
            fence,
            lane,
            ahead,
            sleeping: None,
            times: ChangeTimes::default(),
            zero,
            lengths_mapping: Some(lengths_mapping),
            reservation,
            _lengths_reservation: lengths_reservation,
        })
    }

    pub fn base(&self) -> u64 {
        self.reservation.base()
    }

    pub fn slot_address(&self, slot: usize) -> u64 {
        self.base() + (slot * self.geometry.granule) as u64
    }

    /// The device array of `max_batch` `u32` lengths the kernels read.
    pub fn lengths_ptr(&self) -> u64 {
        self.lengths_mapping.as_ref().map_or(0, |m| m.ptr())
    }

    pub fn check_seq(&self, seq: usize) -> Result<()> {
        let max_batch = self.geometry.layout.max_batch;
        if seq >= max_batch {
            return Err(KvError::NoSuchSequence { seq, max_batch }.into());
        }
        Ok(())
    }

    pub fn check_awake(&self) -> Result<()> {
        if self.sleeping.is_some() {
            return Err(KvError::Asleep.into());
        }
        Ok(())
    }

    /// Maps the zero granule again wherever restoring a mapping failed before.
    pub fn repair(&mut self) -> Result<()> {
        for slot in 0..self.table.slots.len() {
            if self.table.slots[slot].mapping.is_none() {
                let data = self.table.slots[slot].data.clone();
                let mapping = self.map_slot(slot, data.as_ref())?;
                self.table.slots[slot].mapping = Some(mapping);
            }
        }
        Ok(())
    }

    fn map_slot(&self, slot: usize, data: Option<&Arc<Granule<B>>>) -> Result<B::Mapping> {
        map_granule(
            &self.backend,
            &self.reservation,
            slot * self.geometry.granule,
            self.geometry.granule,
            data.map(|d| &d.memory),
            &self.zero,
        )
    }

    /// Unmaps `slot` and maps `data` there; returns what it mapped before. On error the slot
    /// maps what it did before (or, if that fails too, nothing until [`KvState::repair`]).
    /// The caller has waited on the fence.
    fn set_slot(
        &mut self,
        slot: usize,
        data: Option<Arc<Granule<B>>>,
    ) -> Result<Option<Arc<Granule<B>>>> {
        drop(self.table.slots[slot].mapping.take());
        match self.map_slot(slot, data.as_ref()) {
            Ok(mapping) => {
                self.table.slots[slot].mapping = Some(mapping);
                self.table.slots[slot].retiring = false;
                Ok(std::mem::replace(&mut self.table.slots[slot].data, data))
            }
            Err(error) => {
                let old = self.table.slots[slot].data.clone();
                self.table.slots[slot].mapping = self.map_slot(slot, old.as_ref()).ok();
                Err(error)
            }
        }
    }

    /// Applies `changes` in order; on an error undoes the applied ones in reverse. Returns
    /// what each slot mapped before, in order.
    pub fn apply(&mut self, changes: Vec<Change<B>>) -> Result<Vec<Change<B>>> {
        let mut undo: Vec<Change<B>> = Vec::with_capacity(changes.len());
        for (slot, data) in changes {
            match self.set_slot(slot, data) {
                Ok(old) => undo.push((slot, old)),
                Err(error) => {
                    self.revert(undo);
                    return Err(error);
                }
            }
        }
        Ok(undo)
    }

    /// Undoes what [`KvState::apply`] returned (best effort: a slot whose old mapping cannot
    /// be restored is repaired by the next operation). Data granules no row maps any more go
    /// back to the free list.
    pub fn revert(&mut self, undo: Vec<Change<B>>) {
        for (slot, data) in undo.into_iter().rev() {
            let zero = data.is_none();
            match self.set_slot(slot, data) {
                Ok(Some(dropped)) => self.recycle(dropped),
                Ok(None) => {}
                // Mapping the zero granule failed and the slot still maps a granule no row owns:
                // it retires (zeroed here, best effort), so it reads zeros and the next fenced
                // operation maps the zero granule there.
                Err(_) if zero && self.table.slots[slot].data.is_some() => {
                    self.table.slots[slot].retiring = true;
                    let address = self.slot_address(slot);
                    let _ = self
                        .backend
                        .fill_zero(&self.lane, address, self.geometry.granule)
                        .and_then(|()| self.backend.synchronize(&self.lane));
                }
                Err(_) => {}
            }
        }
    }

    /// Keeps the physical memory of a granule no row maps any more.
    pub fn recycle(&mut self, granule: Arc<Granule<B>>) {
        self.keep(granule, false);
    }

    /// [`KvState::recycle`], knowing whether the granule holds zeros.
    fn keep(&mut self, granule: Arc<Granule<B>>, zeroed: bool) {
        if let Ok(granule) = Arc::try_unwrap(granule) {
            self.free.push(granule.memory, zeroed);
        }
    }

    /// Maps the zero granule again over the retiring slots `slots` and keeps their granules
    /// for reuse (as zeroed ones). The caller has made sure the GPU is done with them (the
    /// fence, or the mark of their layer). All or nothing: on error they are all still
    /// retiring.
    pub fn settle_retiring(&mut self, slots: &[usize]) -> Result<()> {
        self.settle_retiring_as(slots, false)
    }

    /// [`KvState::settle_retiring`]; with `dirty` (their zeroing failed) the granules are
    /// kept as ones of unknown contents.
    fn settle_retiring_as(&mut self, slots: &[usize], dirty: bool) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        match self.apply(slots.iter().map(|&slot| (slot, None)).collect()) {
            Ok(undo) => {
                for (_, old) in undo {
                    if let Some(old) = old {
                        // Retiring means zeroed (see `Slot::retiring`), and unmapped now.
                        self.keep(old, !dirty);
                    }
                }
                Ok(())
            }
            Err(error) => {
                self.mark_retiring(slots);
                Err(error)
            }
        }
    }

    /// Flags `slots` retiring again where they still map data (after an undo).
    fn mark_retiring(&mut self, slots: &[usize]) {
        for &slot in slots {
            if self.table.slots[slot].data.is_some() {
                self.table.slots[slot].retiring = true;
            }
        }
    }

    /// Makes `count` free granules hold zeros (at least; see [`super::KvCache::zero_ahead`]),
    /// zeroing at most `at_most` now: dirty free granules first, new ones from the driver for
    /// the rest, each mapped alone, zeroed on the lane and unmapped once the lane is done.
    /// Returns how many free granules hold zeros now. On an error none of them counts as
    /// zeroed: they stay free as dirty ones (where the lane may still write, mapped for good).
    pub fn zero_ahead(&mut self, count: usize, at_most: usize) -> Result<usize> {
        self.check_awake()?;
        let missing = count.saturating_sub(self.free.zeroed_len()).min(at_most);
        if missing == 0 {
            return Ok(self.free.zeroed_len());
        }
        let mut taking: Vec<Arc<B::Memory>> = std::iter::from_fn(|| self.free.pop_dirty())
            .take(missing)
            .collect();
        let mut staged: Vec<(B::Mapping, B::Reservation)> = Vec::with_capacity(missing);
        let zeroing = (|| -> Result<()> {
            while taking.len() < missing {
                taking.push(Arc::new(self.backend.create(self.geometry.granule)?));
            }
            for memory in &taking {
                let (range, mapping) = self.backend.map_alone(memory)?;
                staged.push((mapping, range));
                let ptr = staged.last().expect("pushed").0.ptr();
                self.backend
                    .fill_zero(&self.lane, ptr, self.geometry.granule)?;
            }
            self.backend.synchronize(&self.lane)
        })();
        if let Err(error) = zeroing {
            if self.backend.synchronize(&self.lane).is_err() {
                // The lane may still write there: keep the mappings (and the memory) forever.
                for (mapping, _) in &mut staged {
                    mapping.leak_on_drop();
                }
            }
            drop(staged);
            for memory in taking {
                self.free.push(memory, false);
            }
            return Err(error);
        }
        // The lane is done with them: unmapping is safe.
        drop(staged);
        for memory in taking {
            self.free.push(memory, true);
        }
        Ok(self.free.zeroed_len())
    }

    /// `count` granules, from the free list first. All or nothing.
    pub fn take_granules(&mut self, count: usize) -> Result<Vec<Arc<Granule<B>>>> {
        let mut taken = Vec::with_capacity(count);
        while taken.len() < count {
            let memory = match self.free.pop() {
                Some(memory) => memory,
                None => match self.backend.create(self.geometry.granule) {
                    Ok(memory) => Arc::new(memory),
                    Err(error) => {
                        for granule in taken {
                            let granule: Granule<B> = granule;
                            self.free.push(granule.memory, false);
                        }
                        return Err(error);
                    }
                },
            };
            taken.push(Granule { memory });
        }
        Ok(taken.into_iter().map(Arc::new).collect())
    }

    /// Sets `seq`'s length to `len` (never shrinks it) and backs its rows up to `len` plus the
    /// look-ahead, with fresh zeroed granules.
    pub fn grow(&mut self, seq: usize, len: usize) -> Result<()> {
        self.check_seq(seq)?;
        self.check_awake()?;
        let max_len = self.geometry.layout.max_len;
        if len > max_len {
            return Err(KvError::BeyondMaxLen {
                seq,
                asked: len,
                max_len,
            }
            .into());
        }
        self.repair()?;
        let len = len.max(self.lengths[seq]);
        let target = self
            .geometry
            .granules_for(len.saturating_add(self.ahead).min(max_len));
        let from = self.backed[seq];
        if target <= from {
            self.lengths[seq] = len;
            return Ok(());
        }
        let per_row = target - from;
        // Retiring granules first back to the free list, so this growth reuses them.
        let retiring = self.table.retiring();
        if !retiring.is_empty() {
            self.fence.wait()?;
            self.settle_retiring(&retiring)?;
        }
        let mut granules = self.take_granules(per_row * self.geometry.buffers)?;
        if let Err(error) = self.fence.wait() {
            for granule in granules {
                self.recycle(granule);
            }
            return Err(error);
        }
        let mut changes = Vec::with_capacity(granules.len());
        for buffer in 0..self.geometry.buffers {
            for g in from..target {
                let slot = self.geometry.slot(buffer, seq, g);
                changes.push((slot, Some(granules.pop().expect("counted above"))));
            }
        }
        let slots: Vec<usize> = changes.iter().map(|&(slot, _)| slot).collect();
        let undo = self.apply(changes)?;
        let filled = slots.iter().try_for_each(|&slot| {
            let address = self.slot_address(slot);
            self.backend
                .fill_zero(&self.lane, address, self.geometry.granule)
        });
        if let Err(error) = filled.and_then(|()| self.backend.synchronize(&self.lane)) {
            self.undo_fresh(undo);
            return Err(error);
        }
        self.backed[seq] = target;
        self.lengths[seq] = len;
        Ok(())
    }

    /// Grows `grow`'s sequences (as [`KvState::grow`]) and releases `release`'s (as
    /// [`KvState::release`]) layer by layer, behind a step still in flight: before touching a
    /// layer's K and V it calls `wait_layer(layer)`, which returns once no work reads them any
    /// more (the step's mark after that layer's attention). The fence is not waited for: the
    /// marks are the fence. All or nothing. Returns whether any mapping changed.
    ///
    /// Remaps while kernels run cost several times their idle cost, and the last marks leave
    /// little of the step to hide them behind, so a release remaps nothing here: the released
    /// rows' unshared granules are zeroed on the lane once every mark passed and stay mapped,
    /// retiring (free, reading zeros), until the next fenced operation (a grow, release, share
    /// or sleep: an admission) maps the zero granule over them, or a sequence growing over one
    /// adopts it as it is. Shared granules are unmapped layer by layer.
    ///
    /// Layers flagged in `later` (gated by the step: it waits before them until their remap is
    /// done) are not waited for nor remapped here: their table entries change now, their fresh
    /// granules are zeroed now through a mapping of their own, and the returned [`Remap`]
    /// unmaps and maps their slots once their marks passed ([`Remap::run`]), after which
    /// [`KvState::install`] takes its mappings back. Their released slots map the zero
    /// granule again there (no zeroing behind a gate: GPU work on a stream may queue behind
    /// the gated step).
    pub fn change_behind(
        &mut self,
        grow: &[(usize, usize)],
        release: &[usize],
        mut wait_layer: impl FnMut(usize) -> Result<()>,
        later: &[bool],
    ) -> Result<(bool, Option<Remap<B>>)> {
        self.check_awake()?;
        let max_len = self.geometry.layout.max_len;
        let mut named = vec![false; self.geometry.layout.max_batch];
        for seq in grow
            .iter()
            .map(|&(seq, _)| seq)
            .chain(release.iter().copied())
        {
            self.check_seq(seq)?;
            if std::mem::replace(&mut named[seq], true) {
                return Err(KvError::NamedTwice { seq }.into());
            }
        }
        if let Some(&(seq, asked)) = grow.iter().find(|&&(_, len)| len > max_len) {
            return Err(KvError::BeyondMaxLen {
                seq,
                asked,
                max_len,
            }
            .into());
        }
        self.repair()?;
        let layers = self.geometry.layout.layers;
        // (seq, new length, granules backed now, granules wanted) of every row that grows.
        let growing: Vec<(usize, usize, usize, usize)> = grow
            .iter()
            .map(|&(seq, len)| {
                let len = len.max(self.lengths[seq]);
                let target = self
                    .geometry
                    .granules_for(len.saturating_add(self.ahead).min(max_len));
                (seq, len, self.backed[seq], target.max(self.backed[seq]))
            })
            .collect();
        let releasing: Vec<usize> = release
            .iter()
            .copied()
            .filter(|&seq| self.backed[seq] > 0)
            .collect();
        // Slots the growing rows gain: a retiring one is adopted as it is (zeroed, mapped).
        let mut gained: Vec<usize> = Vec::new();
        for buffer in 0..self.geometry.buffers {
            for &(seq, _, from, to) in &growing {
                gained.extend((from..to).map(|g| self.geometry.slot(buffer, seq, g)));
            }
        }
        let adopted: Vec<usize> = gained
            .iter()
            .copied()
            .filter(|&slot| self.table.slots[slot].retiring)
            .collect();
        let deferred = |buffer: usize| later.get(buffer / 2).copied().unwrap_or(false);
        // The layers left for later take zeroed granules where there are some: no staging
        // mapping to zero them through (host work before the step's marks).
        let deferred_fresh = gained
            .iter()
            .filter(|&&slot| !adopted.contains(&slot) && deferred(2 * self.geometry.layer_of(slot)))
            .count();
        let mut zeroed: Vec<Arc<Granule<B>>> = std::iter::from_fn(|| self.free.pop_zeroed())
            .take(deferred_fresh)
            .map(|memory| Arc::new(Granule { memory }))
            .collect();
        let mut granules = match self.take_granules(gained.len() - adopted.len() - zeroed.len()) {
            Ok(granules) => granules,
            Err(error) => {
                for granule in zeroed {
                    self.keep(granule, true);
                }
                return Err(error);
            }
        };
        // The released rows' unshared granules: zeroed once every mark passed, left retiring.
        // In the layers left for later their zeroing is the remap's too (enqueued behind the
        // layer's mark, see [`Remap::zero_retired`]): no map call for a release there.
        let mut retired: Vec<usize> = Vec::new();
        let mut retired_later: Vec<usize> = Vec::new();
        for buffer in 0..self.geometry.buffers {
            for &seq in &releasing {
                for g in 0..self.backed[seq] {
                    let slot = self.geometry.slot(buffer, seq, g);
                    if self.table.owners(slot) == 1 {
                        if deferred(buffer) {
                            retired_later.push(slot);
                        } else {
                            retired.push(slot);
                        }
                    }
                }
            }
        }
        let changed = !gained.is_empty() || !releasing.is_empty();
        let mut undo: Vec<Change<B>> = Vec::new();
        // Per layer: its changes and their fresh slots (decided now; nothing waits yet).
        let mut per_layer: Vec<Option<LayerChanges<B>>> = Vec::with_capacity(layers);
        for layer in 0..layers {
            let mut changes: Vec<Change<B>> = Vec::new();
            let mut fresh = Vec::new();
            for buffer in [2 * layer, 2 * layer + 1] {
                for &(seq, _, from, to) in &growing {
                    for g in from..to {
                        let slot = self.geometry.slot(buffer, seq, g);
                        if adopted.contains(&slot) {
                            continue;
                        }
                        let ready = if deferred(buffer) { zeroed.pop() } else { None };
                        match ready {
                            Some(granule) => changes.push((slot, Some(granule))),
                            None => {
                                changes.push((slot, Some(granules.pop().expect("counted above"))));
                                fresh.push(slot);
                            }
                        }
                    }
                }
                for &seq in &releasing {
                    for g in 0..self.backed[seq] {
                        let slot = self.geometry.slot(buffer, seq, g);
                        if !retired.contains(&slot) && !retired_later.contains(&slot) {
                            changes.push((slot, None));
                        }
                    }
                }
            }
            per_layer.push(Some((changes, fresh)));
        }
        // The changes of the layers remapped later (their fresh granules zeroed below).
        let mut postponed: Vec<Change<B>> = Vec::new();
        let mut postponed_fresh: Vec<usize> = Vec::new();
        for layer in (0..layers).filter(|&l| later.get(l).copied().unwrap_or(false)) {
            let (changes, fresh) = per_layer[layer].take().expect("built above");
            postponed.extend(changes);
            postponed_fresh.extend(fresh);
        }
        // Mappings of their own for those fresh granules while the lane zeroes them; kept
        // until it is done (and then by the remap: unmapping them is host work the worker
        // does off the step's path).
        let mut staged: Vec<(B::Mapping, B::Reservation)> = Vec::new();
        let mut times = ChangeTimes::default();
        let outcome = (|| -> Result<()> {
            if !changed {
                return Ok(());
            }
            let began = Instant::now();
            // First, before any mark: the zeroing overlaps the step's first layers.
            for (_, data) in postponed
                .iter()
                .filter(|(slot, _)| postponed_fresh.contains(slot))
            {
                let Some(data) = data else { continue };
                let (range, mapping) = self.backend.map_alone(&data.memory)?;
                staged.push((mapping, range));
                let ptr = staged.last().expect("pushed").0.ptr();
                self.backend
                    .fill_zero(&self.lane, ptr, self.geometry.granule)?;
            }
            let mut lap = Instant::now();
            times.staging = lap - began;
            for (layer, entry) in per_layer.iter_mut().enumerate() {
                let Some((changes, fresh)) = entry.take() else {
                    continue;
                };
                wait_layer(layer)?;
                times.waits += lap.elapsed();
                lap = Instant::now();
                undo.extend(self.apply(changes)?);
                for slot in fresh {
                    self.backend.fill_zero(
                        &self.lane,
                        self.slot_address(slot),
                        self.geometry.granule,
                    )?;
                }
                times.remaps += lap.elapsed();
                times.inline_layers += 1;
                lap = Instant::now();
            }
            let synced = self.backend.synchronize(&self.lane);
            times.sync = lap.elapsed();
            synced
        })();
        if let Err(error) = outcome {
            for (_, data) in postponed.drain(..).chain(
                per_layer
                    .iter_mut()
                    .filter_map(Option::take)
                    .flat_map(|(c, _)| c),
            ) {
                if let Some(data) = data {
                    self.recycle(data);
                }
            }
            if self.backend.synchronize(&self.lane).is_err() {
                // The lane may still write there: keep the mappings (and the memory) forever.
                for (slot, _) in &undo {
                    if let Some(mapping) = self.table.slots[*slot].mapping.as_mut() {
                        mapping.leak_on_drop();
                    }
                }
                for (mapping, _) in &mut staged {
                    mapping.leak_on_drop();
                }
            }
            drop(staged);
            // Only layers whose mark was waited for were changed: undoing them is safe too.
            self.revert(undo);
            for granule in granules {
                self.recycle(granule);
            }
            return Err(error);
        }
        // Committed from here: once zeroing starts, the released rows' granules cannot be
        // given back. Zeroing failed: the zero granule is mapped there instead (their mark
        // passed); that failing too leaves them retiring with their old bytes, and the error.
        let zeroing = Instant::now();
        let zeroed = retired
            .iter()
            .try_for_each(|&slot| {
                self.backend
                    .fill_zero(&self.lane, self.slot_address(slot), self.geometry.granule)
            })
            .and_then(|()| self.backend.synchronize(&self.lane));
        let mut late = Ok(());
        if let Err(error) = zeroed {
            // Fills that were enqueued may still run: wait for them before unmapping.
            late = self.backend.synchronize(&self.lane).and_then(|()| {
                let settled = self.apply(retired.iter().map(|&slot| (slot, None)).collect())?;
                undo.extend(settled);
                retired.clear();
                Ok(())
            });
            if late.is_err() {
                late = Err(error);
            }
        }
        for (_, old) in undo {
            if let Some(old) = old {
                self.recycle(old);
            }
        }
        for &slot in &adopted {
            self.table.slots[slot].retiring = false;
        }
        for &slot in retired.iter().chain(&retired_later) {
            self.table.slots[slot].retiring = true;
        }
        for (seq, len, _, to) in growing {
            self.backed[seq] = to;
            self.lengths[seq] = len;
        }
        for &seq in release {
            self.backed[seq] = 0;
            self.lengths[seq] = 0;
        }
        times.sync += zeroing.elapsed();
        if changed {
            self.times = times;
        }
        let remap = (!postponed.is_empty() || !retired_later.is_empty())
            .then(|| self.postpone(postponed, later, staged, &retired_later));
        late.map(|()| (changed, remap))
    }

    /// Commits `changes` to the table now and hands their slots' mappings to a [`Remap`]; it
    /// zeroes the `retired` slots (released rows' granules, left mapped).
    fn postpone(
        &mut self,
        changes: Vec<Change<B>>,
        later: &[bool],
        staged: Vec<(B::Mapping, B::Reservation)>,
        retired: &[usize],
    ) -> Remap<B> {
        let mut slots = Vec::with_capacity(changes.len());
        for (slot, data) in changes {
            let entry = &mut self.table.slots[slot];
            let old_mapping = entry.mapping.take();
            entry.retiring = false;
            let memory = data.as_ref().map(|d| d.memory.clone());
            let old = std::mem::replace(&mut entry.data, data);
            if let Some(old) = old {
                self.recycle(old);
            }
            slots.push(RemapSlot {
                slot,
                layer: self.geometry.layer_of(slot),
                old: old_mapping,
                memory,
                new: None,
            });
        }
        let zero_after = retired
            .iter()
            .map(|&slot| (self.geometry.layer_of(slot), self.slot_address(slot)))
            .collect();
        Remap {
            backend: self.backend.clone(),
            reservation: self.reservation.clone(),
            zero: self.zero.clone(),
            granule: self.geometry.granule,
            layers: (0..later.len()).filter(|&l| later[l]).collect(),
            slots,
            staged,
            zero_after,
            retired: retired.to_vec(),
            zeroing_failed: false,
            error: None,
        }
    }

    /// Takes back the mappings a [`Remap`] made. A slot it could not map stays unmapped until
    /// [`KvState::repair`] maps what the table says there (the remap's error is returned).
    ///
    /// Where zeroing the released rows' granules failed ([`Remap::zero_retired_and_wait`],
    /// whose caller installs at once: their layers' marks passed and no step was launched
    /// since), the zero granule is mapped over them instead, as an inline release does, so no
    /// later grow adopts their old bytes.
    pub fn install(&mut self, remap: Remap<B>) -> Result<()> {
        for entry in remap.slots {
            self.table.slots[entry.slot].mapping = entry.new;
        }
        let settled = if remap.zeroing_failed {
            self.settle_retiring_as(&remap.retired, true)
        } else {
            Ok(())
        };
        remap.error.map_or(settled, Err)
    }

    /// Undoes an `apply` that mapped fresh granules over zero slots, after waiting for work
    /// enqueued on them.
    pub fn undo_fresh(&mut self, undo: Vec<Change<B>>) {
        if self.backend.synchronize(&self.lane).is_err() || self.fence.wait().is_err() {
            // The lane may still write there: keep the mappings (and the memory) forever.
            for (slot, _) in &undo {
                if let Some(mapping) = self.table.slots[*slot].mapping.as_mut() {
                    mapping.leak_on_drop();
                }
            }
        }
        self.revert(undo);
    }

    /// Unmaps `seq`'s rows (the zero granule again) and keeps their granules for reuse; its
    /// length is 0 and the slot is free for a new request.
    pub fn release(&mut self, seq: usize) -> Result<()> {
        self.check_seq(seq)?;
        self.check_awake()?;
        self.repair()?;
        if self.backed[seq] == 0 {
            self.lengths[seq] = 0;
            return Ok(());
        }
        self.fence.wait()?;
        self.settle_retiring(&self.table.retiring())?;
        let mut changes = Vec::new();
        for buffer in 0..self.geometry.buffers {
            for g in 0..self.backed[seq] {
                changes.push((self.geometry.slot(buffer, seq, g), None));
            }
        }
        let undo = self.apply(changes)?;
        for (_, old) in undo {
            if let Some(old) = old {
                self.recycle(old);
            }
        }
        self.backed[seq] = 0;
        self.lengths[seq] = 0;
        Ok(())
    }

    /// Copies the host lengths to the device array (`u32` each) and waits for it.
    pub fn publish_lengths(&self) -> Result<()> {
        let bytes: Vec<u8> = self
            .lengths
            .iter()
            .flat_map(|&len| (len as u32).to_le_bytes())
            .collect();
        self.backend
            .write_host(&self.lane, self.lengths_ptr(), &bytes)
    }

    /// Releases the free list's physical memory.
    pub fn trim(&mut self) -> usize {
        let bytes = self.free.len() * self.geometry.granule;
        self.free.clear();
        bytes
    }

    /// Device pieces of each distinct granule, saved back to back.
    pub fn pieces(&self, groups: &[Vec<usize>]) -> Vec<Piece> {
        groups
            .iter()
            .enumerate()
            .map(|(i, slots)| Piece {
                device: self.slot_address(slots[0]),
                host_offset: i * self.geometry.granule,
                bytes: self.geometry.granule,
            })
            .collect()
    }
}

/// Maps `memory` read-write at `offset` of `reservation`, or the zero granule read-only.
fn map_granule<B: Backend>(
    backend: &B,
    reservation: &B::Reservation,
    offset: usize,
    granule: usize,
    memory: Option<&Arc<B::Memory>>,
    zero: &Arc<B::Memory>,
) -> Result<B::Mapping> {
    match memory {
        Some(memory) => backend.map(reservation, offset, memory, granule),
        None => {
            let mut run = backend.map_read_only(reservation, offset, zero, 1)?;
            Ok(run.pop().expect("one mapping asked for"))
        }
    }
}

#[derive(Debug)]
struct RemapSlot<B: Backend> {
    slot: usize,
    layer: usize,
    /// What the slot mapped before (unmapped by [`Remap::run`]).
    old: Option<B::Mapping>,
    /// What it maps afterwards: a data granule (zeroed already) or, `None`, the zero granule.
    memory: Option<Arc<B::Memory>>,
    new: Option<B::Mapping>,
}

/// The remaps of the layers a change behind a step left for later
/// ([`KvState::change_behind`]): the table says what each slot maps already; this holds the
/// slots' mappings until [`Remap::run`] replaces them, on any thread, once the step passed
/// those layers' marks. Host driver calls only: nothing it does waits on a stream.
#[derive(Debug)]
pub(crate) struct Remap<B: Backend> {
    backend: B,
    reservation: B::Reservation,
    zero: Arc<B::Memory>,
    granule: usize,
    /// The layers it remaps.
    pub layers: Vec<usize>,
    slots: Vec<RemapSlot<B>>,
    /// The mappings the fresh granules were zeroed through (the lane is done with them).
    staged: Vec<(B::Mapping, B::Reservation)>,
    /// Retiring granules (released rows, still mapped) to zero once the step is done with
    /// their layers: (layer, address).
    zero_after: Vec<(usize, u64)>,
    /// Their slots.
    retired: Vec<usize>,
    /// Zeroing them failed and the lane is idle: [`KvState::install`] maps the zero granule
    /// over them.
    zeroing_failed: bool,
    error: Option<crate::error::Error>,
}

impl<B: Backend> Remap<B> {
    /// Unmaps each slot and maps what the table says there (one retry on a driver error;
    /// a slot that still fails stays unmapped and the first error is kept for
    /// [`KvState::install`]). The caller has made sure no work uses those layers now.
    pub fn run(&mut self) {
        for layer in self.layers.clone() {
            self.run_layer(layer);
        }
        self.drop_staged();
    }

    /// [`Remap::run`] for the slots of one layer (the step passed that layer's mark).
    pub fn run_layer(&mut self, layer: usize) {
        for entry in self.slots.iter_mut().filter(|entry| entry.layer == layer) {
            drop(entry.old.take());
            let map = || {
                map_granule(
                    &self.backend,
                    &self.reservation,
                    entry.slot * self.granule,
                    self.granule,
                    entry.memory.as_ref(),
                    &self.zero,
                )
            };
            match map().or_else(|_| map()) {
                Ok(mapping) => entry.new = Some(mapping),
                Err(error) => {
                    self.error.get_or_insert(error);
                }
            }
        }
    }

    /// Enqueues on `lane` the zeroing of the released rows' granules of its layers; the
    /// caller has ordered `lane` after those layers' marks (on the GPU or by waiting), and
    /// waits for `lane` before [`KvState::install`]. Stream work, but none of it waits for a
    /// gate: it runs behind the step in flight's mark, whatever waits after it.
    pub fn zero_retired(&self, lane: &B::Stream) -> Result<()> {
        self.layers
            .iter()
            .try_for_each(|&layer| self.zero_retired_layer(lane, layer))
    }

    /// [`Remap::zero_retired`] for one layer (`lane` ordered after that layer's mark).
    pub fn zero_retired_layer(&self, lane: &B::Stream, layer: usize) -> Result<()> {
        self.zero_after
            .iter()
            .filter(|&&(of, _)| of == layer)
            .try_for_each(|&(_, address)| self.backend.fill_zero(lane, address, self.granule))
    }

    /// Unmaps the mappings the fresh granules were zeroed through (host work, off the step's
    /// path: the lane finished with them before the change returned).
    pub fn drop_staged(&mut self) {
        self.staged.clear();
    }

    /// Whether it has slots to remap (else only granules to zero: no gate needs to close).
    pub fn remaps(&self) -> bool {
        !self.slots.is_empty()
    }

    /// Records an error of the remap's surroundings (a failed wait) for [`KvState::install`].
    pub fn fail(&mut self, error: crate::error::Error) {
        self.error.get_or_insert(error);
    }

    /// [`Remap::zero_retired`] on `lane` and waits for it; the caller has waited for the
    /// layers' marks and installs the remap before the next step. Where zeroing fails the
    /// released granules may hold old bytes: once the fills enqueued are done,
    /// [`KvState::install`] maps the zero granule over them. A lane that cannot be waited for
    /// leaves them mapped, retiring, with the error (the context is lost).
    pub fn zero_retired_and_wait(&mut self, lane: &B::Stream) {
        let zeroed = self
            .zero_retired(lane)
            .and_then(|()| self.backend.synchronize(lane));
        if let Err(error) = zeroed {
            // Fills already enqueued may still run: nothing unmaps there before they are done.
            self.zeroing_failed = self.backend.synchronize(lane).is_ok();
            self.fail(error);
        }
    }
}

impl<B: Backend> Drop for KvState<B> {
    fn drop(&mut self) {
        if let Err(error) = self.fence.wait() {
            tracing::error!(%error, "KV cache dropped while the GPU may use it: leaking its mappings");
            for slot in &mut self.table.slots {
                if let Some(mapping) = slot.mapping.as_mut() {
                    mapping.leak_on_drop();
                }
            }
            if let Some(mapping) = self.lengths_mapping.as_mut() {
                mapping.leak_on_drop();
            }
        }
    }
}
