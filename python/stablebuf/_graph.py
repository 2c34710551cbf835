"""``stablebuf.CUDAGraph``: a ``torch.cuda.CUDAGraph`` whose replay is guarded."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import _guard
from ._devices import Tags, as_tags, current_device, tags_on
from ._upload import upload_graph


class CUDAGraph(torch.cuda.CUDAGraph):
    """A ``torch.cuda.CUDAGraph`` that refuses to replay over released memory.

    ``replay()`` raises :class:`stablebuf.Asleep` or :class:`stablebuf.Unbound` (and launches
    nothing) while a region it guards is asleep or unbound, where a plain graph would hit an
    illegal-address fault that kills the CUDA context.

    ``tags`` are the regions the graph uses. Left ``None``, the graph guards every region of
    its device (the one its capture ran on) that exists when its capture ends (safe, but then
    sleeping any of them blocks this replay); set them at construction or later with
    :meth:`guard`. Use it wherever a
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
        # The set lives in the process-wide guard's record of this graph (graph_tags), so the
        # guard of every torch.cuda.CUDAGraph replay and this class agree on it.
        self._guards_every_region = tags is None
        if tags is not None:
            _guard.graph_tags(self, tags)

    def _device(self) -> int:
        """The device the capture ran on (the current one before the capture ended)."""
        device = _guard.graph_device(self)
        return current_device() if device is None else device

    @property
    def guarded_tags(self) -> Tuple[str, ...]:
        """The regions whose state ``replay()`` checks."""
        tags = _guard.graph_tags(self)
        if tags is None or self._guards_every_region:
            return tuple(tags_on(self._device()))
        return tags

    def guard(self, tags: Tags) -> "CUDAGraph":
        """Set the regions this graph uses (replacing the previous set); returns the graph."""
        self._guards_every_region = False
        _guard.graph_tags(self, as_tags(tags))
        return self

    def capture_end(self) -> None:
        """End the capture; with no tags given, the graph now guards every region of its
        device."""
        super().capture_end()
        if self._guards_every_region:
            self._guards_every_region = False
            # The capture's device is current until torch.cuda.graph's block ends.
            _guard.graph_tags(self, tags_on(current_device()))

    def upload(self, stream: Any = None) -> bool:
        """Upload the captured graph to its device now (see :func:`upload_graph`)."""
        return upload_graph(self, stream)

    def replay(self) -> None:
        """Replay, or raise ``Asleep``/``Unbound`` without launching anything."""
        tags = self.guarded_tags
        with _guard.REMAPS:  # no remap between the check and the launch
            _guard.check(tags)
            with _guard.already_checked(tags):
                super().replay()
            # Regions with fence="last-use" wait for this replay (and no more) before a remap.
            _guard.note_use(tags)

