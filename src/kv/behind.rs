//! Remaps behind the next step: a decode step that waits at a layer's gate
//! ([`KvCache::gate_layer`](super::KvCache::gate_layer), before that layer's K and V are
//! touched) lets [`KvCache::change_behind`](super::KvCache::change_behind) return before that
//! layer is remapped. The gated layers' remap is handed to a worker thread, which, layer by
//! layer, waits (on the host) until the step in flight passed the layer's mark, remaps it, and
//! opens its gate; the next step, launched meanwhile, runs every layer before a gate and waits
//! there only if that layer's remap is not done yet. So a gated layer's remap overlaps the
//! rest of the step in flight and the next step's layers before it, instead of the gap
//! between steps (with every layer gated, the host's part of a change is its gates).
//!
//! Order, per change that defers layers `G` (the step in flight: `t`):
//! 1. the host waits until `t` passed the gates of `G` (the "passed" mark after each wait), so
//!    closing them now cannot stop `t`;
//! 2. the worker's lane, for each layer of `G` in order, waits on the GPU for `t`'s mark of
//!    that layer (taken now, before the next launch could record it again), zeroes the
//!    layer's released granules and records the layer's `reached`;
//! 3. the gates of `G` close (host stores) and the job goes to the worker: for each layer it
//!    waits for `reached` on the host, remaps (host driver calls only: nothing queues behind
//!    the gated step) and opens the gate (a host store); then it hands the mappings back.
//!    The next call into the cache that changes mappings takes them back first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use cudarc::driver::{CudaContext, CudaStream};

use super::state::{KvState, Remap};
use crate::driver::event::StepMark;
use crate::driver::gate::Gates;
use crate::driver::traced;
use crate::error::{KvError, Result};
use crate::vmm_core::Vmm;

/// A remap handed to the worker, and where its result lands.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    done: Mutex<Option<Remap<Vmm>>>,
    ready: Condvar,
}

impl Pending {
    fn deliver(&self, remap: Remap<Vmm>) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = Some(remap);
        self.ready.notify_all();
    }

    /// Blocks until the worker delivered the remap.
    fn wait(&self) -> Remap<Vmm> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(remap) = done.take() {
                return remap;
            }
            done = self.ready.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

struct Job {
    remap: Option<Remap<Vmm>>,
    gates: Arc<Gates>,
    /// Per layer: recorded on the worker's lane once the step passed that layer's mark.
    reached: Vec<Arc<StepMark>>,
    pending: Arc<Pending>,
}

impl Job {
    /// Layer by layer, in order: once the step passed the layer's mark, remaps it and opens
    /// its gate, so the next step runs each layer as soon as that layer is done.
    fn run(&mut self) {
        // The remap stays in the job until delivered: should anything here panic, dropping
        // the job opens every gate (see `Drop`).
        let Some(remap) = self.remap.as_mut() else {
            return;
        };
        for layer in remap.layers.clone() {
            if let Err(error) = self.reached[layer].wait() {
                // The context failed: nothing runs on it any more either way.
                remap.fail(error);
            }
            remap.run_layer(layer);
            self.gates.open(layer);
        }
        remap.drop_staged();
        if let Some(remap) = self.remap.take() {
            self.pending.deliver(remap);
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Not run (the worker is gone or panicked): never leave a gate closed.
        if let Some(mut remap) = self.remap.take() {
            remap.fail(KvError::WorkerStopped.into());
            for &layer in &remap.layers {
                self.gates.open(layer);
            }
            self.pending.deliver(remap);
        }
    }
}

#[derive(Debug)]
struct Worker {
    /// Waits on the GPU for the step's marks, recording `reached` of each layer after its own.
    lane: Arc<CudaStream>,
    reached: Vec<Arc<StepMark>>,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").finish_non_exhaustive()
    }
}

/// The gates of a cache's layers and the worker that remaps behind them.
#[derive(Debug)]
pub(crate) struct Behind {
    gates: Arc<Gates>,
    /// Whether a step ever waited at each layer's gate.
    gated: Vec<AtomicBool>,
    /// Recorded right after each gate's wait: the step got past it.
    passed: Vec<StepMark>,
    worker: Mutex<Option<Worker>>,
    pending: Mutex<Option<Arc<Pending>>>,
}

impl Behind {
    pub fn new(ctx: &Arc<CudaContext>, layers: usize) -> Result<Self> {
        Ok(Self {
            gates: Arc::new(Gates::new(ctx, layers)?),
            gated: (0..layers).map(|_| AtomicBool::new(false)).collect(),
            passed: (0..layers)
                .map(|_| StepMark::new(ctx))
                .collect::<Result<Vec<_>>>()?,
            worker: Mutex::new(None),
            pending: Mutex::new(None),
        })
    }

    /// Enqueues on `stream` the wait at `layer`'s gate and the mark that the step passed it.
    pub fn gate(&self, layer: usize, stream: u64) -> Result<()> {
        self.gates.wait_open(layer, stream)?;
        self.passed[layer].record(stream)?;
        self.gated[layer].store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Per layer: whether changes behind a step leave it to the worker.
    pub fn later(&self) -> Vec<bool> {
        self.gated
            .iter()
            .map(|g| g.load(Ordering::Relaxed))
            .collect()
    }

    /// Takes back the mappings of the remap handed off last, once it is done.
    pub fn settle(&self, state: &mut KvState<Vmm>) -> Result<()> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match pending {
            Some(pending) => state.install(pending.wait()),
            None => Ok(()),
        }
    }

    /// Hands `remap` to the worker (see the module docs). Where that cannot be done it remaps
    /// here, the way a change without gates does: after the layers' marks.
    pub fn hand_off(
        &self,
        ctx: &Arc<CudaContext>,
        state: &mut KvState<Vmm>,
        remap: Remap<Vmm>,
        marks: &[StepMark],
    ) -> Result<()> {
        let mut remap = match self.try_hand_off(ctx, remap, marks) {
            Ok(()) => return Ok(()),
            Err(remap) => *remap,
        };
        for layer in remap.layers.clone() {
            if let Err(error) = marks[layer].wait() {
                remap.fail(error);
            }
        }
        // No gate is closed, but the marks passed and the next step is not launched yet.
        remap.zero_retired_and_wait(&state.lane);
        remap.run();
        state.install(remap)
    }

    fn try_hand_off(
        &self,
        ctx: &Arc<CudaContext>,
        remap: Remap<Vmm>,
        marks: &[StepMark],
    ) -> std::result::Result<(), Box<Remap<Vmm>>> {
        let layers = remap.layers.clone();
        // Only a remap closes gates; zeroing alone waits for nothing but the marks.
        let gated: Vec<usize> = if remap.remaps() {
            layers.clone()
        } else {
            Vec::new()
        };
        for &layer in &gated {
            if let Err(error) = self.passed[layer].wait() {
                tracing::warn!(%error, layer, "waiting for the step to pass a gate; remapping here");
                return Err(Box::new(remap));
            }
        }
        let mut worker = self.worker.lock().unwrap_or_else(|p| p.into_inner());
        if worker.is_none() {
            match spawn(ctx, self.passed.len()) {
                Ok(spawned) => *worker = Some(spawned),
                Err(error) => {
                    tracing::warn!(%error, "no remap worker; remapping here");
                    return Err(Box::new(remap));
                }
            }
        }
        let worker = worker.as_ref().expect("spawned above");
        // The worker's lane, layer by layer (marks are recorded in layer order): after the
        // step's mark, that layer's released granules zeroed, then its `reached` (so the
        // worker's wait for it covers the zeroing too).
        let lane = worker.lane.cu_stream() as usize as u64;
        let ordered = layers.iter().try_for_each(|&layer| {
            marks[layer].order_before(&worker.lane)?;
            remap.zero_retired_layer(&worker.lane, layer)?;
            worker.reached[layer].record(lane)
        });
        if let Err(error) = ordered {
            // Fills already enqueued run behind the mark; the fallback zeroes again on the
            // cache's lane (the same zeros).
            tracing::warn!(%error, "ordering the remap worker after the step; remapping here");
            return Err(Box::new(remap));
        }
        for &layer in &gated {
            self.gates.close(layer);
        }
        let pending = Arc::new(Pending::default());
        let job = Job {
            remap: Some(remap),
            gates: self.gates.clone(),
            reached: worker.reached.clone(),
            pending: pending.clone(),
        };
        let Some(jobs) = worker.jobs.as_ref() else {
            drop(job); // opens the gates, delivers the remap
            return Err(Box::new(pending.wait()));
        };
        match jobs.send(job) {
            Ok(()) => {
                *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(pending);
                Ok(())
            }
            Err(mpsc::SendError(mut job)) => {
                let remap = job.remap.take().expect("not run");
                for &layer in &layers {
                    self.gates.open(layer);
                }
                Err(Box::new(remap))
            }
        }
    }
}

fn spawn(ctx: &Arc<CudaContext>, layers: usize) -> Result<Worker> {
    let lane = traced("cuStreamCreate", 0, || ctx.new_stream())?;
    let reached = (0..layers)
        .map(|_| StepMark::new(ctx).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    let (jobs, queue) = mpsc::channel::<Job>();
    let bound = ctx.clone();
    let thread = std::thread::Builder::new()
        .name("stablebuf-kv-remap".into())
        .spawn(move || {
            let _ = crate::driver::bind_context(&bound);
            for mut job in queue {
                job.run();
            }
        })
        .map_err(|_| KvError::WorkerStopped)?;
    Ok(Worker {
        lane,
        reached,
        jobs: Some(jobs),
        thread: Some(thread),
    })
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
