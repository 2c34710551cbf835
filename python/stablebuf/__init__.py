"""stablebuf for PyTorch: tagged memory regions at fixed device addresses.

Tensors allocated inside ``with stablebuf.region(tag):`` live in one reservation per tag, side
by side, at addresses that never change. That makes three things cheap and safe for CUDA
graphs captured over them:

- :func:`sleep` / :func:`wake`: release a region's device memory (keeping its bytes in pinned
  host memory, or discarding them) and bring it back with one mapping; the same tensors and
  graphs work after the wake.
- :func:`snapshot` / :func:`bind`: keep several weight sets of a region resident and swap them
  under a captured graph with one remap, no copy and no re-capture; :func:`switch` picks the
  cheaper of a remap and a copy for the region's size (small models copy: below
  :func:`crossover_bytes`, about 100 MiB on an H100, a copy is faster than a remap).
- the replay guard: from the first region on, every PyTorch CUDA graph replay (a plain
  ``torch.cuda.CUDAGraph``, :class:`CUDAGraph`, ``torch.compile(mode="reduce-overhead")``'s
  graphs) made while a region it uses is asleep or unbound raises :class:`Asleep` /
  :class:`Unbound` before launching anything, instead of killing the CUDA context
  (:func:`graph_tags`, :func:`guard_stats`; :func:`guard_module` for eager forwards).

::

    import torch, stablebuf

    with stablebuf.region("weights"):
        model = build_model().cuda().half()
    ws_a = stablebuf.bound("weights") or stablebuf.snapshot("weights")
    ws_b = stablebuf.snapshot("weights")
    with stablebuf.writing(ws_b):
        model.load_state_dict(other_state)

    g = stablebuf.CUDAGraph(tags=["weights"])
    with torch.cuda.graph(g):
        out = model(static_x)
    stablebuf.bind("weights", ws_b); g.replay()   # runs on weight set B
    stablebuf.sleep("weights"); stablebuf.wake("weights"); g.replay()

Regions of one process may live on several devices: each on the device that was current when
it was created, and every call acts on a region on its own device, whatever device is current.

The package imports without torch or a GPU (for tooling and tests); the PyTorch glue needs
``torch`` with CUDA when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._capture import CaptureActive
from ._guard import graph_tags, guard_module, guard_stats
from ._manual_guard import GuardedGraph, check, guard, note_use
from ._native import (
    Asleep,
    DeviceMismatch,
    Error,
    KvCache,
    OfferMismatch,
    OutOfMemory,
    OverBudget,
    PeerClosed,
    PublishError,
    PublishTimeout,
    SnapshotMismatch,
    Unbound,
    UnknownTag,
    VersionConflict,
    WeightSet,
    __version__,
    driver_present,
    release_stats,
    set_release_policy,
    trim,
)
from ._regions import library_path, pool, region, stats, tags, timeline
from ._sleep import host_arena, reserve_host, sleep, wake
from ._upload import upload_graph
from ._weights import bind, bound, crossover_bytes, snapshot, switch, unbind, writing
from . import publish  # noqa: E402  (weight publishing between processes; imports no torch)
from ._pipelined import PipelinedEngine, PipelinedTrainer  # noqa: E402  (two regions; no torch)
from ._pulling import PullingEngine  # noqa: E402  (one GPU: the engine copies; no torch)

if TYPE_CHECKING:  # pragma: no cover
    from ._graph import CUDAGraph

__all__ = [
    "Asleep",
    "CUDAGraph",
    "CaptureActive",
    "DeviceMismatch",
    "Error",
    "GuardedGraph",
    "KvCache",
    "OfferMismatch",
    "OutOfMemory",
    "OverBudget",
    "PeerClosed",
    "PublishError",
    "PublishTimeout",
    "SnapshotMismatch",
    "Unbound",
    "UnknownTag",
    "VersionConflict",
    "WeightSet",
    "__version__",
    "bind",
    "bound",
    "check",
    "crossover_bytes",
    "driver_present",
    "graph_tags",
    "guard",
    "guard_module",
    "guard_stats",
    "host_arena",
    "library_path",
    "note_use",
    "PipelinedEngine",
    "PipelinedTrainer",
    "PullingEngine",
    "pool",
    "publish",
    "region",
    "release_stats",
    "reserve_host",
    "set_release_policy",
    "sleep",
    "snapshot",
    "stats",
    "switch",
    "tags",
    "timeline",
    "trim",
    "unbind",
    "upload_graph",
    "wake",
    "writing",
]


def __getattr__(name: str) -> Any:
    # CUDAGraph subclasses torch.cuda.CUDAGraph, so it is defined when first asked for: the
    # package itself imports without torch.
    if name == "CUDAGraph":
        from ._graph import CUDAGraph

        globals()["CUDAGraph"] = CUDAGraph
        return CUDAGraph
    raise AttributeError(f"module 'stablebuf' has no attribute {name!r}")
