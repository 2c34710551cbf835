//! Memory released in the background (issue 43): the per-device release queue.
//!
//! Right after a large `cuMemRelease` the driver's next `cuMemSetAccess` calls are 6–20× slower
//! (measured on an H100: binds after dropping a 2 × 16 GiB space). So when a space, a dataset, a
//! region's set or a pool's cache gives physical memory back, stablebuf does not release it on
//! the caller's path. The memory, already unmapped (the owners' fences decided that the GPU is
//! done with it; this queue never unmaps anything, it only defers `cuMemRelease`), goes to its
//! device's [`Queue`], which
//!
//! - serves the next allocation of the same device and size from it (no `cuMemCreate`);
//! - releases it in bounded pieces (at most [`ReleasePolicy::piece_bytes`] a step, at least one
//!   allocation) when the process is idle: a background thread per device wakes when memory is
//!   held, and releases a piece once no driver call of stablebuf's has been made for
//!   [`ReleasePolicy::idle`] (the *idle hook*: every driver call goes through
//!   [`traced`](super::traced), which bumps a counter the thread watches), then the next piece
//!   after [`ReleasePolicy::gap`] if still idle;
//! - releases pieces when an allocation needs the memory: `cuMemCreate` out of memory releases
//!   a piece at least as large as the request and retries, until nothing is held;
//! - releases everything at [`trim`](crate::release::trim), and when the last owner goes (the
//!   last live allocation of the device that came through the queue: at the end of a process
//!   nothing stays held).
//!
//! Only memory that stablebuf creates for its own spaces, datasets, regions and pools takes this
//! path; exportable memory (another process may still map it), imported memory, host memory, and
//! the raw [`Physical`](super::vmm::Physical) a caller makes with `Physical::new` are released at
//! once as before, so the raw-driver floors of the benches stay raw.
//!
//! The queue itself is generic over what it holds ([`Held`]) so the property tests run it against
//! a fake device on the CPU.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::Result;

/// When memory given back is released to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseMode {
    /// `cuMemRelease` at once, on the caller's path (stablebuf before issue 43).
    Immediate,
    /// Held for reuse; released in pieces by a background thread when the process is idle,
    /// when an allocation needs the memory, or at `trim()`. The default.
    Background,
    /// Held for reuse; released only when an allocation needs the memory, by
    /// [`release_step`](crate::release::release_step) (call it from your own idle hook) or at
    /// `trim()`.
    Manual,
}

/// How the release queues behave; see the module docs. Set with
/// [`set_policy`](crate::release::set_policy), or with the environment variable
/// `STABLEBUF_RELEASE` (`immediate`, `background` or `manual`) read once at first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleasePolicy {
    /// Immediate, background or manual release.
    pub mode: ReleaseMode,
    /// How long no driver call of stablebuf's must have been made before the background
    /// thread releases a piece.
    pub idle: Duration,
    /// Between two pieces of one idle stretch (still no other driver call).
    pub gap: Duration,
    /// Bytes released at most in one piece (one allocation larger than this is still one
    /// piece; 0 releases one allocation a piece).
    pub piece_bytes: usize,
}

impl Default for ReleasePolicy {
    fn default() -> Self {
        Self {
            mode: ReleaseMode::Background,
            idle: Duration::from_millis(20),
            gap: Duration::from_millis(1),
            // 1 GiB: on an H100, binds 100 ms after an idle release of 32 GiB cost 1.06x the
            // quiet bind with 1 GiB pieces, 1.23x with 256 MiB and 1.71x with 64 MiB (many
            // small releases keep the driver slow longer); a bind that lands during a piece
            // waits for at most one `cuMemRelease` of 1 GiB (~0.5 ms).
            piece_bytes: 1 << 30,
        }
    }
}

impl ReleasePolicy {
    /// The policy `STABLEBUF_RELEASE` asks for (the default for an unset or unknown value).
    pub fn from_env() -> Self {
        let mode = match std::env::var("STABLEBUF_RELEASE").as_deref() {
            Ok("immediate") => ReleaseMode::Immediate,
            Ok("manual") => ReleaseMode::Manual,
            _ => ReleaseMode::Background,
        };
        Self {
            mode,
            ..Self::default()
        }
    }
}

/// What a device's release queue did, since the process started (the `held_*` fields: now).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReleaseStats {
    /// Bytes of physical memory held for release now (unmapped, reusable at once).
    pub held_bytes: usize,
    /// Allocations held for release now.
    pub held_allocations: usize,
    /// Pieces of releasing done (background steps, steps asked for, trims, retries).
    pub pieces: u64,
    /// Allocations released to the driver (`cuMemRelease`) by the queue.
    pub releases: u64,
    /// Bytes released to the driver by the queue.
    pub released_bytes: u64,
    /// Allocations served from the queue instead of `cuMemCreate`.
    pub reused: u64,
    /// Bytes served from the queue.
    pub reused_bytes: u64,
    /// `cuMemCreate` calls that ran out of memory and were retried after releasing a piece.
    pub retries: u64,
    /// Pieces the background thread released.
    pub background_pieces: u64,
}

/// Something the queue can hold and release: an allocation that is no longer mapped.
pub(crate) trait Held: Send + 'static {
    fn bytes(&self) -> usize;
    /// Gives the memory back to the driver. Consumes it: released once.
    fn release(self);
}

type PolicySource = Box<dyn Fn() -> ReleasePolicy + Send + Sync>;
type ActivitySource = Box<dyn Fn() -> u64 + Send + Sync>;

struct State<K, H> {
    /// Held allocations by arrival: the oldest is released first.
    entries: BTreeMap<u64, (K, H)>,
    /// Arrival numbers of the held allocations of each key; the newest is reused first.
    by_key: HashMap<K, Vec<u64>>,
    next: u64,
    held_bytes: usize,
    /// Puts and takes so far: the queue's own share of "the process is busy".
    touches: u64,
    stats: ReleaseStats,
    shutdown: bool,
}

impl<K: Eq + Hash + Clone, H: Held> State<K, H> {
    fn insert(&mut self, key: K, held: H) {
        let seq = self.next;
        self.next += 1;
        self.held_bytes += held.bytes();
        self.by_key.entry(key.clone()).or_default().push(seq);
        self.entries.insert(seq, (key, held));
        self.touches += 1;
    }

    fn take(&mut self, key: &K) -> Option<H> {
        let seqs = self.by_key.get_mut(key)?;
        let seq = seqs.pop()?;
        if seqs.is_empty() {
            self.by_key.remove(key);
        }
        let (_, held) = self.entries.remove(&seq)?;
        self.held_bytes -= held.bytes();
        self.touches += 1;
        self.stats.reused += 1;
        self.stats.reused_bytes += held.bytes() as u64;
        Some(held)
    }

    /// Takes out the oldest allocations, up to `budget` bytes (at least one if any is held).
    fn piece(&mut self, budget: usize) -> Vec<H> {
        let mut piece = Vec::new();
        let mut bytes = 0usize;
        while let Some(entry) = self.entries.first_entry() {
            let size = entry.get().1.bytes();
            if !piece.is_empty() && bytes.saturating_add(size) > budget {
                break;
            }
            let seq = *entry.key();
            let (key, held) = entry.remove();
            if let Some(seqs) = self.by_key.get_mut(&key) {
                seqs.retain(|&s| s != seq);
                if seqs.is_empty() {
                    self.by_key.remove(&key);
                }
            }
            self.held_bytes -= size;
            bytes = bytes.saturating_add(size);
            piece.push(held);
        }
        piece
    }
}

struct Shared<K, H> {
    state: Mutex<State<K, H>>,
    wake: Condvar,
    policy: PolicySource,
    activity: ActivitySource,
}

impl<K, H> Shared<K, H> {
    fn lock(&self) -> MutexGuard<'_, State<K, H>> {
        // Every update is a few assignments with no call that can panic between them.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One device's release queue. See the module docs.
pub(crate) struct Queue<K: Eq + Hash + Clone + Send + 'static, H: Held> {
    shared: Arc<Shared<K, H>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Runs on the worker thread before anything else (the real queue marks it quiet, so its
    /// own releases do not count as activity).
    on_worker_start: fn(),
}

impl<K: Eq + Hash + Clone + Send + 'static, H: Held> std::fmt::Debug for Queue<K, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("stats", &self.stats())
            .finish()
    }
}

impl<K: Eq + Hash + Clone + Send + 'static, H: Held> Queue<K, H> {
    pub(crate) fn new(
        policy: impl Fn() -> ReleasePolicy + Send + Sync + 'static,
        activity: impl Fn() -> u64 + Send + Sync + 'static,
        on_worker_start: fn(),
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    entries: BTreeMap::new(),
                    by_key: HashMap::new(),
                    next: 0,
                    held_bytes: 0,
                    touches: 0,
                    stats: ReleaseStats::default(),
                    shutdown: false,
                }),
                wake: Condvar::new(),
                policy: Box::new(policy),
                activity: Box::new(activity),
            }),
            worker: Mutex::new(None),
            on_worker_start,
        }
    }

    /// Takes `held`, given back: holds it, or releases it at once under
    /// [`ReleaseMode::Immediate`].
    pub(crate) fn put(&self, key: K, held: H) {
        let mode = (self.shared.policy)().mode;
        if mode == ReleaseMode::Immediate {
            let bytes = held.bytes();
            held.release();
            let mut state = self.shared.lock();
            state.stats.releases += 1;
            state.stats.released_bytes += bytes as u64;
            return;
        }
        let was_empty = {
            let mut state = self.shared.lock();
            let was_empty = state.entries.is_empty();
            state.insert(key, held);
            was_empty
        };
        if mode == ReleaseMode::Background {
            self.start_worker();
            if was_empty {
                self.shared.wake.notify_all();
            }
        }
    }

    /// A held allocation of `key`, the newest, if any.
    pub(crate) fn take(&self, key: &K) -> Option<H> {
        self.shared.lock().take(key)
    }

    /// Releases one piece of at most `budget` bytes (at least one allocation if any is held);
    /// returns the bytes released.
    pub(crate) fn step(&self, budget: usize) -> usize {
        release_piece(&self.shared, budget, false)
    }

    /// Releases everything held; returns the bytes released.
    pub(crate) fn trim(&self) -> usize {
        let mut released = 0;
        loop {
            let bytes = release_piece(&self.shared, usize::MAX, false);
            if bytes == 0 && self.shared.lock().entries.is_empty() {
                return released;
            }
            released += bytes;
        }
    }

    pub(crate) fn held_bytes(&self) -> usize {
        self.shared.lock().held_bytes
    }

    pub(crate) fn stats(&self) -> ReleaseStats {
        let state = self.shared.lock();
        ReleaseStats {
            held_bytes: state.held_bytes,
            held_allocations: state.entries.len(),
            ..state.stats
        }
    }

    /// An allocation of `key` (`bytes` long): a held one if the queue has one, else `create()`;
    /// when that runs out of memory and memory is held, releases a piece at least `bytes`
    /// large and tries again, until nothing is held.
    pub(crate) fn acquire(
        &self,
        key: &K,
        bytes: usize,
        mut create: impl FnMut() -> Result<H>,
    ) -> Result<H> {
        if let Some(held) = self.take(key) {
            return Ok(held);
        }
        loop {
            match create() {
                Err(error) if error.is_out_of_memory() => {
                    if release_piece(&self.shared, bytes, false) == 0 {
                        return Err(error);
                    }
                    self.shared.lock().stats.retries += 1;
                }
                other => return other,
            }
        }
    }

    /// Wakes the worker (a policy change).
    pub(crate) fn nudge(&self) {
        if (self.shared.policy)().mode == ReleaseMode::Background && self.held_bytes() > 0 {
            self.start_worker();
        }
        self.shared.wake.notify_all();
    }

    fn start_worker(&self) {
        let mut worker = self.worker.lock().unwrap_or_else(|p| p.into_inner());
        if worker.is_some() {
            return;
        }
        let shared = self.shared.clone();
        let on_start = self.on_worker_start;
        let spawned = std::thread::Builder::new()
            .name("stablebuf-release".into())
            .spawn(move || {
                on_start();
                background(&shared);
            });
        match spawned {
            Ok(handle) => *worker = Some(handle),
            // No thread: memory is still released when allocations need it and at trim().
            Err(error) => tracing::warn!(%error, "no background release thread"),
        }
    }
}

impl<K: Eq + Hash + Clone + Send + 'static, H: Held> Drop for Queue<K, H> {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        let worker = self
            .worker
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(worker) = worker {
            if worker.join().is_err() {
                tracing::error!("the background release thread panicked");
            }
        }
        self.trim();
    }
}

/// Takes a piece out under the lock and releases it outside it.
fn release_piece<K: Eq + Hash + Clone, H: Held>(
    shared: &Shared<K, H>,
    budget: usize,
    background: bool,
) -> usize {
    let piece = shared.lock().piece(budget);
    if piece.is_empty() {
        return 0;
    }
    let mut bytes = 0usize;
    let count = piece.len() as u64;
    for held in piece {
        bytes += held.bytes();
        held.release();
    }
    let mut state = shared.lock();
    state.stats.pieces += 1;
    state.stats.releases += count;
    state.stats.released_bytes += bytes as u64;
    if background {
        state.stats.background_pieces += 1;
    }
    bytes
}

/// The background thread: releases a piece whenever the process has been idle long enough.
fn background<K: Eq + Hash + Clone, H: Held>(shared: &Shared<K, H>) {
    let mut state = shared.lock();
    // Activity seen when the current quiet stretch began, and whether a piece was released in it.
    let mut seen = (shared.activity)().wrapping_add(state.touches);
    let mut since = Instant::now();
    let mut released_in_stretch = false;
    loop {
        if state.shutdown {
            return;
        }
        let policy = (shared.policy)();
        if state.entries.is_empty() || policy.mode != ReleaseMode::Background {
            state = shared.wake.wait(state).unwrap_or_else(|p| p.into_inner());
            seen = (shared.activity)().wrapping_add(state.touches);
            since = Instant::now();
            released_in_stretch = false;
            continue;
        }
        let now_seen = (shared.activity)().wrapping_add(state.touches);
        if now_seen != seen {
            seen = now_seen;
            since = Instant::now();
            released_in_stretch = false;
        }
        let quiet = if released_in_stretch {
            policy.gap
        } else {
            policy.idle
        };
        let elapsed = since.elapsed();
        if elapsed < quiet {
            state = shared
                .wake
                .wait_timeout(state, quiet - elapsed)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        drop(state);
        release_piece(shared, policy.piece_bytes, true);
        state = shared.lock();
        released_in_stretch = true;
        since = Instant::now();
        seen = (shared.activity)().wrapping_add(state.touches);
    }
}

#[cfg(test)]
#[path = "held_proptests.rs"]
mod proptests;
