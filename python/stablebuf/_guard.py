"""The process-wide replay guard: every PyTorch CUDA graph replay checks its regions first.

A CUDA graph captured over a region reads the region's addresses; replayed while the region
is asleep or unbound, its kernels hit unmapped memory and the CUDA context dies with an
illegal-address fault. Once the first region exists, this module patches PyTorch so that no
graph can do that:

- ``torch.cuda.CUDAGraph.capture_end`` records the graph's device (the one its capture ran
  on) and which regions the graph may use: the regions of that device that hold allocations
  and are awake and bound when the capture ends (conservative), or, for a graph recorded by
  ``torch.compile``'s CUDA graph trees, the regions its inputs and constants live in (exact).
  Regions of other devices are left out, so a region sleeping on one GPU never blocks the
  graphs of another.
  :func:`graph_tags` narrows or overrides the set by hand.
- ``torch.cuda.CUDAGraph.replay`` checks those regions and raises :class:`stablebuf.Asleep`
  / :class:`stablebuf.Unbound` before anything is launched.
- ``CUDAGraphTreeManager.run`` (``torch.compile(mode="reduce-overhead")``) checks the regions
  of the call's tensors before the tree manager does anything: before it warms up (an eager
  run over the weights), records, copies inputs or starts a new generation, so a refused
  call leaves the tree exactly as it was and the next call after ``wake``/``bind`` replays
  the graph it already has.

Eager kernels are not covered (PyTorch has no single place to check them); see
:func:`guard_module` for a model's eager forward.

The module imports without torch: the patches take the classes as arguments, so the
bookkeeping is tested on stand-in classes where torch is missing.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from . import _native
from ._devices import as_tags, streams_of

TREES_MODULE = "torch._inductor.cudagraph_trees"

# The marker on every function this module installs, so that a second install (another
# thread, a reloaded package) recognises its own patch and does not wrap it again.
_PATCH_MARKER = "__stablebuf_guard__"
# Where a graph's regions are recorded: an attribute on the graph object, else a side table
# for objects that take no attributes.
_TAGS_ATTRIBUTE = "_stablebuf_graph_tags"

_INSTALL_LOCK = threading.Lock()
# Replays and remaps of regions exclude each other. A guarded replay checks its regions, then
# launches: a bind, unbind, sleep, wake or snapshot of another thread between the two would
# wait for the work queued so far and unmap under the launch that follows (the H100 showed an
# illegal address with a replay thread beside a bind thread). Every guarded replay holds this
# from its check to its launch, every remap from its fence to its last mapping. Reentrant:
# a compiled call replays inside its own check, `writing` binds inside a bind's caller.
REMAPS = threading.RLock()
_STATS_LOCK = threading.Lock()
_STATS: Dict[str, int] = {"checked": 0, "refused": 0, "captures": 0}
_INSTALLED: Dict[str, Any] = {"graphs": False, "trees": False, "trees_error": None}
_SIDE_TABLE: "weakref.WeakKeyDictionary[Any, _GraphTags]" = weakref.WeakKeyDictionary()

# Per thread: how deep we are inside a call whose regions were already checked (a tree
# manager call, a stablebuf.CUDAGraph or GuardedGraph replay), and the regions of the
# innermost tree manager call (what a graph recorded inside it uses).
_LOCAL = threading.local()

# Owner lookups of tensor addresses. An address inside a region stays that region's for the
# life of the process (regions are never released), so a hit is kept for ever; a miss is kept
# only until the next region is created (a new reservation may cover a freed address).
_OWNER_HITS: Dict[int, str] = {}
_OWNER_MISSES: Dict[int, int] = {}
_OWNER_CACHE_LIMIT = 1 << 14
_REGIONS_CREATED = [0]
_UNSET: Any = object()
# Whether a capture gets its own cuBLAS workspace (see own_cublas_workspace). A test seam:
# graph_beside_compile.py turns it off to show the fault it prevents.
OWN_CUBLAS_WORKSPACES = True


class _GraphTags:
    """The regions one graph uses (recorded at capture end, and set by hand) and the device
    its capture ran on (``None`` before the capture ends, or without CUDA)."""

    __slots__ = ("captured", "device", "explicit")

    def __init__(self) -> None:
        self.captured: Optional[Tuple[str, ...]] = None
        self.explicit: Optional[Tuple[str, ...]] = None
        self.device: Optional[int] = None

    def effective(self) -> Optional[Tuple[str, ...]]:
        return self.explicit if self.explicit is not None else self.captured


def _count(name: str, by: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[name] += by


def _depth() -> int:
    return getattr(_LOCAL, "depth", 0)


class _AlreadyChecked:
    """``with _AlreadyChecked(tags):`` replays and recordings inside the block were checked by
    the caller: nested replays skip their own check, and graphs recorded inside use ``tags``."""

    __slots__ = ("tags",)

    def __init__(self, tags: Optional[Tuple[str, ...]] = None) -> None:
        self.tags = tags

    def __enter__(self) -> None:
        _LOCAL.depth = _depth() + 1
        stack = getattr(_LOCAL, "recording_tags", None)
        if stack is None:
            stack = _LOCAL.recording_tags = []
        stack.append(self.tags)

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.recording_tags.pop()
        _LOCAL.depth = _depth() - 1


already_checked = _AlreadyChecked


def check(tags: Iterable[str]) -> None:
    """Count one guarded call and raise ``Asleep``/``Unbound``/``UnknownTag`` unless every
    region in ``tags`` may be read by a graph now."""
    names = list(tags)
    _count("checked")
    if not names:
        return
    try:
        _native.check_replayable(names)
    except BaseException:
        _count("refused")
        raise


def note_use(tags: Iterable[str]) -> None:
    """Note that the work just queued (a replay, a compiled call) on the current stream of
    each region's device used the regions ``tags``: a ``fence="last-use"`` region's bind or
    sleep waits for it. A graph replays on its capture device's current stream, the device of
    the regions it uses."""
    names = list(tags)
    if not names:
        return
    _native.note_use(names, streams_of(names))


def _record_of(graph: Any, create: bool) -> Optional[_GraphTags]:
    # Read from the instance dict, not getattr: a wrapper's __getattr__ (GuardedGraph's)
    # would otherwise hand out the wrapped graph's record as its own.
    record = graph.__dict__.get(_TAGS_ATTRIBUTE) if hasattr(graph, "__dict__") else None
    if record is not None:
        return record
    try:
        record = _SIDE_TABLE.get(graph)
    except TypeError:  # neither hashable nor weakly referenceable
        record = None
    if record is not None or not create:
        return record
    record = _GraphTags()
    try:
        graph.__dict__[_TAGS_ATTRIBUTE] = record
        return record
    except (AttributeError, TypeError):
        pass
    try:
        _SIDE_TABLE[graph] = record
    except TypeError:
        raise TypeError(
            f"stablebuf cannot record regions on a {type(graph).__name__}: it takes neither "
            "attributes nor weak references (pass a torch.cuda.CUDAGraph)"
        ) from None
    return record


def graph_tags(graph: Any, tags: Any = _UNSET) -> Optional[Tuple[str, ...]]:
    """The regions whose state a replay of ``graph`` checks; with ``tags``, set them first.

    By default a ``torch.cuda.CUDAGraph`` guards the regions of its device that held
    allocations and were awake and bound when its capture ended (``torch.compile``'s graphs:
    the regions of their inputs and constants).
    ``graph_tags(g, ["weights"])`` narrows that to the regions the graph really reads, so that
    sleeping another region does not block it; ``graph_tags(g, None)`` drops the override and
    goes back to what the capture recorded. Returns the set now in force (``None``: the graph
    was captured before any region existed, so it uses none and replays unchecked).
    """
    if tags is _UNSET:
        record = _record_of(graph, create=False)
        return None if record is None else record.effective()
    record = _record_of(graph, create=True)
    assert record is not None
    if tags is None:
        record.explicit = None
    else:
        record.explicit = tuple(as_tags(tags))
    return record.effective()


def graph_device(graph: Any) -> Optional[int]:
    """The CUDA device ``graph``'s capture ran on, as recorded when it ended (``None`` if the
    guard saw no capture of it)."""
    try:
        record = _record_of(graph, create=False)
    except TypeError:
        return None
    return None if record is None else record.device


def _capture_device() -> Optional[int]:
    """The device of a capture ending now: PyTorch's current device (``torch.cuda.graph``
    makes the capture stream's device current for the whole capture); ``None`` without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - a stand-in or CPU-only torch: no device to record
        return None


def set_graph_tags_if_possible(graph: Any, tags: Iterable[str]) -> None:
    """:func:`graph_tags` for callers that guard the graph themselves (``stablebuf.guard``):
    objects that cannot carry the record are left alone."""
    try:
        graph_tags(graph, list(tags))
    except TypeError:
        pass


def note_region_created() -> None:
    """A new region reserved addresses: cached misses of the owner lookup may be stale."""
    _REGIONS_CREATED[0] += 1


def _owner(address: int) -> Optional[str]:
    tag = _OWNER_HITS.get(address)
    if tag is not None:
        return tag
    if _OWNER_MISSES.get(address) == _REGIONS_CREATED[0]:
        return None
    tag = _native.owner(address)
    if tag is not None:
        if len(_OWNER_HITS) >= _OWNER_CACHE_LIMIT:
            _OWNER_HITS.clear()
        _OWNER_HITS[address] = tag
    else:
        if len(_OWNER_MISSES) >= _OWNER_CACHE_LIMIT:
            _OWNER_MISSES.clear()
        _OWNER_MISSES[address] = _REGIONS_CREATED[0]
    return tag


def tags_of_tensors(values: Iterable[Any]) -> Tuple[str, ...]:
    """The regions the CUDA tensors among ``values`` live in (other values are ignored)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    tensor_type = torch.Tensor
    found = set()
    for value in values:
        if not isinstance(value, tensor_type):
            continue
        try:
            if not value.is_cuda:
                continue
            address = value.data_ptr()
        except Exception:  # noqa: BLE001 - no storage (fake, sparse, meta): not region memory
            continue
        if address:
            tag = _owner(address)
            if tag is not None:
                found.add(tag)
    return tuple(sorted(found))


def _tags_a_capture_may_use(device: Optional[int]) -> Tuple[str, ...]:
    """The regions a graph captured just now on ``device`` may read: those of that device
    (of every device where it is unknown) holding memory and readable now.

    A region asleep or unbound when the capture ends is left out: a graph over it could not
    have been warmed up (the usual run before a capture), and guarding it would refuse every
    replay of, say, another library's graph captured while stablebuf's regions sleep. A
    region of another device is left out too: a graph's kernels run on its own device.
    """
    found = []
    for tag, entry in _native.stats().items():
        if not entry.get("allocations", 0):
            continue
        if device is not None and entry.get("device") != device:
            continue
        try:
            _native.check_replayable([tag])
        except _native.Error:
            continue
        found.append(tag)
    return tuple(found)


# --- the patches -------------------------------------------------------------------------


def _is_ours(function: Any) -> bool:
    return bool(getattr(function, _PATCH_MARKER, False))


def _mark(function: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    functools.update_wrapper(function, original)
    setattr(function, _PATCH_MARKER, True)
    return function


def own_cublas_workspace() -> None:
    """Make the capture that begins now allocate its own cuBLAS workspace, in its own pool.

    PyTorch caches one cuBLAS workspace per (handle, stream), made by the stream's first
    matmul, and a graph captured on that stream bakes the workspace's address into its matmul
    kernels without holding a reference to it. CUDA graph trees
    (``torch.compile(mode="reduce-overhead")``) clear that cache around every warm-up and
    recording (``torch._C._cuda_clearCublasWorkspaces``), which frees every stream's
    workspace; ``torch.cuda.graph``'s ``empty_cache()`` then gives the segment back to CUDA.
    A graph captured earlier then writes through a freed pointer on its next replay: an
    illegal address that kills the context (issue 38), or another tensor overwritten.

    Clearing the cache just before a capture makes the capture's first matmul allocate a
    fresh workspace while the capture allocates into the graph's pool: the workspace then
    lives in memory that stays reserved for as long as the graph exists, so a later clear
    only returns it to that pool. CUDA graph trees do the same for their own recordings.
    Costs one workspace (a few MiB) per captured graph that runs matmuls.
    """
    if not OWN_CUBLAS_WORKSPACES:
        return
    torch = sys.modules.get("torch")
    clear = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def patch_graph_class(graph_class: Any) -> bool:
    """Guard ``graph_class.replay``, record regions in ``graph_class.capture_end`` and give
    each capture its own cuBLAS workspace in ``graph_class.capture_begin`` (once; returns
    whether this call patched)."""
    original_replay = graph_class.replay
    original_capture_end = graph_class.capture_end
    original_capture_begin = getattr(graph_class, "capture_begin", None)
    begin_done = original_capture_begin is None or _is_ours(original_capture_begin)
    if _is_ours(original_replay) and _is_ours(original_capture_end) and begin_done:
        return False

    if not begin_done:

        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
            own_cublas_workspace()
            original_capture_begin(self, *args, **kwargs)

        graph_class.capture_begin = _mark(capture_begin, original_capture_begin)

    if not _is_ours(original_capture_end):

        def capture_end(self: Any) -> None:
            original_capture_end(self)
            _count("captures")
            stack = getattr(_LOCAL, "recording_tags", None)
            inside = stack[-1] if stack else None
            try:
                record = _record_of(self, create=True)
            except TypeError as unrecordable:
                warnings.warn(
                    f"stablebuf: {unrecordable}; its replays are not guarded", stacklevel=2
                )
                return
            assert record is not None
            record.device = _capture_device()
            # A graph recorded inside a checked tree call uses that call's regions; any other
            # graph may use every region of its device that holds memory and is readable now.
            record.captured = (
                inside if inside is not None else _tags_a_capture_may_use(record.device)
            )

        graph_class.capture_end = _mark(capture_end, original_capture_end)

    if not _is_ours(original_replay):

        def replay(self: Any) -> None:
            if _depth() > 0:  # the caller checked, and notes the use
                original_replay(self)
                return
            record = _record_of(self, create=False)
            tags = None if record is None else record.effective()
            if tags is None:  # captured before any region existed: it uses none
                original_replay(self)
                return
            with REMAPS:
                check(tags)
                original_replay(self)
                note_use(tags)

        graph_class.replay = _mark(replay, original_replay)
    return True


def patch_tree_manager(manager_class: Any) -> bool:
    """Check the regions of every call into a CUDA graph tree manager before it runs (once;
    returns whether this call patched).

    Both ``run`` (what compiled functions call) and ``_run`` (what ``run`` calls, and what
    functions compiled before the patch reach) are wrapped; the first one entered checks, the
    nested one sees the thread's depth and goes straight through.
    """
    patched = False
    for name in ("run", "_run"):
        original = manager_class.__dict__.get(name)
        if original is None or _is_ours(original):
            continue
        setattr(manager_class, name, _tree_entry(original))
        patched = True
    return patched


def _tree_entry(original: Callable[..., Any]) -> Callable[..., Any]:
    def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _depth() > 0:
            return original(self, *args, **kwargs)
        new_inputs = args[0] if args else kwargs.get("new_inputs", ())
        function_id = args[1] if len(args) > 1 else kwargs.get("function_id")
        tags = _tags_of_tree_call(self, new_inputs, function_id)
        # Checked before the manager touches anything (warm-up, recording, input copies, a
        # new generation): a refusal leaves the tree as it was.
        with REMAPS:
            check(tags)
            with _AlreadyChecked(tags):
                out = original(self, *args, **kwargs)
            # The call queued its warm-up, recording or replay on the current stream: regions
            # with fence="last-use" wait for it before a remap.
            note_use(tags)
        return out

    return _mark(entry, original)


def _tags_of_tree_call(manager: Any, new_inputs: Any, function_id: Any) -> Tuple[str, ...]:
    # Parameters and buffers reach a compiled graph as inputs (static inputs of the tree);
    # frozen ones as the wrapped function's constants. Both count.
    constants: Iterable[Any] = ()
    functions = getattr(manager, "ids_to_funcs", None)
    if isinstance(functions, dict):
        wrapped = functions.get(function_id)
        constants = getattr(wrapped, "constants", None) or ()
    try:
        inputs = list(new_inputs)
    except TypeError:
        inputs = []
    return tags_of_tensors(itertools.chain(inputs, constants))


def install() -> None:
    """Install the guard into PyTorch (idempotent, thread-safe). Called when the first region
    is created; does nothing where torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    with _INSTALL_LOCK:
        if not _INSTALLED["graphs"]:
            patch_graph_class(torch.cuda.CUDAGraph)
            _INSTALLED["graphs"] = True
        if not _INSTALLED["trees"]:
            try:
                # Imported here rather than found lazily: a tree manager created before the
                # patch would keep unguarded entry points. The import costs about a second
                # once, and torch.compile users import it anyway.
                import importlib

                trees = importlib.import_module(TREES_MODULE)
                patch_tree_manager(trees.CUDAGraphTreeManager)
                _INSTALLED["trees"] = True
                _INSTALLED["trees_error"] = None
            except Exception as missing:  # noqa: BLE001 - torch.compile absent or changed
                _INSTALLED["trees_error"] = f"{type(missing).__name__}: {missing}"


def guard_stats() -> Dict[str, Any]:
    """Counts of the replay guard since the process started: ``checked`` (guarded replays and
    compiled calls looked at), ``refused`` (of those, raised before launching), ``captures``
    (CUDA graph captures ended, e.g. cudagraph-tree recordings), and whether the patches are
    in: ``graphs`` (``torch.cuda.CUDAGraph``), ``trees`` (``torch.compile``'s CUDA graph
    trees), ``trees_error`` (why not, if not)."""
    with _STATS_LOCK:
        out: Dict[str, Any] = dict(_STATS)
    out.update(_INSTALLED)
    return out


def guard_module(module: Any, tags: Any = None) -> Any:
    """Check ``module``'s regions before each eager ``forward`` (a forward pre-hook): calling a
    model while its weights sleep then raises :class:`stablebuf.Asleep` instead of an
    illegal-address fault. ``tags`` default to the regions its parameters and buffers live in.

    Under ``torch.compile`` the hook does nothing (the compiled graph's own replay is guarded,
    and a call out of the traced code would split the graph). Returns the hook's handle
    (``.remove()`` to take it off).
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(module, torch.nn.Module):
        raise TypeError(f"guard_module takes a torch.nn.Module, got {type(module).__name__}")
    if tags is None:
        names = tags_of_tensors(itertools.chain(module.parameters(), module.buffers()))
        if not names:
            raise ValueError(
                "none of the module's parameters or buffers live in a stablebuf region: "
                "create them inside `with stablebuf.region(tag):` or pass tags="
            )
    else:
        names = tuple(as_tags(tags))
    is_compiling = torch.compiler.is_compiling

    def check_regions_before_forward(_module: Any, _args: Any) -> None:
        if is_compiling():
            return None
        check(names)
        return None

    return module.register_forward_pre_hook(check_regions_before_forward)
