"""Cross-node weight sync's pure parts (no torch, no GPU): the control protocol between a
remote trainer and one engine rank over a key-value store (``torch.distributed.TCPStore`` or
any object with ``set``, ``get``, ``check`` and ``add``), the byte ranges a transfer moves, and
the watch that turns a transfer's in-flight operations into done, waiting, stalled or failed.
:mod:`stablebuf._nccl_sync` puts NCCL and the weight sets under it; every rule here is tested
on the CPU with a dictionary store and fake operations (``python/tests/test_remote_cpu.py``).

Keys, under one prefix per engine rank (``P``), ``e`` an epoch (one per trainer that joins),
``s`` a transfer's sequence number within its epoch (1, 2, ...)::

    P/manifest      engine → the manifest (JSON), written once
    P/epoch         trainer: add(1) to join; the engine reads add(0): newest epoch
    P/join/e        trainer → it joined as epoch e (JSON, for a log)
    P/joined/e      engine  → its communicator with epoch e is up; JSON {"last": version}
    P/offer/e/s     trainer → it wants to send version v (decimal)
    P/ready/e/s     engine  → JSON {"ranges": [[start, end], ...]} (receives enqueued: send
                    these byte ranges of the packed set, in order) or {"refused": reason}
    P/done/e/s      engine  → "received" once every byte arrived, else "failed: reason"
    P/leave/e       trainer → it leaves (clean close)
    P/dropped/e     engine  → it dropped epoch e (reason): its communicator was aborted

The engine only ever reads with ``check`` first, so a serving loop never blocks on the store;
the trainer waits with deadlines (:func:`wait_key`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import (
    Any, Callable, Iterable, Iterator, List, Mapping, MutableMapping, Optional, Sequence, Tuple,
)

#: Default bytes per received operation: the granularity of the stall watch (an operation
#: must finish within the stall timeout: 1 GiB in 10 s needs 0.1 GB/s). Over sockets on 2 x
#: H200, 256 MiB operations carried 0.885x what 1 GiB ones did (each operation pays NCCL's
#: start-up again), so operations are as large as that allows.
DEFAULT_CHUNK_BYTES = 1 << 30
#: Default seconds a transfer may go without an operation completing before the engine aborts
#: the trainer's communicator (the stated bound of the dead-trainer test).
DEFAULT_STALL_TIMEOUT = 10.0

Range = Tuple[int, int]

#: The environment a trainer's communicator (``_nccl_sync.PairGroup``) is built under; torch's
#: ``ProcessGroupNCCL`` reads these in its constructor only.
#:
#: ``TORCH_NCCL_BLOCKING_WAIT=1``: no watchdog thread and no heartbeat-monitor thread for this
#: communicator. Their error path is what must never run in an engine: on an operation's error
#: (a trainer that died mid-transfer) torch's watchdog writes the flight-recorder dump signal
#: into the control store and into a process-wide flag, then *sleeps 60 s* (4 x
#: ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``) before it aborts; destroying the group joins that
#: thread, so the engine's ``poll`` stalled for up to a minute. The flag also wakes the
#: heartbeat monitor of the process's first ``ProcessGroupNCCL`` (an engine's own TP group, or
#: any later trainer's communicator reading the signal from the store), which dumps, sleeps
#: ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s) and then, unless
#: ``TORCH_NCCL_ENABLE_MONITORING=0``, kills the process; its group's destruction (``close``,
#: ``destroy_process_group``) blocks for those 480 s. Blocking-wait mode only changes
#: ``Work.wait``, which the engine calls only on completed operations
#: (:func:`operation_error`): it returns at once, or aborts the communicator and raises the
#: operation's error. The engine's stall watch is the timeout.
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up, never tear the process down) and
#: ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` stay as a second line should a torch start those threads
#: anyway.
PAIR_GROUP_ENV = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str],
               environ: Optional[MutableMapping[str, str]] = None) -> Iterator[None]:
    """Sets ``values`` in ``environ`` (``os.environ``) for the ``with`` body and puts every
    variable back as it was (removed where it was not set), also on an exception. One body at a
    time in the process (communicators come up on helper threads)."""
    env = os.environ if environ is None else environ
    with _ENV_LOCK:
        saved = {name: env.get(name) for name in values}
        try:
            env.update(values)
            yield
        finally:
            for name, old in saved.items():
                if old is None:
                    env.pop(name, None)
                else:
                    env[name] = old


class ControlTimeout(TimeoutError):
    """A key the caller waited for did not appear in time."""


def plan_ranges(spans: Iterable[Range], chunk_bytes: int) -> List[Range]:
    """The byte ranges a transfer moves: the union of ``spans`` ([start, end) pairs, the
    manifest's tensors; overlapping or touching ones merged, gaps left out: they are never
    written), each cut into pieces of at most ``chunk_bytes``. Sorted; empty spans ignored."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: at least 1")
    merged: List[List[int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in spans if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: List[Range] = []
    for start, end in merged:
        while start < end:
            cut = min(end, start + chunk_bytes)
            out.append((start, cut))
            start = cut
    return out


def entry_spans(entries: Iterable[Any]) -> List[Range]:
    """[offset, offset + span) of each manifest entry (:class:`stablebuf._manifest.Entry`)."""
    return [(e.offset, e.offset + e.span) for e in entries if e.span > 0]


def overlaps(entries: Iterable[Any], window: Range) -> List[Tuple[Any, int, int]]:
    """For a bucket holding bytes ``window`` of the set: each entry that has bytes there, with
    the part's start and end (bytes of the set). What a copy out of the bucket moves."""
    lo, hi = window
    out = []
    for e in entries:
        start, end = max(lo, e.offset), min(hi, e.offset + e.span)
        if start < end:
            out.append((e, start, end))
    return out


class Keys:
    """The key names under ``prefix`` (see the module's docstring)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/") + "/"

    def __getattr__(self, name: str) -> Callable[..., str]:
        if name.startswith("_"):
            raise AttributeError(name)
        prefix = self.prefix

        def key(*parts: Any) -> str:
            return prefix + "/".join([name, *map(str, parts)])

        return key


def has(store: Any, key: str) -> bool:
    """Whether ``key`` is set (never blocks)."""
    return bool(store.check([key]))


def read(store: Any, key: str) -> str:
    value = store.get(key)
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def wait_key(
    store: Any,
    key: str,
    deadline: Optional[float],
    what: str,
    *,
    abandon: Sequence[str] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Tuple[str, str]:
    """Waits until ``key`` or one of ``abandon`` is set; returns (the key found, its value).
    Raises :class:`ControlTimeout` naming ``what`` after ``deadline`` (``None``: forever)."""
    pause = 0.0005
    while True:
        for k in (key, *abandon):
            if has(store, k):
                return k, read(store, k)
        if deadline is not None and clock() > deadline:
            raise ControlTimeout(f"nothing came while waiting for {what} ({key})")
        sleep(pause)
        pause = min(pause * 2, 0.02)


def operation_error(op: Any) -> Optional[BaseException]:
    """The error a *completed* operation ended with, or None. torch's ``Work.exception()``
    cannot return to Python (torch 2.11: pybind11 has no converter for
    ``std::exception_ptr`` and raises TypeError even for a success), so an operation with
    ``wait()`` (a torch.distributed Work) is asked through it: it returns at once for a
    completed operation and raises the operation's error. Others answer ``exception()``."""
    wait = getattr(op, "wait", None)
    if wait is not None:
        try:
            wait()
        except Exception as error:  # noqa: BLE001 - the operation's own failure
            return error
        return None
    exception = getattr(op, "exception", None)
    return exception() if exception is not None else None


@dataclass
class Watch:
    """One transfer's operations (objects with ``is_completed()``, which may raise for a
    failed one, and ``wait()`` or ``exception()``: :func:`operation_error`), done in order. :meth:`check` says where it
    stands: ``"done"``, ``"waiting"``, ``"stalled"`` (no operation completed for
    ``stall_timeout`` seconds since the last did, or since the start) or ``"failed"``."""

    operations: List[Any]
    stall_timeout: float
    started: float
    first_open: int = 0
    last_progress: float = field(default=0.0)
    failure: Optional[str] = None
    finished: Optional[float] = None

    def __post_init__(self) -> None:
        self.last_progress = self.started

    def check(self, now: float) -> str:
        if self.failure is not None:
            return "failed"
        if self.finished is not None:
            return "done"
        while self.first_open < len(self.operations):
            op = self.operations[self.first_open]
            try:
                completed = bool(op.is_completed())
                error = operation_error(op) if completed else None
            except Exception as raised:  # noqa: BLE001 - the operation's own failure
                self.failure = f"{type(raised).__name__}: {raised}"
                return "failed"
            if error is not None:
                self.failure = f"{type(error).__name__}: {error}"
                return "failed"
            if not completed:
                break
            self.first_open += 1
            self.last_progress = now
        if self.first_open == len(self.operations):
            self.finished = now
            return "done"
        if now - self.last_progress > self.stall_timeout:
            self.failure = (
                f"no progress for {now - self.last_progress:.1f} s (stall timeout "
                f"{self.stall_timeout:g} s; {self.first_open} of {len(self.operations)} "
                "operations done)"
            )
            return "stalled"
        return "waiting"


@dataclass
class Offer:
    epoch: int
    seq: int
    version: int


class EngineControl:
    """The engine rank's side of the control protocol: never blocks (``check`` before every
    ``get``). :meth:`look` returns at most one event per call, in the order they matter:
    a newer trainer joining, the current one leaving, then its next offer."""

    def __init__(self, store: Any, prefix: str, manifest_json: str) -> None:
        self.store = store
        self.keys = Keys(prefix)
        store.set(self.keys.manifest(), manifest_json)
        self.epoch = 0  # the epoch joined (0: none)
        self.seen = 0  # the newest epoch looked at
        self.seq = 1  # the next offer expected from the current epoch

    def newest_epoch(self) -> int:
        return int(self.store.add(self.keys.epoch(), 0))

    def look(self) -> Optional[Tuple[str, Any]]:
        """``("join", epoch)``, ``("leave", epoch)``, ``("offer", Offer)`` or ``None``."""
        newest = self.newest_epoch()
        if newest > self.seen and has(self.store, self.keys.join(newest)):
            self.seen = newest
            return ("join", newest)
        if self.epoch:
            if has(self.store, self.keys.leave(self.epoch)):
                return ("leave", self.epoch)
            key = self.keys.offer(self.epoch, self.seq)
            if has(self.store, key):
                return ("offer", Offer(self.epoch, self.seq, int(read(self.store, key))))
        return None

    def joined(self, epoch: int, last: int) -> None:
        self.epoch, self.seq = epoch, 1
        self.store.set(self.keys.joined(epoch), json.dumps({"last": last}))

    def ready(self, offer: Offer, ranges: Sequence[Range]) -> None:
        self.store.set(
            self.keys.ready(offer.epoch, offer.seq), json.dumps({"ranges": [list(r) for r in ranges]})
        )
        self.seq = offer.seq + 1

    def refuse(self, offer: Offer, reason: str) -> None:
        self.store.set(self.keys.ready(offer.epoch, offer.seq), json.dumps({"refused": reason}))
        self.seq = offer.seq + 1

    def done(self, offer: Offer, outcome: str) -> None:
        self.store.set(self.keys.done(offer.epoch, offer.seq), outcome)

    def drop(self, epoch: int, reason: str) -> None:
        """The engine gave epoch ``epoch`` up (its communicator is aborted)."""
        self.store.set(self.keys.dropped(epoch), reason)
        if self.epoch == epoch:
            self.epoch = 0


class TrainerControl:
    """The trainer's side: blocking calls with deadlines."""

    def __init__(self, store: Any, prefix: str, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store = store
        self.keys = Keys(prefix)
        self.epoch = 0
        self.seq = 1
        self._clock, self._sleep = clock, sleep

    def _wait(self, key: str, deadline: Optional[float], what: str) -> Tuple[str, str]:
        abandon = [self.keys.dropped(self.epoch)] if self.epoch else []
        return wait_key(self.store, key, deadline, what, abandon=abandon, clock=self._clock,
                        sleep=self._sleep)

    def manifest(self, deadline: Optional[float]) -> str:
        return self._wait(self.keys.manifest(), deadline, "the engine's manifest")[1]

    def join(self, info: str = "{}") -> int:
        self.epoch = int(self.store.add(self.keys.epoch(), 1))
        self.seq = 1
        self.store.set(self.keys.join(self.epoch), info)
        return self.epoch

    def dropped(self) -> Optional[str]:
        key = self.keys.dropped(self.epoch)
        return read(self.store, key) if self.epoch and has(self.store, key) else None

    def wait_joined(self, deadline: Optional[float]) -> int:
        """The engine's last committed version once it is connected to this epoch."""
        key, value = self._wait(self.keys.joined(self.epoch), deadline, "the engine to join")
        if key != self.keys.joined(self.epoch):
            raise ConnectionError(f"the engine dropped this trainer: {value}")
        return int(json.loads(value)["last"])

    def offer(self, version: int) -> int:
        seq = self.seq
        self.store.set(self.keys.offer(self.epoch, seq), str(int(version)))
        self.seq += 1
        return seq

    def wait_ready(self, seq: int, deadline: Optional[float]) -> Tuple[Optional[List[Range]], str]:
        """(ranges, "") once the engine enqueued its receives, or (None, reason) refused."""
        key, value = self._wait(self.keys.ready(self.epoch, seq), deadline,
                                "the engine to free a weight set and enqueue its receives")
        if key != self.keys.ready(self.epoch, seq):
            raise ConnectionError(f"the engine dropped this trainer: {value}")
        answer = json.loads(value)
        if "refused" in answer:
            return None, str(answer["refused"])
        return [(int(s), int(e)) for s, e in answer["ranges"]], ""

    def wait_done(self, seq: int, deadline: Optional[float]) -> str:
        key, value = self._wait(self.keys.done(self.epoch, seq), deadline,
                                "the engine to confirm the transfer")
        if key != self.keys.done(self.epoch, seq):
            raise ConnectionError(f"the engine dropped this trainer: {value}")
        return value

    def leave(self) -> None:
        if self.epoch:
            self.store.set(self.keys.leave(self.epoch), "bye")
