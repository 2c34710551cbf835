//! Creating physical memory ahead of need, off the request's path.
//!
//! `cuMemCreate` is the one slow step of a grow into memory the pool does not cache (about
//! 0.9 ms for 1.5 GiB on an H200, against ~0.1 ms to map and grant access). With
//! [`PoolOptions::create_ahead`](super::PoolOptions::create_ahead) on, each request that had to
//! create memory tells a worker thread how much; the worker creates that much again (the next
//! grow of a growing workload is usually like the last) and puts it in the cache, where the next
//! request finds it and only maps it. The worker takes the pool's lock only to hand the memory
//! over, never while `cuMemCreate` runs.
//!
//! It creates nothing that would break the pool's budget, nor when the device would be left
//! with less than [`HEADROOM_PERCENT`] of its memory free: memory created ahead is cached
//! memory, and drains (out of memory, [`ElasticPool::drain`](super::ElasticPool::drain)) release
//! it like any other.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};

use cudarc::driver::CudaContext;

use super::backend::{Backend, Vmm};
use super::state::State;
use crate::driver;

/// The worker creates nothing that would leave less than this share of the device free.
pub const HEADROOM_PERCENT: usize = 10;

/// The handle requests use to wake the worker; dropping it (with the pool) stops the worker.
#[derive(Debug)]
pub(crate) struct CreateAhead {
    requests: Mutex<Sender<usize>>,
    progress: Arc<Progress>,
}

/// Requests sent and finished, so [`CreateAhead::settle`] can wait for the worker to catch up.
#[derive(Debug, Default)]
struct Progress {
    counts: Mutex<(u64, u64)>,
    changed: Condvar,
}

impl CreateAhead {
    /// Starts the worker for the pool whose state is `state`, on `ctx`'s device (both held
    /// weakly: the worker never keeps the pool alive).
    pub(crate) fn start(state: Weak<Mutex<State<Vmm>>>, ctx: Weak<CudaContext>) -> Self {
        let (requests, incoming) = mpsc::channel();
        let progress = Arc::new(Progress::default());
        let worker_progress = progress.clone();
        let spawned = std::thread::Builder::new()
            .name("stablebuf-create-ahead".into())
            .spawn(move || work(state, ctx, incoming, worker_progress));
        if let Err(error) = spawned {
            tracing::warn!(%error, "no create-ahead worker: every request creates its own memory");
        }
        Self {
            requests: Mutex::new(requests),
            progress,
        }
    }

    /// A request just created `bytes`: prepare as much for the next one.
    pub(crate) fn created(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.progress
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0 += 1;
        let sent = self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(bytes);
        if sent.is_err() {
            self.progress.finish_one(); // no worker: nothing will come
        }
    }

    /// Blocks until the worker has handled every request sent so far.
    pub(crate) fn settle(&self) {
        let mut counts = self
            .progress
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        while counts.1 < counts.0 {
            counts = self
                .progress
                .changed
                .wait(counts)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Progress {
    fn finish_one(&self) {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).1 += 1;
        self.changed.notify_all();
    }
}

fn work(
    state: Weak<Mutex<State<Vmm>>>,
    ctx: Weak<CudaContext>,
    incoming: Receiver<usize>,
    progress: Arc<Progress>,
) {
    while let Ok(bytes) = incoming.recv() {
        if let (Some(state), Some(ctx)) = (state.upgrade(), ctx.upgrade()) {
            create_one(&state, &ctx, bytes);
        }
        progress.finish_one();
    }
}

/// The pool's state, taken like the pool's handles take it (a panic elsewhere leaves the books
/// as they were after their last completed step).
fn lock(state: &Mutex<State<Vmm>>) -> MutexGuard<'_, State<Vmm>> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Creates `bytes` (rounded to the granularity) and hands it to the pool's cache, if the budget
/// and the device's free memory allow.
fn create_one(state: &Mutex<State<Vmm>>, ctx: &Arc<CudaContext>, bytes: usize) {
    let span = tracing::debug_span!("create_ahead", bytes);
    let _entered = span.enter();
    let (granularity, room) = {
        let state = lock(state);
        (state.granularity(), state.budget_room())
    };
    let bytes = bytes.div_ceil(granularity) * granularity;
    if bytes > room {
        tracing::debug!(bytes, room, "over the pool's budget: nothing created ahead");
        return;
    }
    // Memory held for release counts as free: the create reuses or releases it.
    let held = driver::deferred::held_bytes(ctx.ordinal());
    match driver::memory_info(ctx).map(|(free, total)| (free + held, total)) {
        Ok((free, total)) if free.saturating_sub(bytes) >= total / 100 * HEADROOM_PERCENT => {}
        Ok((free, _)) => {
            tracing::debug!(
                bytes,
                free,
                "too little free device memory: nothing created ahead"
            );
            return;
        }
        Err(error) => {
            tracing::debug!(%error, "no memory figures: nothing created ahead");
            return;
        }
    }
    let memory = match Vmm::new(ctx).create(bytes) {
        Ok(memory) => memory,
        Err(error) => {
            tracing::debug!(%error, bytes, "creating ahead failed; the next request creates its own");
            return;
        }
    };
    if lock(state).adopt(memory, bytes).is_err() {
        tracing::debug!(
            bytes,
            "the budget changed meanwhile: the memory created ahead was released"
        );
    }
}
