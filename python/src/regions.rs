//! The process-wide regions and the one place that calls `stablebuf::region`.
//!
//! One `State` per process behind one lock: the tag table (tag → [`Region`], its device and
//! allocator slot), each device's context, and the pinned [`HostArena`] that sleeping regions
//! are copied into. The lock is held only to look things up or swap the arena; driver work
//! runs on a cloned [`Region`] handle (each region locks itself), so an allocation in one
//! region never waits for another region's sleep. Nothing here touches Python: the C entry
//! points call in without the GIL, and the bindings release the GIL around the slow calls.
//!
//! **Devices.** A region lives on the device it was registered on (PyTorch's current device
//! when its pool was made), in that device's primary context, the one PyTorch uses. Every call
//! acts on each region in the region's own context, on the stream the caller names for the
//! region's device ([`Streams`]), whatever device is current, and leaves the caller's context
//! current when it returns ([`ContextScope`]). The pinned arena is one per process: it is
//! pinned portable (`CU_MEMHOSTREGISTER_PORTABLE` / `CU_MEMHOSTALLOC_PORTABLE`), so every
//! context copies to and from it at pinned speed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use stablebuf::cudarc::driver::{CudaContext, CudaStream};
use stablebuf::device::borrow_stream;
use stablebuf::host::{StorageUsed, TransferReport};
use stablebuf::region::{
    timeline_svg, Region, RegionOptions, RegionStats, Snapshot, SwitchStrategy, Switched,
};
use stablebuf::{CostModel, FencePolicy, HostArena, HostStorage};

use crate::context::ContextScope;
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
    /// Each device's primary context, by ordinal, opened once.
    contexts: HashMap<usize, Arc<CudaContext>>,
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
        ctx.and_then(|ctx| stablebuf::device::memory_info(ctx).ok())
            .map(|(free, _)| free)
    } else {
        None
    };
    Failure::from_core(&error, free)
}

/// The context of `device` (its primary context, the one PyTorch uses), opened once.
fn context(state: &mut State, device: i32) -> Result<Arc<CudaContext>, Failure> {
    let ordinal = usize::try_from(device)
        .map_err(|_| Failure::new(Kind::Error, format!("invalid device index {device}")))?;
    if let Some(ctx) = state.contexts.get(&ordinal) {
        return Ok(ctx.clone());
    }
    // Opening makes the new context current: the caller's comes back.
    let _scope = ContextScope::keep();
    let ctx = stablebuf::open_device(ordinal).map_err(|e| failure(e, None))?;
    state.contexts.insert(ordinal, ctx.clone());
    Ok(ctx)
}

/// The primary context of `device`, opened once per process (regions and imported weight sets
/// of that device share it). The calling thread's current context is left as it was.
pub fn device_context(device: i32) -> Result<Arc<CudaContext>, Failure> {
    context(&mut state(), device)
}

/// Registers `tag` on `device` (creating its region there, `capacity` bytes of addresses) and
/// returns its allocator slot. Registering an existing tag returns its slot if `device` is
/// the tag's; from another device it is a [`Kind::DeviceMismatch`] naming both devices.
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
        let _scope = ContextScope::enter(&ctx)?;
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

/// The device `tag`'s region lives on.
pub fn device(tag: &str) -> Result<i32, Failure> {
    Ok(state().table.get(tag)?.device)
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

/// The allocation entry point of `slot`: `bytes` from that tag's region, which must live on
/// `device` (the device PyTorch allocates for); another device is a [`Kind::DeviceMismatch`].
pub fn alloc(slot: usize, bytes: usize, device: i32) -> Result<u64, Failure> {
    let (region, home) = {
        let state = state();
        let entry = state.table.at_slot(slot)?;
        (entry.region.clone(), entry.device)
    };
    if device != home {
        return Err(Failure::device_mismatch(region.tag(), home, device));
    }
    let _scope = ContextScope::enter(region.context())?;
    region
        .alloc(bytes)
        .map_err(|e| failure(e, Some(region.context())))
}

/// The free entry point: gives the allocation at `address` back to the region that holds it
/// (in the region's context, whichever device PyTorch frees from).
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
    let _scope = ContextScope::enter(region.context())?;
    region.free(address).map_err(|e| failure(e, None))
}

/// PyTorch's current stream (its handle) on each device, by device ordinal. A region's copies
/// and fences go on the stream of its own device, whatever device is current when the call is
/// made; a device with no entry uses its legacy default stream (handle 0), which is what
/// PyTorch uses before it has made any other current.
pub type Streams = HashMap<usize, usize>;

fn stream_handle(streams: &Streams, region: &Region) -> usize {
    streams
        .get(&region.context().ordinal())
        .copied()
        .unwrap_or(0)
}

/// Notes that the work enqueued so far on the streams of `streams` used the regions of `tags`
/// (each region's on its own device's stream): a later bind, sleep or free of a region created
/// with `last_use` waits up to here on that stream (an event; nothing waits now). A no-op for
/// the other regions.
pub fn note_use<S: AsRef<str>>(tags: &[S], streams: &Streams) -> Result<(), Failure> {
    let regions = regions(tags)?;
    let scope = ContextScope::keep();
    for region in regions {
        scope.switch_to(region.context())?;
        region
            .note_use(stream_handle(streams, &region) as u64)
            .map_err(|e| {
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

/// PyTorch's stream `handle` as a cudarc stream of `region`'s context, which must be current
/// (the caller's [`ContextScope`] made it so). A stream of another context (another device's)
/// is refused: the region's copies and fences must run on its own device.
fn borrowed_stream(region: &Region, handle: usize) -> Result<Arc<CudaStream>, Failure> {
    let ctx = region.context();
    // The core's `borrow_stream` asks the driver (`cuStreamGetCtx`); PyTorch keeps the stream
    // alive for the duration of the call, and the wrapper is dropped before the call returns.
    // Work a call leaves enqueued on it (a copy switch's copy) is the stream's like any
    // PyTorch kernel.
    let borrowed = borrow_stream(ctx, handle as u64).map_err(|error| {
        Failure::from_core(&error, None).context(format_args!(
            "checking the stream {handle:#x} given for region `{}`",
            region.tag()
        ))
    })?;
    borrowed.ok_or_else(|| {
        Failure::new(
            Kind::DeviceMismatch,
            format!(
                "stream {handle:#x} belongs to another device's context than region `{}`, which \
                 lives on device {}: pass that device's stream (torch.cuda.current_stream({}))",
                region.tag(),
                ctx.ordinal(),
                ctx.ordinal()
            ),
        )
    })
}

/// Round `bytes` up to whole arena steps.
pub fn arena_size(bytes: usize) -> usize {
    bytes.div_ceil(ARENA_STEP).max(1) * ARENA_STEP
}

/// A pinned arena with at least `needed` bytes free, pinning (again, through `ctx`) only when
/// the current one is too small and holds nothing. When it is too small but holds sleeping
/// regions, the current one is returned and the core streams what does not fit through it
/// (slower). The arena is portable: pinned through one device's context, it serves them all.
fn arena_for(
    state: &mut State,
    ctx: &Arc<CudaContext>,
    needed: usize,
) -> Result<Arc<HostArena>, Failure> {
    if let Some(arena) = &state.arena {
        let holds_nothing = arena.free_bytes() == arena.capacity();
        if arena.largest_free() >= needed || !holds_nothing {
            return Ok(arena.clone());
        }
    }
    pin(state, ctx, arena_size(needed))
}

fn pin(state: &mut State, ctx: &Arc<CudaContext>, bytes: usize) -> Result<Arc<HostArena>, Failure> {
    // Pinning and unpinning make their context current: the caller's comes back.
    let _scope = ContextScope::keep();
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
/// through `device`'s context, so that later sleeps only copy. The arena is one per process
/// and portable: the regions of every device sleep into it. Returns the arena's capacity.
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

/// Sleeps the regions of `tags`, each on its own device's stream of `streams`: with `keep`,
/// their bytes go to the pinned arena (pinned on first use); without, they are discarded. All
/// or nothing: an awake region that cannot sleep (unbound) refuses the call before any region
/// sleeps, and if one region fails while sleeping, the ones this call put to sleep are woken
/// again (with their contents only if `keep`) before the failure is returned.
pub fn sleep<S: AsRef<str>>(
    tags: &[S],
    keep: bool,
    streams: &Streams,
) -> Result<Vec<Transfer>, Failure> {
    let regions = regions(tags)?;
    let Some(first) = regions.first() else {
        return Ok(Vec::new());
    };
    // Refused up front rather than undone: waking back a region whose contents this call
    // discarded could not bring them back.
    for region in regions.iter().filter(|region| !region.is_asleep()) {
        region.check_replayable().map_err(|refusal| {
            failure_of(refusal, region).context(format_args!("sleeping region `{}`", region.tag()))
        })?;
    }
    let scope = ContextScope::keep();
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
            HostStorage::Pinned(arena_for(&mut state(), first.context(), needed)?)
        }
    } else {
        HostStorage::Discard
    };
    let mut done = Vec::with_capacity(regions.len());
    let mut slept_now: Vec<(&Region, Arc<CudaStream>)> = Vec::new();
    for region in &regions {
        let outcome = scope.switch_to(region.context()).and_then(|()| {
            let stream = borrowed_stream(region, stream_handle(streams, region))?;
            let was_asleep = region.is_asleep();
            let report = region.sleep(&storage, &stream).map_err(|error| {
                failure_of(error, region)
                    .context(format_args!("sleeping region `{}`", region.tag()))
            })?;
            Ok((report, was_asleep, stream))
        });
        match outcome {
            Ok((report, was_asleep, stream)) => {
                if !was_asleep {
                    slept_now.push((region, stream));
                }
                done.push(Transfer::new(region.tag(), &report));
            }
            Err(failure) => {
                for (undo, stream) in slept_now.iter().rev() {
                    let woken = scope
                        .switch_to(undo.context())
                        .and_then(|()| undo.wake(stream).map_err(|e| failure_of(e, undo)));
                    if let Err(undo_failure) = woken {
                        return Err(failure.context(format_args!(
                            "(waking `{}` back also failed: {}; it stays asleep)",
                            undo.tag(),
                            undo_failure.message
                        )));
                    }
                }
                return Err(failure);
            }
        }
    }
    Ok(done)
}

/// A core error of `region`'s as a [`Failure`] (out of memory: with its device's free bytes).
fn failure_of(error: stablebuf::Error, region: &Region) -> Failure {
    failure(error, Some(region.context()))
}

/// Wakes the regions of `tags`, each backed by one allocation under one mapping, each on its
/// own device's stream of `streams`. Waking an awake region does nothing. On failure the
/// regions before the failing one are awake, the failing one and those after it still asleep
/// with their host copies: retrying is safe.
pub fn wake<S: AsRef<str>>(tags: &[S], streams: &Streams) -> Result<Vec<Transfer>, Failure> {
    let regions = regions(tags)?;
    let scope = ContextScope::keep();
    let mut done = Vec::with_capacity(regions.len());
    for region in &regions {
        scope.switch_to(region.context())?;
        let stream = borrowed_stream(region, stream_handle(streams, region))?;
        let report = region.wake(&stream).map_err(|e| {
            failure_of(e, region).context(format_args!("waking region `{}`", region.tag()))
        })?;
        done.push(Transfer::new(region.tag(), &report));
    }
    Ok(done)
}

/// A weight set of `tag`: a second backing of its used span holding the current contents,
/// copied on `stream` (PyTorch's stream of the region's device).
pub fn snapshot(tag: &str, stream: usize) -> Result<Snapshot, Failure> {
    let region = region(tag)?;
    let _scope = ContextScope::enter(region.context())?;
    let stream = borrowed_stream(&region, stream)?;
    region.snapshot(&stream).map_err(|e| failure_of(e, &region))
}

/// A weight set of `tag` in memory another process can import (the publish path).
pub fn snapshot_shareable(tag: &str, stream: usize) -> Result<Snapshot, Failure> {
    let region = region(tag)?;
    let _scope = ContextScope::enter(region.context())?;
    let stream = borrowed_stream(&region, stream)?;
    region
        .snapshot_shareable(&stream)
        .map_err(|e| failure_of(e, &region))
}

/// Wakes the sleeping region `tag` straight onto `weights` (one mapping, no copy).
pub fn wake_onto(tag: &str, weights: &Snapshot) -> Result<(), Failure> {
    let region = region(tag)?;
    let _scope = ContextScope::enter(region.context())?;
    region
        .wake_onto(weights)
        .map_err(|e| failure_of(e, &region))
}

/// The first address of `tag`'s reservation: manifests give offsets from it.
pub fn base(tag: &str) -> Result<u64, Failure> {
    Ok(region(tag)?.base())
}

/// Where `weights` (a weight set of region `tag`) is mapped at its private home address, in
/// `tag`'s context (the first call maps it: one map and set-access). Its memory is the bound
/// memory when the set is bound, so a copy there changes what the region's tensors read.
pub fn home_of(tag: &str, weights: &Snapshot) -> Result<u64, Failure> {
    let region = region(tag)?;
    let _scope = ContextScope::enter(region.context())?;
    weights.home_ptr().map_err(|e| failure_of(e, &region))
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
    let _scope = ContextScope::enter(region.context())?;
    let previous = region.bound();
    region.bind(weights).map_err(|e| failure_of(e, &region))?;
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
/// says: by remap (as [`bind`]) or by a copy, enqueued on `stream` (PyTorch's stream of the
/// region's device), into the region's own live set. Returns which way it went.
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
    let _scope = ContextScope::enter(region.context())?;
    let stream = borrowed_stream(&region, stream)?;
    region
        .switch_to(weights, strategy, &stream)
        .map_err(|e| failure_of(e, &region))
}

/// The weight-set size above which a remap is cheaper than a copy on `device`, from its cost
/// model (calibrated once per process: tens of milliseconds, 1 GiB of device memory meanwhile);
/// `None` if one way always wins.
pub fn crossover_bytes(device: i32) -> Result<Option<usize>, Failure> {
    let ctx = device_context(device)?;
    let _scope = ContextScope::enter(&ctx)?;
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
    let _scope = ContextScope::enter(region.context())?;
    region.unbind().map_err(|e| failure(e, None))
}

/// `Ok` if a graph over the regions of `tags` may replay now.
pub fn check_replayable<S: AsRef<str>>(tags: &[S]) -> Result<(), Failure> {
    for region in regions(tags)? {
        region.check_replayable().map_err(|e| failure(e, None))?;
    }
    Ok(())
}

/// Every region's statistics and the device it lives on, in slot order.
pub fn stats() -> Vec<(RegionStats, i32)> {
    let regions: Vec<(Region, i32)> = state()
        .table
        .entries()
        .iter()
        .map(|entry| (entry.region.clone(), entry.device))
        .collect();
    regions
        .iter()
        .map(|(region, device)| (region.stats(), *device))
        .collect()
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
        let streams = Streams::new();
        for failure in [
            sleep(&["missing"], true, &streams).unwrap_err(),
            wake(&["missing"], &streams).unwrap_err(),
            note_use(&["missing"], &streams).unwrap_err(),
            snapshot("missing", 0).unwrap_err(),
            unbind("missing").unwrap_err(),
            check_replayable(&["missing"]).unwrap_err(),
            bound("missing").unwrap_err(),
            device("missing").unwrap_err(),
        ] {
            assert_eq!(failure.kind, Kind::UnknownTag, "{failure}");
        }
        assert_eq!(sleep::<&str>(&[], true, &streams), Ok(Vec::new()));
        assert_eq!(wake::<&str>(&[], &streams), Ok(Vec::new()));
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
