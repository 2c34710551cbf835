"""RL weight sync from another node over NCCL, received straight into the engine's shadow
weight set (issue 42). Re-exported by :mod:`stablebuf.publish` as :class:`RemoteEngine` and
:class:`RemoteTrainer`; the pure protocol is :mod:`stablebuf._remote`.

How the engine writes a set it does not serve: its spare sets are made shareable
(``snapshot_shareable``) as for the one-host publish, and at start each is exported and
imported again *in the same process* through a private Unix socket (``PublishChannel``):
the import maps the set's physical memory at a second address, read-write, and DLPack gives a
torch tensor over it (no copy, no memory: one more mapping of the same pages). NCCL receives
into that tensor while the region's addresses, and so the engine's graphs, stay on the bound
set. A commit is the last receive completing; the switch is then a bind of the set (one remap)
at a step boundary, agreed across tensor-parallel ranks by :mod:`stablebuf._switcher`, as the
one-host :class:`~stablebuf.publish.Engine` does (this class is one, with another transport).

The trainer's communicator is a standalone ``ProcessGroupNCCL`` of two ranks (the trainer
0, this engine rank 1) over a ``PrefixStore`` of the control store, one per trainer that joins
(an epoch): it is not registered with ``torch.distributed``'s world, shares nothing with the
engine's tensor-parallel group, and :meth:`RemoteEngine.poll` aborts it alone (its
``abort()``) when the trainer leaves, is replaced, or stalls for ``stall_timeout`` seconds
mid-transfer. It is built under :data:`stablebuf._remote.PAIR_GROUP_ENV`
(``TORCH_NCCL_BLOCKING_WAIT=1``: no watchdog or heartbeat-monitor thread, whose error path
sleeps 60 s before aborting, blocks the group's destruction and can take the engine process
down; see there). The engine asks ``is_completed()`` at step boundaries and calls
``Work.wait`` only on a completed operation, to read its error (a completed operation's wait
returns at once; a failed one's aborts the communicator and raises): it never makes the serving
stream wait on a transfer that may never end.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _native
from ._devices import cuda_torch, device_of, stream_of
from ._manifest import Entry, Manifest, VersionBook
from ._native import OfferMismatch, PeerClosed, PublishError, PublishTimeout, VersionConflict
from ._remote import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STALL_TIMEOUT,
    PAIR_GROUP_ENV,
    ControlTimeout,
    EngineControl,
    Offer,
    TrainerControl,
    Watch,
    entry_spans,
    operation_error,
    overlaps,
    plan_ranges,
    scoped_env,
)
from ._switcher import DEFAULT_AGREE_EVERY, Switch, VersionSwitcher, check_agree_every

#: The ``ProcessGroupNCCL`` timeout of a trainer's communicator: how long its ``abort()`` waits
#: for NCCL's abort before it raises. (No watchdog runs on it: the engine's stall watch is the
#: transfer's timeout.)
DEFAULT_NCCL_TIMEOUT = 600.0


def control_store(host: str, port: int, *, server: bool, timeout: float = 60.0) -> Any:
    """A ``torch.distributed.TCPStore`` for the control messages. The engine side serves it
    (``server=True``; ``port=0`` picks a free port: read ``store.port``), trainers connect.
    The engine should serve it: a trainer that dies then takes nothing with it."""
    cuda_torch()
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, is_master=server, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the pair communicator


class PairGroup:
    """A two-rank ``ProcessGroupNCCL`` of its own (trainer 0, engine 1) over
    ``PrefixStore(prefix, store)``; only :meth:`broadcast` (root 0) and :meth:`abort`."""

    def __init__(self, store: Any, prefix: str, rank: int, device: int,
                 timeout: float = DEFAULT_NCCL_TIMEOUT) -> None:
        torch = cuda_torch()
        import torch.distributed as dist

        self.device = device
        self._torch = torch
        prefixed = dist.PrefixStore(prefix, store)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout)
        # Read by the constructor only: no watchdog or monitor thread (see PAIR_GROUP_ENV).
        with scoped_env(PAIR_GROUP_ENV):
            self.backend = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        self.aborted = False
        self.abort_error: Optional[str] = None
        #: Seconds the last :meth:`abort` took (``None``: not aborted), for the engine's report.
        self.abort_seconds: Optional[float] = None

    def broadcast(self, tensor: Any) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if hasattr(opts, "asyncOp"):
            # On NCCL's own stream, never the caller's (torch's synchronous mode enqueues on
            # the current stream: the serving stream would wait behind a stalled receive).
            opts.asyncOp = True
        return self.backend.broadcast([tensor], opts)

    def abort(self) -> None:
        """Aborts this communicator alone (``ncclCommAbort``): operations in flight end, its
        memory and descriptors go. Idempotent. Never ``shutdown`` first: it flushes the
        operations in flight, which a dead peer never completes."""
        if self.aborted:
            return
        self.aborted = True
        start = time.monotonic()
        for name in ("abort", "_abort", "shutdown", "_shutdown"):
            method = getattr(self.backend, name, None)
            if method is not None:
                try:
                    method()
                except Exception as error:  # noqa: BLE001 - the peer is gone: abort anyway
                    #: What the backend's abort raised (``None``: nothing), for reports.
                    self.abort_error = f"{name}(): {type(error).__name__}: {error}"
                    warnings.warn(f"the trainer's communicator: {self.abort_error}",
                                  RuntimeWarning, stacklevel=2)
                break
        self.backend = None  # its destructor joins no thread (blocking-wait mode)
        self.abort_seconds = time.monotonic() - start


def _poll_done(work: Any, deadline: float) -> None:
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise PublishTimeout("the peer's communicator did not come up in time")
        time.sleep(0.001)
    error = operation_error(work)
    if error is not None:
        raise PublishError(f"the warm-up broadcast failed: {error}")


#: One warm-up stream per device for the process's life. A fresh stream per trainer would
#: leak: the caching allocator keeps the warm-up tensor's 2 MiB segment for its stream alone,
#: and a stream never used again never reuses it (2 MiB per trainer that ever joined).
_WARM_UP_STREAMS: Dict[int, Any] = {}
_WARM_UP_LOCK = threading.Lock()


def _warm_up_stream(torch: Any, device: int) -> Any:
    with _WARM_UP_LOCK:
        if device not in _WARM_UP_STREAMS:
            _WARM_UP_STREAMS[device] = torch.cuda.Stream(device)
        return _WARM_UP_STREAMS[device]


def _warm_up(pair: PairGroup, epoch: int, deadline: float, root: bool) -> None:
    """Brings the communicator up (its first operation) and checks both sides agree on the
    epoch. On a side stream: nothing the serving stream queues waits for it."""
    torch = pair._torch
    torch.cuda.set_device(pair.device)
    side = _warm_up_stream(torch, pair.device)
    with torch.cuda.stream(side):
        value = torch.full((1,), epoch if root else -1, dtype=torch.int64,
                           device=f"cuda:{pair.device}")
        _poll_done(pair.broadcast(value), deadline)
        side.synchronize()
        got = int(value.item())
    if got != epoch:
        raise PublishError(f"the warm-up carried epoch {got}, {epoch} expected")


# ------------------------------------------------------------------ tensors over a set


def views_over(torch: Any, flat: Any, entries: Sequence[Entry]) -> Dict[str, Any]:
    """``name → tensor`` over ``flat`` (a one-dimensional ``uint8`` tensor laid out as the
    set), as the manifest places them."""
    views = {}
    for e in entries:
        dtype = getattr(torch, e.dtype)
        if e.span:
            piece = flat[e.offset : e.offset + e.span].view(dtype)
            views[e.name] = piece.as_strided(e.shape, e.stride)
        else:
            views[e.name] = torch.empty(0, dtype=dtype, device=flat.device).reshape(e.shape)
    return views


def alias_sets(sets: Sequence[Any], manifest: Manifest, device: int) -> List[Any]:
    """Maps each of this process's shareable ``sets`` a second time, read-write (exported and
    imported through a private socket); returns the imported sets, in order (DLPack-able)."""
    folder = tempfile.mkdtemp(prefix="sbalias-")
    path = os.path.join(folder, "s")
    listener = _native.PublishListener(path)
    client = server = None
    try:
        client = _native.PublishChannel.connect(path)
        deadline = time.monotonic() + 10
        while server is None:
            server = listener.accept()
            if server is None:
                if time.monotonic() > deadline:
                    raise PublishError("the private socket to alias the sets never connected")
                time.sleep(0.001)
        imported = []
        for ws in sets:
            server.offer(ws, manifest.fingerprint)
            imported.append(
                client.receive_set(device, tag=manifest.tag, fingerprint=manifest.fingerprint,
                                   nbytes=manifest.nbytes)
            )
            server.wait_ack(ws.id)
        return imported
    except PublishError as error:
        raise PublishError(
            f"mapping the engine's own weight sets a second time failed ({error}): see "
            "nccl-sync-42.md, 'native API' (WeightSet.alias) for the fallback"
        ) from None
    finally:
        for ch in (client, server):
            if ch is not None:
                with contextlib.suppress(Exception):
                    ch.close()
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ the engine


class _Joining:
    """A trainer's communicator coming up on a thread of its own (the serving loop goes on)."""

    def __init__(self, epoch: int, pair_factory: Callable[[], PairGroup], deadline: float) -> None:
        self.epoch = epoch
        self.pair: Optional[PairGroup] = None
        self.error: Optional[str] = None
        self._factory, self._deadline = pair_factory, deadline
        self.thread = threading.Thread(target=self._run, name=f"stablebuf-join-{epoch}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.pair = self._factory()
            _warm_up(self.pair, self.epoch, self._deadline, root=False)
        except Exception as error:  # noqa: BLE001 - reported by poll
            self.error = f"{type(error).__name__}: {error}"

    @property
    def finished(self) -> bool:
        return not self.thread.is_alive()


class _Transfer:
    def __init__(self, offer: Offer, weight_set: Any, ranges: List[Tuple[int, int]],
                 mode: str, watch: Watch) -> None:
        self.offer, self.weight_set, self.ranges, self.mode, self.watch = (
            offer, weight_set, ranges, mode, watch)
        self.next_range = 0  # bucket mode: the next range to receive
        self.copies_s = 0.0


#: The comparison paths that receive into a staging bucket and copy into the live parameters.
BUCKET_MODES = ("bucket", "paused")


def make_remote_engine_class(
    Engine: Any, tensors_of: Callable[[Any], Dict[str, Any]],
    entries_of: Callable[[str, Mapping[str, Any]], List[Entry]],
    start_min_of: Callable[[Any], Any],
) -> Any:
    """:class:`RemoteEngine`, a subclass of ``Engine`` (passed in by :mod:`stablebuf.publish`,
    which this module does not import: no import circle)."""

    class RemoteEngine(Engine):
        """An engine rank that receives its weights from a trainer on another node over NCCL,
        straight into a spare weight set (no staging bucket, no copy after), and switches as
        :class:`~stablebuf.publish.Engine` does: :meth:`poll` at every step boundary (never
        blocks, never raises for a peer), ``group=`` for tensor parallelism (a version bound on
        every rank at the same boundary or on none), ``keep_previous`` and :meth:`rollback`.

        ``store``: the control store (:func:`control_store`; this rank's messages live under
        ``prefix``, one prefix per tensor-parallel rank, e.g. ``f"sync/tp{rank}"``). The region
        should be made with ``fence="last-use"``, so that a bind waits for the graphs' last use
        and never for a receive in flight on the same GPU.

        A trainer that stalls mid-transfer for ``stall_timeout`` seconds (dead, or its node's
        network gone) is dropped: its communicator alone is aborted, the half-written set goes
        back to the free ones, the engine serves on; the next :meth:`poll` after the stall is
        seen says so in ``status.problems``. A new trainer may join at any time (the newest
        one wins; the older one's communicator is aborted).

        ``mode_for(version)``: ``"shadow"`` (default), or one of two comparison paths (one
        engine, no group, for measurements only): ``"paused"``, the anchors' mechanism (the
        serving loop waits in :meth:`poll` while every bucket of ``bucket_bytes`` is received
        and copied into the live parameters, as vLLM's and TRL's NCCL update and
        checkpoint-engine do), and ``"bucket"`` (each bucket received while serving, the loop
        paused only for its copy into the live parameters).
        """

        def __init__(
            self,
            tag: str,
            tensors: Any,
            *,
            store: Any,
            prefix: str = "stablebuf/sync",
            sets: int = 2,
            keep_previous: bool = False,
            group: Any = None,
            agree_every: int = DEFAULT_AGREE_EVERY,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            stall_timeout: float = DEFAULT_STALL_TIMEOUT,
            join_timeout: float = 60.0,
            nccl_timeout: float = DEFAULT_NCCL_TIMEOUT,
            control_interval: float = 0.002,
            bucket_bytes: int = 1 << 30,
        ) -> None:
            if sets < 2 + keep_previous:
                raise ValueError(f"sets={sets}: at least {2 + keep_previous}")
            check_agree_every(agree_every)
            torch = cuda_torch()
            self.tag = tag
            self._torch = torch
            self._device = device_of(tag)
            self._live = tensors_of(tensors)
            entries = entries_of(tag, self._live)
            torch.cuda.current_stream(self._device).synchronize()
            self._sets = [_native.snapshot_shareable(tag, stream_of(tag)) for _ in range(sets)]
            self.manifest = Manifest.build(tag, self._sets[0].nbytes, sets, entries)
            self._by_id = {ws.id: ws for ws in self._sets}
            self._aliases = alias_sets(self._sets, self.manifest, self._device)
            self._flat = {
                ws.id: torch.from_dlpack(imp) for ws, imp in zip(self._sets, self._aliases)
            }
            self._channel: Optional[Any] = None  # the live PairGroup (trainer_connected)
            self._versions = VersionBook()
            self._group = group
            self._switcher = VersionSwitcher(
                lambda: _native.bound(tag),
                keep_previous=keep_previous,
                start_min=None if group is None else start_min_of(group),
                agree_every=agree_every,
            )
            self._asleep = False
            self._closed = False
            self._unreported: List[str] = []
            self._quiet: Optional[Any] = None
            self._control = EngineControl(store, prefix, self.manifest.to_json())
            self._store, self._prefix = store, prefix
            self._free: List[int] = [ws.id for ws in self._sets]
            self._joining: Optional[_Joining] = None
            self._orphans: List[_Joining] = []
            self._transfer: Optional[_Transfer] = None
            self._pending: Optional[Offer] = None  # an offer waiting for a free set
            self.chunk_bytes, self.stall_timeout = int(chunk_bytes), float(stall_timeout)
            self.join_timeout, self.nccl_timeout = float(join_timeout), float(nccl_timeout)
            self.control_interval = float(control_interval)
            self.bucket_bytes = int(bucket_bytes)
            self._bucket: Optional[Any] = None
            self._next_look = 0.0
            self.mode_for: Callable[[int], str] = lambda version: "shadow"
            #: (event, version, time.monotonic()): "ready" (receives enqueued), "received"
            #: (the commit: the last byte seen arrived), "copied" (bucket mode), "dropped".
            self.timeline: List[Tuple[str, int, float]] = []
            self.transfer_stats: Dict[int, Dict[str, float]] = {}

        # ---------------------------------------------------------- state

        @property
        def path(self) -> str:  # no Unix socket: the control store carries the handshake
            return self._prefix

        @property
        def epoch(self) -> int:
            """The trainer epoch connected now (0: none)."""
            return self._control.epoch if self._channel is not None else 0

        @property
        def free_sets(self) -> List[int]:
            return list(self._free)

        def shadow_tensors(self, set_id: int) -> Dict[str, Any]:
            """Tensors over spare set ``set_id`` at its second address (for checks)."""
            return views_over(self._torch, self._flat[set_id], self.manifest.entries)

        def accept(self, timeout: Optional[float] = None) -> bool:
            """Reads the control store until a trainer's communicator is up (or ``timeout``)."""
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                self._read_trainer(self._unreported, force=True)
                if self._channel is not None:
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(0.002)

        def wait_for_commit(self, version: int, timeout: Optional[float] = 30.0) -> bool:
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                self._read_trainer(self._unreported, force=True)
                if self._versions.last >= version:
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(0.0005)

        def sleep(self) -> None:
            raise PublishError("RemoteEngine does not sleep (its sets receive while it serves)")

        # ---------------------------------------------------------- the trainer side

        def _read_trainer(self, problems: List[str], force: bool = False) -> None:
            now = time.monotonic()
            self._progress(now, problems)
            for orphan in [o for o in self._orphans if o.finished]:
                self._orphans.remove(orphan)
                if orphan.pair is not None:
                    orphan.pair.abort()
            joining = self._joining
            if joining is not None and joining.finished:
                self._joining = None
                if joining.error is not None or joining.pair is None:
                    if joining.pair is not None:
                        joining.pair.abort()
                    problems.append(f"trainer epoch {joining.epoch} failed to join: {joining.error}")
                    with contextlib.suppress(Exception):
                        self._control.drop(joining.epoch, f"join failed: {joining.error}")
                else:
                    self._channel = joining.pair
                    self._control.joined(joining.epoch, self._versions.last)
            if not force and now < self._next_look:
                return
            self._next_look = now + self.control_interval
            try:
                self._look(problems)
            except Exception as error:  # noqa: BLE001 - the store is the peer's medium
                problems.append(f"the control store failed: {type(error).__name__}: {error}")

        def _look(self, problems: List[str]) -> None:
            for _ in range(4):  # a join, a leave and an offer may all wait
                if self._pending is not None:
                    if not self._start(self._pending, problems):
                        return
                    self._pending = None
                event = self._control.look()
                if event is None:
                    return
                kind, what = event
                if kind == "join":
                    self._drop_trainer(f"a newer trainer (epoch {what}) joined")
                    if self._joining is not None:  # an older join still coming up
                        self._orphans.append(self._joining)
                    # Bound now: the helper thread calls the factory later, when this loop
                    # may have rebound `what` (a second join read in the same call).
                    factory = functools.partial(
                        PairGroup, self._store, f"{self._prefix}/pg/{what}/", 1, self._device,
                        self.nccl_timeout)
                    self._joining = _Joining(what, factory, time.monotonic() + self.join_timeout)
                elif kind == "leave":
                    self._drop_trainer(None)
                elif kind == "offer":
                    if not self._start(what, problems):
                        self._pending = what
                        return

        def _start(self, offer: Offer, problems: List[str]) -> bool:
            """Enqueues the receives of ``offer`` (or refuses it); ``False``: not now (a
            transfer in flight, or no free set)."""
            if self._transfer is not None or self._channel is None:
                return False
            problem = self._versions.problem(offer.version)
            if problem is not None:
                self._control.refuse(offer, problem)
                problems.append(f"VersionConflict: {problem}: refused")
                return True
            mode = self.mode_for(offer.version)
            if mode in BUCKET_MODES:
                if self._group is not None:
                    raise PublishError("bucket mode is a one-engine comparison (no group)")
                ranges = plan_ranges(entry_spans(self.manifest.entries),
                                     min(self.bucket_bytes, self.manifest.nbytes))
                size = max(e - s for s, e in ranges)
                if self._bucket is None or self._bucket.numel() < size:
                    self._bucket = self._torch.empty(size, dtype=self._torch.uint8,
                                                     device=f"cuda:{self._device}")
                weight_set = None
                ops = [self._channel.broadcast(self._bucket[: ranges[0][1] - ranges[0][0]])]
            else:
                if not self._free:
                    return False
                set_id = self._free.pop(0)
                weight_set = self._by_id[set_id]
                flat = self._flat[set_id]
                ranges = plan_ranges(entry_spans(self.manifest.entries), self.chunk_bytes)
                ops = [self._channel.broadcast(flat[s:e]) for s, e in ranges]
            now = time.monotonic()
            watch = Watch(ops, self.stall_timeout, now)
            self._transfer = _Transfer(offer, weight_set, ranges, mode, watch)
            self._transfer.next_range = 1
            self._control.ready(offer, ranges)
            self.timeline.append(("ready", offer.version, now))
            return True

        def _progress(self, now: float, problems: List[str]) -> None:
            transfer = self._transfer
            if transfer is None:
                return
            state = transfer.watch.check(now)
            if state == "done" and transfer.mode in BUCKET_MODES:
                state = self._bucket_step(transfer, now)
            while state == "waiting" and transfer.mode == "paused":
                # The anchors' engine does nothing else until the update is in: this poll
                # (the serving loop) returns when the last bucket is copied, or the trainer
                # stalls.
                time.sleep(0.0001)
                now = time.monotonic()
                state = transfer.watch.check(now)
                if state == "done":
                    state = self._bucket_step(transfer, now)
            if state == "done":
                self._transfer = None
                version = transfer.offer.version
                self._versions.advance(version)
                self.timeline.append(("received", version, now))
                started = next(t for k, v, t in reversed(self.timeline)
                               if k == "ready" and v == version)
                self.transfer_stats[version] = {
                    "seconds_seen": now - started, "copy_s": transfer.copies_s,
                    "bytes": float(sum(e - s for s, e in transfer.ranges)),
                }
                if transfer.mode in BUCKET_MODES:
                    # The live parameters hold it now: nothing to bind.
                    self._switcher.version = version
                    self._switcher.last = max(self._switcher.last, version)
                else:
                    self._switcher.committed(transfer.weight_set, version)
                self._control.done(transfer.offer, "received")
            elif state in ("stalled", "failed"):
                reason = transfer.watch.failure
                abort_s = self._drop_trainer(
                    f"version {transfer.offer.version}'s transfer {state}: {reason}")
                took = "" if abort_s is None else f" in {abort_s:.2f} s"
                problems.append(
                    f"PeerClosed: the trainer's transfer of version {transfer.offer.version} "
                    f"{state} ({reason}): its communicator alone was aborted{took}; the engine "
                    f"serves on version {self.version}, and a new trainer may join"
                )

        def _bucket_step(self, transfer: _Transfer, now: float) -> str:
            """Bucket mode, a range received: copy it into the live parameters now (the
            serving loop is paused meanwhile: it waits for this poll), then receive the next."""
            torch = self._torch
            start, end = transfer.ranges[transfer.next_range - 1]
            t0 = time.perf_counter()
            by_name = self._live
            for entry, lo, hi in overlaps(self.manifest.entries, (start, end)):
                live = by_name[entry.name]
                flat_live = live.view(-1).view(torch.uint8) if live.is_contiguous() else None
                if flat_live is None:
                    raise PublishError(f"bucket mode needs contiguous tensors: `{entry.name}`")
                flat_live[lo - entry.offset : hi - entry.offset].copy_(
                    self._bucket[lo - start : hi - start], non_blocking=True)
            torch.cuda.current_stream(self._device).synchronize()
            transfer.copies_s += time.perf_counter() - t0
            self.timeline.append(("copied", transfer.offer.version, time.monotonic()))
            if transfer.next_range == len(transfer.ranges):
                return "done"
            s, e = transfer.ranges[transfer.next_range]
            transfer.next_range += 1
            transfer.watch = Watch([self._channel.broadcast(self._bucket[: e - s])],
                                   self.stall_timeout, time.monotonic())
            return "waiting"

        def _drop_trainer(self, reason: Optional[str] = None) -> Optional[float]:
            """Drops the trainer (aborts its communicator); returns the seconds the abort
            took, or ``None`` where none was connected."""
            transfer, self._transfer = self._transfer, None
            if transfer is not None and transfer.weight_set is not None:
                self._free.append(transfer.weight_set.id)  # never committed: free again
            self._pending = None
            pair, self._channel = self._channel, None
            if pair is None:
                return None
            pair.abort()
            epoch = self._control.epoch
            self.timeline.append(("dropped", epoch, time.monotonic()))
            if reason is not None and epoch:
                with contextlib.suppress(Exception):
                    self._control.drop(epoch, reason)
            self._control.epoch = 0
            return pair.abort_seconds

        def _apply(self, switch: Switch, problems: List[str]) -> None:
            for weight_set in switch.released:
                if self._is_spare(weight_set) and weight_set.id not in self._free:
                    self._free.append(weight_set.id)

        def close(self) -> None:
            self._drop_trainer("the engine closed")
            joining, self._joining = self._joining, None
            for j in [joining, *self._orphans] if joining is not None else list(self._orphans):
                j.thread.join(timeout=self.join_timeout)
                if j.pair is not None:
                    j.pair.abort()
            self._orphans = []
            self._closed = True

    return RemoteEngine


# ------------------------------------------------------------------ the trainer


class RemoteTrainer:
    """The trainer's side for one engine rank (its shard): a packed buffer laid out as the
    engine's weight set, on this process's GPU, sent with NCCL broadcasts into the engine's
    spare set. Use :meth:`connect`; :meth:`publish` copies a state dict in (casting) and
    sends it; :meth:`tensors` gives the buffer's tensors to fill yourself, then
    :meth:`send`."""

    def __init__(self, control: TrainerControl, manifest: Manifest, pair: PairGroup,
                 device: int, last: int, torch: Any) -> None:
        self._control, self.manifest, self._pair = control, manifest, pair
        self.device, self._torch = device, torch
        self._packed = torch.zeros(manifest.nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self._views = views_over(torch, self._packed, manifest.entries)
        self._versions = VersionBook(last)
        #: Per version: seconds of the transfer (first send enqueued → last completed) and bytes.
        self.stats: Dict[int, Dict[str, float]] = {}

    @classmethod
    def connect(cls, store: Any, prefix: str = "stablebuf/sync", *, device: Optional[int] = None,
                expect: Optional[Mapping[str, Any]] = None, check_dtypes: bool = False,
                timeout: float = 60.0, nccl_timeout: float = DEFAULT_NCCL_TIMEOUT) -> "RemoteTrainer":
        torch = cuda_torch()
        device = torch.cuda.current_device() if device is None else int(device)
        deadline = time.monotonic() + timeout
        control = TrainerControl(store, prefix)
        try:
            manifest = Manifest.from_json(control.manifest(deadline))
        except ControlTimeout as late:
            raise PublishTimeout(str(late)) from None
        except ValueError as bad:
            raise PublishError(str(bad)) from None
        if expect is not None:
            problem = manifest.first_mismatch(expect, dtypes=check_dtypes)
            if problem is not None:
                raise OfferMismatch(problem)
        epoch = control.join(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        pair = PairGroup(store, f"{prefix}/pg/{epoch}/", 0, device, nccl_timeout)
        try:
            _warm_up(pair, epoch, deadline, root=True)
            last = control.wait_joined(deadline)
        except (ControlTimeout, ConnectionError) as error:
            pair.abort()
            raise PublishTimeout(str(error)) from None
        except BaseException:
            pair.abort()
            raise
        return cls(control, manifest, pair, device, last, torch)

    @property
    def epoch(self) -> int:
        return self._control.epoch

    @property
    def version(self) -> int:
        return self._versions.last

    def tensors(self) -> Dict[str, Any]:
        """The packed buffer's tensors (the engine's names, shapes and dtypes)."""
        return self._views

    def publish(self, weights: Mapping[str, Any], version: int, timeout: Optional[float] = 60.0) -> None:
        problem = self.manifest.first_mismatch(weights, dtypes=False)
        if problem is not None:
            raise OfferMismatch(problem)
        for name, source in weights.items():
            self._views[name].copy_(source, non_blocking=True)
        self._torch.cuda.synchronize(self.device)
        self.send(version, timeout)

    def send(self, version: int, timeout: Optional[float] = 60.0,
             stop_after: Optional[int] = None) -> None:
        """Sends the packed buffer as ``version`` and waits for the engine's confirmation.
        ``stop_after`` (tests): send only that many ranges, then return at once (a trainer
        about to die mid-transfer)."""
        problem = self._versions.problem(version)
        if problem is not None:
            raise VersionConflict(problem)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            seq = self._control.offer(version)
            ranges, refused = self._control.wait_ready(seq, deadline)
        except ControlTimeout as late:
            raise PublishTimeout(str(late)) from None
        except ConnectionError as gone:
            raise PeerClosed(str(gone)) from None
        if ranges is None:
            raise VersionConflict(f"the engine refused version {version}: {refused}")
        torch = self._torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        start = time.perf_counter()
        works = []
        with torch.cuda.stream(side):
            for i, (s, e) in enumerate(ranges):
                if stop_after is not None and i >= stop_after:
                    return
                works.append(self._pair.broadcast(self._packed[s:e]))
        for work in works:
            while not work.is_completed():
                if deadline is not None and time.monotonic() > deadline:
                    raise PublishTimeout(f"version {version}'s send did not finish in time")
                time.sleep(0.0001)
        seconds = time.perf_counter() - start
        try:
            outcome = self._control.wait_done(seq, deadline)
        except ControlTimeout as late:
            raise PublishTimeout(str(late)) from None
        except ConnectionError as gone:
            raise PeerClosed(str(gone)) from None
        if outcome != "received":
            raise PublishError(f"the engine did not take version {version}: {outcome}")
        self._versions.advance(version)
        nbytes = float(sum(e - s for s, e in ranges))
        self.stats[version] = {"seconds": seconds, "bytes": nbytes,
                               "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0}

    def close(self) -> None:
        """Leaves (the engine aborts its side of the communicator) and aborts this side."""
        with contextlib.suppress(Exception):
            self._control.leave()
        self._pair.abort()
        self._views = {}
        self._packed = None

    def __enter__(self) -> "RemoteTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
