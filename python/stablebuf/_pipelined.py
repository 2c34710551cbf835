"""A version switch that costs the engine no remap: two regions, a graph each, and the switch is
only a choice of graph (issue 41 item 1).

::

    # engine process: the model twice, each copy in its own region with its own graph
    def capture(i):                       # the graph over copy i (tags=[its region] only)
        return graphs[i]
    engine = PipelinedEngine(("w-a", "w-b"), "/tmp/engine", (params_a, params_b), capture)
    while serving:
        status = engine.poll()            # at a step boundary: switches to a newer version
        engine.step()                     # replays the graph of the region now current
        out = outputs[engine.current]

    # trainer process
    trainer = PipelinedTrainer.connect("/tmp/engine", expect=model.state_dict())
    trainer.publish(model.state_dict(), version=step)   # into the idle region's set

How it works. Region ``tags[i]`` holds copy ``i`` of the weights; at start-up each region is
bound to one exportable weight set (``snapshot_shareable`` + one bind: the last remap this
engine ever makes) and each graph is captured (by the caller's ``capture``) over its own region.
One region serves (``current``); the other is idle. The idle region's set is offered to the
trainer on its own socket (``path + ".a"`` / ``path + ".b"``), released for writing once the
idle region's last replay has finished on the GPU (an event recorded after each replay; the
engine only queries it, never waits). The trainer writes the next version straight into that
set, which is still bound under the idle region, synchronises and commits; the next
:meth:`PipelinedEngine.poll` makes the idle region current, and :meth:`PipelinedEngine.step`
replays its graph. Nothing is remapped, so the switch costs the same at any size: reading the
commit from the socket, the bookkeeping, and the launch. Both graphs are uploaded to the
device when the engine is built (:func:`stablebuf.upload_graph`), so the first switch's launch
is not the graph's upload. The region left becomes idle and its set
goes to the trainer once its last replay is done; the versions alternate between the regions.

Memory: two copies of the weights in the engine (one per region), the same as
:class:`stablebuf.publish.Engine` with its default two sets, plus each graph's own memory
(activations, outputs) twice. No third copy: a set bound under the idle region is written in
place rather than bound ahead, because a set can be under one region at a time and a bind
waits on that region's last use. No rollback (the previous version is overwritten by the next
publish) and no tensor-parallel group: use :class:`~stablebuf.publish.Engine` for those.

Guarantees as for :class:`~stablebuf.publish.Engine`: the engine switches only to a committed
set, so a trainer killed mid-write leaves it serving what it served; a set is released to the
trainer only after its region's last replay is done, so the trainer never writes weights a
queued replay reads; :meth:`PipelinedEngine.poll` never raises for what a trainer did (it shows
in ``status.problems``); a trainer may reconnect at any time (one per socket).

Timing: every switch is logged (:attr:`PipelinedEngine.switches`) with its parts in
nanoseconds (``time.perf_counter_ns``): ``message`` (accepting and reading the trainer's
messages), ``poll`` (the rest of the poll up to the switch), ``fence`` and ``remap`` (always 0
here: kept so tables line up with :class:`~stablebuf.publish.Engine`), ``launch`` (the replay
call), and the stamps ``poll_at`` / ``launched_at`` (``time.monotonic_ns``, the clock a trainer's
``last_commit_at_ns`` uses). :meth:`PipelinedEngine.stats` summarises them.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _guard, _native
from ._devices import cuda_torch, device_of, stream_of
from ._manifest import Manifest, VersionBook
from ._native import PeerClosed, PublishError, PublishTimeout, VersionConflict
from ._share import DEFAULT_CHUNK_BYTES, SharePacer, summarize
from ._upload import upload_graph
from .publish import (
    _POLL_SECONDS,
    PollStatus,
    Trainer,
    _tensors_of,
    _wait_for_message,
    manifest_entries,
    refuse_trainer,
)

__all__ = ["PipelinedEngine", "PipelinedTrainer", "region_paths", "PARTS"]

#: The parts of a switch, in the order they happen.
PARTS = ("message", "poll", "fence", "remap", "launch")

_SUFFIXES = ("a", "b")


def region_paths(path: str) -> Tuple[str, str]:
    """The two sockets of a :class:`PipelinedEngine` at ``path``."""
    return (f"{path}.{_SUFFIXES[0]}", f"{path}.{_SUFFIXES[1]}")


def staging_path(path: str) -> str:
    """The socket of a :class:`~stablebuf.PullingEngine`'s staging set at ``path``."""
    return f"{path}.s"


def is_pulling(path: str) -> bool:
    """Whether the engine at ``path`` is a :class:`~stablebuf.PullingEngine` (its staging
    socket exists)."""
    return os.path.exists(staging_path(path))


def remove_stale_staging(path: str) -> bool:
    """Removes the staging socket an earlier :class:`~stablebuf.PullingEngine` at ``path`` left
    (killed before it could): a trainer would take it for this engine's. Only a socket, as the
    engine's own sockets replace stale ones; returns whether one was removed."""
    staging = staging_path(path)
    try:
        if not stat.S_ISSOCK(os.lstat(staging).st_mode):
            return False
        os.unlink(staging)
    except FileNotFoundError:
        return False
    return True


# What the engine knows of each region's set.
_SERVING = "serving"  # current, or idle but its last replay may still run: the engine's
_FREE = "free"  # idle and released (or to release at the next handshake): the trainer's
_COMMITTED = "committed"  # idle, holds a committed version: the next poll switches to it


class _Port:
    """One region of a :class:`PipelinedEngine`: its set, socket and trainer channel."""

    def __init__(self, tag: str, path: str, weight_set: Any, manifest: Manifest) -> None:
        self.tag = tag
        self.set = weight_set
        self.manifest = manifest
        self.listener = _native.PublishListener(path)
        self.channel: Optional[Any] = None
        self.state = _SERVING
        self.version = 0

    def drop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class PipelinedEngine:
    """The serving side with two regions and a graph each (see the module's docstring).

    ``tags``: the two regions (made with ``fence="last-use"`` so that nothing else waits for
    the other region's replays; the engine itself never remaps after start-up). ``path``: the
    sockets are ``path + ".a"`` and ``path + ".b"``. ``tensors``: the two copies of the model
    (modules or mappings name → tensor, the same names and shapes, every tensor in its region,
    both holding the starting weights). ``capture(i)``: returns the graph over copy ``i`` (an
    object with ``replay()``; a ``stablebuf.CUDAGraph(tags=[tags[i]])`` so its replays are
    noted against its own region only), called once after the sets are bound.
    """

    handshake_timeout = 60.0
    #: Whether trainers connect to a staging socket (``path + ".s"``) instead of the regions'.
    _exports_staging = False

    def __init__(
        self,
        tags: Sequence[str],
        path: str,
        tensors: Sequence[Any],
        capture: Callable[[int], Any],
    ) -> None:
        if len(tags) != 2 or len(tensors) != 2 or tags[0] == tags[1]:
            raise ValueError("two distinct regions and two copies of the model")
        torch = cuda_torch()
        self._torch = torch
        self.tags = (str(tags[0]), str(tags[1]))
        self.device = device_of(self.tags[0])
        if device_of(self.tags[1]) != self.device:
            raise ValueError(
                f"regions `{self.tags[0]}` and `{self.tags[1]}` live on devices "
                f"{self.device} and {device_of(self.tags[1])}: both must be on the engine's GPU"
            )
        named = [_tensors_of(t) for t in tensors]
        if {n: tuple(t.shape) for n, t in named[0].items()} != {
            n: tuple(t.shape) for n, t in named[1].items()
        }:
            raise ValueError("the two copies of the model differ in names or shapes")
        paths = region_paths(path)
        if not self._exports_staging:
            remove_stale_staging(path)
        ports: List[_Port] = []
        try:
            for i, tag in enumerate(self.tags):
                entries = manifest_entries(tag, _native.region_base(tag), named[i])
                torch.cuda.current_stream(self.device).synchronize()
                weight_set = _native.snapshot_shareable(tag, stream_of(tag))
                with _guard.REMAPS:  # the region's own backing goes when this returns
                    _native.bind(tag, weight_set)
                manifest = Manifest.build(tag, weight_set.nbytes, 1, entries)
                ports.append(_Port(tag, paths[i], weight_set, manifest))
        except BaseException:
            for port in ports:
                port.listener.close()
            raise
        self._ports = ports
        self._graphs = [capture(0), capture(1)]
        stream = torch.cuda.current_stream(self.device)
        # The second graph is first replayed at the first switch, whose launch would upload it
        # (~4 ms for ~3,000 nodes on an H200: the switch's p99 at 8 GiB, issue 41): upload both
        # now. ``uploaded[i]``: whether graph i could be (a PyTorch graph, instantiated).
        self.uploaded = tuple(upload_graph(graph, stream) for graph in self._graphs)
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        for event in self._events:
            event.record(stream)  # after the captures and warm-ups the caller queued
        # Region 1 is idle: its set goes to the trainer once the work queued over it so far
        # (the caller's warm-up and capture) is done (_release_idle, at accept and poll).
        self.current = 0
        self._versions = VersionBook()
        self._closed = False
        self._unreported: List[str] = []
        self._pending: Optional[Dict[str, int]] = None
        #: One dict per switch: ``version``, ``region``, the parts in ns (:data:`PARTS`),
        #: ``poll_at`` and ``launched_at`` (``time.monotonic_ns``).
        self.switches: List[Dict[str, int]] = []

    # ----------------------------------------------------------------- state

    @property
    def paths(self) -> Tuple[str, str]:
        return (self._ports[0].listener.path, self._ports[1].listener.path)

    @property
    def version(self) -> int:
        """The version the current region holds (0: the starting weights)."""
        return self._ports[self.current].version

    @property
    def connected(self) -> bool:
        """Whether a trainer is connected (to either socket)."""
        return any(port.channel is not None for port in self._ports)

    @property
    def last_committed(self) -> int:
        return self._versions.last

    @property
    def weight_sets(self) -> List[Any]:
        return [port.set for port in self._ports]

    @property
    def graph(self) -> Any:
        """The graph :meth:`step` replays now."""
        return self._graphs[self.current]

    def _check_open(self) -> None:
        if self._closed:
            raise PublishError("the pipelined engine is closed")

    # ----------------------------------------------------------------- trainer connection

    def accept(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (forever with ``None``) for a trainer on both
        sockets; returns whether both are connected."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._release_idle(self._unreported)
            for port in self._ports:
                self._accept_pending(port, self._unreported)
            if all(port.channel is not None for port in self._ports):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(_POLL_SECONDS * 10)

    def _accept_pending(self, port: _Port, problems: List[str]) -> None:
        while True:
            channel = port.listener.accept()
            if channel is None:
                return
            if port.channel is not None:
                refuse_trainer(
                    channel,
                    f"region `{port.tag}` already has a trainer: one trainer per pipelined engine",
                )
                continue
            try:
                self._handshake(port, channel)
            except PublishError as error:
                problems.append(f"a trainer's handshake failed: {type(error).__name__}: {error}")

    def _handshake(self, port: _Port, channel: Any) -> None:
        deadline = time.monotonic() + self.handshake_timeout
        try:
            channel.send_manifest(port.manifest.with_published(self._versions.last).to_json())
            channel.offer(port.set, port.manifest.fingerprint)
            _wait_for_message(channel, deadline, "the trainer to import the weight set")
            channel.wait_ack(port.set.id)
            if port.state == _FREE:
                channel.send("released", set=port.set.id)
        except PublishError:
            channel.close()
            raise
        port.channel = channel

    def _read(self, port: _Port, problems: List[str]) -> None:
        self._accept_pending(port, problems)
        while port.channel is not None and port.channel.message_waiting():
            try:
                kind, set_id, version, reason = port.channel.receive()
            except PeerClosed as closed:
                port.drop()
                problems.append(
                    f"PeerClosed: the trainer of region `{port.tag}` went away ({closed}); the "
                    f"engine keeps serving version {self.version}, and a trainer may reconnect"
                )
                return
            if kind == "commit":
                self._on_commit(port, set_id, version, problems)
            elif kind == "reject":
                port.drop()
                problems.append(f"PublishError: the trainer refused: {reason}")
            else:
                port.drop()
                problems.append(f"PublishError: protocol: a `{kind}` message from the trainer")

    def _on_commit(self, port: _Port, set_id: int, version: int, problems: List[str]) -> None:
        if set_id != port.set.id or port.state != _FREE:
            port.drop()
            problems.append(
                f"PublishError: the trainer committed set {set_id} of region `{port.tag}`, "
                "which it may not write now: it was dropped"
            )
            return
        problem = self._versions.problem(version)
        if problem is not None:
            with contextlib.suppress(PublishError):
                port.channel.send("released", set=set_id)
            problems.append(f"VersionConflict: {problem}: the set went back to the trainer")
            return
        self._versions.advance(version)
        port.state = _COMMITTED
        port.version = version

    def _release_idle(self, problems: List[str]) -> None:
        """The idle region's set goes to the trainer once its last replay is done (a query,
        never a wait)."""
        port = self._ports[1 - self.current]
        if port.state != _SERVING or not self._events[1 - self.current].query():
            return
        port.state = _FREE
        if port.channel is not None:
            try:
                port.channel.send("released", set=port.set.id)
            except PeerClosed as closed:
                port.drop()
                problems.append(f"PeerClosed: the trainer went away ({closed})")

    # ----------------------------------------------------------------- serving

    def poll(self) -> PollStatus:
        """Call at every step boundary; never blocks and never raises for what a trainer did.
        Releases the idle region's set once its last replay is done, accepts trainers, reads
        their commits and, when the idle region holds a newer committed version, makes it
        current (no remap): the next :meth:`step` replays its graph."""
        self._check_open()
        poll_at = time.monotonic_ns()
        t0 = time.perf_counter_ns()
        problems, self._unreported = self._unreported, []
        self._hand_back(problems)
        t1 = time.perf_counter_ns()
        self._read_trainers(problems)
        t2 = time.perf_counter_ns()
        self._before_switch()
        idle = 1 - self.current
        bound = None
        if self._ports[idle].state == _COMMITTED:
            self._ports[self.current].state = _SERVING  # released once its last replay is done
            self._ports[idle].state = _SERVING
            self.current = idle
            bound = self._ports[idle].version
            t3 = time.perf_counter_ns()
            self._pending = {
                "version": bound,
                "region": idle,
                "message": t2 - t1,
                "poll": (t1 - t0) + (t3 - t2),
                "fence": 0,
                "remap": 0,
                "poll_at": poll_at,
            }
        return PollStatus(
            version=self.version,
            bound=bound,
            trainer_connected=self.connected,
            problems=tuple(problems),
        )

    # The parts of a poll a PullingEngine does its own way.
    def _hand_back(self, problems: List[str]) -> None:
        self._release_idle(problems)

    def _read_trainers(self, problems: List[str]) -> None:
        for port in self._ports:
            self._read(port, problems)

    def _before_switch(self) -> None:
        """Work between reading the commits and the switch (none here)."""

    def step(self) -> None:
        """Replays the current region's graph on the current stream and notes its end (an
        event) so the region's set is released only after it."""
        self._check_open()
        current = self.current
        t0 = time.perf_counter_ns()
        self._graphs[current].replay()
        self._events[current].record(self._torch.cuda.current_stream(self.device))
        if self._pending is not None:
            record, self._pending = self._pending, None
            record["launch"] = time.perf_counter_ns() - t0
            record["launched_at"] = time.monotonic_ns()
            self.switches.append(record)

    def stats(self) -> Dict[str, Any]:
        """Per part of :data:`PARTS` and ``total`` (their sum), :func:`summarize` of the
        switches' times in milliseconds, and ``switches``."""
        out: Dict[str, Any] = {"switches": len(self.switches)}
        for part in PARTS:
            out[part] = summarize([r[part] / 1e6 for r in self.switches])
        out["total"] = summarize([sum(r[p] for p in PARTS) / 1e6 for r in self.switches])
        return out

    def close(self) -> None:
        """Disconnects the trainers and stops listening (the sets stay bound)."""
        for port in self._ports:
            port.drop()
            port.listener.close()
        self._closed = True

    def __enter__(self) -> "PipelinedEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _are_views_of(weights: Mapping[str, Any], views: Mapping[str, Any]) -> bool:
    """Whether ``weights`` are exactly ``views`` (the same tensor objects, name by name)."""
    return len(weights) == len(views) and all(views.get(n) is t for n, t in weights.items())


class PipelinedTrainer:
    """The trainer of a :class:`PipelinedEngine`: one :class:`~stablebuf.publish.Trainer` per
    region; each version goes into whichever region's set the engine has released (the idle
    one), so the versions alternate between the regions."""

    def __init__(self, trainers: Sequence[Trainer], pulling: bool = False) -> None:
        self._trainers = list(trainers)
        #: Whether the engine is a :class:`~stablebuf.PullingEngine` (one trainer: its staging
        #: set; the engine copies each version in itself).
        self.pulling = bool(pulling)
        self._versions = VersionBook(max(t.version for t in self._trainers))
        #: ``time.monotonic_ns()`` just before the last commit was sent.
        self.last_commit_at_ns = 0
        #: Where the last :meth:`publish` spent its time, as
        #: :attr:`stablebuf.publish.Trainer.last_write` says, with ``region``.
        self.last_write: Dict[str, float] = {}

    @property
    def gpu_timing(self) -> bool:
        """:attr:`stablebuf.publish.Trainer.gpu_timing` of both regions' trainers."""
        return self._trainers[0].gpu_timing

    @gpu_timing.setter
    def gpu_timing(self, on: bool) -> None:
        for trainer in self._trainers:
            trainer.gpu_timing = bool(on)

    @property
    def copy_streams(self) -> int:
        """:attr:`stablebuf.publish.Trainer.copy_streams` of both regions' trainers."""
        return self._trainers[0].copy_streams

    @copy_streams.setter
    def copy_streams(self, streams: int) -> None:
        for trainer in self._trainers:
            trainer.copy_streams = int(streams)

    def twin(self, device: Optional[int] = None) -> Dict[str, Any]:
        """:meth:`stablebuf.publish.Trainer.twin`: the weights laid out as in the engine's sets,
        one buffer on ``device``; a :meth:`publish` of exactly these tensors is one copy. One
        buffer serves both regions where their layouts agree (two copies of one model
        allocated alike: the usual case); a region laid out otherwise takes them tensor by
        tensor."""
        first = self._trainers[0]
        if self.pulling:
            # The staging set itself: train in it, acquire() before each change, publish()
            # only commits.
            return dict(first.tensors(first.set_ids[0]))
        views = first.twin(device)
        for trainer in self._trainers[1:]:
            if trainer.manifest.entries == first.manifest.entries:
                trainer._twin = first._twin
        return views

    @classmethod
    def connect(cls, path: str, **kwargs: Any) -> "PipelinedTrainer":
        """Connects to both sockets of the engine at ``path`` (keyword arguments as for
        :meth:`stablebuf.publish.Trainer.connect`: ``expect``, ``device``, ``access``,
        ``writer``, ``timeout``, ...)."""
        if is_pulling(path):  # a PullingEngine: its staging set only
            return cls([Trainer.connect(staging_path(path), **kwargs)], pulling=True)
        trainers: List[Trainer] = []
        try:
            for p in region_paths(path):
                trainers.append(Trainer.connect(p, **kwargs))
        except BaseException:
            for t in trainers:
                t.close()
            raise
        return cls(trainers)

    @property
    def version(self) -> int:
        return self._versions.last

    @property
    def manifest(self) -> Manifest:
        return self._trainers[0].manifest

    def acquire(self, timeout: Optional[float] = 30.0) -> Tuple[int, int]:
        """``(region, set)`` the trainer may write now, waiting for the engine to release one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for i, trainer in enumerate(self._trainers):
                set_id = trainer.try_acquire()
                if set_id is not None:
                    return i, set_id
            if deadline is not None and time.monotonic() > deadline:
                raise PublishTimeout(
                    "nothing arrived while waiting for the engine to release a set"
                )
            time.sleep(_POLL_SECONDS)

    def tensors(self, region: int, set_id: int) -> Dict[str, Any]:
        return self._trainers[region].tensors(set_id)

    def commit(self, region: int, set_id: int, version: int) -> None:
        """Commits ``version`` in ``region``'s set (synchronise its writes first)."""
        problem = self._versions.problem(version)
        if problem is not None:
            raise VersionConflict(problem)
        trainer = self._trainers[region]
        # The region's own book may lag behind the other region's: versions grow across both.
        trainer._versions = VersionBook(max(trainer._versions.last, self._versions.last))
        trainer.commit(set_id, version)
        self.last_commit_at_ns = trainer.last_commit_at_ns
        self._versions.advance(version)

    def publish(
        self,
        weights: Mapping[str, Any],
        version: int,
        timeout: Optional[float] = 30.0,
        *,
        share: float = 1.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> Tuple[int, int]:
        """Writes ``weights`` into the idle region's set (``share`` as for
        :meth:`stablebuf.publish.Trainer.publish`), synchronises, commits ``version``; returns
        ``(region, set)``."""
        checked_at = time.perf_counter()
        SharePacer(share)
        problem = (
            None
            if self._trainers[0]._is_twin(weights)
            else self.manifest.first_mismatch(weights, dtypes=False)
        )
        if problem is not None:
            from ._native import OfferMismatch

            raise OfferMismatch(problem)
        problem = self._versions.problem(version)
        if problem is not None:
            raise VersionConflict(problem)
        t0 = time.perf_counter()
        region, set_id = self.acquire(timeout)
        t1 = time.perf_counter()
        trainer = self._trainers[region]
        if self.pulling and _are_views_of(weights, trainer.tensors(set_id)):
            # Written in place (the staging set itself): nothing to copy, the engine copies.
            trainer._synchronize(set_id)
            parts = {"issue_s": 0.0, "wait_s": 0.0, "gpu_s": 0.0, "paused_s": 0.0,
                     "chunks": 0.0, "copies": 0.0, "cross_device": 0.0, "lanes": 1.0,
                     "bytes": float(trainer._bytes), "twin": 1.0}
        else:
            parts = trainer._write_synchronized(set_id, weights, share, chunk_bytes)
        t2 = time.perf_counter()
        self.commit(region, set_id, version)
        t3 = time.perf_counter()
        parts.update(
            check_s=t0 - checked_at,
            acquire_s=t1 - t0,
            commit_s=t3 - t2,
            total_s=t3 - checked_at,
            region=float(region),
        )
        self.last_write = parts
        return region, set_id

    def close(self) -> None:
        for trainer in self._trainers:
            trainer.close()

    def __enter__(self) -> "PipelinedTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
