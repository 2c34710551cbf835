//! Uploading PyTorch's executable graphs ahead of their first replay (`cuGraphUpload`).
//!
//! A graph's first launch uploads it to the device: milliseconds for a graph of thousands of
//! nodes, paid by whichever step replays it first. A pipelined engine's second graph is first
//! replayed at its first version switch, which then took ~4 ms on an H200 at 8 GiB (issue 41);
//! uploading both graphs when the engine is built moves that cost to start-up.

use stablebuf::device::{borrow_stream, upload_foreign_exec};

use crate::context::ContextScope;
use crate::errors::{Failure, Kind};
use crate::regions::device_context;

/// Uploads the executable graph `exec` (PyTorch's `raw_cuda_graph_exec()`, a `CUgraphExec` of
/// device `device`'s primary context) on PyTorch's stream `stream` of that device. The
/// calling thread's current context is left as it was.
pub fn upload(device: i32, exec: u64, stream: usize) -> Result<(), Failure> {
    let ctx = device_context(device)?;
    let _scope = ContextScope::enter(&ctx)?;
    let borrowed = borrow_stream(&ctx, stream as u64)
        .map_err(|error| {
            Failure::from_core(&error, None).context(format_args!(
                "checking the stream {stream:#x} given for the upload"
            ))
        })?
        .ok_or_else(|| {
            Failure::new(
                Kind::DeviceMismatch,
                format!(
                    "stream {stream:#x} belongs to another device's context than device \
                     {device}'s, where the graph lives: pass torch.cuda.current_stream({device})"
                ),
            )
        })?;
    upload_foreign_exec(&borrowed, exec).map_err(|error| {
        Failure::from_core(&error, None).context(format_args!(
            "uploading graph exec {exec:#x} on device {device}"
        ))
    })
}
