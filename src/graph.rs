//! Graphs captured over spaces, replayed on whatever datasets are bound.
//!
//! A [`StableGraph`] keeps the closure that issued its work, so it can re-capture the same work
//! at any time and ask the driver (`cuGraphExecUpdate`) whether the existing executable can take
//! it: [`StableGraph::check_update`]. Because slot addresses never change, a rebind leaves the
//! captured parameters valid, and the check comes back `Success` with nothing to patch.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;

use crate::driver::{self, graph as raw};
use crate::error::{Error, GraphError, Result};
use crate::fence::CaptureGuard;
use crate::space::{Space, SpaceShared};

/// The work a graph replays: it issues kernels, copies or library calls on the given stream.
pub type Work = Box<dyn FnMut(&Arc<CudaStream>) -> Result<()> + Send>;

/// What the driver said about an exec update, as a Rust enum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum UpdateOutcome {
    /// The executable took the new graph.
    Success,
    /// Rejected for an unspecified reason.
    Error,
    /// Nodes or edges were added or removed.
    TopologyChanged,
    /// A node's type changed.
    NodeTypeChanged,
    /// A kernel node's function changed.
    FunctionChanged,
    /// Parameters changed in a way that cannot be updated.
    ParametersChanged,
    /// Something not updatable (e.g. a node type that does not support update).
    NotSupported,
    /// A kernel function changed in an unsupported way.
    UnsupportedFunctionChange,
    /// Node attributes changed in an unsupported way.
    AttributesChanged,
    /// A result this build does not know.
    Unknown(u32),
}

impl UpdateOutcome {
    fn from_code(code: u32) -> Self {
        match code {
            0 => Self::Success,
            1 => Self::Error,
            2 => Self::TopologyChanged,
            3 => Self::NodeTypeChanged,
            4 => Self::FunctionChanged,
            5 => Self::ParametersChanged,
            6 => Self::NotSupported,
            7 => Self::UnsupportedFunctionChange,
            8 => Self::AttributesChanged,
            other => Self::Unknown(other),
        }
    }
}

/// The result of an update check ([`StableGraph::check_update`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct UpdateReport {
    /// What `cuGraphExecUpdate` said; [`UpdateOutcome::Success`] means the existing
    /// executable now runs the re-captured work.
    pub outcome: UpdateOutcome,
    /// Index (in [`StableGraph::node_kinds`] order of the re-captured graph) of the node the
    /// driver blamed, if it named one.
    pub error_node: Option<usize>,
    /// Time to re-capture the work.
    pub capture_time: Duration,
    /// Time `cuGraphExecUpdate` took.
    pub update_time: Duration,
}

impl UpdateReport {
    /// Whether the executable took the re-captured graph (no re-instantiation needed).
    pub fn is_success(&self) -> bool {
        self.outcome == UpdateOutcome::Success
    }
}

/// The kind of a graph node (the driver's `CUgraphNodeType`), as listed by
/// [`StableGraph::node_kinds`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeKind {
    /// A kernel launch (cuBLAS calls show up as one or more of these).
    Kernel,
    /// A memory copy.
    Memcpy,
    /// A memory set (fill).
    Memset,
    /// A host function call.
    Host,
    /// A nested graph.
    ChildGraph,
    /// A node with no work, used for dependencies.
    Empty,
    /// A wait on an event.
    WaitEvent,
    /// An event record.
    EventRecord,
    /// A signal of an external semaphore.
    ExternalSemaphoreSignal,
    /// A wait on an external semaphore.
    ExternalSemaphoreWait,
    /// A stream-ordered allocation made during the capture.
    MemAlloc,
    /// A stream-ordered free made during the capture.
    MemFree,
    /// A batch of memory operations (waits and writes on device memory).
    BatchMemOp,
    /// A conditional node (if/while/switch).
    Conditional,
    /// A node type this build does not know, with its raw code.
    Other(u32),
}

impl NodeKind {
    fn from_code(code: u32) -> Self {
        match code {
            0 => Self::Kernel,
            1 => Self::Memcpy,
            2 => Self::Memset,
            3 => Self::Host,
            4 => Self::ChildGraph,
            5 => Self::Empty,
            6 => Self::WaitEvent,
            7 => Self::EventRecord,
            8 => Self::ExternalSemaphoreSignal,
            9 => Self::ExternalSemaphoreWait,
            10 => Self::MemAlloc,
            11 => Self::MemFree,
            12 => Self::BatchMemOp,
            13 => Self::Conditional,
            other => Self::Other(other),
        }
    }
}

/// A CUDA graph captured over one or more spaces.
///
/// Replaying checks, under the spaces' locks, that every group of every space has a dataset
/// bound; otherwise it returns [`GraphError::Unbound`] and
/// launches nothing, so a missing binding is
/// an error rather than an illegal-address fault. The graph keeps its spaces' addresses reserved
/// for as long as it lives.
///
/// # Threads
/// `StableGraph` is `Send` and `Sync`: share it (`Arc<StableGraph>`, or `&StableGraph` in scoped
/// threads) and call [`replay`](StableGraph::replay) from several threads at once. Launches of
/// one graph are serialised by the spaces' locks and by a lock on the executable (the driver
/// does not synchronise calls on one executable), so each launch is enqueued whole, in the order
/// the threads got the locks; the GPU runs launches of one executable one after the other anyway.
/// Re-capturing ([`check_update`](StableGraph::check_update),
/// [`update_with`](StableGraph::update_with)) takes `&mut self`: it replaces what replays use.
pub struct StableGraph {
    // Field order is drop order: the executable and graph go before the spaces they point into.
    handles: Mutex<Handles>,
    /// Only used through `&mut self` (`get_mut`, never locked): the lock is what makes the
    /// closure, which need not be `Sync`, shareable.
    work: Mutex<Work>,
    stream: Arc<CudaStream>,
    spaces: Vec<Arc<SpaceShared>>,
    capture_time: Duration,
    instantiate_time: Duration,
}

/// The driver objects of a graph. Field order is drop order: the executable before the graph.
struct Handles {
    exec: raw::Exec,
    graph: raw::Graph,
}

// `StableGraph` must stay shareable between threads (see its docs).
const _: fn() = || {
    fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<StableGraph>();
};

impl std::fmt::Debug for StableGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StableGraph")
            .field(
                "spaces",
                &self.spaces.iter().map(|s| s.id()).collect::<Vec<_>>(),
            )
            .field("capture_time", &self.capture_time)
            .field("instantiate_time", &self.instantiate_time)
            .finish_non_exhaustive()
    }
}

/// Captures `work` on `stream` into a graph (not instantiated). The capture always ends, also
/// when `work` fails, so the stream is usable afterwards.
fn capture_graph(stream: &Arc<CudaStream>, work: &mut Work) -> Result<(raw::Graph, Duration)> {
    if driver::is_capturing(stream)? {
        return Err(Error::Graph(GraphError::AlreadyCapturing));
    }
    let start = Instant::now();
    raw::begin_capture(stream)?;
    let outcome = {
        let _guard = CaptureGuard::enter();
        work(stream)
    };
    let ended = raw::end_capture(stream);
    outcome?;
    let graph = raw::require_graph(ended?)?;
    Ok((graph, start.elapsed()))
}

// Here rather than in `space`, which knows nothing of graphs.
impl Space {
    /// Captures `work` on `stream` as a graph over this space. See [`StableGraph::capture`].
    pub fn capture<F>(&self, stream: &Arc<CudaStream>, work: F) -> Result<StableGraph>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static,
    {
        StableGraph::capture(stream, &[self], work)
    }
}

impl StableGraph {
    /// Captures `work` on `stream` over `spaces` and instantiates it.
    ///
    /// `work` must issue the same work each time it is called: [`StableGraph::check_update`]
    /// calls it again. Everything it touches must exist before the capture (no allocation inside).
    /// Kernels may be captured over unbound slots, but copy and memset nodes are checked by the
    /// driver when captured: bind a dataset under the slots they use first (any dataset of the
    /// group; later binds change the data, not the graph).
    /// `stream` must not be the legacy default stream (it cannot be captured).
    pub fn capture<F>(stream: &Arc<CudaStream>, spaces: &[&Space], work: F) -> Result<Self>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static,
    {
        let mut shared: Vec<Arc<SpaceShared>> = spaces.iter().map(|s| s.shared.clone()).collect();
        shared.sort_by_key(|s| s.id());
        shared.dedup_by_key(|s| s.id());
        let device = stream.context().ordinal();
        if let Some(space) = shared.iter().find(|s| !s.access().contains(&device)) {
            return Err(Error::Graph(GraphError::NotGranted {
                device,
                granted: space.access().to_vec(),
            }));
        }
        for space in &shared {
            space.attach(stream);
        }
        let mut work: Work = Box::new(work);
        let (graph, capture_time) = capture_graph(stream, &mut work)?;
        let start = Instant::now();
        let exec = graph.instantiate()?;
        let instantiate_time = start.elapsed();
        tracing::debug!(
            capture_us = capture_time.as_secs_f64() * 1e6,
            instantiate_us = instantiate_time.as_secs_f64() * 1e6,
            "graph captured"
        );
        Ok(Self {
            handles: Mutex::new(Handles { exec, graph }),
            work: Mutex::new(work),
            stream: stream.clone(),
            spaces: shared,
            capture_time,
            instantiate_time,
        })
    }

    /// Replays on the capture stream.
    pub fn replay(&self) -> Result<()> {
        self.launch(&self.stream)
    }

    /// Replays on another stream (of the same context).
    pub fn replay_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.launch(stream)
    }

    fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        // Locks in id order (no deadlock between graphs over the same spaces); held until the
        // launch is enqueued so no bind can unmap between the check and the launch. A later
        // bind waits for this launch on the fence. The executable's lock comes last, and
        // nothing that holds it takes a space's lock.
        let _locks = self
            .spaces
            .iter()
            .map(|space| space.lock_replayable(stream))
            .collect::<Result<Vec<_>>>()?;
        self.handles().exec.launch(stream)
    }

    fn handles(&self) -> MutexGuard<'_, Handles> {
        // A launch or a node query cannot leave the handles half-changed: a poisoned lock still
        // guards valid handles.
        self.handles
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn handles_mut(&mut self) -> &mut Handles {
        self.handles
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn work_mut(&mut self) -> &mut Work {
        self.work
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Re-captures the graph's own work and asks the driver to update the executable with it.
    /// `Success` proves the executable is reusable as it is (after any rebind).
    pub fn check_update(&mut self) -> Result<UpdateReport> {
        let stream = self.stream.clone();
        let (graph, capture_time) = capture_graph(&stream, self.work_mut())?;
        self.try_update(graph, capture_time)
            .map(|(report, _)| report)
    }

    /// Captures different `work` and tries to update the executable to it. On success the graph
    /// replays `work` from now on; when the driver rejects it (say, the topology changed) the
    /// report says why and the graph keeps replaying its old work, unchanged.
    pub fn update_with<F>(&mut self, work: F) -> Result<UpdateReport>
    where
        F: FnMut(&Arc<CudaStream>) -> Result<()> + Send + 'static,
    {
        let mut work: Work = Box::new(work);
        let (graph, capture_time) = capture_graph(&self.stream, &mut work)?;
        let (report, graph) = self.try_update(graph, capture_time)?;
        if report.is_success() {
            *self.work_mut() = work;
            self.handles_mut().graph = graph;
        }
        Ok(report)
    }

    fn try_update(
        &mut self,
        graph: raw::Graph,
        capture_time: Duration,
    ) -> Result<(UpdateReport, raw::Graph)> {
        let start = Instant::now();
        let raw = self.handles_mut().exec.update(&graph)?;
        let report = UpdateReport {
            outcome: UpdateOutcome::from_code(raw.result_code),
            error_node: raw.error_node,
            capture_time,
            update_time: start.elapsed(),
        };
        tracing::debug!(outcome = ?report.outcome, update_us = report.update_time.as_secs_f64() * 1e6, "update check");
        Ok((report, graph))
    }

    /// The kind of every node of the captured graph.
    pub fn node_kinds(&self) -> Result<Vec<NodeKind>> {
        Ok(self
            .handles()
            .graph
            .node_types()?
            .into_iter()
            .map(NodeKind::from_code)
            .collect())
    }

    /// The stream the graph was captured on (and replays on by default).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// How long the first capture took.
    pub fn capture_time(&self) -> Duration {
        self.capture_time
    }

    /// How long instantiation took.
    pub fn instantiate_time(&self) -> Duration {
        self.instantiate_time
    }
}
