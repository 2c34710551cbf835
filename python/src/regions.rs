//! The process-wide regions and the one place that calls `stablebuf::region`.
//!
//! One `State` per process behind one lock: the tag table (tag → [`Region`], allocator slot),
//! the device's context, and the pinned [`HostArena`] that sleeping regions are copied into.
//! The lock is held only to look things up or swap the arena; driver work runs on a cloned
//! [`Region`] handle (each region locks itself), so an allocation in one region never waits for
//! another region's sleep. Nothing here touches Python: the C entry points call in without the
//! GIL, and the bindings release the GIL around the slow calls.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use stablebuf::cudarc::driver::{sys, CudaContext, CudaStream};
use stablebuf::region::{
    timeline_svg, Region, RegionOptions, RegionStats, Snapshot, SwitchStrategy, Switched,
};
use stablebuf::{CostModel, FencePolicy, HostArena, HostStorage, StorageUsed, TransferReport};

use crate::errors::{Failure, Kind};
use crate::tags::{Reserved, TagTable};

impl Reserved for Region {
    fn base(&self) -> u64 {
        Region::base(self)
    }
    fn capacity(&self) -> usize {
        Region::capacity(self)
    }
}

/// Pinned host memory grows in steps of this, so that a slightly larger second sleep reuses the
/// arena instead of pinning again.
const ARENA_STEP: usize = 64 << 20;

#[derive(Default)]
struct State {
    table: TagTable<Region>,
    ctx: Option<Arc<CudaContext>>,
    arena: Option<Arc<HostArena>>,
    /// How long the last pin of the arena took, and how many pins there were.
    last_pin: Duration,
    pins: u32,
}

fn state() -> MutexGuard<'static, State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE
        .get_or_init(Mutex::default)
        .lock()
        // Every update below is a single assignment or push: a panic cannot leave it half done.
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A core error as a [`Failure`]; out-of-memory errors also say how much the device has free.
fn failure(error: stablebuf::Error, ctx: Option<&CudaContext>) -> Failure {
    let free = if error.is_out_of_memory() {
        ctx.and_then(|ctx| stablebuf::memory_info(ctx).ok())
            .map(|(free, _)| free)
    } else {
        None
    };
    Failure::from_core(&error, free)
}

/// The context of `device` (its primary context, the one PyTorch uses), opened once.
fn context(state: &mut State, device: i32) -> Result<Arc<CudaContext>, Failure> {
    if let Some(ctx) = &state.ctx {
        if ctx.ordinal() as i32 != device {
            return Err(Failure::new(
                Kind::Error,
                format!(
                    "stablebuf uses device {} in this process, not device {device}",
                    ctx.ordinal()
                ),
            ));
        }
        return Ok(ctx.clone());
    }
    let ordinal = usize::try_from(device)
        .map_err(|_| Failure::new(Kind::Error, format!("invalid device index {device}")))?;
    let ctx = stablebuf::open_device(ordinal).map_err(|e| failure(e, None))?;
    state.ctx = Some(ctx.clone());
    Ok(ctx)
}

/// Registers `tag` on `device` (creating its region, `capacity` bytes of addresses) and
/// returns its allocator slot. Registering an existing tag returns its slot.
/// With `last_use`, the region's fence is [`FencePolicy::LastUse`]: a bind, sleep or free waits
/// only for the uses noted with [`note_use`] (guarded replays note theirs), so a bind of this
/// region overlaps a replay over another region queued after its last use. Only a new region
/// takes the option; an existing tag keeps the fence it was created with.
pub fn register(
    tag: &str,
    device: i32,
    capacity: Option<usize>,
    last_use: bool,
) -> Result<usize, Failure> {
    let mut state = state();
    if state.table.slot(tag).is_some() {
        // Only checks the device: an existing tag creates nothing.
        return state.table.register(tag, device, already_registered);
    }
    crate::tags::validate_tag(tag)?;
    let ctx = context(&mut state, device)?;
    let mut options = RegionOptions::default();
    if let Some(capacity) = capacity {
        options = options.capacity(capacity);
    }
    if last_use {
        options = options.fence(FencePolicy::LastUse);
    }
    state.table.register(tag, device, || {
        Region::new(&ctx, tag, options).map_err(|e| failure(e, Some(&ctx)))
    })
}

fn already_registered() -> Result<Region, Failure> {
    Err(Failure::internal(
        "a region was about to be created for a tag that has one",
    ))
}

/// Registered tags, in slot order.
pub fn tags() -> Vec<String> {
    state()
        .table
        .tags()
        .into_iter()
        .map(str::to_string)
        .collect()
}

fn region(tag: &str) -> Result<Region, Failure> {
    Ok(state().table.get(tag)?.region.clone())
}

fn regions<S: AsRef<str>>(tags: &[S]) -> Result<Vec<Region>, Failure> {
    let state = state();
    Ok(state
        .table
        .resolve(tags)?
        .into_iter()
        .map(|entry| entry.region.clone())
        .collect())
}

/// The allocation entry point of `slot`: `bytes` from that tag's region, on `device`.
pub fn alloc(slot: usize, bytes: usize, device: i32) -> Result<u64, Failure> {
    let (region, home) = {
        let state = state();
        let entry = state.table.at_slot(slot)?;
        (entry.region.clone(), entry.device)
    };
    if device != home {
        return Err(Failure::new(
            Kind::Error,
            format!(
                "region `{}` lives on device {home}; PyTorch asked for memory on device {device}",
                region.tag()
            ),
        ));
    }
    region
        .alloc(bytes)
        .map_err(|e| failure(e, Some(region.context())))
}

/// The free entry point: gives the allocation at `address` back to the region that holds it.
pub fn free(address: u64) -> Result<usize, Failure> {
    let region = state()
        .table
        .owner(address)
        .map(|entry| entry.region.clone())
        .ok_or_else(|| {
            Failure::new(
                Kind::Error,
                format!("no stablebuf region holds address {address:#x}"),
            )
        })?;
    region.free(address).map_err(|e| failure(e, None))
}

/// Notes that the work enqueued so far on `stream` (PyTorch's stream handle) used the regions
/// of `tags`: a later bind, sleep or free of a region created with `last_use` waits up to here
/// on that stream (an event; nothing waits now). A no-op for the other regions.
pub fn note_use<S: AsRef<str>>(tags: &[S], stream: usize) -> Result<(), Failure> {
    for region in regions(tags)? {
        region.note_use(stream as u64).map_err(|e| {
            failure(e, None).context(format_args!("noting a use of `{}`", region.tag()))
        })?;
    }
    Ok(())
}

/// The tag of the region whose reservation holds `address`.
pub fn owner(address: u64) -> Option<String> {
    state().table.owner(address).map(|entry| entry.tag.clone())
}

/// What one sleep or wake of one region did.
#[derive(Clone, Debug, PartialEq)]
pub struct Transfer {
    pub tag: String,
    pub bytes: usize,
    pub seconds: f64,
    pub storage: &'static str,
}

impl Transfer {
    fn new(tag: &str, report: &TransferReport) -> Self {
        Self {
            tag: tag.to_string(),
            bytes: report.bytes,
            seconds: report.elapsed.as_secs_f64(),
            storage: match report.storage {
                StorageUsed::Arena => "pinned",
                StorageUsed::ArenaStaged => "pageable (staged through the pinned arena)",
                StorageUsed::Pageable => "pageable",
                StorageUsed::Discarded => "discarded",
            },
        }
    }
}

/// Torch's stream as a cudarc stream of `ctx`.
fn borrowed_stream(ctx: &Arc<CudaContext>, handle: usize) -> Arc<CudaStream> {
    // SAFETY: `handle` is PyTorch's current stream on the regions' device (the Python layer
    // passes `torch.cuda.current_stream().cuda_stream`), so it belongs to this (primary)
    // context; PyTorch keeps it alive for the duration of the call, and the wrapper (which
    // does not destroy a borrowed stream) is dropped before the call returns. Work a call
    // leaves enqueued on it (a copy switch's copy) is the stream's like any PyTorch kernel.
    unsafe { ctx.wrap_borrowed_stream(handle as sys::CUstream) }
}

/// Round `bytes` up to whole arena steps.
pub fn arena_size(bytes: usize) -> usize {
    bytes.div_ceil(ARENA_STEP).max(1) * ARENA_STEP
}

/// A pinned arena with at least `needed` bytes free, pinning (again) only when the current
/// one is too small and holds nothing. When it is too small but holds sleeping regions, the
/// current one is returned and the core streams what does not fit through it (slower).
fn arena_for(state: &mut State, needed: usize) -> Result<Arc<HostArena>, Failure> {
    if let Some(arena) = &state.arena {
        let holds_nothing = arena.free_bytes() == arena.capacity();
        if arena.largest_free() >= needed || !holds_nothing {
            return Ok(arena.clone());
        }
    }
    let ctx = state
        .ctx
        .clone()
        .ok_or_else(|| Failure::new(Kind::Error, "no region exists yet"))?;
    pin(state, &ctx, arena_size(needed))
}

fn pin(state: &mut State, ctx: &Arc<CudaContext>, bytes: usize) -> Result<Arc<HostArena>, Failure> {
    // Unpin the old one first: both at once could exhaust pinnable memory.
    state.arena = None;
    let start = Instant::now();
    let arena = HostArena::new(ctx, bytes).map_err(|e| failure(e, None))?;
    state.last_pin = start.elapsed();
    state.pins += 1;
    state.arena = Some(arena.clone());
    Ok(arena)
}

/// Pins `bytes` of host memory for sleeping regions now (the slow step: about 0.5 s per GiB),
/// so that later sleeps only copy. Returns the arena's capacity.
pub fn reserve_host(bytes: usize, device: i32) -> Result<usize, Failure> {
    let mut state = state();
    let ctx = context(&mut state, device)?;
    if let Some(arena) = &state.arena {
        if arena.capacity() >= bytes {
            return Ok(arena.capacity());
        }
        if arena.free_bytes() != arena.capacity() {
            return Err(Failure::new(
                Kind::Error,
                format!(
                    "cannot grow the pinned arena to {bytes} bytes while sleeping regions hold \
                     {} bytes of it: wake them first",
                    arena.capacity() - arena.free_bytes()
                ),
            ));
        }
    }
    Ok(pin(&mut state, &ctx, arena_size(bytes))?.capacity())
}

/// The arena's capacity and free bytes, the seconds its last pin took and how many pins there
/// were; `None` before the first pin.
pub fn host_arena() -> Option<(usize, usize, f64, u32)> {
    let state = state();
    state.arena.as_ref().map(|arena| {
        (
            arena.capacity(),
            arena.free_bytes(),
            state.last_pin.as_secs_f64(),
            state.pins,
        )
    })
}

/// Sleeps the regions of `tags`: with `keep`, their bytes go to the pinned arena (pinned on
/// first use); without, they are discarded. All or nothing: if one region fails, the ones this
/// call put to sleep are woken again before the failure is returned.
pub fn sleep<S: AsRef<str>>(
    tags: &[S],
    keep: bool,
    stream: usize,
) -> Result<Vec<Transfer>, Failure> {
    let regions = regions(tags)?;
    let Some(first) = regions.first() else {
        return Ok(Vec::new());
    };
    let ctx = first.context().clone();
    let storage = if keep {
        let needed: usize = regions
            .iter()
            .map(Region::stats)
            .filter(|stats| !stats.asleep)
            .map(|stats| stats.allocated)
            .sum();
        if needed == 0 {
            HostStorage::Discard
        } else {
            HostStorage::Pinned(arena_for(&mut state(), needed)?)
        }
    } else {
        HostStorage::Discard
    };
    let stream = borrowed_stream(&ctx, stream);
    let mut done = Vec::with_capacity(regions.len());
    let mut slept_now: Vec<&Region> = Vec::new();
    for region in &regions {
        let was_asleep = region.is_asleep();
        match region.sleep(&storage, &stream) {
            Ok(report) => {
                if !was_asleep {
                    slept_now.push(region);
                }
                done.push(Transfer::new(region.tag(), &report));
            }
            Err(error) => {
                let failure = failure(error, Some(&ctx))
                    .context(format_args!("sleeping region `{}`", region.tag()));
                for undo in slept_now.iter().rev() {
                    if let Err(undo_error) = undo.wake(&stream) {
                        return Err(failure.context(format_args!(
                            "(waking `{}` back also failed: {undo_error}; it stays asleep)",
                            undo.tag()
                        )));
                    }
                }
                return Err(failure);
            }
        }
    }
    Ok(done)
}

/// Wakes the regions of `tags`, each backed by one allocation under one mapping. Waking an
/// awake region does nothing. On failure the regions before the failing one are awake, the
/// failing one and those after it still asleep with their host copies: retrying is safe.
pub fn wake<S: AsRef<str>>(tags: &[S], stream: usize) -> Result<Vec<Transfer>, Failure> {
    let regions = regions(tags)?;
    let Some(first) = regions.first() else {
        return Ok(Vec::new());
    };
    let stream = borrowed_stream(first.context(), stream);
    let mut done = Vec::with_capacity(regions.len());
    for region in &regions {
        let report = region.wake(&stream).map_err(|e| {
            failure(e, Some(region.context()))
                .context(format_args!("waking region `{}`", region.tag()))
        })?;
        done.push(Transfer::new(region.tag(), &report));
    }
    Ok(done)
}

/// A weight set of `tag`: a second backing of its used span holding the current contents.
pub fn snapshot(tag: &str, stream: usize) -> Result<Snapshot, Failure> {
    let region = region(tag)?;
    let stream = borrowed_stream(region.context(), stream);
    region
        .snapshot(&stream)
        .map_err(|e| failure(e, Some(region.context())))
}

/// A weight set of `tag` in memory another process can import (the publish path).
pub fn snapshot_shareable(tag: &str, stream: usize) -> Result<Snapshot, Failure> {
    let region = region(tag)?;
    let stream = borrowed_stream(region.context(), stream);
    region
        .snapshot_shareable(&stream)
        .map_err(|e| failure(e, Some(region.context())))
}

/// Wakes the sleeping region `tag` straight onto `weights` (one mapping, no copy).
pub fn wake_onto(tag: &str, weights: &Snapshot) -> Result<(), Failure> {
    let region = region(tag)?;
    region
        .wake_onto(weights)
        .map_err(|e| failure(e, Some(region.context())))
}

/// The first address of `tag`'s reservation: manifests give offsets from it.
pub fn base(tag: &str) -> Result<u64, Failure> {
    Ok(region(tag)?.base())
}

/// The context of the region `tag` (where its weight sets live).
pub fn device_context_of(tag: &str) -> Result<Arc<CudaContext>, Failure> {
    Ok(region(tag)?.context().clone())
}

/// A core error as a [`Failure`] (for the publish bindings).
pub fn core_failure(error: stablebuf::Error) -> Failure {
    failure(error, None)
}

/// Binds `weights` (taken from region `weights_tag`) under `tag`'s addresses and returns the
/// weight set that was bound before (`None` if the region had none).
pub fn bind(tag: &str, weights: &Snapshot, weights_tag: &str) -> Result<Option<Snapshot>, Failure> {
    let region = region(tag)?;
    if weights.region_id() != region.id() {
        return Err(Failure::new(
            Kind::SnapshotMismatch,
            format!(
                "a weight set of region `{weights_tag}` cannot be bound into region `{tag}`: \
                 bind weight sets into the region they were taken from"
            ),
        ));
    }
    let previous = region.bound();
    region
        .bind(weights)
        .map_err(|e| failure(e, Some(region.context())))?;
    Ok(previous)
}

/// A switch strategy by its Python name: `"auto"`, `"copy"` or `"remap"`.
pub fn parse_strategy(name: &str) -> Option<SwitchStrategy> {
    match name {
        "auto" => Some(SwitchStrategy::Auto),
        "copy" => Some(SwitchStrategy::Copy),
        "remap" => Some(SwitchStrategy::Remap),
        _ => None,
    }
}

/// The Python name of the way a switch went: `"copy"` or `"remap"`.
pub fn way_name(way: Switched) -> &'static str {
    match way {
        Switched::Copied => "copy",
        Switched::Remapped => "remap",
    }
}

/// Makes `tag`'s region read `weights` (taken from region `weights_tag`) the way `strategy`
/// says: by remap (as [`bind`]) or by a copy, enqueued on `stream`, into the region's own live
/// set. Returns which way it went.
pub fn switch(
    tag: &str,
    weights: &Snapshot,
    weights_tag: &str,
    strategy: SwitchStrategy,
    stream: usize,
) -> Result<Switched, Failure> {
    let region = region(tag)?;
    if weights.region_id() != region.id() {
        return Err(Failure::new(
            Kind::SnapshotMismatch,
            format!(
                "a weight set of region `{weights_tag}` cannot be switched into region `{tag}`: \
                 switch to weight sets of the region they were taken from"
            ),
        ));
    }
    let stream = borrowed_stream(region.context(), stream);
    region
        .switch_to(weights, strategy, &stream)
        .map_err(|e| failure(e, Some(region.context())))
}

/// The weight-set size above which a remap is cheaper than a copy on `device`, from its cost
/// model (calibrated once per process: tens of milliseconds, 1 GiB of device memory meanwhile);
/// `None` if one way always wins.
pub fn crossover_bytes(device: i32) -> Result<Option<usize>, Failure> {
    let ctx = context(&mut state(), device)?;
    let model = CostModel::for_device(&ctx).map_err(|e| failure(e, Some(&ctx)))?;
    Ok(model.crossover_bytes())
}

/// The weight set bound under `tag` now, if the region is consolidated.
pub fn bound(tag: &str) -> Result<Option<Snapshot>, Failure> {
    Ok(region(tag)?.bound())
}

/// Unmaps `tag`'s weight set; guarded replays then raise `Unbound` until a bind.
pub fn unbind(tag: &str) -> Result<(), Failure> {
    let region = region(tag)?;
    region.unbind().map_err(|e| failure(e, None))
}

/// `Ok` if a graph over the regions of `tags` may replay now.
pub fn check_replayable<S: AsRef<str>>(tags: &[S]) -> Result<(), Failure> {
    for region in regions(tags)? {
        region.check_replayable().map_err(|e| failure(e, None))?;
    }
    Ok(())
}

/// Every region's statistics, in slot order.
pub fn stats() -> Vec<RegionStats> {
    let regions: Vec<Region> = state()
        .table
        .entries()
        .iter()
        .map(|entry| entry.region.clone())
        .collect();
    regions.iter().map(Region::stats).collect()
}

/// The SVG timeline of every region's maps, unmaps, allocations and frees.
pub fn timeline(title: &str) -> Result<String, Failure> {
    let regions: Vec<Region> = state()
        .table
        .entries()
        .iter()
        .map(|entry| entry.region.clone())
        .collect();
    timeline_svg(&regions, title).map_err(|e| failure(e, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Everything else here needs a GPU (python/tests/test_gpu.py covers it); without a driver
    // these are the paths a CPU machine takes.

    #[test]
    fn unknown_tags_fail_before_any_driver_call() {
        for failure in [
            sleep(&["missing"], true, 0).unwrap_err(),
            wake(&["missing"], 0).unwrap_err(),
            snapshot("missing", 0).unwrap_err(),
            unbind("missing").unwrap_err(),
            check_replayable(&["missing"]).unwrap_err(),
            bound("missing").unwrap_err(),
        ] {
            assert_eq!(failure.kind, Kind::UnknownTag, "{failure}");
        }
        assert_eq!(sleep::<&str>(&[], true, 0), Ok(Vec::new()));
        assert_eq!(check_replayable::<&str>(&[]), Ok(()));
    }

    #[test]
    fn unregistered_slots_and_foreign_addresses_are_errors_not_crashes() {
        assert_eq!(alloc(63, 1 << 20, 0).unwrap_err().kind, Kind::UnknownTag);
        assert_eq!(free(0xdead_0000).unwrap_err().kind, Kind::Error);
        assert_eq!(owner(0xdead_0000), None);
    }

    #[test]
    fn without_a_driver_registering_says_so_and_registers_nothing() {
        if stablebuf::driver_present() {
            return; // a GPU machine: test_gpu.py covers registration
        }
        let failure = register("weights", 0, None, false).unwrap_err();
        assert!(failure.message.contains("CUDA driver"), "{failure}");
        assert!(!tags().contains(&"weights".to_string()));
        assert!(reserve_host(1 << 20, 0).is_err());
        assert_eq!(host_arena(), None);
    }

    #[test]
    fn strategies_and_ways_have_their_python_names() {
        assert_eq!(parse_strategy("auto"), Some(SwitchStrategy::Auto));
        assert_eq!(parse_strategy("copy"), Some(SwitchStrategy::Copy));
        assert_eq!(parse_strategy("remap"), Some(SwitchStrategy::Remap));
        for bad in ["", "Auto", "copy-in", "bind"] {
            assert_eq!(parse_strategy(bad), None, "{bad}");
        }
        assert_eq!(way_name(Switched::Copied), "copy");
        assert_eq!(way_name(Switched::Remapped), "remap");
    }

    #[test]
    fn without_a_driver_the_crossover_says_so() {
        if stablebuf::driver_present() {
            return; // a GPU machine: test_gpu.py covers it
        }
        let failure = crossover_bytes(0).unwrap_err();
        assert!(failure.message.contains("CUDA driver"), "{failure}");
    }

    #[test]
    fn arenas_grow_in_whole_steps() {
        assert_eq!(arena_size(1), ARENA_STEP);
        assert_eq!(arena_size(ARENA_STEP), ARENA_STEP);
        assert_eq!(arena_size(ARENA_STEP + 1), 2 * ARENA_STEP);
        assert_eq!(arena_size(0), ARENA_STEP);
    }
}
