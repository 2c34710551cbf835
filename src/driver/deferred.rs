//! The real release queues: one per device, holding the physical memory stablebuf's spaces,
//! datasets, regions and pools gave back (see [`super::held`] for the design), and the
//! functions of [`crate::release`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use cudarc::driver::{sys, CudaContext};

use super::held::{Held, Queue, ReleasePolicy, ReleaseStats};
use super::{activity, mark_quiet, memory_info};
use crate::error::Result;

/// A `cuMemCreate` handle no longer mapped anywhere, waiting to be reused or released.
#[derive(Debug)]
pub(crate) struct HeldPhysical {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) handle: sys::CUmemGenericAllocationHandle,
    pub(crate) bytes: usize,
}

impl Held for HeldPhysical {
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn release(self) {
        let handle = self.handle;
        super::release(&self.ctx, "cuMemRelease", self.bytes, || {
            // SAFETY: the handle came from cuMemCreate (non-exportable memory, never handed to
            // another process) and the queue releases each held handle once, here: it left
            // its `Physical` without being released (the `Physical` drop put it in the queue),
            // and a `Physical` maps only while it lives, so nothing is left mapped.
            unsafe { sys::cuMemRelease(handle) }
        });
    }
}

/// One device's queue: held allocations keyed by their size.
pub(crate) type DeviceQueue = Queue<usize, HeldPhysical>;

fn policy_cell() -> &'static RwLock<ReleasePolicy> {
    static POLICY: OnceLock<RwLock<ReleasePolicy>> = OnceLock::new();
    POLICY.get_or_init(|| RwLock::new(ReleasePolicy::from_env()))
}

/// The policy in force.
pub fn policy() -> ReleasePolicy {
    *policy_cell().read().unwrap_or_else(|p| p.into_inner())
}

fn registry() -> &'static Mutex<HashMap<usize, Weak<DeviceQueue>>> {
    static QUEUES: OnceLock<Mutex<HashMap<usize, Weak<DeviceQueue>>>> = OnceLock::new();
    QUEUES.get_or_init(Mutex::default)
}

/// The live queues, by device ordinal.
fn live() -> Vec<(usize, Arc<DeviceQueue>)> {
    let mut registry = registry().lock().unwrap_or_else(|p| p.into_inner());
    registry.retain(|_, weak| weak.strong_count() > 0);
    registry
        .iter()
        .filter_map(|(&ordinal, weak)| Some((ordinal, weak.upgrade()?)))
        .collect()
}

fn live_queue(ordinal: usize) -> Option<Arc<DeviceQueue>> {
    registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&ordinal)
        .and_then(Weak::upgrade)
}

/// Device `ordinal`'s queue, made if it has none. Every allocation made through it holds it:
/// when the last one goes, the queue releases what it holds.
pub(crate) fn device_queue(ordinal: usize) -> Arc<DeviceQueue> {
    let mut registry = registry().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(queue) = registry.get(&ordinal).and_then(Weak::upgrade) {
        return queue;
    }
    let queue = Arc::new(Queue::new(policy, activity, mark_quiet));
    registry.insert(ordinal, Arc::downgrade(&queue));
    queue
}

/// Sets how memory given back is released, for every device; a queue switched to
/// [`ReleaseMode::Immediate`](super::held::ReleaseMode::Immediate) keeps what it holds until
/// the next step, allocation or [`trim`].
pub fn set_policy(policy: ReleasePolicy) {
    *policy_cell().write().unwrap_or_else(|p| p.into_inner()) = policy;
    for (_, queue) in live() {
        queue.nudge();
    }
}

/// Releases everything device `ordinal` holds for release, now; returns the bytes released.
pub fn trim(ordinal: usize) -> usize {
    live_queue(ordinal).map_or(0, |queue| queue.trim())
}

/// Releases everything every device holds for release, now; returns the bytes released.
pub fn trim_all() -> usize {
    live().into_iter().map(|(_, queue)| queue.trim()).sum()
}

/// Releases one piece of at most `max_bytes` (at least one allocation, if any is held) of what
/// device `ordinal` holds; returns the bytes released. The hook for a process that knows when it
/// is idle (with [`ReleaseMode::Manual`](super::held::ReleaseMode::Manual)).
pub fn release_step(ordinal: usize, max_bytes: usize) -> usize {
    live_queue(ordinal).map_or(0, |queue| queue.step(max_bytes))
}

/// What device `ordinal`'s queue holds and did (all zero if it has none now: a queue goes with
/// the last allocation that came through it).
pub fn stats(ordinal: usize) -> ReleaseStats {
    live_queue(ordinal).map_or_else(ReleaseStats::default, |queue| queue.stats())
}

/// Bytes held for release on device `ordinal`.
pub fn held_bytes(ordinal: usize) -> usize {
    live_queue(ordinal).map_or(0, |queue| queue.held_bytes())
}

/// Releases held memory of `ctx`'s device, a piece at a time, until the driver reports at least
/// `bytes` free or nothing is held; returns the free bytes then (`cuMemGetInfo`). For a caller
/// about to allocate outside stablebuf (another library's allocator).
pub fn ensure_free(ctx: &CudaContext, bytes: usize) -> Result<usize> {
    let queue = live_queue(ctx.ordinal());
    loop {
        let (free, _) = memory_info(ctx)?;
        if free >= bytes {
            return Ok(free);
        }
        let released = queue
            .as_ref()
            .map_or(0, |queue| queue.step(bytes.saturating_sub(free)));
        if released == 0 {
            return Ok(free);
        }
    }
}
