"""``stablebuf.CUDAGraph``: a ``torch.cuda.CUDAGraph`` whose replay is guarded."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _native
from ._api import Tags, _as_tags


class CUDAGraph(torch.cuda.CUDAGraph):
    """A ``torch.cuda.CUDAGraph`` that refuses to replay over released memory.

    ``replay()`` raises :class:`stablebuf.Asleep` or :class:`stablebuf.Unbound` (and launches
    nothing) while a region it guards is asleep or unbound, where a plain graph would hit an
    illegal-address fault that kills the CUDA context.

    ``tags`` are the regions the graph uses. Left ``None``, the graph guards every region that
    exists when its capture ends (safe, but then sleeping any region blocks this replay); set
    them at construction or later with :meth:`guard`. Use it wherever a
    ``torch.cuda.CUDAGraph`` goes::

        g = stablebuf.CUDAGraph(tags=["weights", "kv"])
        with torch.cuda.graph(g):
            out = model(static_input)
        g.replay()
    """

    def __new__(cls, tags: Optional[Tags] = None, keep_graph: bool = False) -> "CUDAGraph":
        return super().__new__(cls, keep_graph)

    def __init__(self, tags: Optional[Tags] = None, keep_graph: bool = False) -> None:
        super().__init__(keep_graph)
        self._guarded: Optional[Tuple[str, ...]] = None if tags is None else tuple(_as_tags(tags))

    @property
    def guarded_tags(self) -> Tuple[str, ...]:
        """The regions whose state ``replay()`` checks."""
        if self._guarded is None:
            return tuple(_native.tags())
        return self._guarded

    def guard(self, tags: Tags) -> "CUDAGraph":
        """Set the regions this graph uses (replacing the previous set); returns the graph."""
        self._guarded = tuple(_as_tags(tags))
        return self

    def capture_end(self) -> None:
        """End the capture; with no tags given, the graph now guards every existing region."""
        super().capture_end()
        if self._guarded is None:
            self._guarded = tuple(_native.tags())

    def replay(self) -> None:
        """Replay, or raise ``Asleep``/``Unbound`` without launching anything."""
        tags = list(self.guarded_tags)
        _native.check_replayable(tags)
        super().replay()
        # Regions with fence="last-use" wait for this replay (and no more) before a remap.
        _native.note_use(tags, torch.cuda.current_stream().cuda_stream)
