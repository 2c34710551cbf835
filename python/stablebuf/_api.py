"""Regions, sleep/wake, weight sets and the replay guard (everything but the graph subclass)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import warnings
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import _guard, _native
from ._native import Error, UnknownTag, WeightSet

if TYPE_CHECKING:  # pragma: no cover
    import torch

Tags = Union[str, Iterable[str]]

# One (allocator, pool) per tag, kept for the life of the process: a MemPool must outlive
# every tensor allocated from it, and PyTorch crashes when a pool built on a pluggable
# allocator is collected early (pytorch#146431).
_POOLS: Dict[str, Tuple[Any, Any]] = {}
_POOLS_LOCK = threading.Lock()
_EXPANDABLE_WARNED = False
# The device of each tag's region: a region never moves, so what the extension said is kept.
_TAG_DEVICES: Dict[str, int] = {}


class CaptureActive(Error):
    """A call that unmaps, maps or copies region memory (``sleep``, ``wake``, ``bind``,
    ``switch``, ``unbind``, ``snapshot``, ``crossover_bytes``, which may calibrate) came while
    a CUDA graph capture is under way on the current stream (of the current device, or of the
    device of a region the call acts on); nothing was changed."""


CaptureActive.__module__ = "stablebuf"


def _refuse_during_capture(call: str, tags: Sequence[str] = ()) -> None:
    """Raise :class:`CaptureActive` if the current stream, or the current stream of a device
    the regions ``tags`` live on, is capturing a CUDA graph: a remap or a copy now would be
    captured into (or break) the graph being recorded."""
    torch = sys.modules.get("torch")
    if torch is None:
        return  # without torch nothing can be capturing through PyTorch
    try:
        if not torch.cuda.is_initialized():
            return
        capturing = bool(torch.cuda.is_current_stream_capturing())
        capturing = capturing or _capturing_on_other_devices(torch, tags)
    except Exception:  # noqa: BLE001 - a torch without CUDA: no capture can be under way
        return
    if capturing:
        raise CaptureActive(
            f"stablebuf.{call}() was called while a CUDA graph capture is under way on the "
            "current stream; nothing was changed: call it before the capture begins or after "
            "it ends"
        )


def _capturing_on_other_devices(torch: Any, tags: Sequence[str]) -> bool:
    """Whether PyTorch's current stream is capturing on a device of the regions ``tags`` other
    than the current device (the regions' copies and fences run on those streams)."""
    here = torch.cuda.current_device()
    for device in _devices_of(tags):
        if device != here:
            with torch.cuda.device(device):
                if torch.cuda.is_current_stream_capturing():
                    return True
    return False


def _device_of(tag: str) -> int:
    """The CUDA device region ``tag`` lives on; :class:`UnknownTag` if there is no region."""
    device = _TAG_DEVICES.get(tag)
    if device is None:
        device = _TAG_DEVICES[tag] = _native.region_device(tag)
    return device


def _devices_of(tags: Iterable[str]) -> List[int]:
    """The devices of the regions ``tags``, each once. Unknown tags are skipped: the call that
    follows names them in its :class:`UnknownTag`."""
    devices: List[int] = []
    for tag in tags:
        try:
            device = _device_of(tag)
        except UnknownTag:
            continue
        if device not in devices:
            devices.append(device)
    return devices


def _tags_on(device: int) -> List[str]:
    """The tags whose regions live on ``device``, in creation order."""
    return [tag for tag in _native.tags() if _device_of(tag) == device]


def _as_tags(tags: Tags) -> List[str]:
    """``"w"`` or ``["w", "kv"]`` as a list of tags."""
    if isinstance(tags, str):
        return [tags]
    names = list(tags)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"tags must be strings, got {type(name).__name__}: {name!r}")
    return names


def _torch() -> "Any":
    try:
        import torch
    except ImportError as missing:  # pragma: no cover - depends on the environment
        raise ImportError("stablebuf's PyTorch glue needs torch (pip install torch)") from missing
    if not torch.cuda.is_available():
        raise Error("stablebuf regions need a CUDA device, and torch sees none")
    return torch


def _stream_of(tag: str) -> int:
    """PyTorch's current CUDA stream handle on the device of region ``tag``, whatever device is
    current (0, the legacy default stream, where torch has not initialised CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.current_stream(_device_of(tag)).cuda_stream)


def _streams_of(tags: Iterable[str]) -> Dict[int, int]:
    """``{device: PyTorch's current CUDA stream handle there}`` for the devices of the regions
    ``tags``: each region's copies and fences go on its own device's stream. Empty where torch
    has not initialised CUDA (the extension then uses each device's legacy default stream)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {
        device: int(torch.cuda.current_stream(device).cuda_stream) for device in _devices_of(tags)
    }


def _current_device() -> int:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.current_device())


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
        device = _current_device()
        if found is not None:
            # Creates nothing; raises DeviceMismatch if the tag's region is on another device.
            _native.register(tag, device, capacity, last_use)
            return found[1]
        torch = _torch()
        slot = _native.register(tag, device, capacity, last_use)
        _TAG_DEVICES[tag] = device
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            library_path(), _native.alloc_symbol(slot), _native.FREE_SYMBOL
        )
        mem_pool = torch.cuda.MemPool(allocator.allocator())
        _POOLS[tag] = (allocator, mem_pool)
        _guard.note_region_created()
    # From the first region on, every CUDA graph replay and compiled call checks its regions.
    _guard.install()
    return mem_pool


def _warn_free_errors() -> None:
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
    torch = _torch()
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
        _warn_free_errors()


def tags() -> List[str]:
    """Every region's tag, in creation order."""
    return _native.tags()


def sleep(tags: Tags, keep: bool = True) -> Dict[str, Dict[str, Any]]:
    """Release the device memory of the regions ``tags``, keeping their addresses.

    With ``keep=True`` the bytes are copied to pinned host memory first, and :func:`wake` puts
    them back; with ``keep=False`` they are discarded (KV caches, activations). The pinned host
    arena is allocated once and reused: call :func:`reserve_host` up front, otherwise the first
    sleep pins it (about 0.5 s per GiB) and that cost shows in the first sleep.

    Waits for all work in flight on the region's device before unmapping; copies run on the
    current stream of the region's device (whatever device is current). Sleeping an asleep
    region does nothing. All or nothing: an unbound region refuses the call (:class:`Unbound`)
    before any region sleeps, and if one region fails while sleeping, the others this call put
    to sleep are woken again. Returns ``{tag: {"bytes", "seconds", "gb_per_s", "storage"}}``.
    """
    names = _as_tags(tags)
    _refuse_during_capture("sleep", names)
    try:
        with _guard.REMAPS:  # never between another thread's check and launch
            return _native.sleep(names, keep, _streams_of(names))
    finally:
        _warn_free_errors()


def wake(tags: Tags) -> Dict[str, Dict[str, Any]]:
    """Back the regions ``tags`` with device memory again (one allocation and one mapping per
    region) and restore their bytes; tensors and graphs over them are valid again.

    Waking an awake region does nothing. On :class:`OutOfMemory` the failing region (and those
    after it) stays asleep with its host copy: free memory and call ``wake`` again.
    """
    names = _as_tags(tags)
    _refuse_during_capture("wake", names)
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.wake(names, _streams_of(names))


def snapshot(tag: str) -> WeightSet:
    """A new weight set of region ``tag``: a second backing of its used span holding the
    region's current contents (one device allocation, one copy on the current stream of the
    region's device).

    Fill it with :func:`writing` (e.g. ``model.load_state_dict(other)``) and swap it in with
    :func:`bind`. The first snapshot also folds the region's backing into one allocation, so
    every later bind is one mapping.
    """
    _refuse_during_capture("snapshot", [tag])
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.snapshot(tag, _stream_of(tag))


def bind(tag: str, weights: WeightSet) -> Optional[WeightSet]:
    """Put ``weights`` under region ``tag``'s addresses and return the weight set bound before.

    Every tensor and captured graph over the region reads the new weights from then on; nothing
    is copied and nothing is re-captured. Waits for all work in flight on the region's device
    first (never unmaps under a running kernel). Raises :class:`SnapshotMismatch` for a weight
    set of another region, or when the region grew past the weight set (take a new snapshot).
    """
    _refuse_during_capture("bind", [tag])
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.bind(tag, weights)


_STRATEGIES = ("auto", "copy", "remap")


def switch(tag: str, weights: WeightSet, *, strategy: str = "auto") -> str:
    """Make region ``tag`` read the contents of ``weights`` the cheaper way for its size, and
    return which way it went: ``"copy"`` or ``"remap"``.

    - ``"remap"``: exactly :func:`bind`. ``weights`` is mapped under the region's addresses
      after the region's fence (the device going idle, by default): about 0.1 ms on an H100
      whatever the size. Writes to the region's tensors then land in ``weights``.
    - ``"copy"``: the region's own *live* weight set is put under its addresses (allocated and
      bound with one remap on the first copy switch, and bound again after a remap switch),
      then ``weights``' bytes are copied into it on the current stream (of the region's
      device): no fence, a time
      proportional to the region's used span (about 0.7 ms per GiB on an H100).
    - ``"auto"`` (default): copy when the device's cost model predicts a copy of the region's
      span to be cheaper than a remap (spans below :func:`crossover_bytes`, about 100 MiB on an
      H100), remap otherwise. Small models then never switch slower than a copy-in, large ones
      get the remap.

    How a switch that returned ``"copy"`` differs from :func:`bind`:

    - ``weights`` is only read. :func:`bound` returns the region's live set, not ``weights``,
      and writes to the region's tensors (``load_state_dict``, an optimizer step) land in the
      live set, never in ``weights``; the next copy switch overwrites them. Use
      :func:`writing` or ``strategy="remap"`` to write into a weight set.
    - The copy is ordered on the current stream only, like any PyTorch copy into the
      parameters: graphs and kernels queued after it on that stream see the new weights; work
      on another stream that reads the region must wait for the current stream first.
    - Memory: one more weight set of the region's span, allocated on the first copy switch
      and kept until the region sleeps or is unbound.

    Switching to the weight set bound now does nothing and returns ``"remap"``. An unbound
    region can be switched. The first ``"auto"`` switch of a process calibrates the cost model
    (tens of milliseconds and 1 GiB of device memory meanwhile): call :func:`crossover_bytes`
    at start-up to pay that early.

    Raises ``ValueError`` for an unknown ``strategy`` (before anything else),
    :class:`CaptureActive` during a capture on the current stream, ``TypeError`` unless
    ``weights`` is a :class:`WeightSet`, :class:`SnapshotMismatch` for a weight set of another
    region or when the region grew past it, :class:`Asleep` while the region sleeps; nothing
    changes on any of them.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, not {strategy!r}")
    _refuse_during_capture("switch", [tag])
    if not isinstance(weights, WeightSet):
        raise TypeError(
            "weights must be a stablebuf.WeightSet (from stablebuf.snapshot or stablebuf.bound), "
            f"not {type(weights).__name__}"
        )
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.switch(tag, weights, strategy, _stream_of(tag))


def crossover_bytes(device: Optional[int] = None) -> Optional[int]:
    """The region span, in bytes, below which :func:`switch` with ``strategy="auto"`` copies
    and above which it remaps, on CUDA device ``device`` (default: the current one); ``None``
    if one way always wins there.

    It comes from the device's cost model, calibrated on first use in the process (timed
    remaps and device-to-device copies: tens of milliseconds and 1 GiB of device memory for
    the duration), then kept, per device. About 100 MiB on an H100. Raises
    :class:`CaptureActive` during a capture on the current stream (calibrating would break it).
    """
    _refuse_during_capture("crossover_bytes")
    return _native.crossover_bytes(_current_device() if device is None else int(device))


def bound(tag: str) -> Optional[WeightSet]:
    """The weight set under region ``tag`` now (``None`` before the first snapshot or wake).
    After a :func:`switch` that copied, it is the region's own live set, which the next copy
    switch overwrites: take a :func:`snapshot` to keep its contents."""
    return _native.bound(tag)


def unbind(tag: str) -> None:
    """Unmap region ``tag``'s weight set (keep :func:`bound` first to bind it back). Graphs
    guarded by the tag raise :class:`Unbound` until the next :func:`bind`."""
    _refuse_during_capture("unbind", [tag])
    with _guard.REMAPS:
        _native.unbind(tag)


@contextlib.contextmanager
def writing(weights: WeightSet) -> Iterator[WeightSet]:
    """Bind ``weights`` for the block, then bind back what was bound before.

    Writes to the region's tensors inside the block (``model.load_state_dict(sd_b)``,
    ``param.copy_(...)``) land in ``weights``::

        ws_b = stablebuf.snapshot("weights")
        with stablebuf.writing(ws_b):
            model.load_state_dict(state_b)
    """
    previous = bind(weights.tag, weights)
    try:
        yield weights
    finally:
        # The writes were eager: a "last-use" region's bind must wait for them.
        note_use([weights.tag])
        if previous is not None:
            bind(weights.tag, previous)


def note_use(tags: Tags) -> None:
    """Note that the work queued so far on the current stream (of each region's device) used
    the regions ``tags``.

    Only regions made with ``fence="last-use"`` care: their binds, sleeps and frees wait for
    the last noted use on each stream (an event), not for the whole device. Guarded replays
    and :func:`writing` note their uses themselves; call this after eager work over such a
    region."""
    names = _as_tags(tags)
    _native.note_use(names, _streams_of(names))


def check(tags: Tags) -> None:
    """Raise :class:`Asleep` or :class:`Unbound` unless a graph over the regions ``tags`` may
    replay now (:class:`UnknownTag` for a tag with no region)."""
    _native.check_replayable(_as_tags(tags))


def reserve_host(nbytes: int) -> int:
    """Pin ``nbytes`` of host memory for sleeping regions now, once, and return the pinned
    capacity. Pinning is the slow part of a sleep (about 0.5 s per GiB); without this call the
    first ``sleep(keep=True)`` pins what it needs. One arena serves the regions of every
    device (it is pinned portable)."""
    return _native.reserve_host(int(nbytes), _current_device())


def host_arena() -> Optional[Dict[str, Any]]:
    """``{"capacity", "free", "pin_seconds", "pins"}`` of the pinned host arena, or ``None``
    before anything was pinned."""
    return _native.host_arena()


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


class GuardedGraph:
    """A CUDA graph whose :meth:`replay` first checks that its regions are awake and bound
    (made by :func:`guard`). Other attributes are the wrapped graph's."""

    def __init__(self, graph: Any, tags: Tags) -> None:
        self.graph = graph
        self.tags: Tuple[str, ...] = tuple(_as_tags(tags))

    def replay(self) -> None:
        """Replay the graph, or raise :class:`Asleep` / :class:`Unbound` without launching."""
        tags = list(self.tags)
        with _guard.REMAPS:  # no remap between the check and the launch
            _guard.check(tags)
            with _guard.already_checked(self.tags):
                self.graph.replay()
            _guard.note_use(tags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)

    def __repr__(self) -> str:
        return f"GuardedGraph({self.graph!r}, tags={self.tags!r})"


def guard(graph: Any, tags: Optional[Tags] = None) -> GuardedGraph:
    """Wrap a ``torch.cuda.CUDAGraph`` so that ``replay()`` raises :class:`Asleep` or
    :class:`Unbound` instead of faulting when a region it uses is asleep or unbound.

    ``tags`` are the regions the graph reads or writes; by default every region that exists
    now on the graph's device (the device its capture ran on, else the current one: safe,
    but then sleeping any of them blocks the replay). The tags are also recorded as the
    graph's own (:func:`graph_tags`), so a replay of the unwrapped graph checks the same
    regions."""
    if tags is None:
        device = _guard.graph_device(graph)
        tags = _tags_on(_current_device() if device is None else device)
    guarded = GuardedGraph(graph, tags)
    _guard.set_graph_tags_if_possible(graph, guarded.tags)
    return guarded
