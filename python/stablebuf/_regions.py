"""Regions and what PyTorch allocates in them: :func:`pool` and :func:`region` (one
pluggable-allocator ``MemPool`` per tag), and the views of every region: :func:`tags`,
:func:`stats`, :func:`timeline`, :func:`library_path`."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple, Union

from . import _guard, _native
from ._devices import cuda_torch, current_device, remember_device
from ._native import Error

if TYPE_CHECKING:  # pragma: no cover
    import torch

# One (allocator, pool) per tag, kept for the life of the process: a MemPool must outlive
# every tensor allocated from it, and PyTorch crashes when a pool built on a pluggable
# allocator is collected early (pytorch#146431).
_POOLS: Dict[str, Tuple[Any, Any]] = {}
_POOLS_LOCK = threading.Lock()
_EXPANDABLE_WARNED = False


def library_path() -> str:
    """Path of the shared library whose C functions PyTorch's pluggable allocator calls."""
    path = _native.__file__
    if path is None:  # pragma: no cover - extension modules always have a file
        raise Error("stablebuf._native has no file path")
    return str(path)


def _expandable_segments_requested() -> bool:
    for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if re.search(r"expandable_segments\s*:\s*true", os.environ.get(variable, ""), re.I):
            return True
    return False


@contextlib.contextmanager
def _expandable_segments_off(torch: Any) -> Iterator[None]:
    """Expandable segments must be off while a pool on a pluggable allocator allocates
    (pytorch#147851): switch them off for the block and back on after, saying so once."""
    if not _expandable_segments_requested():
        yield
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        raise Error(
            "PYTORCH_CUDA_ALLOC_CONF asks for expandable_segments:True, which pools on a "
            "pluggable allocator do not support (pytorch#147851), and this torch cannot switch "
            "it off at run time: unset it for processes that use stablebuf regions"
        )
    global _EXPANDABLE_WARNED
    if not _EXPANDABLE_WARNED:
        _EXPANDABLE_WARNED = True
        warnings.warn(
            "stablebuf: expandable_segments is switched off inside stablebuf.region() "
            "(pools on a pluggable allocator do not support it, pytorch#147851); it stays on "
            "elsewhere",
            RuntimeWarning,
            stacklevel=4,
        )
    setter("expandable_segments:False")
    try:
        yield
    finally:
        setter("expandable_segments:True")


_FENCES = ("device", "last-use")


def _last_use(fence: str) -> bool:
    if fence not in _FENCES:
        raise ValueError(f"fence must be one of {_FENCES}, not {fence!r}")
    return fence == "last-use"


def pool(
    tag: str, *, capacity: Optional[int] = None, fence: str = "device"
) -> "torch.cuda.MemPool":
    """The ``torch.cuda.MemPool`` whose memory comes from region ``tag`` (created on first use,
    on the current CUDA device, with ``capacity`` bytes of addresses; 1 TiB by default, which
    costs no memory).

    The region lives on that device for good: a tag names one region on one device, and
    asking for it while another device is current raises :class:`DeviceMismatch` (naming both
    devices). Regions of other tags may live on other devices.

    ``fence`` (used when the region is created) says what a bind, sleep or free waits for
    before it unmaps: ``"device"`` (default) all work on the device, which cannot miss a use;
    ``"last-use"`` only the uses noted on each stream — guarded replays (every
    ``torch.cuda.CUDAGraph`` over a region, ``torch.compile(mode="reduce-overhead")`` calls),
    :func:`writing` blocks, and :func:`note_use` for anything else — so
    a bind overlaps a replay over another region queued after its last use (see
    ``examples/weight_swap.py``, pipelined). An eager kernel over a ``"last-use"`` region that
    nobody noted is not waited for.

    Pass ``pool(tag).id`` to ``torch.cuda.graph(g, pool=...)`` to put a graph's own memory
    (activations, outputs) in a region that can sleep: see the README for what the capture
    probe found.
    """
    last_use = _last_use(fence)
    with _POOLS_LOCK:
        found = _POOLS.get(tag)
        device = current_device()
        if found is not None:
            # Creates nothing; raises DeviceMismatch if the tag's region is on another device.
            _native.register(tag, device, capacity, last_use)
            return found[1]
        torch = cuda_torch()
        slot = _native.register(tag, device, capacity, last_use)
        remember_device(tag, device)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            library_path(), _native.alloc_symbol(slot), _native.FREE_SYMBOL
        )
        mem_pool = torch.cuda.MemPool(allocator.allocator())
        _POOLS[tag] = (allocator, mem_pool)
        _guard.note_region_created()
    # From the first region on, every CUDA graph replay and compiled call checks its regions.
    _guard.install()
    return mem_pool


def warn_free_errors() -> None:
    """Warn about each free that failed since the last call (a free runs inside PyTorch's
    allocator, where it cannot raise)."""
    for message in _native.take_free_errors():
        warnings.warn(f"stablebuf: a free failed: {message}", RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def region(
    tag: str, *, capacity: Optional[int] = None, fence: str = "device"
) -> Iterator["torch.cuda.MemPool"]:
    """Allocate every CUDA tensor made in this block (on this thread) in region ``tag``.

    The region is one reservation of device addresses; its allocations sit side by side, at
    addresses that never change, so graphs captured over them stay valid across
    :func:`sleep`/:func:`wake` and :func:`bind`. Yields the tag's ``MemPool``.

    Raises :class:`Asleep` if the region is asleep (PyTorch could otherwise hand out cached
    blocks over released memory), :class:`Unbound` if it is unbound, and
    :class:`DeviceMismatch` if the region lives on another device than the current one. An
    allocation the region refuses raises the typed error (:class:`OutOfMemory` with the bytes
    asked and free, :class:`Asleep`, ...) instead of PyTorch's generic out-of-memory error,
    which becomes its ``__cause__``.
    """
    torch = cuda_torch()
    mem_pool = pool(tag, capacity=capacity, fence=fence)
    _native.check_replayable([tag])
    _native.take_alloc_error()  # a stale failure must not be blamed on this block
    try:
        with _expandable_segments_off(torch), torch.cuda.use_mem_pool(mem_pool):
            yield mem_pool
    except RuntimeError as refused:  # torch.OutOfMemoryError is a RuntimeError
        cause = _native.take_alloc_error()
        if cause is not None:
            raise cause from refused
        raise
    finally:
        warn_free_errors()


def tags() -> List[str]:
    """Every region's tag, in creation order."""
    return _native.tags()


def stats() -> Dict[str, Dict[str, Any]]:
    """Per tag: ``reserved`` (virtual bytes), ``allocated`` (bytes PyTorch holds from the region),
    ``allocations``, ``span``, ``mapped`` (physical bytes now), ``mappings``, ``asleep``,
    ``host_bytes`` (kept on the host while asleep), ``device`` (the CUDA device the region
    lives on), and from PyTorch's pool, where it can tell,
    ``tensor_bytes`` (in live tensors) and ``cached`` (held by PyTorch's cache, free for
    tensors)."""
    out: Dict[str, Dict[str, Any]] = _native.stats()
    for tag, entry in out.items():
        found = _POOLS.get(tag)
        if found is None:
            continue
        try:
            segments = found[1].snapshot(include_traces=False)
        except Exception:  # noqa: BLE001 - PyTorch's view is extra; the region's is above
            continue
        in_tensors = sum(int(s.get("allocated_size", 0)) for s in segments)
        total = sum(int(s.get("total_size", 0)) for s in segments)
        entry["tensor_bytes"] = in_tensors
        entry["cached"] = total - in_tensors
    return out


def timeline(path: Union[str, "os.PathLike[str]"], title: str = "stablebuf regions") -> str:
    """Write the SVG timeline (address against time) of every region's maps, unmaps,
    allocations and frees to ``path``; returns the path."""
    svg = _native.timeline_svg(title)
    with open(path, "w", encoding="utf-8") as out:
        out.write(svg)
    return os.fspath(path)
