//! The ways to give a captured decode step a new weight set every step, side by side in one
//! process, and the timed, checked runner they share (`examples/decode_loop.rs`,
//! `benches/decode.rs`).
//!
//! ```text
//!   (a) lanes, rebind     Pipeline of 2 or 3 lanes; each step binds the next set into the next
//!                         lane (one unmap + map + set-access) and replays that lane's graph
//!   (s) rebind, serial    one space, one stream: bind the next set (after the last replay),
//!                         then replay
//!   (e) no swap           the same lanes never rebinding, or one graph on one stream: the floor
//!   (b) copy-in, serial   one static weight buffer: D2D copy of the whole set, then replay, on
//!                         one stream (PyTorch's `static.copy_(w); graph.replay()`)
//!   (c) copy-in, pipelined two static buffers and two graphs: while step s replays from one, a
//!                         side stream copies step s+1's set into the other (event-ordered both
//!                         ways), so only bandwidth, not latency, is shared
//!   (d) re-capture        capture the step over the set's own addresses and instantiate it,
//!                         every step
//! ```
//! Every step's output is copied (on the step's stream, after it) into a history slot, so the
//! runner checks exactly the steps it timed against the reference for the weight set each one
//! used, after the chunk.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use stablebuf::buffer::{copy_between, LinearBuffer};
use stablebuf::cudarc::driver::{sys::CUevent_flags, CudaContext, CudaEvent, CudaStream};
use stablebuf::error::LayoutError;
use stablebuf::graph::NodeKind;
use stablebuf::kernels::Blas;
use stablebuf::kernels::{f32_from_bf16, DecodeKernels};
use stablebuf::{Dataset, Error, Layout, Pipeline, Result, Space, SpaceOptions, StableGraph};

use super::{compare, fill_input, forward, rms, work, Acts, AllReduce, Raw, Shape, Weights};

/// Seed of the input batch (the same in every space, so every variant computes the same thing).
pub const INPUT_SEED: u64 = 0x5eed_0001;
const BF16: usize = 2;

/// What one step left behind: the stream it ran on, where its output is, which set it used.
pub struct StepOut {
    pub stream: Arc<CudaStream>,
    pub x: Raw,
    pub set: usize,
}

/// One way of running a step on a new weight set.
pub trait Variant {
    /// Label in tables ("a3", "c", …).
    fn label(&self) -> &str;
    /// What it does, in a few words.
    fn describe(&self) -> String;
    /// Bytes of weights copied per step.
    fn bytes_copied(&self) -> usize {
        0
    }
    /// Enqueues step `s` (counted per variant from 0) and returns without waiting for it.
    fn step(&mut self, s: usize) -> Result<StepOut>;
    /// Steps that could not take the planned weight set (see [`LaneSteps::adjusted`]).
    fn adjusted_steps(&self) -> usize {
        0
    }
}

/// What every variant of one process shares: the device, the weight sets, and one stream with
/// its space (scratch, and group "weights" bound to set 0) and cuBLAS handle for the
/// single-stream variants.
pub struct Setup<'a> {
    pub ctx: Arc<CudaContext>,
    pub kernels: Arc<DecodeKernels>,
    pub shape: Shape,
    pub layout: Layout,
    pub sets: &'a [Dataset],
    pub main: Arc<CudaStream>,
    pub main_space: Space,
    pub main_acts: Acts,
    pub main_blas: Arc<Blas>,
    /// The all-reduce of a tensor-parallel stack (see [`Setup::all_reduce`]).
    pub reduce: Option<AllReduce>,
}

/// `count` weight sets made from `space`'s layout, filled on the device from seeds
/// `first_seed`, `first_seed + 1`, …
pub fn make_sets(
    space: &Space,
    kernels: &DecodeKernels,
    stream: &Arc<CudaStream>,
    shape: Shape,
    count: usize,
    first_seed: u64,
) -> Result<Vec<Dataset>> {
    let sets = (0..count)
        .map(|i| {
            let set = space.new_dataset("weights")?;
            super::fill_weights(
                kernels,
                stream,
                &Weights::home(&set, shape)?,
                shape,
                first_seed + i as u64,
            )?;
            Ok(set)
        })
        .collect::<Result<Vec<_>>>()?;
    stream.synchronize()?;
    Ok(sets)
}

impl<'a> Setup<'a> {
    /// `main_space` must have `shape`'s layout (the one the sets were made from).
    pub fn new(
        ctx: &Arc<CudaContext>,
        kernels: &Arc<DecodeKernels>,
        shape: Shape,
        main_space: Space,
        sets: &'a [Dataset],
    ) -> Result<Self> {
        if sets.len() < 2 {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "the decode loops need at least 2 weight sets, got {}",
                sets.len()
            ))));
        }
        let main = ctx.new_stream()?;
        main_space.bind(&sets[0])?;
        let main_acts = Acts::in_space(&main_space)?;
        fill_input(kernels, &main, &main_acts, INPUT_SEED)?;
        let main_blas = Arc::new(Blas::new(&main, &main_acts.workspace)?);
        Ok(Self {
            ctx: ctx.clone(),
            kernels: kernels.clone(),
            shape,
            layout: main_space.layout().clone(),
            sets,
            main,
            main_space,
            main_acts,
            main_blas,
            reduce: None,
        })
    }

    /// Sums each layer's partial down projection over the ranks with `reduce` in every
    /// variant's step (a stack with `shape.ranks > 1`).
    pub fn all_reduce(mut self, reduce: AllReduce) -> Self {
        self.reduce = Some(reduce);
        self
    }

    /// Bytes of one weight set (what a copy-in moves per step).
    pub fn set_bytes(&self) -> usize {
        self.sets[0].bytes()
    }

    /// Runs one step outside any graph on the main stream (set 0), so cuBLAS has chosen and
    /// loaded its kernels for this shape before a capture records them.
    fn warm_main(&self, batch: usize) -> Result<()> {
        self.forward_main(batch)?;
        Ok(self.main.synchronize()?)
    }

    /// Enqueues one step outside any graph on the main stream, over the set bound there.
    fn forward_main(&self, batch: usize) -> Result<()> {
        let weights = Weights::in_space(&self.main_space, self.shape)?;
        forward(
            &self.main_blas,
            &self.kernels,
            &self.main,
            &weights,
            &self.main_acts,
            self.shape,
            batch,
            self.reduce.as_ref(),
        )
    }

    /// For each weight set in turn: bind it in the main space, poison `x`, `run` a step there
    /// and read the first `batch` rows of `x`. Leaves set 0 bound.
    fn outputs_per_set(
        &self,
        batch: usize,
        mut run: impl FnMut() -> Result<()>,
    ) -> Result<Vec<Vec<u16>>> {
        let elements = batch * self.shape.hidden;
        let mut outputs = Vec::with_capacity(self.sets.len());
        for set in self.sets {
            self.main_space.bind(set)?;
            self.kernels.fill(&self.main, &self.main_acts.x, f32::NAN)?;
            run()?;
            let x: Vec<u16> = self.main_space.read(&self.main, "x")?;
            outputs.push(x[..elements].to_vec());
        }
        self.main_space.bind(&self.sets[0])?;
        Ok(outputs)
    }

    fn capture_main(&self, weights: Weights, batch: usize) -> Result<StableGraph> {
        let work = work(
            self.main_blas.clone(),
            self.kernels.clone(),
            weights,
            self.main_acts,
            self.shape,
            batch,
            self.reduce.clone(),
        );
        StableGraph::capture(&self.main, &[&self.main_space], work)
    }

    /// (e1): one graph over the main space, replayed on whatever is bound (set 0).
    pub fn replay(&self, batch: usize) -> Result<Replay> {
        self.warm_main(batch)?;
        let graph = self.capture_main(Weights::in_space(&self.main_space, self.shape)?, batch)?;
        Ok(Replay {
            graph,
            x: self.main_acts.x,
        })
    }

    /// The output of every weight set for `batch` rows (bf16 bits, `batch × hidden`), each
    /// computed by `replay`'s graph with that set bound in the main space. Leaves set 0 bound.
    pub fn references(&self, replay: &Replay, batch: usize) -> Result<Vec<Vec<u16>>> {
        self.outputs_per_set(batch, || replay.graph.replay())
    }

    /// The output of every weight set for `batch` rows (bf16 bits, `batch × hidden`), each
    /// computed eagerly (no graph) on the main stream with that set bound in the main space.
    /// Leaves set 0 bound.
    pub fn eager_references(&self, batch: usize) -> Result<Vec<Vec<u16>>> {
        self.outputs_per_set(batch, || self.forward_main(batch))
    }

    /// (s): a space of its own, bound to a new set before every replay, on one stream.
    pub fn rebind_serial(&self, batch: usize) -> Result<RebindSerial<'a>> {
        let space = Space::new(&self.ctx, self.layout.clone())?;
        let stream = self.ctx.new_stream()?;
        space.bind(&self.sets[0])?;
        let acts = Acts::in_space(&space)?;
        fill_input(&self.kernels, &stream, &acts, INPUT_SEED)?;
        let blas = Arc::new(Blas::new(&stream, &acts.workspace)?);
        let mut step = work(
            blas,
            self.kernels.clone(),
            Weights::in_space(&space, self.shape)?,
            acts,
            self.shape,
            batch,
            self.reduce.clone(),
        );
        step(&stream)?; // cuBLAS picks and loads its kernels outside the capture
        stream.synchronize()?;
        let graph = StableGraph::capture(&stream, &[&space], step)?;
        Ok(RebindSerial {
            graph,
            space,
            sets: self.sets,
            x: acts.x,
        })
    }

    /// (b): one static buffer laid out like a set; copy, then replay.
    pub fn copy_serial(&self, batch: usize) -> Result<CopySerial<'a>> {
        self.warm_main(batch)?;
        let buffer = LinearBuffer::new(&self.ctx, self.set_bytes())?;
        let graph =
            self.capture_main(Weights::at(buffer.ptr(), &self.sets[0], self.shape), batch)?;
        Ok(CopySerial {
            graph,
            buffer,
            stream: self.main.clone(),
            sets: self.sets,
            x: self.main_acts.x,
        })
    }

    /// (c): two static buffers, two graphs, a side stream for the copies.
    pub fn copy_pipelined(&self, batch: usize) -> Result<CopyPipelined<'a>> {
        self.warm_main(batch)?;
        let buffers = [
            LinearBuffer::new(&self.ctx, self.set_bytes())?,
            LinearBuffer::new(&self.ctx, self.set_bytes())?,
        ];
        let graphs = [
            self.capture_main(
                Weights::at(buffers[0].ptr(), &self.sets[0], self.shape),
                batch,
            )?,
            self.capture_main(
                Weights::at(buffers[1].ptr(), &self.sets[0], self.shape),
                batch,
            )?,
        ];
        let event = || self.ctx.new_event(None); // no timing: cheaper to wait on
        Ok(CopyPipelined {
            graphs,
            buffers,
            main: self.main.clone(),
            side: self.ctx.new_stream()?,
            copied: [event()?, event()?],
            replayed: [event()?, event()?],
            primed: false,
            sets: self.sets,
            x: self.main_acts.x,
        })
    }

    /// (d): capture over the set's own addresses and instantiate, every step.
    pub fn recapture(&self, batch: usize) -> Result<Recapture<'a>> {
        self.warm_main(batch)?;
        Ok(Recapture {
            blas: self.main_blas.clone(),
            kernels: self.kernels.clone(),
            acts: self.main_acts,
            space: self.main_space.clone(),
            stream: self.main.clone(),
            sets: self.sets,
            shape: self.shape,
            batch,
            reduce: self.reduce.clone(),
            previous: None,
        })
    }

    /// A pipeline of `count` lanes of the layout, each with its own cuBLAS handle, input and
    /// graph for `batch` rows, set 0 bound in every lane. Share it between a rebinding and a
    /// no-swap [`LaneSteps`].
    pub fn lanes(&self, count: usize, batch: usize) -> Result<Rc<RefCell<SharedLanes>>> {
        let (kernels, shape, first) = (self.kernels.clone(), self.shape, &self.sets[0]);
        let reduce = self.reduce.clone();
        let pipeline = Pipeline::new(
            &self.ctx,
            &self.layout,
            count,
            SpaceOptions::default(),
            |space, stream| {
                let acts = Acts::in_space(space)?;
                let blas = Arc::new(Blas::new(stream, &acts.workspace)?);
                space.bind(first)?;
                fill_input(&kernels, stream, &acts, INPUT_SEED)?;
                let weights = Weights::in_space(space, shape)?;
                let mut step = work(
                    blas,
                    kernels.clone(),
                    weights,
                    acts,
                    shape,
                    batch,
                    reduce.clone(),
                );
                step(stream)?; // cuBLAS picks and loads its kernels outside the capture
                stream.synchronize()?;
                Ok(step)
            },
        )?;
        Ok(Rc::new(RefCell::new(SharedLanes { pipeline, taken: 0 })))
    }
}

/// (e1) One graph on one stream, never swapped.
pub struct Replay {
    pub graph: StableGraph,
    x: Raw,
}

impl Variant for Replay {
    fn label(&self) -> &str {
        "e1"
    }
    fn describe(&self) -> String {
        "replay, no swap, 1 stream".into()
    }
    fn step(&mut self, _s: usize) -> Result<StepOut> {
        self.graph.replay()?;
        Ok(StepOut {
            stream: self.graph.stream().clone(),
            x: self.x,
            set: 0,
        })
    }
}

/// A pipeline and how many steps it has taken (so which lane is next), shared by the variants
/// that step it.
pub struct SharedLanes {
    pub pipeline: Pipeline,
    taken: usize,
}

/// Steps of a shared pipeline: (a) rebinding a new set every step, or (e) binding what each
/// lane already holds (a no-op: the same lanes, streams and graphs, without the rebind).
pub struct LaneSteps<'a> {
    lanes: Rc<RefCell<SharedLanes>>,
    rebind: bool,
    sets: &'a [Dataset],
    label: String,
    /// Steps where the rotation would have bound the set the lane already held, so the next
    /// one was bound instead: 0 when every chunk is a multiple of the lane count and the lane
    /// count is not a multiple of the set count.
    pub adjusted: usize,
}

impl<'a> LaneSteps<'a> {
    pub fn new(lanes: Rc<RefCell<SharedLanes>>, rebind: bool, sets: &'a [Dataset]) -> Self {
        let count = lanes.borrow().pipeline.lanes().len();
        let label = format!("{}{count}", if rebind { "a" } else { "e" });
        Self {
            lanes,
            rebind,
            sets,
            label,
            adjusted: 0,
        }
    }
}

impl Variant for LaneSteps<'_> {
    fn label(&self) -> &str {
        &self.label
    }
    fn describe(&self) -> String {
        let count = self.lanes.borrow().pipeline.lanes().len();
        if self.rebind {
            format!("stablebuf, {count} lanes, rebind every step")
        } else {
            format!("{count} lanes, no swap")
        }
    }
    fn step(&mut self, s: usize) -> Result<StepOut> {
        let mut shared = self.lanes.borrow_mut();
        let count = shared.pipeline.lanes().len();
        let lane = &shared.pipeline.lanes()[shared.taken % count];
        let held = lane.space().bound_dataset("weights")?;
        let held = self.sets.iter().position(|d| Some(d.id()) == held);
        let set = if self.rebind {
            // Step s on lane s % n binds set (s + 1) % W; the lane last held (s + 1 - n) % W.
            let mut set = (s + 1) % self.sets.len();
            if Some(set) == held {
                set = (set + 1) % self.sets.len();
                self.adjusted += 1;
            }
            set
        } else {
            held.ok_or_else(|| {
                Error::Layout(LayoutError::InvalidShape(
                    "a lane holds no known weight set".into(),
                ))
            })?
        };
        let lane = shared.pipeline.step(&[&self.sets[set]])?;
        let out = StepOut {
            stream: lane.stream().clone(),
            x: Raw::of(lane.space().slot("x")?),
            set,
        };
        shared.taken += 1;
        Ok(out)
    }
    fn adjusted_steps(&self) -> usize {
        self.adjusted
    }
}

/// (s) One space and one stream: bind the next set, then replay.
pub struct RebindSerial<'a> {
    graph: StableGraph,
    space: Space,
    sets: &'a [Dataset],
    x: Raw,
}

impl Variant for RebindSerial<'_> {
    fn label(&self) -> &str {
        "s"
    }
    fn describe(&self) -> String {
        "stablebuf, 1 space, bind then replay".into()
    }
    fn step(&mut self, s: usize) -> Result<StepOut> {
        let set = s % self.sets.len();
        // The bind waits for the space's last replay (the default fence), then remaps.
        self.space.bind(&self.sets[set])?;
        self.graph.replay()?;
        Ok(StepOut {
            stream: self.graph.stream().clone(),
            x: self.x,
            set,
        })
    }
}

fn home(set: &Dataset) -> Result<Raw> {
    Ok(Raw {
        ptr: set.home_ptr()?,
        bytes: set.bytes(),
    })
}

/// (b) Copy the whole set into one static buffer, then replay, on one stream.
pub struct CopySerial<'a> {
    graph: StableGraph,
    buffer: LinearBuffer,
    stream: Arc<CudaStream>,
    sets: &'a [Dataset],
    x: Raw,
}

impl Variant for CopySerial<'_> {
    fn label(&self) -> &str {
        "b"
    }
    fn describe(&self) -> String {
        "copy-in, serial (1 static set)".into()
    }
    fn bytes_copied(&self) -> usize {
        self.buffer.bytes()
    }
    fn step(&mut self, s: usize) -> Result<StepOut> {
        let set = s % self.sets.len();
        let source = home(&self.sets[set])?;
        copy_between(&self.stream, &self.buffer, 0, &source, 0, source.bytes)?;
        self.graph.replay()?;
        Ok(StepOut {
            stream: self.stream.clone(),
            x: self.x,
            set,
        })
    }
}

/// (c) Two static buffers: step s replays from buffer s % 2 while the side stream copies step
/// s + 1's set into the other one.
pub struct CopyPipelined<'a> {
    graphs: [StableGraph; 2],
    buffers: [LinearBuffer; 2],
    main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    /// `copied[i]`: the last copy into buffer i is done.
    copied: [CudaEvent; 2],
    /// `replayed[i]`: the last replay reading buffer i is done.
    replayed: [CudaEvent; 2],
    primed: bool,
    sets: &'a [Dataset],
    x: Raw,
}

impl CopyPipelined<'_> {
    /// Enqueues on the side stream: once the last replay reading buffer `buffer` is done, copy
    /// set `set` into it, and mark `copied[buffer]`.
    fn prefetch(&self, set: usize, buffer: usize) -> Result<()> {
        self.side.wait(&self.replayed[buffer])?;
        let source = home(&self.sets[set])?;
        copy_between(
            &self.side,
            &self.buffers[buffer],
            0,
            &source,
            0,
            source.bytes,
        )?;
        Ok(self.copied[buffer].record(&self.side)?)
    }
}

impl Variant for CopyPipelined<'_> {
    fn label(&self) -> &str {
        "c"
    }
    fn describe(&self) -> String {
        "copy-in, pipelined (2 static sets)".into()
    }
    fn bytes_copied(&self) -> usize {
        self.buffers[0].bytes()
    }
    fn step(&mut self, s: usize) -> Result<StepOut> {
        let count = self.sets.len();
        let (current, next) = (s % 2, (s + 1) % 2);
        if !self.primed {
            // The first step's set: later ones were prefetched by the step before them.
            self.prefetch(s % count, current)?;
            self.primed = true;
        }
        self.main.wait(&self.copied[current])?;
        self.graphs[current].replay()?;
        self.replayed[current].record(&self.main)?;
        // Overlaps this replay: it reads the other buffer.
        self.prefetch((s + 1) % count, next)?;
        Ok(StepOut {
            stream: self.main.clone(),
            x: self.x,
            set: s % count,
        })
    }
}

/// (d) Capture the step over the set's own memory and instantiate it, every step.
pub struct Recapture<'a> {
    blas: Arc<Blas>,
    kernels: Arc<DecodeKernels>,
    acts: Acts,
    space: Space,
    stream: Arc<CudaStream>,
    sets: &'a [Dataset],
    shape: Shape,
    batch: usize,
    reduce: Option<AllReduce>,
    /// The last step's graph: destroying an executable still in flight is deferred by the
    /// driver to its completion, so the previous one can go as soon as the next is launched.
    previous: Option<StableGraph>,
}

impl Variant for Recapture<'_> {
    fn label(&self) -> &str {
        "d"
    }
    fn describe(&self) -> String {
        "re-capture + instantiate".into()
    }
    fn step(&mut self, s: usize) -> Result<StepOut> {
        let set = s % self.sets.len();
        let weights = Weights::home(&self.sets[set], self.shape)?;
        let work = work(
            self.blas.clone(),
            self.kernels.clone(),
            weights,
            self.acts,
            self.shape,
            self.batch,
            self.reduce.clone(),
        );
        let graph = StableGraph::capture(&self.stream, &[&self.space], work)?;
        graph.replay()?;
        self.previous = Some(graph);
        Ok(StepOut {
            stream: self.stream.clone(),
            x: self.acts.x,
            set,
        })
    }
}

/// How many nodes of each kind a graph has, as "N kernels, M memsets, …".
pub fn describe_nodes(graph: &StableGraph) -> Result<String> {
    let kinds = graph.node_kinds()?;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for kind in &kinds {
        let name = match kind {
            NodeKind::Kernel => "kernel".to_string(),
            other => format!("{other:?}"),
        };
        match counts.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => counts.push((name, 1)),
        }
    }
    let parts: Vec<String> = counts.iter().map(|(n, c)| format!("{c} {n}")).collect();
    Ok(format!("{} nodes ({})", kinds.len(), parts.join(", ")))
}

/// One chunk of consecutive steps of one variant.
pub struct Chunk {
    /// When each step's output copy finished, in µs after the first step's (CUDA events on the
    /// step's stream).
    pub ends_us: Vec<f64>,
    /// Host time of each `step` call (bind + enqueue, or copy + enqueue, …).
    pub host_us: Vec<f64>,
    /// Each step's output, bf16 bits, `batch × hidden`.
    pub outputs: Vec<Vec<u16>>,
    /// The weight set each step used.
    pub sets: Vec<usize>,
}

/// Runs chunks of steps with a history slot for the outputs and an event per step.
pub struct Runner {
    ctx: Arc<CudaContext>,
    kernels: Arc<DecodeKernels>,
    history: Space,
    slot: Raw,
    stream: Arc<CudaStream>,
    events: Vec<CudaEvent>,
    hidden: usize,
}

impl Runner {
    /// Room for chunks of up to `max_steps` steps of up to `shape.max_batch` rows.
    pub fn new(
        ctx: &Arc<CudaContext>,
        kernels: &Arc<DecodeKernels>,
        shape: Shape,
        max_steps: usize,
    ) -> Result<Self> {
        let bytes = max_steps * shape.max_batch * shape.hidden * BF16;
        let history = Space::new(ctx, Layout::builder().scratch("history", bytes).build()?)?;
        let slot = Raw::of(history.slot("history")?);
        let events = (0..max_steps)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            ctx: ctx.clone(),
            kernels: kernels.clone(),
            history,
            slot,
            stream: ctx.new_stream()?,
            events,
            hidden: shape.hidden,
        })
    }

    /// Runs steps `first .. first + len` of `variant` for `batch` rows back to back, then
    /// waits for the device and collects times and outputs.
    pub fn chunk(
        &self,
        variant: &mut dyn Variant,
        first: usize,
        len: usize,
        batch: usize,
    ) -> Result<Chunk> {
        if len == 0 || len > self.events.len() {
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "a chunk of {len} steps (1..={} fit)",
                self.events.len()
            ))));
        }
        let bytes = batch * self.hidden * BF16;
        // Poisoned, so a step whose output never arrived reads as NaN, not as an old value.
        self.kernels.fill(&self.stream, &self.slot, f32::NAN)?;
        self.stream.synchronize()?;
        let mut host_us = Vec::with_capacity(len);
        let mut sets = Vec::with_capacity(len);
        for i in 0..len {
            let start = Instant::now();
            let out = variant.step(first + i)?;
            host_us.push(start.elapsed().as_secs_f64() * 1e6);
            copy_between(&out.stream, &self.slot, i * bytes, &out.x, 0, bytes)?;
            self.events[i].record(&out.stream)?;
            sets.push(out.set);
        }
        self.ctx.synchronize()?;
        let ends_us = (0..len)
            .map(|i| Ok(f64::from(self.events[0].elapsed_ms(&self.events[i])?) * 1e3))
            .collect::<Result<Vec<_>>>()?;
        let history: Vec<u16> = self.history.read(&self.stream, "history")?;
        let per_step = batch * self.hidden;
        let outputs = (0..len)
            .map(|i| history[i * per_step..(i + 1) * per_step].to_vec())
            .collect();
        Ok(Chunk {
            ends_us,
            host_us,
            outputs,
            sets,
        })
    }
}

/// Steps of each chunk whose windows are left out (the pipeline filling).
pub const SKIP: usize = 2;
/// Steps per timing window.
pub const WINDOW: usize = 6;

/// One variant's results for one batch size.
pub struct Row {
    pub label: String,
    pub describe: String,
    pub copied: usize,
    pub windows: Vec<f64>,
    pub span_us: f64,
    pub span_steps: usize,
    pub host_us: Vec<f64>,
    /// One per reference the rounds checked against, in the order given.
    pub checks: Vec<Checked>,
    pub adjusted: usize,
}

impl Row {
    /// Median µs per step over the timing windows.
    pub fn per_step(&self) -> f64 {
        median(&self.windows)
    }
    /// The chunks' spans over their steps.
    pub fn mean(&self) -> f64 {
        self.span_us / self.span_steps as f64
    }
    /// The first check (against the references every run has).
    pub fn checked(&self) -> &Checked {
        &self.checks[0]
    }
    /// Every failure of every check.
    pub fn failures(&self) -> impl Iterator<Item = &String> {
        self.checks.iter().flat_map(|c| &c.failures)
    }
}

/// Every variant's row for one batch size.
pub struct BatchResult {
    pub batch: usize,
    /// The no-swap graph's nodes, described.
    pub nodes: String,
    pub rows: Vec<Row>,
}

impl BatchResult {
    pub fn row(&self, label: &str) -> &Row {
        self.rows
            .iter()
            .find(|r| r.label == label)
            .expect("every variant has a row")
    }
    /// The variant's median µs per step.
    pub fn us(&self, label: &str) -> f64 {
        self.row(label).per_step()
    }
}

/// Runs `variants` in chunks of `chunk` steps: one warm-up chunk each (checked, not timed),
/// then `rounds` rounds of one chunk each, the order rotating every round. Every step's output
/// is checked against each `(references, check)` pair (references per weight set, bf16 bits).
pub fn run_rounds(
    variants: &mut [Box<dyn Variant + '_>],
    runner: &Runner,
    checks: &[(&[Vec<u16>], Checked)],
    batch: usize,
    rounds: usize,
    chunk: usize,
) -> Result<Vec<Row>> {
    let mut rows: Vec<Row> = variants
        .iter()
        .map(|v| Row {
            label: v.label().to_string(),
            describe: v.describe(),
            copied: v.bytes_copied(),
            windows: Vec::new(),
            span_us: 0.0,
            span_steps: 0,
            host_us: Vec::new(),
            checks: checks.iter().map(|(_, c)| c.clone()).collect(),
            adjusted: 0,
        })
        .collect();
    let count = variants.len();
    let mut next = vec![0usize; count];
    for round in 0..=rounds {
        for j in 0..count {
            let k = (j + round) % count;
            let result = runner.chunk(variants[k].as_mut(), next[k], chunk, batch)?;
            next[k] += chunk;
            let row = &mut rows[k];
            for (check, (references, _)) in row.checks.iter_mut().zip(checks) {
                check.add(&row.label, &result, references);
            }
            if round == 0 {
                continue; // warm-up: checked, not timed
            }
            row.windows
                .extend(window_times(&result.ends_us, SKIP, WINDOW));
            row.span_us += result.ends_us[chunk - 1] - result.ends_us[SKIP];
            row.span_steps += chunk - 1 - SKIP;
            row.host_us.extend_from_slice(&result.host_us[SKIP..]);
        }
    }
    for (row, variant) in rows.iter_mut().zip(variants.iter()) {
        row.adjusted = variant.adjusted_steps();
    }
    Ok(rows)
}

/// Per-step times of a chunk: the mean over each window of `window` consecutive steps
/// (`(end[i] - end[i - window]) / window`), leaving out windows that start in the first `skip`
/// steps (the pipeline filling). Windows, not single steps, because lanes on several streams
/// can finish in pairs.
pub fn window_times(ends_us: &[f64], skip: usize, window: usize) -> Vec<f64> {
    (skip + window..ends_us.len())
        .map(|i| (ends_us[i] - ends_us[i - window]) / window as f64)
        .collect()
}

/// The median (NaN for none).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// What the checks of one variant found.
#[derive(Clone)]
pub struct Checked {
    pub steps: usize,
    /// Steps whose output equals the reference bit for bit.
    pub bitwise: usize,
    /// Largest |difference| relative to the reference's RMS.
    pub worst: f32,
    /// Largest ‖difference‖₂ / ‖reference‖₂ of a step.
    pub worst_l2: f32,
    pub failures: Vec<String>,
    tolerance: Tolerance,
}

/// When a step's output passes.
#[derive(Clone, Copy)]
enum Tolerance {
    /// Every element within `rtol·|reference| + atol_rms·RMS(reference)`.
    Elements { rtol: f32, atol_rms: f32 },
    /// ‖difference‖₂ ≤ `l2`·‖reference‖₂, and no element off by more than `max_rms`·RMS.
    Norm { l2: f32, max_rms: f32 },
}

impl Default for Checked {
    /// Within 1/64 relative plus 2% of the reference's RMS per element (a wrong or stale set
    /// differs by about the RMS itself).
    fn default() -> Self {
        Self::within(1.0 / 64.0, 0.02)
    }
}

impl Checked {
    /// Elements pass within `rtol·|reference| + atol_rms·RMS(reference)`.
    pub fn within(rtol: f32, atol_rms: f32) -> Self {
        Self::new(Tolerance::Elements { rtol, atol_rms })
    }

    /// A step passes when ‖output − reference‖₂ ≤ `l2`·‖reference‖₂ and no element is off by
    /// more than `max_rms`·RMS(reference): for references computed another way (a CPU model),
    /// where bf16 rounding flips add up over the layers but a wrong or stale weight set is off
    /// by about the RMS everywhere.
    pub fn norm_within(l2: f32, max_rms: f32) -> Self {
        Self::new(Tolerance::Norm { l2, max_rms })
    }

    fn new(tolerance: Tolerance) -> Self {
        Self {
            steps: 0,
            bitwise: 0,
            worst: 0.0,
            worst_l2: 0.0,
            failures: Vec::new(),
            tolerance,
        }
    }

    /// Compares every step of `chunk` with `references[set]`.
    pub fn add(&mut self, name: &str, chunk: &Chunk, references: &[Vec<u16>]) {
        for (i, (output, &set)) in chunk.outputs.iter().zip(&chunk.sets).enumerate() {
            let want_bits = &references[set];
            let got: Vec<f32> = output.iter().map(|&b| f32_from_bf16(b)).collect();
            let want: Vec<f32> = want_bits.iter().map(|&b| f32_from_bf16(b)).collect();
            let scale = rms(&want);
            let difference: Vec<f32> = got.iter().zip(&want).map(|(g, w)| g - w).collect();
            let l2 = rms(&difference) / scale;
            let (worst, ok) = match self.tolerance {
                Tolerance::Elements { rtol, atol_rms } => {
                    compare(&got, &want, rtol, atol_rms * scale)
                }
                Tolerance::Norm { l2: limit, max_rms } => {
                    let (worst, within) = compare(&got, &want, 0.0, max_rms * scale);
                    (worst, within && l2 <= limit)
                }
            };
            self.worst_l2 = if l2.is_nan() || self.worst_l2.is_nan() {
                f32::NAN
            } else {
                self.worst_l2.max(l2)
            };
            self.steps += 1;
            self.bitwise += usize::from(output == want_bits);
            let relative = worst / scale;
            if relative.is_nan() || self.worst.is_nan() {
                self.worst = f32::NAN;
            } else {
                self.worst = self.worst.max(relative);
            }
            if !ok && self.failures.len() < 5 {
                self.failures.push(format!(
                    "{name}: step {i} of a chunk (weight set {set}): max |diff| {worst}, \
                     |diff|/|reference| {l2:.2e} (reference RMS {scale})"
                ));
            }
        }
    }
}
