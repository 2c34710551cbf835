//! vmm mode's logic: who owns which pointer, untagged allocations on the pool, tagged ones in
//! regions, copy elision, pause and resume. Generic over [`Device`], so all of it runs on the
//! CPU in the tests below with a fake device.
//!
//! Locking: `state` (ownership table, elision state, tag book) is one mutex. Device work that
//! can take long (allocating, freeing, pausing) runs outside it, except where two allocations
//! must not change under it: a graft and a deferred copy performed at a flush point hold it, so
//! a concurrent free cannot unmap a source being read.

pub mod device;
pub mod elide;
pub mod gpu;
pub mod monitor;
pub mod nccl;
pub mod query;
pub mod stats;
pub mod table;
pub mod tags;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use stablebuf::pool::Event;

use crate::cuda::codes::Fail;
use crate::engine::device::{Device, PoolView, Transfer};
use crate::engine::elide::{Alloc, CopyDecision, CopyRequest, Elider, FreeDecision, PendingCopy};
use crate::engine::query::Allocation;
use crate::engine::stats::Counters;
use crate::engine::table::{Lookup, OwnershipTable};
use crate::engine::tags::TagBook;

/// Who serves an allocation of the layer.
#[derive(Debug)]
enum Owner<B> {
    /// An untagged pool block.
    Pool { device: usize, block: B },
    /// An allocation in a tag's region.
    Tag { device: usize, tag: Arc<str> },
}

struct State<B> {
    table: OwnershipTable<Owner<B>>,
    elider: Elider,
    tags: TagBook,
    /// Pool allocations whose memory is held but not mapped yet (see [`Engine::alloc`]).
    held: BTreeSet<u64>,
}

/// What a free did.
#[derive(Debug, PartialEq, Eq)]
pub enum Freed {
    /// Not the layer's pointer: pass it to CUDA.
    NotOwned,
    /// Freed by the layer.
    Done,
}

/// What a copy needs from the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Copied {
    /// Deferred: return success without calling CUDA.
    Deferred,
    /// Pending copies were performed; now pass this copy to CUDA.
    PassThrough,
}

/// A `cudaMemcpy`/`cudaMemcpyAsync` as the hooks see it.
#[derive(Clone, Copy, Debug)]
pub struct CopyCall {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
    pub device_to_device: bool,
    pub stream: u64,
    pub sync: bool,
}

/// Everything the engine counts that is not a plain counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineView {
    pub live_allocations: usize,
    pub live_bytes: usize,
    pub tags: usize,
    pub tags_paused: usize,
    pub tagged_bytes: usize,
    pub host_bytes: usize,
    pub host_arena_bytes: usize,
    pub pool: PoolView,
    pub pending_copies: usize,
}

type Opener<D> = Box<dyn Fn(usize) -> Result<D, Fail> + Send + Sync>;

pub struct Engine<D: Device> {
    elide: bool,
    open: Opener<D>,
    devices: Mutex<BTreeMap<usize, Arc<D>>>,
    state: Mutex<State<D::Block>>,
    /// Mirror of the elider's pending count, read lock-free at every flush point.
    pending: AtomicUsize,
    /// Mirror of `State::held`'s size, read lock-free at every flush point.
    held: AtomicUsize,
    /// The smallest allocation held unmapped until its first use: the smallest copy elision
    /// defers (a smaller one can never be a deferred copy's destination).
    held_min: usize,
    /// Bumped at every flush point: an allocation is fresh while it has not moved.
    epoch: AtomicU64,
    /// Set once the layer cannot see every call that may touch memory: nothing is deferred
    /// any more (when unsure, copy).
    unsure: AtomicBool,
    counters: Arc<Counters>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change to the state is one step that a panic cannot leave half done.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<D: Device> Engine<D> {
    /// `open(ordinal)` makes a device's pool on first use. `elide_min` is the smallest copy
    /// elision defers; `elide` turns elision on.
    pub fn new(
        open: impl Fn(usize) -> Result<D, Fail> + Send + Sync + 'static,
        elide: bool,
        elide_min: usize,
        counters: Arc<Counters>,
    ) -> Self {
        Self {
            elide,
            open: Box::new(open),
            devices: Mutex::new(BTreeMap::new()),
            state: Mutex::new(State {
                table: OwnershipTable::new(),
                elider: Elider::new(elide_min),
                tags: TagBook::new(),
                held: BTreeSet::new(),
            }),
            pending: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            held_min: elide_min.max(1),
            epoch: AtomicU64::new(0),
            unsure: AtomicBool::new(false),
            counters,
        }
    }

    pub fn eliding(&self) -> bool {
        self.elide
    }

    /// The device's state, opened on first use.
    pub fn device(&self, ordinal: usize) -> Result<Arc<D>, Fail> {
        let mut devices = lock(&self.devices);
        if let Some(device) = devices.get(&ordinal) {
            return Ok(device.clone());
        }
        let device = Arc::new((self.open)(ordinal)?);
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The device if it was opened already (never opens one).
    pub fn opened(&self, ordinal: usize) -> Option<Arc<D>> {
        lock(&self.devices).get(&ordinal).cloned()
    }

    fn opened_devices(&self) -> Vec<(usize, Arc<D>)> {
        lock(&self.devices)
            .iter()
            .map(|(o, d)| (*o, d.clone()))
            .collect()
    }

    fn note_failure(&self, fail: &Fail) {
        if fail.is_out_of_memory() {
            Counters::bump(&self.counters.oom_errors);
        }
    }

    /// Allocates `bytes` on `device`, under `tag` (its region) or untagged (the pool).
    /// `bytes == 0` gives address 0, as `cudaMalloc` does.
    pub fn alloc(&self, device: usize, bytes: usize, tag: Option<Arc<str>>) -> Result<u64, Fail> {
        if bytes == 0 {
            return Ok(0);
        }
        let result = self.alloc_inner(device, bytes, tag);
        if let Err(fail) = &result {
            self.note_failure(fail);
        }
        result
    }

    fn alloc_inner(
        &self,
        ordinal: usize,
        bytes: usize,
        tag: Option<Arc<str>>,
    ) -> Result<u64, Fail> {
        let device = self.device(ordinal)?;
        match tag {
            None => {
                // With copy elision, a large fresh allocation may be a copy's destination whose
                // first bytes a graft replaces: hold its memory (out of memory is reported
                // now) and map it at the first flush point, or map only the rest at the graft.
                let hold = self.would_hold(bytes);
                let (address, block) = if hold {
                    device.alloc_held(bytes)?
                } else {
                    device.alloc(bytes)?
                };
                let mut state = lock(&self.state);
                let owner = Owner::Pool {
                    device: ordinal,
                    block,
                };
                if let Err(owner) = state.table.insert(address, bytes, owner) {
                    drop(state);
                    if let Owner::Pool { block, .. } = owner {
                        let _ = device.free(block);
                    }
                    return Err(Fail::Internal(format!(
                        "the pool returned {address:#x}, which the layer already owns"
                    )));
                }
                let epoch = self.epoch.load(Ordering::SeqCst);
                state.elider.on_alloc(address, epoch);
                if hold {
                    state.held.insert(address);
                    self.held.store(state.held.len(), Ordering::SeqCst);
                    // Elision stopped meanwhile: its flush may have run before this insert,
                    // and from now on calls that touch memory are not all flush points.
                    if self.unsure() {
                        self.map_all_held(&mut state)?;
                    }
                }
                Ok(address)
            }
            Some(tag) => {
                let tag = {
                    let mut state = lock(&self.state);
                    state.tags.check_alloc(&tag)?;
                    state.tags.register(&tag)
                };
                let address = device.tag_alloc(&tag, bytes)?;
                let mut state = lock(&self.state);
                let owner = Owner::Tag {
                    device: ordinal,
                    tag: tag.clone(),
                };
                if state.table.insert(address, bytes, owner).is_err() {
                    drop(state);
                    let _ = device.tag_free(&tag, address);
                    return Err(Fail::Internal(format!(
                        "region {tag:?} returned {address:#x}, which the layer already owns"
                    )));
                }
                state.tags.allocated(&tag, ordinal, bytes);
                Ok(address)
            }
        }
    }

    /// Whether an untagged allocation of `bytes` would be held unmapped until its first use.
    pub fn would_hold(&self, bytes: usize) -> bool {
        self.elide && !self.unsure() && bytes >= self.held_min
    }

    /// Frees `address` if the layer owns it.
    pub fn free(&self, address: u64) -> Result<Freed, Fail> {
        let mut state = lock(&self.state);
        match state.table.lookup(address) {
            Lookup::Foreign => return Ok(Freed::NotOwned),
            Lookup::Inside { start, .. } => {
                return Err(Fail::InvalidValue(format!(
                    "free of {address:#x}, inside the allocation at {start:#x}"
                )))
            }
            Lookup::Start { .. } => {}
        }
        let decision = if matches!(
            state.table.get(address).map(|e| &e.payload),
            Some(Owner::Pool { .. })
        ) {
            state.elider.on_free(address)
        } else {
            FreeDecision::Plain
        };
        self.pending.store(state.elider.pending(), Ordering::SeqCst);
        self.forget_held(&mut state, address);
        let entry = state.table.remove(address).expect("looked up above");
        Counters::bump(&self.counters.frees);
        match (entry.payload, decision) {
            (Owner::Pool { device, block }, FreeDecision::Graft(copy)) => {
                // Under the lock: the target must not be freed while its memory is swapped.
                let result = self.graft(&mut state, device, block, &copy);
                drop(state);
                result.map(|()| Freed::Done)
            }
            (Owner::Pool { device, block }, decision) => {
                drop(state);
                if let FreeDecision::Cancel(_) = decision {
                    Counters::bump(&self.counters.copies_cancelled);
                }
                self.device(device)?.free(block)?;
                Ok(Freed::Done)
            }
            (Owner::Tag { device, tag }, _) => {
                state.tags.freed(&tag, entry.bytes);
                drop(state);
                self.device(device)?.tag_free(&tag, address)?;
                Ok(Freed::Done)
            }
        }
    }

    /// The source of a deferred copy is being freed: move its memory under the target. If the
    /// device cannot, and still has the source, the copy is performed instead.
    fn graft(
        &self,
        state: &mut State<D::Block>,
        ordinal: usize,
        source: D::Block,
        copy: &PendingCopy,
    ) -> Result<(), Fail> {
        let device = self.device(ordinal)?;
        // Mapped by the graft if held (in front the source's memory, behind the rest).
        self.forget_held(state, copy.dst);
        let Some(entry) = state.table.get_mut(copy.dst) else {
            // The target is gone (cannot happen: its free cancels the copy); nothing to keep.
            return device.free(source);
        };
        let Owner::Pool { block: target, .. } = &mut entry.payload else {
            return device.free(source);
        };
        match device.graft(target, source) {
            Ok(()) => {
                Counters::bump(&self.counters.copies_elided);
                Counters::add(&self.counters.bytes_elided, copy.bytes as u64);
                Ok(())
            }
            Err((fail, Some(mut source))) => {
                tracing::warn!(%fail, dst = copy.dst, src = copy.src, bytes = copy.bytes,
                    "copy elision: remapping failed, copying instead");
                // A failed graft leaves a held target unmapped (and the source, if nothing
                // touched it since its malloc): map them for the copy.
                let copied = device
                    .map_held(target)
                    .and_then(|()| device.map_held(&mut source))
                    .and_then(|()| device.copy_now(copy));
                Counters::bump(&self.counters.copies_performed);
                let freed = device.free(source);
                copied.and(freed)
            }
            Err((fail, None)) => {
                tracing::error!(%fail, dst = copy.dst, src = copy.src, bytes = copy.bytes,
                    "copy elision: remapping failed after the source was given up; the \
                     destination's first bytes are undefined");
                Err(fail)
            }
        }
    }

    /// Whether `address` lies in memory the layer owns.
    pub fn owns(&self, address: u64) -> bool {
        lock(&self.state).table.containing(address).is_some()
    }

    /// The allocation `address` lies in, for a query about the pointer (its range, its
    /// attributes, a graph node built on it by hand), with the memory there: a query is a
    /// flush point, so a held allocation is mapped and deferred copies are performed first,
    /// and what the driver is then asked sees what CUDA shows for `cudaMalloc` memory.
    /// `None`: not the layer's pointer (ask the driver). A failed flush is the error.
    pub fn settle(&self, address: u64) -> Result<Option<Allocation>, Fail> {
        let mut state = lock(&self.state);
        let Some((start, bytes)) = state.table.containing(address) else {
            return Ok(None);
        };
        let device = match state.table.get(start).map(|e| &e.payload) {
            Some(Owner::Pool { device, .. } | Owner::Tag { device, .. }) => *device,
            None => return Ok(None),
        };
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if self.work_pending() {
            self.flush_locked(&mut state)?;
        }
        Ok(Some(Allocation {
            start,
            bytes,
            device,
        }))
    }

    /// Bumps the epoch: nothing allocated before now is fresh any more. The hot path of every
    /// flush point; returns whether copies are pending or allocations held unmapped (then
    /// call [`Engine::flush`]).
    pub fn touch(&self) -> bool {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.work_pending()
    }

    fn work_pending(&self) -> bool {
        self.pending.load(Ordering::SeqCst) > 0 || self.held.load(Ordering::SeqCst) > 0
    }

    /// A flush point: maps every held allocation and performs every deferred copy now.
    pub fn flush(&self) -> Result<(), Fail> {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if !self.work_pending() {
            return Ok(());
        }
        let mut state = lock(&self.state);
        self.flush_locked(&mut state)
    }

    /// `address` is no longer held (freed, or mapped by a graft).
    fn forget_held(&self, state: &mut State<D::Block>, address: u64) {
        if state.held.remove(&address) {
            self.held.store(state.held.len(), Ordering::SeqCst);
        }
    }

    /// Maps every held allocation. The count is cleared only once all are mapped, for the
    /// same reason as the pending copies' (see [`Engine::flush_locked`]).
    fn map_all_held(&self, state: &mut State<D::Block>) -> Result<(), Fail> {
        let mut first_failure = None;
        for address in std::mem::take(&mut state.held) {
            let Some(Owner::Pool { device, block }) =
                state.table.get_mut(address).map(|e| &mut e.payload)
            else {
                continue;
            };
            let result = self.device(*device).and_then(|d| d.map_held(block));
            if let Err(fail) = result {
                tracing::error!(%fail, address, "mapping a held allocation failed");
                first_failure.get_or_insert(fail);
            }
        }
        self.held.store(0, Ordering::SeqCst);
        first_failure.map_or(Ok(()), Err)
    }

    fn flush_locked(&self, state: &mut State<D::Block>) -> Result<(), Fail> {
        // Held allocations first: a copy below, or the call after this flush point, may
        // touch any of them.
        let mut first_failure = self.map_all_held(state).err();
        let copies = state.elider.take_all();
        for copy in copies {
            let result = self.device(copy.device).and_then(|d| d.copy_now(&copy));
            Counters::bump(&self.counters.copies_performed);
            if let Err(fail) = result {
                tracing::error!(%fail, dst = copy.dst, src = copy.src, bytes = copy.bytes,
                    "copy elision: performing a deferred copy failed");
                first_failure.get_or_insert(fail);
            }
        }
        // Only now, with every copy enqueued and done: another thread's flush point that reads
        // `pending` while these copies are still being performed must see them pending, wait
        // for the lock and so forward its own call after them. Clearing the count first let a
        // thread launch a kernel that overwrote a source on the copy's stream ahead of the
        // copy (the random multi-threaded programs on the H100: 16 of 8924 buffers wrong).
        self.pending.store(state.elider.pending(), Ordering::SeqCst);
        first_failure.map_or(Ok(()), Err)
    }

    /// From now on no copy is deferred, and the pending ones are performed now. Returns
    /// whether this call is the one that stopped elision.
    pub fn stop_eliding(&self) -> Result<bool, Fail> {
        let first = !self.unsure.swap(true, Ordering::SeqCst);
        self.flush()?;
        Ok(first)
    }

    /// Whether elision was stopped ([`Engine::stop_eliding`]).
    pub fn unsure(&self) -> bool {
        self.unsure.load(Ordering::SeqCst)
    }

    /// A copy call with elision on: deferred, or (after performing the pending ones) passed on.
    pub fn copy(&self, call: CopyCall) -> Result<Copied, Fail> {
        let epoch = self.epoch.load(Ordering::SeqCst);
        let mut state = lock(&self.state);
        let alloc_of = |state: &State<D::Block>, address: u64| {
            let (start, bytes) = state.table.containing(address)?;
            match &state.table.get(start)?.payload {
                Owner::Pool { device, .. } => Some(Alloc {
                    start,
                    bytes,
                    device: *device,
                }),
                Owner::Tag { .. } => None,
            }
        };
        let dst_alloc = alloc_of(&state, call.dst);
        let src_alloc = alloc_of(&state, call.src);
        let capturing = match (dst_alloc, src_alloc) {
            (Some(dst), Some(_)) if call.device_to_device => self
                .opened(dst.device)
                .is_some_and(|d| d.is_capturing(call.stream)),
            _ => false,
        };
        let request = CopyRequest {
            dst: call.dst,
            src: call.src,
            bytes: call.bytes,
            stream: call.stream,
            sync: call.sync,
            device_to_device: call.device_to_device,
            capturing,
            unsure: self.unsure.load(Ordering::SeqCst),
            dst_alloc,
            src_alloc,
        };
        match state.elider.on_copy(&request, epoch) {
            CopyDecision::Defer => {
                self.pending.store(state.elider.pending(), Ordering::SeqCst);
                Counters::bump(&self.counters.copies_deferred);
                Ok(Copied::Deferred)
            }
            CopyDecision::Perform(reason) => {
                tracing::trace!(?reason, "copy not deferred");
                // This copy may read or write anything: it is a flush point too.
                self.epoch.fetch_add(1, Ordering::SeqCst);
                self.flush_locked(&mut state)?;
                Ok(Copied::PassThrough)
            }
        }
    }

    /// Makes `tag` known and returns the shared name to keep as a thread's current tag.
    pub fn register_tag(&self, tag: &str) -> Arc<str> {
        lock(&self.state).tags.register(tag)
    }

    /// The tags a pause of `tag` (`None`: every tag) would act on now: those awake. A tag never
    /// set is [`Fail::UnknownTag`], as for the pause itself.
    pub fn tags_to_pause(&self, tag: Option<&str>) -> Result<Vec<Arc<str>>, Fail> {
        let plan = lock(&self.state).tags.plan_pause(tag)?;
        Ok(plan.into_iter().map(|(name, _)| name).collect())
    }

    /// The tags paused now.
    pub fn paused_tags(&self) -> BTreeSet<Arc<str>> {
        let state = lock(&self.state);
        state
            .tags
            .iter()
            .filter(|(_, s)| s.paused)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The tags of the layer's allocations that share a byte with `[start, start + bytes)`:
    /// the memory a pause can take from under that range. Empty when the range holds none of
    /// the layer's tagged memory (untagged pool memory keeps its pages while allocated).
    pub fn tags_in(&self, start: u64, bytes: usize) -> Vec<Arc<str>> {
        let state = lock(&self.state);
        let mut tags: Vec<Arc<str>> = Vec::new();
        for (_, entry) in state.table.overlapping(start, bytes) {
            if let Owner::Tag { tag, .. } = &entry.payload {
                if !tags.contains(tag) {
                    tags.push(tag.clone());
                }
            }
        }
        tags
    }

    /// Pauses `tag` (`None`: every tag) on every device that holds its memory.
    pub fn pause(&self, tag: Option<&str>, keep: bool) -> Result<Transfer, Fail> {
        let plan = {
            let mut state = lock(&self.state);
            let plan = state.tags.plan_pause(tag)?;
            // Marked first: allocations under these tags are refused from now on.
            for (name, _) in &plan {
                state.tags.mark_paused(name, true);
            }
            plan
        };
        let mut total = Transfer::default();
        for (name, devices) in plan {
            let mut done: Vec<Arc<D>> = Vec::new();
            for ordinal in devices {
                let result = self
                    .device(ordinal)
                    .and_then(|device| device.pause(&name, keep).map(|t| (device, t)));
                match result {
                    Ok((device, transfer)) => {
                        total.add(transfer);
                        done.push(device);
                    }
                    Err(fail) => {
                        // All or nothing for this tag: wake what was paused.
                        for device in done {
                            if let Err(undo) = device.resume(&name) {
                                tracing::error!(%undo, tag = %name,
                                    "undoing a partial pause failed; resume the tag to retry");
                            }
                        }
                        lock(&self.state).tags.mark_paused(&name, false);
                        self.note_failure(&fail);
                        return Err(fail);
                    }
                }
            }
        }
        Counters::bump(&self.counters.pauses);
        Counters::set(
            &self.counters.last_pause_ns,
            total.elapsed.as_nanos() as u64,
        );
        Ok(total)
    }

    /// Resumes `tag` (`None`: every paused tag). Resuming an awake tag does nothing. If a
    /// device runs out of memory the tag stays paused (its host copy is kept): retry later.
    pub fn resume(&self, tag: Option<&str>) -> Result<Transfer, Fail> {
        let plan = lock(&self.state).tags.plan_resume(tag)?;
        let mut total = Transfer::default();
        for (name, devices) in plan {
            for ordinal in devices {
                match self.device(ordinal).and_then(|d| d.resume(&name)) {
                    Ok(transfer) => total.add(transfer),
                    Err(fail) => {
                        self.note_failure(&fail);
                        return Err(fail);
                    }
                }
            }
            lock(&self.state).tags.mark_paused(&name, false);
        }
        Counters::bump(&self.counters.resumes);
        Counters::set(
            &self.counters.last_resume_ns,
            total.elapsed.as_nanos() as u64,
        );
        Ok(total)
    }

    /// Cached bytes of the device's pool (0 if it was never opened).
    pub fn cached(&self, ordinal: usize) -> usize {
        self.opened(ordinal).map_or(0, |d| d.pool().cached)
    }

    pub fn reserve_host(&self, ordinal: usize, bytes: usize) -> Result<(), Fail> {
        self.device(ordinal)?.reserve_host(bytes)
    }

    pub fn view(&self) -> EngineView {
        let devices = self.opened_devices();
        let state = lock(&self.state);
        let mut view = EngineView {
            live_allocations: state.table.len(),
            live_bytes: state.table.live_bytes(),
            tags: state.tags.len(),
            tags_paused: state.tags.paused_count(),
            tagged_bytes: state.tags.iter().map(|(_, s)| s.live_bytes).sum(),
            pending_copies: state.elider.pending(),
            ..EngineView::default()
        };
        let tags: Vec<Arc<str>> = state.tags.iter().map(|(t, _)| t.clone()).collect();
        drop(state);
        for (_, device) in &devices {
            view.pool.add(device.pool());
            view.host_bytes += tags
                .iter()
                .filter_map(|t| device.tag(t))
                .map(|t| t.host_bytes)
                .sum::<usize>();
        }
        view.host_arena_bytes = devices.first().map_or(0, |(_, d)| d.host_arena_bytes());
        view
    }

    /// Timeline events of every device, on the layer's clock. Does not block: if another
    /// thread holds the device list (exiting mid-call), returns nothing.
    pub fn try_events(&self) -> Option<Vec<(Duration, u32, Vec<Event>)>> {
        let devices: Vec<Arc<D>> = self.devices.try_lock().ok()?.values().cloned().collect();
        Some(devices.iter().flat_map(|d| d.events()).collect())
    }

    /// One line per device (used at exit; does not block on the device list).
    pub fn try_summary(&self) -> Option<Vec<String>> {
        let devices: Vec<(usize, Arc<D>)> = self
            .devices
            .try_lock()
            .ok()?
            .iter()
            .map(|(o, d)| (*o, d.clone()))
            .collect();
        Some(
            devices
                .iter()
                .map(|(ordinal, device)| format!("device {ordinal}: {}", device.summary()))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::device::TagView;
    use std::collections::HashMap;
    use std::sync::atomic::AtomicBool;

    const GIB: usize = 1 << 30;
    const MIB: usize = 1 << 20;

    /// A device made of address arithmetic and a log of what was asked of it.
    /// Called inside `copy_now`, while the engine performs a deferred copy.
    type CopyHook = Box<dyn Fn() + Send + Sync>;

    #[derive(Default)]
    struct Fake {
        ordinal: usize,
        inner: Mutex<FakeState>,
        fail_graft: AtomicBool,
        capturing: AtomicBool,
        during_copy: Mutex<Option<CopyHook>>,
    }

    #[derive(Default)]
    struct FakeState {
        next: u64,
        log: Vec<String>,
        regions: HashMap<String, (bool, usize)>,
        /// Fail the next n allocations with out of memory.
        oom: usize,
        /// Held allocations (start → bytes): touching one before it is mapped is a GPU fault.
        held: HashMap<u64, usize>,
        fail_pause: Option<String>,
    }

    #[derive(Debug)]
    struct FakeBlock {
        address: u64,
        bytes: usize,
    }

    impl Fake {
        fn new(ordinal: usize) -> Self {
            let fake = Fake {
                ordinal,
                ..Fake::default()
            };
            lock(&fake.inner).next = 0x7f00_0000_0000 + ((ordinal as u64) << 40);
            fake
        }

        fn log(&self) -> Vec<String> {
            lock(&self.inner).log.clone()
        }

        fn say(&self, line: String) {
            lock(&self.inner).log.push(line);
        }

        /// Panics (the fake's GPU fault) if `[address, address + bytes)` meets a held block.
        fn assert_mapped(&self, address: u64, bytes: usize) {
            let inner = lock(&self.inner);
            for (&start, &len) in &inner.held {
                let overlaps = address < start + len as u64 && start < address + bytes as u64;
                assert!(!overlaps, "{address:#x} touched while held unmapped");
            }
        }

        fn carve(&self, bytes: usize) -> u64 {
            let mut inner = lock(&self.inner);
            let address = inner.next;
            inner.next += (bytes as u64).div_ceil(2 * MIB as u64) * 2 * MIB as u64;
            address
        }
    }

    impl Device for Fake {
        type Block = FakeBlock;

        fn alloc(&self, bytes: usize) -> Result<(u64, FakeBlock), Fail> {
            {
                let mut inner = lock(&self.inner);
                if inner.oom > 0 {
                    inner.oom -= 1;
                    return Err(Fail::OutOfMemory(format!("{bytes} bytes")));
                }
            }
            let address = self.carve(bytes);
            self.say(format!("alloc {address:#x} {bytes}"));
            Ok((address, FakeBlock { address, bytes }))
        }

        fn alloc_held(&self, bytes: usize) -> Result<(u64, FakeBlock), Fail> {
            let (address, block) = self.alloc(bytes)?;
            let mut inner = lock(&self.inner);
            inner.held.insert(address, bytes);
            let line = inner.log.last_mut().expect("alloc logged");
            *line = format!("alloc_held {address:#x} {bytes}");
            Ok((address, block))
        }

        fn map_held(&self, block: &mut FakeBlock) -> Result<(), Fail> {
            let mut inner = lock(&self.inner);
            if inner.held.remove(&block.address).is_some() {
                inner.log.push(format!("map_held {:#x}", block.address));
            }
            Ok(())
        }

        fn free(&self, block: FakeBlock) -> Result<(), Fail> {
            lock(&self.inner).held.remove(&block.address);
            self.say(format!("free {:#x}", block.address));
            Ok(())
        }

        fn graft(
            &self,
            target: &mut FakeBlock,
            source: FakeBlock,
        ) -> Result<(), (Fail, Option<FakeBlock>)> {
            if self.fail_graft.load(Ordering::SeqCst) {
                return Err((Fail::OutOfMemory("graft".into()), Some(source)));
            }
            assert!(source.bytes <= target.bytes);
            let mut inner = lock(&self.inner);
            let was_held = inner.held.remove(&target.address).is_some();
            inner.held.remove(&source.address);
            let onto = if was_held { " (onto held)" } else { "" };
            inner.log.push(format!(
                "graft {:#x} <- {:#x}{onto}",
                target.address, source.address
            ));
            Ok(())
        }

        fn copy_now(&self, copy: &PendingCopy) -> Result<(), Fail> {
            if let Some(hook) = lock(&self.during_copy).as_ref() {
                hook();
            }
            self.assert_mapped(copy.dst, copy.bytes);
            self.assert_mapped(copy.src, copy.bytes);
            self.say(format!(
                "copy {:#x} <- {:#x} {} on {:#x}",
                copy.dst, copy.src, copy.bytes, copy.stream
            ));
            Ok(())
        }

        fn is_capturing(&self, _stream: u64) -> bool {
            self.capturing.load(Ordering::SeqCst)
        }

        fn tag_alloc(&self, tag: &str, bytes: usize) -> Result<u64, Fail> {
            let address = self.carve(bytes);
            let mut inner = lock(&self.inner);
            inner.regions.entry(tag.to_string()).or_default().1 += bytes;
            inner.log.push(format!("tag_alloc {tag} {address:#x}"));
            Ok(address)
        }

        fn tag_free(&self, tag: &str, address: u64) -> Result<(), Fail> {
            self.say(format!("tag_free {tag} {address:#x}"));
            Ok(())
        }

        fn pause(&self, tag: &str, keep: bool) -> Result<Transfer, Fail> {
            let mut inner = lock(&self.inner);
            if inner.fail_pause.as_deref() == Some(tag) {
                return Err(Fail::OutOfMemory("pinned host memory".into()));
            }
            let region = inner.regions.entry(tag.to_string()).or_default();
            region.0 = true;
            let bytes = region.1;
            inner
                .log
                .push(format!("pause {tag} keep={keep} on {}", self.ordinal));
            Ok(Transfer {
                bytes,
                copied: if keep { bytes } else { 0 },
                elapsed: Duration::from_millis(1),
            })
        }

        fn resume(&self, tag: &str) -> Result<Transfer, Fail> {
            let mut inner = lock(&self.inner);
            let region = inner.regions.entry(tag.to_string()).or_default();
            region.0 = false;
            let bytes = region.1;
            inner.log.push(format!("resume {tag} on {}", self.ordinal));
            Ok(Transfer {
                bytes,
                copied: bytes,
                elapsed: Duration::from_millis(2),
            })
        }

        fn reserve_host(&self, bytes: usize) -> Result<(), Fail> {
            self.say(format!("reserve_host {bytes}"));
            Ok(())
        }

        fn host_arena_bytes(&self) -> usize {
            0
        }

        fn pool(&self) -> PoolView {
            PoolView {
                cached: 5,
                ..PoolView::default()
            }
        }

        fn tag(&self, tag: &str) -> Option<TagView> {
            let inner = lock(&self.inner);
            let (asleep, bytes) = *inner.regions.get(tag)?;
            Some(TagView {
                allocated: bytes,
                mapped: if asleep { 0 } else { bytes },
                host_bytes: if asleep { bytes } else { 0 },
                asleep,
            })
        }

        fn events(&self) -> Vec<(Duration, u32, Vec<Event>)> {
            Vec::new()
        }

        fn summary(&self) -> String {
            "fake".into()
        }
    }

    type TestEngine = (
        Engine<SharedFake>,
        Arc<Mutex<Vec<Arc<Fake>>>>,
        Arc<Counters>,
    );

    /// An engine over fake devices; the devices are kept so the test can read their logs.
    fn engine(elide: bool) -> TestEngine {
        let opened: Arc<Mutex<Vec<Arc<Fake>>>> = Arc::default();
        let keep = opened.clone();
        let counters = Arc::new(Counters::default());
        let engine = Engine::new(
            move |ordinal| {
                let fake = Arc::new(Fake::new(ordinal));
                lock(&keep).push(fake.clone());
                Ok(SharedFake(fake))
            },
            elide,
            64 * MIB,
            counters.clone(),
        );
        (engine, opened, counters)
    }

    /// `Arc<Fake>` as a device, so the test keeps a handle on it.
    struct SharedFake(Arc<Fake>);

    impl Device for SharedFake {
        type Block = FakeBlock;
        fn alloc(&self, b: usize) -> Result<(u64, FakeBlock), Fail> {
            self.0.alloc(b)
        }
        fn alloc_held(&self, b: usize) -> Result<(u64, FakeBlock), Fail> {
            self.0.alloc_held(b)
        }
        fn map_held(&self, b: &mut FakeBlock) -> Result<(), Fail> {
            self.0.map_held(b)
        }
        fn free(&self, b: FakeBlock) -> Result<(), Fail> {
            self.0.free(b)
        }
        fn graft(&self, t: &mut FakeBlock, s: FakeBlock) -> Result<(), (Fail, Option<FakeBlock>)> {
            self.0.graft(t, s)
        }
        fn copy_now(&self, c: &PendingCopy) -> Result<(), Fail> {
            self.0.copy_now(c)
        }
        fn is_capturing(&self, s: u64) -> bool {
            self.0.is_capturing(s)
        }
        fn tag_alloc(&self, t: &str, b: usize) -> Result<u64, Fail> {
            self.0.tag_alloc(t, b)
        }
        fn tag_free(&self, t: &str, a: u64) -> Result<(), Fail> {
            self.0.tag_free(t, a)
        }
        fn pause(&self, t: &str, k: bool) -> Result<Transfer, Fail> {
            self.0.pause(t, k)
        }
        fn resume(&self, t: &str) -> Result<Transfer, Fail> {
            self.0.resume(t)
        }
        fn reserve_host(&self, b: usize) -> Result<(), Fail> {
            self.0.reserve_host(b)
        }
        fn host_arena_bytes(&self) -> usize {
            self.0.host_arena_bytes()
        }
        fn pool(&self) -> PoolView {
            self.0.pool()
        }
        fn tag(&self, t: &str) -> Option<TagView> {
            self.0.tag(t)
        }
        fn events(&self) -> Vec<(Duration, u32, Vec<Event>)> {
            self.0.events()
        }
        fn summary(&self) -> String {
            self.0.summary()
        }
    }

    fn d2d(dst: u64, src: u64, bytes: usize) -> CopyCall {
        CopyCall {
            dst,
            src,
            bytes,
            device_to_device: true,
            stream: 0x5,
            sync: false,
        }
    }

    #[test]
    fn foreign_pointers_pass_through_and_own_ones_are_freed() {
        let (engine, devices, counters) = engine(false);
        let a = engine.alloc(0, 64 * MIB, None).unwrap();
        assert!(engine.owns(a) && engine.owns(a + 100));
        assert!(!engine.owns(0x1234));
        assert_eq!(engine.free(0x1234), Ok(Freed::NotOwned));
        assert!(matches!(engine.free(a + 8), Err(Fail::InvalidValue(_))));
        assert_eq!(engine.free(a), Ok(Freed::Done));
        assert_eq!(
            engine.free(a),
            Ok(Freed::NotOwned),
            "a second free is foreign"
        );
        assert_eq!(
            engine.alloc(0, 0, None),
            Ok(0),
            "zero bytes: NULL, like cudaMalloc"
        );
        let log = lock(&devices)[0].log();
        assert_eq!(
            log,
            vec![format!("alloc {a:#x} {}", 64 * MIB), format!("free {a:#x}")]
        );
        assert_eq!(Counters::get(&counters.frees), 1);
        assert_eq!(engine.view().live_allocations, 0);
    }

    #[test]
    fn devices_open_lazily_one_each() {
        let (engine, devices, _) = engine(false);
        assert_eq!(engine.cached(0), 0, "asking for the cache opens nothing");
        assert!(lock(&devices).is_empty());
        let a = engine.alloc(1, MIB, None).unwrap();
        let b = engine.alloc(1, MIB, None).unwrap();
        engine.alloc(0, MIB, None).unwrap();
        assert_eq!(lock(&devices).len(), 2);
        assert_ne!(a, b);
        assert_eq!(engine.cached(1), 5);
    }

    #[test]
    fn out_of_memory_is_counted_and_reported() {
        let (engine, devices, counters) = engine(false);
        engine.alloc(0, MIB, None).unwrap();
        lock(&lock(&devices)[0].inner).oom = 1;
        assert!(matches!(
            engine.alloc(0, GIB, None),
            Err(Fail::OutOfMemory(_))
        ));
        assert_eq!(Counters::get(&counters.oom_errors), 1);
        assert!(
            engine.alloc(0, GIB, None).is_ok(),
            "the next try may succeed"
        );
    }

    #[test]
    fn a_flush_point_during_another_threads_flush_still_sees_the_copy_pending() {
        // Thread A performs a deferred copy (at its flush point); thread B reaches a flush
        // point meanwhile. B must be told copies are pending, so that it waits for A's flush
        // instead of launching ahead of the copy on its stream.
        let (engine, devices, _) = engine(true);
        let engine = Arc::new(engine);
        let a = engine.alloc(0, 3 * GIB / 2, None).unwrap();
        flush_point(&engine); // a fill kernel on `a`
        let b = engine.alloc(0, 3 * GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(b, a, 3 * GIB / 2)), Ok(Copied::Deferred));
        let seen = Arc::new(Mutex::new(Vec::new()));
        {
            let weak = Arc::downgrade(&engine);
            let seen = seen.clone();
            let fake = lock(&devices)[0].clone();
            *lock(&fake.during_copy) = Some(Box::new(move || {
                let other_thread = weak.clone();
                let pending = std::thread::spawn(move || other_thread.upgrade().unwrap().touch())
                    .join()
                    .unwrap();
                lock(&seen).push(pending);
            }));
        }
        engine.flush().unwrap();
        assert_eq!(
            *lock(&seen),
            vec![true],
            "a flush point during the copy saw nothing pending"
        );
        assert!(!engine.touch(), "nothing is pending once the copy is done");
        *lock(&lock(&devices)[0].during_copy) = None;
    }

    /// What the layer does at a hooked launch, copy or synchronize.
    fn flush_point<D: Device>(engine: &Engine<D>) {
        if engine.touch() {
            engine.flush().unwrap();
        }
    }

    #[test]
    fn large_allocations_are_held_unmapped_until_the_first_flush_point() {
        let (engine, devices, _) = engine(true);
        let small = engine.alloc(0, MIB, None).unwrap();
        let large = engine.alloc(0, GIB, None).unwrap();
        let never_used = engine.alloc(0, GIB, None).unwrap();
        let log = lock(&devices)[0].log();
        assert_eq!(
            log,
            vec![
                format!("alloc {small:#x} {MIB}"),
                format!("alloc_held {large:#x} {GIB}"),
                format!("alloc_held {never_used:#x} {GIB}"),
            ],
            "below the elision minimum an allocation is mapped at once"
        );
        engine.free(never_used).unwrap();
        assert!(
            engine.touch(),
            "a launch must map the held allocation first"
        );
        engine.flush().unwrap();
        assert!(!engine.touch());
        let log = lock(&devices)[0].log();
        assert_eq!(
            &log[3..],
            &[
                format!("free {never_used:#x}"),
                format!("map_held {large:#x}")
            ],
            "freed before any use, an allocation is never mapped"
        );
        // Without elision nothing is held.
        let (plain, devices, _) = self::engine(false);
        let a = plain.alloc(0, GIB, None).unwrap();
        assert_eq!(lock(&devices)[0].log(), vec![format!("alloc {a:#x} {GIB}")]);
    }

    #[test]
    fn a_pointer_query_sees_the_whole_allocation_mapped() {
        let (engine, devices, _) = engine(true);
        let held = engine.alloc(0, GIB + 1000, None).unwrap();
        let other = engine.alloc(0, GIB, None).unwrap();
        // A pointer inside: the allocation's start and the size asked for, on its device.
        assert_eq!(
            engine.settle(held + 4096),
            Ok(Some(Allocation {
                start: held,
                bytes: GIB + 1000,
                device: 0,
            }))
        );
        // Mapped before the driver is asked anything about it (the query is a flush point).
        let log = lock(&devices)[0].log();
        assert!(log.contains(&format!("map_held {held:#x}")), "{log:?}");
        assert!(
            !engine.touch(),
            "nothing is held once a query has been answered"
        );
        // The last byte is in it, the byte after it is the next allocation's or no one's.
        assert_eq!(
            engine
                .settle(held + GIB as u64 + 999)
                .unwrap()
                .map(|a| a.start),
            Some(held)
        );
        assert_ne!(
            engine
                .settle(held + GIB as u64 + 1000)
                .unwrap()
                .map(|a| a.start),
            Some(held)
        );
        assert_eq!(engine.settle(other).unwrap().map(|a| a.bytes), Some(GIB));
    }

    #[test]
    fn a_foreign_pointer_query_touches_nothing() {
        let (engine, devices, _) = engine(true);
        let held = engine.alloc(0, GIB, None).unwrap();
        let before = lock(&devices)[0].log();
        assert_eq!(engine.settle(0x1000), Ok(None));
        assert_eq!(lock(&devices)[0].log(), before);
        assert!(engine.touch(), "the layer's held allocation is still held");
        let _ = held;
    }

    #[test]
    fn a_query_on_a_copys_destination_performs_the_copy_first() {
        let (engine, devices, _) = engine(true);
        let a = engine.alloc(0, 3 * GIB / 2, None).unwrap();
        flush_point(&engine);
        let b = engine.alloc(0, 3 * GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(b, a, 3 * GIB / 2)), Ok(Copied::Deferred));
        assert_eq!(engine.settle(b).unwrap().map(|x| x.start), Some(b));
        let log = lock(&devices)[0].log();
        assert!(
            log.iter().any(|line| line.starts_with("copy ")),
            "the deferred copy was not performed: {log:?}"
        );
        // The source's free is a plain free now, not a graft.
        engine.free(a).unwrap();
        assert!(!engine.touch());
    }

    #[test]
    fn tagged_allocations_answer_their_region_range() {
        let (engine, _, _) = engine(false);
        let tag = engine.register_tag("weights");
        let a = engine.alloc(0, 5 * MIB, Some(tag)).unwrap();
        assert_eq!(
            engine.settle(a + 17),
            Ok(Some(Allocation {
                start: a,
                bytes: 5 * MIB,
                device: 0,
            }))
        );
    }

    #[test]
    fn once_elision_stops_nothing_is_held_and_held_allocations_are_mapped() {
        let (engine, devices, _) = engine(true);
        let a = engine.alloc(0, GIB, None).unwrap();
        assert_eq!(engine.stop_eliding(), Ok(true));
        let b = engine.alloc(0, GIB, None).unwrap();
        assert!(!engine.touch());
        let log = lock(&devices)[0].log();
        assert_eq!(
            log,
            vec![
                format!("alloc_held {a:#x} {GIB}"),
                format!("map_held {a:#x}"),
                format!("alloc {b:#x} {GIB}"),
            ]
        );
    }

    #[test]
    fn a_deferred_copy_between_untouched_allocations_maps_both_before_copying() {
        // Nothing touched either allocation: the copy reads memory nobody wrote, but it must
        // not fault when it is performed (flush point) or when a graft fails (fallback copy).
        for failing_graft in [false, true] {
            let (engine, devices, counters) = engine(true);
            lock(&devices).clear();
            let a = engine.alloc(0, GIB, None).unwrap();
            let b = engine.alloc(0, 2 * GIB, None).unwrap();
            assert_eq!(engine.copy(d2d(b, a, GIB)), Ok(Copied::Deferred));
            let fake = lock(&devices)[0].clone();
            if failing_graft {
                fake.fail_graft.store(true, Ordering::SeqCst);
                engine.free(a).unwrap();
            } else {
                flush_point(&engine);
                engine.free(a).unwrap();
            }
            let log = fake.log();
            let copy = log
                .iter()
                .position(|l| l.starts_with("copy"))
                .expect("copied");
            for address in [a, b] {
                let mapped = log
                    .iter()
                    .position(|l| l == &format!("map_held {address:#x}"));
                assert!(mapped.is_some_and(|m| m < copy), "{log:?}");
            }
            assert_eq!(Counters::get(&counters.copies_performed), 1);
            assert!(!engine.touch());
        }
    }

    #[test]
    fn the_resize_idiom_grafts_instead_of_copying() {
        let (engine, devices, counters) = engine(true);
        let a = engine.alloc(0, 3 * GIB / 2, None).unwrap();
        flush_point(&engine); // a fill kernel on `a`
        let b = engine.alloc(0, 3 * GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(b, a, 3 * GIB / 2)), Ok(Copied::Deferred));
        assert_eq!(engine.free(a), Ok(Freed::Done));
        let log = lock(&devices)[0].log();
        assert_eq!(
            log.last().unwrap(),
            &format!("graft {b:#x} <- {a:#x} (onto held)"),
            "b's memory was held unmapped until the graft: {log:?}"
        );
        assert!(
            log.contains(&format!("map_held {a:#x}")),
            "the fill kernel mapped a"
        );
        assert!(!log.iter().any(|l| l.starts_with("copy")), "{log:?}");
        assert!(
            !log.iter().any(|l| l == &format!("free {a:#x}")),
            "a's memory lives on in b"
        );
        assert_eq!(Counters::get(&counters.copies_elided), 1);
        assert_eq!(Counters::get(&counters.bytes_elided), 3 * GIB as u64 / 2);
        assert!(!engine.owns(a) && engine.owns(b));
    }

    #[test]
    fn a_flush_point_performs_the_deferred_copy_on_its_stream() {
        let (engine, devices, counters) = engine(true);
        let a = engine.alloc(0, GIB, None).unwrap();
        let b = engine.alloc(0, 2 * GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(b, a, GIB)), Ok(Copied::Deferred));
        assert!(engine.touch(), "a launch sees a pending copy");
        engine.flush().unwrap();
        assert!(!engine.touch());
        engine.free(a).unwrap();
        let log = lock(&devices)[0].log();
        assert!(
            log.contains(&format!("copy {b:#x} <- {a:#x} {GIB} on 0x5")),
            "{log:?}"
        );
        assert_eq!(log.last().unwrap(), &format!("free {a:#x}"));
        assert_eq!(Counters::get(&counters.copies_performed), 1);
        assert_eq!(Counters::get(&counters.copies_elided), 0);
    }

    #[test]
    fn another_copy_performs_pending_copies_first() {
        let (engine, devices, _) = engine(true);
        let a = engine.alloc(0, GIB, None).unwrap();
        let b = engine.alloc(0, 2 * GIB, None).unwrap();
        engine.copy(d2d(b, a, GIB)).unwrap();
        // A device-to-host read of b (not device to device): must see the copy.
        let read = CopyCall {
            device_to_device: false,
            ..d2d(0x1000, b, 4096)
        };
        assert_eq!(engine.copy(read), Ok(Copied::PassThrough));
        let log = lock(&devices)[0].log();
        assert!(log.last().unwrap().starts_with("copy"), "{log:?}");
        // b was touched by that read: a later copy into b is not deferred.
        let c = engine.alloc(0, GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(b, c, GIB)), Ok(Copied::PassThrough));
    }

    #[test]
    fn freeing_the_destination_cancels_and_failed_grafts_copy() {
        let (engine, devices, counters) = engine(true);
        let a = engine.alloc(0, GIB, None).unwrap();
        let b = engine.alloc(0, 2 * GIB, None).unwrap();
        engine.copy(d2d(b, a, GIB)).unwrap();
        engine.free(b).unwrap();
        assert_eq!(Counters::get(&counters.copies_cancelled), 1);
        engine.free(a).unwrap();
        let fake = lock(&devices)[0].clone();
        assert!(!fake
            .log()
            .iter()
            .any(|l| l.starts_with("copy") || l.starts_with("graft")));

        fake.fail_graft.store(true, Ordering::SeqCst);
        let a = engine.alloc(0, GIB, None).unwrap();
        let b = engine.alloc(0, 2 * GIB, None).unwrap();
        engine.copy(d2d(b, a, GIB)).unwrap();
        assert_eq!(engine.free(a), Ok(Freed::Done));
        let log = fake.log();
        let n = log.len();
        assert_eq!(log[n - 2], format!("copy {b:#x} <- {a:#x} {GIB} on 0x5"));
        assert_eq!(log[n - 1], format!("free {a:#x}"));
    }

    #[test]
    fn capturing_streams_and_disabled_elision_defer_nothing() {
        let (engine, devices, _) = engine(true);
        let a = engine.alloc(0, GIB, None).unwrap();
        let b = engine.alloc(0, 2 * GIB, None).unwrap();
        lock(&devices)[0].capturing.store(true, Ordering::SeqCst);
        assert_eq!(engine.copy(d2d(b, a, GIB)), Ok(Copied::PassThrough));
        let (plain, _, _) = engine_pair_without_elision();
        assert!(!plain.eliding());
    }

    #[test]
    fn once_unsure_pending_copies_are_performed_and_nothing_is_deferred() {
        let (engine, devices, counters) = engine(true);
        let a = engine.alloc(0, GIB, None).unwrap();
        let b = engine.alloc(0, 2 * GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(b, a, GIB)), Ok(Copied::Deferred));
        assert_eq!(engine.stop_eliding(), Ok(true));
        assert_eq!(
            engine.stop_eliding(),
            Ok(false),
            "only the first call stops it"
        );
        assert!(engine.unsure());
        let log = lock(&devices)[0].log();
        assert!(
            log.contains(&format!("copy {b:#x} <- {a:#x} {GIB} on 0x5")),
            "{log:?}"
        );
        let c = engine.alloc(0, GIB, None).unwrap();
        let d = engine.alloc(0, 2 * GIB, None).unwrap();
        assert_eq!(engine.copy(d2d(d, c, GIB)), Ok(Copied::PassThrough));
        engine.free(a).unwrap();
        engine.free(c).unwrap();
        assert_eq!(Counters::get(&counters.copies_elided), 0);
        assert_eq!(Counters::get(&counters.copies_performed), 1);
    }

    fn engine_pair_without_elision() -> TestEngine {
        engine(false)
    }

    #[test]
    fn tagged_memory_goes_to_regions_and_pauses_by_tag() {
        let (engine, devices, counters) = engine(false);
        let weights = engine.register_tag("weights");
        let w0 = engine.alloc(0, GIB, Some(weights.clone())).unwrap();
        let w1 = engine.alloc(1, GIB, Some(weights.clone())).unwrap();
        let kv = engine
            .alloc(0, GIB, Some(engine.register_tag("kv")))
            .unwrap();
        let plain = engine.alloc(0, GIB, None).unwrap();
        assert!(engine.owns(w0) && engine.owns(w1) && engine.owns(kv) && engine.owns(plain));

        let paused = engine.pause(Some("weights"), true).unwrap();
        assert_eq!(paused.bytes, 2 * GIB, "both devices");
        assert_eq!(paused.copied, 2 * GIB);
        let again = engine.pause(Some("weights"), true).unwrap();
        assert_eq!(again, Transfer::default(), "pausing twice does nothing");
        assert!(matches!(
            engine.alloc(0, MIB, Some(weights.clone())),
            Err(Fail::NotPermitted(_))
        ));
        let view = engine.view();
        assert_eq!((view.tags, view.tags_paused), (2, 1));
        assert_eq!(view.host_bytes, 2 * GIB);

        assert_eq!(engine.resume(Some("weights")).unwrap().bytes, 2 * GIB);
        assert_eq!(
            engine.resume(Some("weights")).unwrap(),
            Transfer::default(),
            "idempotent"
        );
        assert!(engine.alloc(0, MIB, Some(weights)).is_ok());
        assert_eq!(
            engine.pause(Some("never-set"), true),
            Err(Fail::UnknownTag("never-set".into()))
        );
        engine.free(kv).unwrap();
        let log0 = lock(&devices)[0].log();
        assert!(log0.contains(&"pause weights keep=true on 0".to_string()));
        assert!(log0.contains(&format!("tag_free kv {kv:#x}")));
        assert!(
            !log0.iter().any(|l| l.starts_with("pause kv")),
            "kv was not paused"
        );
        assert_eq!(
            Counters::get(&counters.pauses),
            1 + 1,
            "the no-op pause counts too"
        );
        assert_eq!(
            Counters::get(&counters.last_resume_ns),
            0,
            "the no-op resume took 0 ns"
        );
    }

    #[test]
    fn a_failed_pause_wakes_what_it_paused() {
        let (engine, devices, _) = engine(false);
        let tag = engine.register_tag("w");
        engine.alloc(0, GIB, Some(tag.clone())).unwrap();
        engine.alloc(1, GIB, Some(tag.clone())).unwrap();
        lock(&lock(&devices)[1].inner).fail_pause = Some("w".into());
        assert!(matches!(
            engine.pause(Some("w"), true),
            Err(Fail::OutOfMemory(_))
        ));
        assert!(lock(&devices)[0]
            .log()
            .contains(&"resume w on 0".to_string()));
        assert!(
            engine.alloc(0, MIB, Some(tag)).is_ok(),
            "the tag is awake again"
        );
        assert_eq!(engine.view().tags_paused, 0);
    }

    #[test]
    fn tags_in_a_range_and_the_tags_a_pause_would_take() {
        let (engine, _, _) = engine(false);
        let w = engine.register_tag("w");
        let kv = engine.register_tag("kv");
        let a = engine.alloc(0, 4 * MIB, Some(w.clone())).unwrap();
        let b = engine.alloc(0, 4 * MIB, Some(w)).unwrap();
        let c = engine.alloc(1, 2 * MIB, Some(kv)).unwrap();
        let plain = engine.alloc(0, 2 * MIB, None).unwrap();
        assert_eq!(engine.tags_in(a, 4 * MIB), vec![Arc::from("w")]);
        assert_eq!(
            engine.tags_in(b + 8, 16),
            vec![Arc::from("w")],
            "named once"
        );
        assert_eq!(engine.tags_in(c, 2 * MIB), vec![Arc::from("kv")]);
        assert!(engine.tags_in(plain, 2 * MIB).is_empty(), "untagged memory");
        assert!(engine.tags_in(0x1234, 64).is_empty(), "foreign memory");
        let mut all = engine.tags_to_pause(None).unwrap();
        all.sort();
        assert_eq!(all, vec![Arc::from("kv"), Arc::from("w")]);
        engine.pause(Some("w"), false).unwrap();
        assert_eq!(engine.tags_to_pause(None).unwrap(), vec![Arc::from("kv")]);
        assert!(
            engine.tags_to_pause(Some("w")).unwrap().is_empty(),
            "paused already"
        );
        assert_eq!(
            engine.tags_to_pause(Some("nope")),
            Err(Fail::UnknownTag("nope".into()))
        );
        assert_eq!(
            engine.paused_tags().into_iter().collect::<Vec<_>>(),
            vec![Arc::from("w")]
        );
        engine.resume(None).unwrap();
        assert!(engine.paused_tags().is_empty());
    }

    #[test]
    fn pause_of_all_tags_and_of_a_tag_without_memory() {
        let (engine, _, _) = engine(false);
        engine.register_tag("empty");
        assert_eq!(
            engine.pause(Some("empty"), false).unwrap(),
            Transfer::default()
        );
        assert_eq!(engine.view().tags_paused, 1);
        assert_eq!(engine.resume(None).unwrap(), Transfer::default());
        assert_eq!(engine.view().tags_paused, 0);
    }

    #[test]
    fn many_threads_allocate_and_free_without_losing_track() {
        let (engine, _, counters) = engine(false);
        let engine = Arc::new(engine);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let engine = engine.clone();
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for n in 0..50 {
                        let tag = (n % 3 == 0).then(|| engine.register_tag(&format!("t{t}")));
                        mine.push(engine.alloc(t % 2, MIB * (1 + n % 4), tag).unwrap());
                    }
                    for address in mine {
                        assert_eq!(engine.free(address), Ok(Freed::Done));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(engine.view().live_allocations, 0);
        assert_eq!(Counters::get(&counters.frees), 400);
    }
}
