"""One GPU: the engine copies each version in itself, a chunk per step (issue 41, item 2).

With the trainer and the engine on one GPU, every copy the trainer's process makes while the
engine serves is a switch of the GPU between two contexts: on an H200 each chunk of a shared
write cost the engine's 1 ms step about 0.33 ms, whatever the chunk's size (64 or 16 MiB), so
no bandwidth share brought the longest step under 1.3x. Here the trainer's process makes no
GPU work while the engine serves: it trains (or gathers) into a third weight set the engine
exports, the *staging* set, and commits it; the engine then copies it into its idle region on
its current stream, one chunk of ``chunk_bytes`` before each step, and switches to that region's
graph after the last chunk (as :class:`~stablebuf.PipelinedEngine` does, no remap). A step pays
its chunk's copy at the copy's full speed, and no context switch.

The chunks run before the steps, not beside them: on an H200, 64 MiB chunks on a stream of
their own beside 1 ms steps (1 GiB of weights) made every step they met 10-16% longer, 3.1 ms
lost per version, against 1.8 ms for per-tensor copies in line (``rl_weight_sync.py``).

A chunk is one or a few flat byte copies: the model's tensors lie side by side in both places,
so runs of them are copied whole, into the idle region's weight set at its own address
(``WeightSet.memory()``: the same memory the region reads). One copy call per run, not one per
tensor: on an H200, with a copy per tensor piece, 1 GiB in 16 MiB chunks lost 3.1 ms per
version and in 64 MiB chunks 1.8 ms, about 29 us more for each extra piece.

::

    # engine process (one GPU)
    engine = PullingEngine(("w-a", "w-b"), "/tmp/engine", (params_a, params_b), capture)
    while serving:
        engine.poll()                      # may queue one chunk, or switch
        engine.step()

    # trainer process, the same GPU
    trainer = stablebuf.PipelinedTrainer.connect("/tmp/engine", expect=model.state_dict())
    weights = trainer.twin()               # pulling engine: the staging set itself
    for step in training:
        trainer.acquire()                  # the engine has read the last version
        train_one_step(model)              # the model lives in ``weights`` (see the README)
        trainer.publish(weights, version=step)   # only a commit: nothing to copy

The staging set is the engine's memory: a trainer killed mid-write leaves the engine serving
what it served (nothing was committed); killed after its commit, the engine still copies the
version in and switches. The staging set goes back to the trainer once the engine's copies out
of it are done on the GPU (an event, queried at each poll).

Memory: three copies of the weights on the GPU (the two regions and the staging set), against
the pipelined engine's two plus the trainer's own; where the trainer's model lives in the
staging set, the same total.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _guard, _native
from ._devices import stream_of
from ._manifest import Manifest
from ._pipelined import _COMMITTED, _FREE, _SERVING, PipelinedEngine, _Port, staging_path
from ._share import plan_byte_copies
from .publish import PollStatus, _tensors_of, _views_over

__all__ = ["PullingEngine", "DEFAULT_PULL_BYTES"]

#: Bytes the engine copies before each step: ~0.03 ms at ~2 TB/s, a copy's rate on an H200.
DEFAULT_PULL_BYTES = 64 << 20


class PullingEngine(PipelinedEngine):
    """A :class:`~stablebuf.PipelinedEngine` that copies each version in itself, from a staging
    set the trainer writes, ``chunk_bytes`` before each step (see the module's docstring). The
    arguments as for :class:`~stablebuf.PipelinedEngine`; the trainer connects to
    ``path + ".s"`` (:meth:`stablebuf.PipelinedTrainer.connect` finds it)."""

    _exports_staging = True

    def __init__(
        self,
        tags: Sequence[str],
        path: str,
        tensors: Sequence[Any],
        capture: Callable[[int], Any],
        *,
        chunk_bytes: int = DEFAULT_PULL_BYTES,
        staging_tag: Optional[str] = None,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be positive")
        super().__init__(tags, path, tensors, capture)
        for port in self._ports:  # the trainer writes the staging set only
            port.listener.close()
        try:
            self._build_staging(tensors, path, staging_tag, chunk_bytes)
        except BaseException:
            super().close()
            raise

    def _build_staging(
        self, tensors: Sequence[Any], path: str, staging_tag: Optional[str], chunk_bytes: int
    ) -> None:
        from ._regions import region  # imports torch

        torch = self._torch
        self._named = [_tensors_of(t) for t in tensors]
        layout = self._ports[0].manifest
        tag = staging_tag or f"{self.tags[0]}.staging"
        end = max((e.offset + e.span for e in layout.entries), default=0)
        with torch.cuda.device(self.device), region(tag, fence="last-use"):
            flat = torch.empty(max(end, 1), dtype=torch.uint8, device=f"cuda:{self.device}")
        # The staging set holds region 0's byte image from where the buffer starts.
        shift = int(flat.data_ptr()) - int(_native.region_base(tag))
        entries = [dataclasses.replace(e, offset=e.offset + shift) for e in layout.entries]
        torch.cuda.current_stream(self.device).synchronize()
        weight_set = _native.snapshot_shareable(tag, stream_of(tag))
        with _guard.REMAPS:
            _native.bind(tag, weight_set)
        self._staging = _Port(
            tag, staging_path(path), weight_set, Manifest.build(tag, weight_set.nbytes, 1, entries)
        )
        self._staging.state = _FREE  # the trainer's from its handshake on
        self._staging_flat = flat
        self._source = _views_over(torch, flat, layout)
        self._copies = [
            self._copies_into(torch, port, layout, flat, named, chunk_bytes)
            for port, named in zip(self._ports, self._named)
        ]
        self._pull: Optional[Dict[str, Any]] = None
        self._read_done = torch.cuda.Event()
        self._reading = False
        #: Chunks queued, over the engine's life.
        self.chunks_pulled = 0
        #: Per region: (chunks, copy calls) a version takes (a call per run of side-by-side
        #: tensors within a chunk, and one per tensor laid out otherwise).
        self.plan = tuple((len(chunks), sum(len(c) for c in chunks)) for chunks in self._copies)

    def _copies_into(
        self, torch: Any, port: _Port, layout: Manifest, flat: Any, named: Dict[str, Any],
        chunk_bytes: int,
    ) -> List[List[Tuple[Any, Any]]]:
        """The chunks of copies (destination, source) that bring the staging set into
        ``port``'s region: flat byte runs into its weight set's memory where a tensor's bytes
        are its own and laid out as in the staging set, the tensor itself otherwise."""
        home = torch.from_dlpack(port.set.memory())
        source = {e.name: e for e in layout.entries}
        pieces, whole = [], []
        for entry in port.manifest.entries:
            src = source[entry.name]
            nbytes = math.prod(entry.shape) * entry.itemsize
            if nbytes == 0:
                continue
            if (entry.span == nbytes and src.span == nbytes and entry.stride == src.stride
                    and entry.dtype == src.dtype):
                pieces.append((entry.offset, src.offset, nbytes))
            else:  # strided over others' bytes, or laid out otherwise: torch copies it
                whole.append(entry.name)
        chunks = [
            [(home[d : d + n], flat[s : s + n]) for d, s, n in chunk]
            for chunk in plan_byte_copies(pieces, chunk_bytes)
        ]
        return chunks + [[(named[name], self._source[name])] for name in whole]

    # ----------------------------------------------------------------- state

    @property
    def paths(self) -> Any:
        return (self._staging.listener.path,)

    @property
    def connected(self) -> bool:
        return self._staging.channel is not None

    @property
    def weight_sets(self) -> Any:
        return [port.set for port in self._ports] + [self._staging.set]

    # ----------------------------------------------------------------- trainer connection

    def accept(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (forever with ``None``) for a trainer on the staging
        socket; returns whether one is connected."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._accept_pending(self._staging, self._unreported)
            if self._staging.channel is not None:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def _release_staging(self, problems: Any) -> None:
        """The staging set goes back to the trainer once the copies out of it are done."""
        if not self._reading or not self._read_done.query():
            return
        self._reading = False
        self._staging.state = _FREE
        if self._staging.channel is not None:
            try:
                self._staging.channel.send("released", set=self._staging.set.id)
            except _native.PeerClosed as closed:
                self._staging.drop()
                problems.append(f"PeerClosed: the trainer went away ({closed})")

    # ----------------------------------------------------------------- serving

    def _pull_chunk(self) -> bool:
        """Queues the next chunk of a committed version into the idle region, on the current
        stream (at most one per poll); after the last, the idle region holds that version (the
        next replays come after the copies on the stream). Returns whether it queued."""
        idle = 1 - self.current
        if self._pull is None:
            if self._staging.state != _COMMITTED or self._ports[idle].state == _COMMITTED:
                return False
            if not self._events[idle].query():  # the idle region's last replay may still read
                return False
            self._pull = {"version": self._staging.version, "next": 0, "region": idle}
            self._staging.state = _SERVING  # being read: not the trainer's
        pull = self._pull
        chunks = self._copies[pull["region"]]
        if pull["next"] < len(chunks):
            for dst, src in chunks[pull["next"]]:
                dst.copy_(src, non_blocking=True)
            pull["next"] += 1
            self.chunks_pulled += 1
        if pull["next"] >= len(chunks):
            self._read_done.record(self._torch.cuda.current_stream(self.device))
            self._reading = True
            port = self._ports[pull["region"]]
            port.state = _COMMITTED
            port.version = pull["version"]
            self._pull = None
        return True

    def poll(self) -> PollStatus:
        """Call at every step boundary; never blocks and never raises for what a trainer did.
        Hands the staging set back once the engine's copies out of it are done, reads the
        trainer's commit, queues at most one chunk of a committed version into the idle region
        (on the current stream, before the next step), and after its last chunk makes that
        region current: the next :meth:`step` replays its graph."""
        return super().poll()

    def _hand_back(self, problems: List[str]) -> None:
        self._release_staging(problems)

    def _read_trainers(self, problems: List[str]) -> None:
        self._read(self._staging, problems)

    def _before_switch(self) -> None:
        self._pull_chunk()

    def close(self) -> None:
        """Disconnects the trainer and stops listening (the sets stay bound)."""
        self._staging.drop()
        self._staging.listener.close()
        super().close()
