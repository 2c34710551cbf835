//! Raw graph objects: a captured graph, its executable, capture, launch and exec update.
//!
//! Unlike cudarc's `CudaGraph`, capture and instantiation are separate, because an update check
//! needs a freshly captured graph that is never instantiated.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::{bind_context, traced, traced_raw};
use crate::error::{Error, GraphError, Result};

/// A captured (not instantiated) graph. Destroyed on drop.
#[derive(Debug)]
pub(crate) struct Graph {
    ctx: Arc<CudaContext>,
    graph: sys::CUgraph,
}

// SAFETY: a CUgraph is a handle the driver lets any thread use as long as calls on one graph are
// not concurrent; `Graph` is only used through `&mut`/owned access or immutable queries made
// by its single owner, so moving it between threads is sound.
unsafe impl Send for Graph {}

/// An instantiated graph. Destroyed on drop.
#[derive(Debug)]
pub(crate) struct Exec {
    ctx: Arc<CudaContext>,
    exec: sys::CUgraphExec,
}

// SAFETY: as for `Graph`; the owner (`StableGraph`) never shares it between threads at once.
unsafe impl Send for Exec {}

/// What `cuGraphExecUpdate` said, in plain numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawUpdate {
    /// `CUgraphExecUpdateResult` as its integer value (newer drivers may add values).
    pub(crate) result_code: u32,
    /// Index, in `Graph::node_types` order, of the node of the new graph that failed.
    pub(crate) error_node: Option<usize>,
}

/// `CUgraphExecUpdateResultInfo` with the result read as a plain integer, so a value this build's
/// bindings do not know cannot become an invalid Rust enum.
#[repr(C)]
struct UpdateResultInfo {
    result: u32,
    error_node: sys::CUgraphNode,
    error_from_node: sys::CUgraphNode,
}

/// Starts capturing `stream` in thread-local mode: other threads' CUDA calls are unaffected.
pub(crate) fn begin_capture(stream: &CudaStream) -> Result<()> {
    bind_context(stream.context())?;
    traced("cuStreamBeginCapture", 0, || {
        // SAFETY: the stream is live for the call (borrowed); capture mode is a valid enum value.
        unsafe {
            result::stream::begin_capture(
                stream.cu_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
    })
}

/// Ends the capture on `stream`. `None` when nothing was captured.
///
/// The capture is ended even when binding the context fails (that error is returned after,
/// with the graph destroyed): a stream left capturing would capture, or refuse, everything
/// enqueued on it from then on.
pub(crate) fn end_capture(stream: &CudaStream) -> Result<Option<Graph>> {
    let bound = bind_context(stream.context());
    let graph = traced("cuStreamEndCapture", 0, || {
        // SAFETY: the stream is live; the returned graph (if any) is owned by us from now on.
        unsafe { result::stream::end_capture(stream.cu_stream()) }
    })?;
    let graph = (!graph.is_null()).then(|| Graph {
        ctx: stream.context().clone(),
        graph,
    });
    bound.map(|()| graph)
}

impl Graph {
    /// Instantiates the graph into an executable.
    pub(crate) fn instantiate(&self) -> Result<Exec> {
        bind_context(&self.ctx)?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        traced_raw("cuGraphInstantiateWithFlags", 0, || {
            // SAFETY: valid out-pointer and live graph; flags 0 = default behaviour.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, self.graph, 0) }
        })?;
        Ok(Exec {
            ctx: self.ctx.clone(),
            exec,
        })
    }

    fn nodes(&self) -> Result<Vec<sys::CUgraphNode>> {
        bind_context(&self.ctx)?;
        let mut count = 0usize;
        traced_raw("cuGraphGetNodes", 0, || {
            // SAFETY: a null node array asks only for the count.
            unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut count) }
        })?;
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
        traced_raw("cuGraphGetNodes", 0, || {
            // SAFETY: `nodes` has room for `count` handles; the driver writes at most `count`.
            unsafe { sys::cuGraphGetNodes(self.graph, nodes.as_mut_ptr(), &mut count) }
        })?;
        nodes.truncate(count);
        Ok(nodes)
    }

    /// The type of every node (`CUgraphNodeType` as integers), in the driver's node order.
    pub(crate) fn node_types(&self) -> Result<Vec<u32>> {
        self.nodes()?
            .into_iter()
            .map(|node| {
                let mut kind = 0u32;
                traced_raw("cuGraphNodeGetType", 0, || {
                    // SAFETY: the node belongs to this live graph. The type is written as a
                    // 32-bit enum; reading it into a u32 keeps unknown values well-defined.
                    unsafe { sys::cuGraphNodeGetType(node, (&mut kind as *mut u32).cast()) }
                })?;
                Ok(kind)
            })
            .collect()
    }
}

impl Exec {
    /// Launches the executable on `stream`.
    pub(crate) fn launch(&self, stream: &CudaStream) -> Result<()> {
        bind_context(&self.ctx)?;
        traced_raw("cuGraphLaunch", 0, || {
            // SAFETY: live exec and stream of the same context.
            unsafe { sys::cuGraphLaunch(self.exec, stream.cu_stream()) }
        })
    }

    /// Tries to update this executable in place to `graph` (`cuGraphExecUpdate_v2`).
    ///
    /// A rejected update is not an error here: the driver reports why in the result code, and
    /// this executable is left as it was. Other failures are errors.
    pub(crate) fn update(&self, graph: &Graph) -> Result<RawUpdate> {
        bind_context(&self.ctx)?;
        let mut info = UpdateResultInfo {
            result: 0,
            error_node: std::ptr::null_mut(),
            error_from_node: std::ptr::null_mut(),
        };
        // A rejected update is an answer, not a failure: only other results are errors.
        traced("cuGraphExecUpdate_v2", 0, || {
            // SAFETY: `UpdateResultInfo` has the layout of CUgraphExecUpdateResultInfo (a 32-bit
            // enum then two node handles, repr(C)); both handles are live and of one context.
            let status = unsafe {
                sys::cuGraphExecUpdate_v2(
                    self.exec,
                    graph.graph,
                    (&mut info as *mut UpdateResultInfo).cast(),
                )
            };
            match status {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => Ok(()),
                other => Err(cudarc::driver::DriverError(other)),
            }
        })?;
        let error_node = if info.error_node.is_null() {
            None
        } else {
            graph.nodes()?.iter().position(|&n| n == info.error_node)
        };
        tracing::debug!(
            call = "cuGraphExecUpdate_v2",
            result = info.result,
            "exec update"
        );
        Ok(RawUpdate {
            result_code: info.result,
            error_node,
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let graph = self.graph;
        super::release(&self.ctx, "cuGraphDestroy", 0, || {
            // SAFETY: owned graph, destroyed once.
            unsafe { sys::cuGraphDestroy(graph) }
        });
    }
}

impl Drop for Exec {
    fn drop(&mut self) {
        let exec = self.exec;
        super::release(&self.ctx, "cuGraphExecDestroy", 0, || {
            // SAFETY: owned exec, destroyed once. The driver defers the destruction until
            // launches in flight complete.
            unsafe { sys::cuGraphExecDestroy(exec) }
        });
    }
}

/// Uploads another runtime's executable graph to the device on `stream` (`cuGraphUpload`), so
/// that its first launch costs what the later ones do. Without it the first launch uploads the
/// graph itself: about 4 ms for a graph of ~3,000 nodes on an H200 (issue 41 measured that
/// launch as the p99 of a pipelined switch at 8 GiB, the first switch to the second region).
///
/// `exec` is a raw `CUgraphExec` as a number (PyTorch's
/// `torch.cuda.CUDAGraph.raw_cuda_graph_exec()`) of `stream`'s context, which its owner keeps
/// alive for the call, as for [`borrow_stream`](super::context::borrow_stream)'s handle; a null
/// one is the driver's `CUDA_ERROR_INVALID_VALUE`. The upload is ordered after the work queued
/// on `stream` and before the exec's later launches, wherever they go.
#[cfg_attr(any(test, feature = "fault-injection"), track_caller)]
pub fn upload_foreign_exec(stream: &CudaStream, exec: u64) -> Result<()> {
    bind_context(stream.context())?;
    traced_raw("cuGraphUpload", 0, || {
        // SAFETY: `exec` is a live executable of this context (the function's contract: its
        // owner, another runtime, keeps it alive for the call; the driver refuses null), and
        // the stream is borrowed live for the call.
        unsafe { sys::cuGraphUpload(exec as sys::CUgraphExec, stream.cu_stream()) }
    })
}

/// Turns "nothing captured" into an error for callers that need a graph.
pub(crate) fn require_graph(graph: Option<Graph>) -> Result<Graph> {
    graph.ok_or(Error::Graph(GraphError::EmptyCapture))
}
