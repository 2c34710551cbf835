//! Pipelined rebinding: several lanes (spaces of one layout, each with its own stream and graph),
//! used in turn. While one lane's replay runs on the GPU, the host binds the next step's datasets
//! into the next lane, so the cost of a bind hides behind compute.
//!
//! ```text
//!  host:   bind L0 | replay L0 | bind L1 | replay L1 | bind L0 (waits for L0's last replay) ...
//!  GPU L0:           [======= step 0 =======]                  [======= step 2 ====...
//!  GPU L1:                                 [======= step 1 =======]
//! ```
//!
//! How many lanes: a bind into lane `L` waits for `L`'s previous replay. With 2 lanes that wait
//! ends just as the other lane's replay starts, so the remap lands partly on the critical path;
//! with 3 the host runs a full replay ahead. Measured on an H100 with a 3×4096 FP32 MLP whose
//! 192 MiB of weights and 4 MiB batch are rebound every step: 2 lanes +7.5% to +12% per step over
//! the same lanes never rebinding, 3 lanes +0.7%. Use 3 unless memory for the third
//! lane's scratch is short.
//!
//! Each lane's space uses [`FencePolicy::AttachedStreams`], so a bind into one lane waits for
//! that lane's own earlier work and never for another lane's: the library, not the caller,
//! guarantees no backing is unmapped while a replay still uses it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::dataset::Dataset;
use crate::driver;
use crate::error::{Error, Result};
use crate::fence::FencePolicy;
use crate::graph::StableGraph;
use crate::layout::Layout;
use crate::space::{Space, SpaceOptions};

/// One lane: a space, its stream, and the graph captured over it.
#[derive(Debug)]
pub struct Lane {
    // Field order is drop order: the graph before the space it points into.
    graph: StableGraph,
    space: Space,
    stream: Arc<CudaStream>,
}

impl Lane {
    /// The lane's space: read its outputs here (`lane.space().read(lane.stream(), "y")`)
    /// after the lane's step.
    pub fn space(&self) -> &Space {
        &self.space
    }

    /// The lane's own stream: its replays run here, and reading outputs on it orders the read
    /// after the lane's last replay.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The graph captured over the lane's space, replayed by [`Pipeline::step`].
    pub fn graph(&self) -> &StableGraph {
        &self.graph
    }
}

/// Lanes used round-robin. See the module docs.
#[derive(Debug)]
pub struct Pipeline {
    lanes: Vec<Lane>,
    next: usize,
}

impl Pipeline {
    /// Makes `lanes` (at least 2) spaces of `layout` with `options` (the fence is forced to
    /// `AttachedStreams`), and captures in each the work `build` returns for it. `build` gets the
    /// lane's space and stream; it is where per-lane resources (a cuBLAS handle on the lane's
    /// stream, say) are made.
    pub fn new<F, W>(
        ctx: &Arc<CudaContext>,
        layout: &Layout,
        lanes: usize,
        options: SpaceOptions,
        mut build: F,
    ) -> Result<Self>
    where
        F: FnMut(&Space, &Arc<CudaStream>) -> Result<W>,
        W: FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static,
    {
        if lanes < 2 {
            return Err(Error::InvalidShape(format!(
                "a pipeline needs at least 2 lanes, got {lanes}"
            )));
        }
        let options = options.fence(FencePolicy::AttachedStreams);
        let lanes = (0..lanes)
            .map(|_| {
                let space = Space::with_options(ctx, layout.clone(), options.clone())?;
                let stream = driver::traced("cuStreamCreate", 0, || ctx.new_stream())?;
                space.attach(&stream);
                let work = build(&space, &stream)?;
                let graph = space.capture(&stream, work)?;
                Ok(Lane {
                    graph,
                    space,
                    stream,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { lanes, next: 0 })
    }

    /// Binds `datasets` into the next lane (waiting only for that lane's earlier replays) and
    /// enqueues its replay. Returns the lane, to read its outputs after syncing its stream.
    pub fn step(&mut self, datasets: &[&Dataset]) -> Result<&Lane> {
        let index = self.next;
        let lane = &self.lanes[index];
        for dataset in datasets {
            lane.space.bind_on(dataset, &lane.stream)?;
        }
        lane.graph.replay()?;
        self.next = (index + 1) % self.lanes.len();
        Ok(&self.lanes[index])
    }

    /// Every lane, in the order [`step`](Self::step) uses them (step `i` runs on lane
    /// `i % lanes().len()`, counting from the first step).
    pub fn lanes(&self) -> &[Lane] {
        &self.lanes
    }

    /// Waits for every lane's work.
    pub fn synchronize(&self) -> Result<()> {
        self.lanes
            .iter()
            .try_for_each(|lane| driver::synchronize_stream(&lane.stream))
    }
}
