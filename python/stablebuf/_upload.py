"""Uploading a captured graph ahead of its first replay (``cuGraphUpload``).

A graph's first launch uploads it to the device: milliseconds for thousands of nodes, paid by
whichever step replays it first. :class:`~stablebuf.PipelinedEngine` uploads both of its
graphs when it is built, so its first switch to the second region costs what the others do
(issue 41 measured ~4 ms for that first launch at 8 GiB on an H200, the p99 of the switch).
Imports no torch until called."""

from __future__ import annotations

from typing import Any

from . import _guard, _native
from ._devices import cuda_torch


def upload_graph(graph: Any, stream: Any = None) -> bool:
    """Uploads ``graph`` (a captured ``torch.cuda.CUDAGraph``, ``stablebuf.CUDAGraph``
    included) to its device on ``stream`` (default: that device's current stream), so that its
    first replay costs what the later ones do. Reads and writes no tensor; ordered after the
    work queued on ``stream``. Returns ``False``, doing nothing, where PyTorch gives no
    executable to upload: a graph without ``raw_cuda_graph_exec`` (an older PyTorch, or an
    object that is not a PyTorch graph), or a ``keep_graph=True`` graph not instantiated yet
    (its first replay instantiates and uploads it, as before). A driver failure raises
    :class:`stablebuf.Error`."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None:
        return False
    try:
        exec_handle = int(raw())
    except RuntimeError:  # not instantiated yet (keep_graph=True before instantiate())
        return False
    torch = cuda_torch()
    device = _guard.graph_device(graph)
    if device is None:
        device = torch.cuda.current_device()
    if stream is None:
        stream = torch.cuda.current_stream(device)
    _native.upload_graph(int(device), exec_handle, int(stream.cuda_stream))
    return True
