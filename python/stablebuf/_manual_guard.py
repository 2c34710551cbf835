"""The replay guard by hand, for what the process-wide guard (``_guard``) does not see:
:func:`check` before a use, :func:`note_use` after eager work, and :func:`guard`, a graph
wrapped in both (:class:`GuardedGraph`)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _guard, _native
from ._devices import Tags, as_tags, current_device, streams_of, tags_on


def note_use(tags: Tags) -> None:
    """Note that the work queued so far on the current stream (of each region's device) used
    the regions ``tags``.

    Only regions made with ``fence="last-use"`` care: their binds, sleeps and frees wait for
    the last noted use on each stream (an event), not for the whole device. Guarded replays
    and :func:`writing` note their uses themselves; call this after eager work over such a
    region."""
    names = as_tags(tags)
    _native.note_use(names, streams_of(names))


def check(tags: Tags) -> None:
    """Raise :class:`Asleep` or :class:`Unbound` unless a graph over the regions ``tags`` may
    replay now (:class:`UnknownTag` for a tag with no region)."""
    _native.check_replayable(as_tags(tags))


class GuardedGraph:
    """A CUDA graph whose :meth:`replay` first checks that its regions are awake and bound
    (made by :func:`guard`). Other attributes are the wrapped graph's."""

    def __init__(self, graph: Any, tags: Tags) -> None:
        self.graph = graph
        self.tags: Tuple[str, ...] = tuple(as_tags(tags))

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
        tags = tags_on(current_device() if device is None else device)
    guarded = GuardedGraph(graph, tags)
    _guard.set_graph_tags_if_possible(graph, guarded.tags)
    return guarded
