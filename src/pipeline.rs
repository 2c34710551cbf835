//! Pipelined rebinding: several lanes (spaces of one layout, each with its own stream and graph),
//! used in turn. While one lane's replay runs on the GPU, the host binds the next step's datasets
//! into the next lane, so the cost of a bind hides behind compute.
//!
//! ```text
//!  host:   bind L0 | replay L0 | bind L1 | replay L1 | bind L0 (waits for L0's last replay) ...
//!  GPU:              [===== step 0 (L0) =====][===== step 1 (L1) =====][===== step 2 (L0) ===
//! ```
//!
//! **Replays run in step order** (the default; [`Pipeline::order_replays`]): each lane's replay
//! waits on the GPU, through an event, for the previous step's replay on the other lane. Only
//! binds overlap replays; replays never overlap each other. That is what makes 2 lanes enough. A
//! bind into lane `L` must wait for `L`'s previous replay (step `i - 2`), and it must be done
//! before step `i` is enqueued; the GPU meanwhile has step `i - 1` to run, all of it when
//! replays are ordered. When the two lanes' replays were free to overlap (the first version of
//! this module), step `i - 1` started as soon as it was enqueued and shared the GPU with step
//! `i - 2`, so by the time `i - 2` finished, part of `i - 1`'s slack was already spent and the
//! GPU could idle while the host unmapped, mapped and launched. Measured on an
//! H100 with a 3×4096 FP32 MLP whose 192 MiB of weights and 4 MiB batch are rebound every step,
//! unordered lanes cost +7.6% to +15.8% per step with 2 lanes and +0.7% with 3 (a full replay of
//! slack), over the same lanes never rebinding. In order, the host has a whole replay to bind in
//! (the bind of 192 MiB and a copy-in of 4 MiB take well under the 510 µs replay).
//! `benches/lanes.rs` measures both orders, 2 and 3 lanes, against the same lanes never
//! rebinding and against one stream replaying alone; turn ordering off only when lanes run
//! independent work that should share the GPU.
//!
//! Each lane's space uses [`FencePolicy::AttachedStreams`], so a bind into one lane waits for
//! that lane's own earlier work (its stream, which includes the event wait on the lane before)
//! and never for the replay running on the other lane: the library, not the caller, guarantees
//! no backing is unmapped while a replay still uses it.
//!
//! **Threads.** A pipeline is `Send` but deliberately not `Sync`: its steps are one sequence, in
//! order, so one thread drives it (`step` takes `&mut self`); move it to another thread to drive
//! it there. Sharing `&Pipeline` between threads would offer nothing that needs it, so the type
//! does not promise it:
//!
//! ```compile_fail
//! fn shared_between_threads<T: Sync>() {}
//! shared_between_threads::<stablebuf::Pipeline>();
//! ```

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use crate::dataset::Dataset;
use crate::driver;
use crate::error::{Error, LayoutError, Result};
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
    /// Recorded on the lane's stream after each of its replays: the next step's replay, on the
    /// other lane, waits on it.
    replayed: CudaEvent,
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
    /// The lane of the last replay, which the next one waits for when `in_order`.
    previous: Option<usize>,
    in_order: bool,
    /// Send but not Sync, whatever the fields are (see "Threads" in the module docs).
    _one_driver: PhantomData<Cell<()>>,
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
            return Err(Error::Layout(LayoutError::InvalidShape(format!(
                "a pipeline needs at least 2 lanes, got {lanes}"
            ))));
        }
        let options = options.fence(FencePolicy::AttachedStreams);
        let lanes = (0..lanes)
            .map(|_| {
                let space = Space::with_options(ctx, layout.clone(), options.clone())?;
                let stream = driver::traced("cuStreamCreate", 0, || ctx.new_stream())?;
                space.attach(&stream);
                let work = build(&space, &stream)?;
                let graph = space.capture(&stream, work)?;
                let replayed = driver::traced("cuEventCreate", 0, || ctx.new_event(None))?;
                Ok(Lane {
                    graph,
                    space,
                    stream,
                    replayed,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            lanes,
            next: 0,
            previous: None,
            in_order: true,
            _one_driver: PhantomData,
        })
    }

    /// Binds `datasets` into the next lane (waiting only for that lane's earlier replays) and
    /// enqueues its replay, after the previous step's replay when replays run in order. Returns
    /// the lane, to read its outputs after syncing its stream.
    pub fn step(&mut self, datasets: &[&Dataset]) -> Result<&Lane> {
        let index = self.next;
        let lane = &self.lanes[index];
        for dataset in datasets {
            lane.space.bind_on(dataset, &lane.stream)?;
        }
        // After the binds, so copy-in binds on the lane's stream overlap the previous replay.
        if let Some(previous) = self.previous.filter(|&p| self.in_order && p != index) {
            let before = &self.lanes[previous].replayed;
            driver::traced("cuStreamWaitEvent", 0, || lane.stream.wait(before))?;
        }
        lane.graph.replay()?;
        self.previous = Some(index);
        driver::traced("cuEventRecord", 0, || lane.replayed.record(&lane.stream))?;
        self.next = (index + 1) % self.lanes.len();
        Ok(&self.lanes[index])
    }

    /// Whether each replay waits on the GPU for the previous step's replay (the default: see
    /// the module docs). Turned off, lanes' replays may overlap on the GPU; binds still never
    /// unmap under a replay either way.
    pub fn order_replays(&mut self, in_order: bool) {
        self.in_order = in_order;
    }

    /// Whether replays are ordered ([`order_replays`](Self::order_replays)).
    pub fn replays_in_order(&self) -> bool {
        self.in_order
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipeline_can_move_to_another_thread() {
        fn movable<T: Send>() {}
        movable::<Pipeline>();
    }
}
