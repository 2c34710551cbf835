"""Weight publishing between processes (RL post-training): the trainer writes new weights
straight into the engine's spare weight sets, the engine binds them with one remap.

::

    # engine process (serves with CUDA graphs captured over region "weights")
    engine = stablebuf.publish.Engine("weights", "/tmp/engine.sock", model)   # 2 spare sets
    while serving:
        status = engine.poll()   # at a step boundary: binds the newest committed version
        for problem in status.problems:
            log.warning(problem)  # never raised: the engine serves on
        graph.replay()

    # trainer process, on the engine's GPU
    trainer = stablebuf.publish.Trainer.connect("/tmp/engine.sock", expect=model.state_dict())
    trainer.publish(model.state_dict(), version=step)   # copy (casting), sync, commit

How it works: the engine makes ``sets`` exportable weight sets of its region and offers them
over a Unix socket (the file descriptors ride along), with a manifest (tensor name → offset,
shape, stride, dtype). The trainer imports every set on its device (the engine's GPU, or
another one given peer access with ``access=``), maps it read-write and builds ordinary torch
tensors over it (zero-copy: ``torch.from_dlpack`` of a capsule built in Rust). To publish it
takes a set the engine has released, copies its weights in, synchronises, and commits the
version. ``Engine.poll`` binds the newest committed set (its graphs replay on it from the next
replay) and releases the set it replaced back to the trainer: with two sets that is a double
buffer, and the trainer never writes the bound set.

Guarantees: a set is bound only after its commit, and a commit is sent only after the writes
are done; a trainer that dies mid-write leaves the engine serving what it had bound, and its
half-written set goes back to the next trainer. Every set the engine does not bind, keep for
a rollback or hold waiting goes back to the trainer, a refused one included. One trainer per
engine: a second is refused; a trainer publishes to several engines with one :class:`Trainer`
each. The engine's serving calls (:meth:`Engine.poll`, :meth:`Engine.rollback`) return a
:class:`PollStatus` and raise only for misuse; the trainer's calls raise subclasses of
:class:`stablebuf.Error`, after which both sides are as they were.

Tensor parallelism: one engine per rank, each with its own trainer (the trainer's rank that
holds the same shard, on the engine's GPU), and ``group=`` a ``torch.distributed`` group of
the engines' ranks (a gloo group keeps the agreement off the GPU and beside the step:
``dist.new_group(backend="gloo")``). Every rank calls :meth:`Engine.poll` at the same step
boundary; a version is then bound on every rank at that boundary or on none
(:mod:`stablebuf._switcher` says how), so no step ever mixes two versions across ranks. The
ranks agree at every ``agree_every``-th boundary (default 8); the boundaries between cost
next to nothing, and a version every rank has is bound within ``2 * agree_every`` boundaries.
``keep_previous=True`` keeps the version bound before the last switch for
:meth:`Engine.rollback` (one bind): one more set, so ``sets`` is at least 3.
"""

from __future__ import annotations

import contextlib
import math
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import _guard, _native, _sleep
from ._devices import cuda_torch, device_of, stream_of
from ._manifest import Entry, Manifest, VersionBook, dtype_name
from ._native import (
    OfferMismatch,
    PeerClosed,
    PublishError,
    PublishTimeout,
    VersionConflict,
    WeightSet,
)
from ._share import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_COPY_STREAMS,
    SharePacer,
    crosses_devices,
    write_shared,
)
from ._switcher import (
    DEFAULT_AGREE_EVERY,
    StartMin,
    Switch,
    SwitchFailed,
    VersionSwitcher,
    check_agree_every,
)

#: The manifest differs from what the trainer expects (an :class:`OfferMismatch`).
ManifestMismatch = OfferMismatch

__all__ = [
    "Engine",
    "Manifest",
    "ManifestMismatch",
    "OfferMismatch",
    "PeerClosed",
    "PollStatus",
    "PublishError",
    "PublishTimeout",
    "RemoteEngine",
    "RemoteTrainer",
    "Trainer",
    "VersionConflict",
]

#: How long the waiting loops sleep between looks at the socket.
_POLL_SECONDS = 0.0002


def _tensors_of(source: Any) -> Dict[str, Any]:
    """``name → tensor`` of a module (its state dict, tied weights included) or a mapping."""
    if hasattr(source, "state_dict") and callable(source.state_dict):
        return dict(source.state_dict(keep_vars=True))
    return dict(source)


def manifest_entries(tag: str, base: int, named: Mapping[str, Any]) -> List[Entry]:
    """The manifest entries of ``named`` tensors, which must all live in region ``tag`` (whose
    addresses start at ``base``)."""
    entries = []
    for name, t in named.items():
        if _native.owner(int(t.data_ptr())) != tag and t.numel() > 0:
            raise ValueError(
                f"tensor `{name}` is not in region `{tag}`: allocate the model inside "
                f"`with stablebuf.region({tag!r}):`"
            )
        entries.append(
            Entry(
                name,
                int(t.data_ptr()) - base if t.numel() > 0 else 0,  # empty: no address
                tuple(t.shape),
                tuple(t.stride()),
                dtype_name(t.dtype),
            )
        )
    return entries


def _entries_of(tag: str, named: Mapping[str, Any]) -> List[Entry]:
    """The manifest entries of ``named`` (name → tensor), every one in region ``tag``."""
    return manifest_entries(tag, _native.region_base(tag), named)


def torch_start_min(group: Any) -> StartMin:
    """Starts the element-wise minimum of a few integers over ``group`` (a
    ``torch.distributed`` process group), as :class:`~stablebuf._switcher.VersionSwitcher`
    asks for it. On a gloo group it runs on the host, in gloo's own threads, while the caller
    goes on (a serving loop's step); on any other backend (NCCL) it runs on the current
    device and is waited for at once, which waits for that device's queued work too.

    On the host each reduction runs in a CPU tensor over a buffer of this function's own
    (``torch.frombuffer`` over an ``array``: no tensor built from a list, no ``tolist``), which
    is used again once its answer is read: a reduction still in flight keeps its own."""
    torch = cuda_torch()
    import torch.distributed as dist

    all_reduce, minimum = dist.all_reduce, dist.ReduceOp.MIN
    if dist.get_backend(group) != "gloo":

        def start_on_device(values: Sequence[int]) -> Callable[[], List[int]]:
            device = torch.device("cuda", torch.cuda.current_device())
            t = torch.tensor(list(values), dtype=torch.int64, device=device)
            all_reduce(t, op=minimum, group=group)
            done = [int(v) for v in t.tolist()]
            return lambda: done

        return start_on_device

    # Per length, the buffers whose reductions were read (free to use again).
    free: Dict[int, List[Tuple[Any, Any]]] = {}

    def start_on_host(values: Sequence[int]) -> Callable[[], List[int]]:
        n = len(values)
        spare = free.get(n)
        if spare:
            buffer, t = spare.pop()
            buffer[:] = array("q", values)
        else:
            buffer = array("q", values)
            t = torch.frombuffer(buffer, dtype=torch.int64)  # shares buffer's memory
        work = all_reduce(t, op=minimum, group=group, async_op=True)
        answer: List[int] = []

        def result() -> List[int]:
            if not answer:
                work.wait()  # raises when the group broke: the buffer is then never used again
                answer.extend(buffer.tolist())
                free.setdefault(n, []).append((buffer, t))  # done: it may carry the next one
            return list(answer)

        return result

    return start_on_host


def _wait_for_message(channel: Any, deadline: Optional[float], what: str) -> None:
    while not channel.message_waiting():
        if deadline is not None and time.monotonic() > deadline:
            raise PublishTimeout(f"nothing arrived while waiting for {what}")
        time.sleep(_POLL_SECONDS)


def choose_writer(
    device: int, access: Optional[Sequence[int]], current: int, writer: Optional[int] = None
) -> int:
    """The device whose streams write a trainer's imported sets (its views of them live there):
    ``writer`` when given, else the ``current`` device when it may write them, else ``device``
    (where they were imported). A device may write them when it is ``device`` or in
    ``access``; a ``writer`` that may not is a ``ValueError``.

    Why it matters: a trainer on GPU 0 writing sets of an engine on GPU 1 over NVLink. With
    views on GPU 1, every ``copy_`` from GPU 0 is a copy between devices, which PyTorch fences
    per tensor against the trainer's queue on GPU 1 (:func:`stablebuf._share.crosses_devices`):
    the tensors go one at a time, each waiting for GPU 1, busy serving, to take the trainer's
    turn. With views on GPU 0 (the set is mapped for it) every copy is an ordinary copy on
    GPU 0's stream, queued at once, and GPU 1 sees only the bytes arriving."""
    allowed = {int(device)} | {int(d) for d in (access or ())}
    if writer is not None:
        if int(writer) not in allowed:
            raise ValueError(
                f"writer={writer}: the sets are mapped for devices {sorted(allowed)} only "
                f"(pass it in access=[{int(device)}, {int(writer)}])"
            )
        return int(writer)
    return int(current) if int(current) in allowed else int(device)


def _flat_on(torch: Any, imported: Any, device: int) -> Any:
    """A one-dimensional ``uint8`` tensor over the whole of ``imported`` (zero-copy, keeping it
    alive), on CUDA device ``device``: ``imported``'s own, or a peer its mapping grants access to
    (``access=``), which the extension exports it as (``__dlpack__(dl_device=...)``; a
    ``BufferError`` for any other device)."""
    kind, own = imported.__dlpack_device__()
    if int(device) == int(own):
        return torch.from_dlpack(imported)
    return torch.from_dlpack(imported.__dlpack__(dl_device=(kind, int(device))))


def _views_over(torch: Any, flat: Any, manifest: Manifest) -> Dict[str, Any]:
    """``name -> tensor`` over the flat ``uint8`` tensor ``flat`` laid out as ``manifest``
    says (zero-copy views)."""
    views = {}
    for e in manifest.entries:
        dtype = getattr(torch, e.dtype)
        piece = flat[e.offset : e.offset + max(e.span, 0)]
        typed = piece.view(dtype) if e.span else torch.empty(0, dtype=dtype, device=flat.device)
        views[e.name] = typed.as_strided(e.shape, e.stride) if e.span else typed.reshape(e.shape)
    return views


#: The page a weight set is mapped with (its allocation granularity): where a twin's write
#: over several copy streams cuts it.
TRANSLATION_PAGE = 2 << 20


_Cut = Tuple[Dict[str, Any], Dict[str, Any]]  # (views, weights) of one write


def _twin_pieces(target: Any, source: Any, lanes: int) -> _Cut:
    """``(views, weights)`` for a twin's write: the whole flat ``source`` into ``target`` as
    one copy, or, for ``lanes`` above 1, as that many contiguous pieces of about equal size
    (page-aligned cuts), one per copy stream, for links where several copy engines carry more
    than one (NVLink on 2 x H200 does not: see ``DEFAULT_COPY_STREAMS``)."""
    n = int(source.numel())
    lanes = max(1, min(int(lanes), -(-n // TRANSLATION_PAGE)))
    if lanes == 1:
        return {"twin": target}, {"twin": source}
    piece = -(-n // lanes // TRANSLATION_PAGE) * TRANSLATION_PAGE
    views, weights = {}, {}
    for i, lo in enumerate(range(0, n, piece)):
        hi = min(n, lo + piece)
        views[f"twin.{i}"], weights[f"twin.{i}"] = target[lo:hi], source[lo:hi]
    return views, weights


class _GpuSpan:
    """The GPU time from :meth:`start` to :meth:`stop` on the current stream of ``device`` (as
    it is at :meth:`start`), with two timing events made once and reused; ``seconds()`` once
    both are done, ``nan`` where it cannot tell."""

    def __init__(self, torch: Any, device: int) -> None:
        self._torch, self._device = torch, device
        self._stream = None
        try:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        except Exception:  # noqa: BLE001 - timing is a report, never a reason to fail
            self._events = None

    def start(self) -> None:
        if self._events is not None:
            self._stream = self._torch.cuda.current_stream(self._device)
            self._events[0].record(self._stream)

    def stop(self) -> None:
        if self._events is not None and self._stream is not None:
            self._events[1].record(self._stream)

    def seconds(self) -> float:
        if self._events is None:
            return math.nan
        try:
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        except Exception:  # noqa: BLE001
            return math.nan


class _NoSpan:
    """:class:`_GpuSpan` when nothing is timed on the GPU."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def seconds(self) -> float:
        return math.nan


_NO_SPAN = _NoSpan()


@dataclass(frozen=True)
class PollStatus:
    """What one :meth:`Engine.poll` or :meth:`Engine.rollback` did, and where the engine
    stands after it. Nothing a peer (the trainer, another rank) does makes those calls raise:
    it shows here.

    - ``version``: the version bound now (0: the weights the engine started with). With a
      group, the same on every rank while ``group_in_step``.
    - ``bound``: the version this call bound (a switch, or the version a rollback went back
      to), else ``None``. Equal on every rank of a group.
    - ``refused``: the versions refused at this call because a bind failed (here or, with a
      group, on another rank). Every rank is still on ``version``, and each refused version's
      set (with every older one waiting) went back to the trainer on every rank; the trainer
      publishes a newer version when it has one. Equal on every rank of a group.
    - ``trainer_connected``: whether a trainer is connected after this call.
    - ``group_in_step``: whether this rank serves the version its group serves and can switch
      with it (always ``True`` without a group). ``False`` after a group reduction raised (a
      rank died, say) or after this rank could not bind its old set back when the group
      refused a version: it then serves on but switches no more, hands every set that arrives
      back to its trainer, and the caller has to rebuild the group.
    - ``problems``: what went wrong since the last poll, one sentence each, for a log: a
      refused version or rollback, a trainer that went away or was dropped (a version not
      newer, a set it may not write), a failed handshake, a lost group. Empty: all went well.
    """

    version: int
    bound: Optional[int] = None
    refused: Tuple[int, ...] = ()
    trainer_connected: bool = False
    group_in_step: bool = True
    problems: Tuple[str, ...] = ()


def refuse_trainer(channel: Any, reason: str) -> None:
    """Tells a trainer that connected why it is refused (if it still listens) and closes its
    channel: one writer per set."""
    with contextlib.suppress(PublishError):
        channel.send("reject", reason=reason)
    channel.close()


class Engine:
    """The serving side: owns region ``tag`` and ``sets`` spare weight sets, exported to one
    trainer at a time through the Unix socket ``path``.

    ``tensors`` is the model (its ``state_dict``) or a mapping name → tensor; every tensor must
    live in the region. ``sets`` must be at least 2 (a double buffer): the trainer writes one
    while the engine serves the other; 3 with ``keep_previous`` (the version before the last
    switch stays resident for :meth:`rollback`). Each set is one more copy of the weights in
    device memory.

    ``group``: the ``torch.distributed`` group of the tensor-parallel ranks' engines (gloo:
    the agreement then runs on the host, beside the step); every switch and rollback is then
    made on every rank or on none, and every rank must call :meth:`poll`, :meth:`rollback`,
    :meth:`sleep` and :meth:`wake` at the same step boundary. The ranks agree at every
    ``agree_every``-th call of :meth:`poll` (an agreement boundary; default
    :data:`~stablebuf._switcher.DEFAULT_AGREE_EVERY`, 8): there they collect the all-reduce
    started at the agreement boundary before, bind what it found, read the trainer's messages
    and start the next; the boundaries between only count themselves (no collective, no native
    call, no message read: a commit, a connecting or departed trainer is taken at the next
    agreement boundary). A version every rank has is bound within ``2 * agree_every``
    boundaries, on every rank at the same one; ``agree_every=1`` agrees at every boundary (a
    switch two boundaries after every rank has the version, for the whole agreement's cost at
    every step). A :meth:`rollback` is an agreement boundary of its own. Without a group,
    ``agree_every`` is unused: every :meth:`poll` binds the newest commit.

    :meth:`poll` and :meth:`rollback` return a :class:`PollStatus` and raise only for misuse
    (a closed engine; a rollback asleep or without ``keep_previous``): a serving loop logs
    ``status.problems`` and goes on serving.
    """

    #: Seconds a connecting trainer has to import the sets before it is dropped.
    handshake_timeout = 60.0

    def __init__(
        self,
        tag: str,
        path: str,
        tensors: Any,
        *,
        sets: int = 2,
        keep_previous: bool = False,
        group: Any = None,
        agree_every: int = DEFAULT_AGREE_EVERY,
    ) -> None:
        if sets < 2 + keep_previous:
            raise ValueError(
                f"sets={sets}: at least {2 + keep_previous} (the trainer writes one, the engine "
                "serves one" + (", and keeps the previous version)" if keep_previous else ")")
            )
        check_agree_every(agree_every)  # before anything is made
        torch = cuda_torch()
        self.tag = tag
        base = _native.region_base(tag)
        entries = manifest_entries(tag, base, _tensors_of(tensors))
        # The region's device, whichever is current: its stream orders the snapshots' copies.
        torch.cuda.current_stream(device_of(tag)).synchronize()
        self._sets: List[WeightSet] = [
            _native.snapshot_shareable(tag, stream_of(tag)) for _ in range(sets)
        ]
        self.manifest = Manifest.build(tag, self._sets[0].nbytes, sets, entries)
        self._by_id = {ws.id: ws for ws in self._sets}
        self._listener = _native.PublishListener(path)
        self._channel: Optional[Any] = None
        self._versions = VersionBook()
        self._group = group
        # Committed, bound and kept sets, and the group's agreement on each switch. Before the
        # first switch the region's own backing is bound (`bound` is None): asked for only
        # when a rollback or a refused switch needs it back.
        self._switcher = VersionSwitcher(
            lambda: _native.bound(tag),
            keep_previous=keep_previous,
            start_min=None if group is None else torch_start_min(group),
            agree_every=agree_every,
        )
        self._asleep = False
        self._closed = False
        # What went wrong outside poll (accept, wait_for_commit, wake): the next poll says it.
        self._unreported: List[str] = []
        # What a group's poll between agreement boundaries returns (built once, reused).
        self._quiet: Optional[PollStatus] = None

    # ----------------------------------------------------------------- state

    @property
    def path(self) -> str:
        return self._listener.path

    @property
    def version(self) -> int:
        """The version bound now (0: the weights the engine started with)."""
        return self._switcher.version

    @property
    def agree_every(self) -> int:
        """With a group: the ranks agree at every ``agree_every``-th boundary."""
        return self._switcher.agree_every

    @property
    def connected(self) -> bool:
        """Whether a trainer is connected."""
        return self._channel is not None

    @property
    def weight_sets(self) -> List[WeightSet]:
        return list(self._sets)

    @property
    def bound_set(self) -> Optional[WeightSet]:
        """The spare set bound now, or ``None`` while the region's own backing is."""
        bound = self._switcher.bound
        return bound if bound is not None and self._is_spare(bound) else None

    @property
    def ready_versions(self) -> List[int]:
        """Committed versions not bound yet (a group binds one once every rank has it)."""
        return sorted(self._switcher.ready)

    @property
    def last_committed(self) -> int:
        """The newest version a trainer committed to this engine (0: none yet)."""
        return self._versions.last

    @property
    def previous_version(self) -> Optional[int]:
        """The version :meth:`rollback` would bind (``None``: none kept)."""
        previous = self._switcher.previous
        return None if previous is None else previous[1]

    def _is_spare(self, weight_set: Any) -> bool:
        """Whether ``weight_set`` is one of the sets offered to trainers (not the region's own
        backing)."""
        return self._by_id.get(getattr(weight_set, "id", None)) is weight_set

    def _check_open(self) -> None:
        if self._closed:
            raise PublishError(f"engine `{self.tag}` is closed")

    # ----------------------------------------------------------------- trainer connection

    def accept(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (forever with ``None``) for a trainer and hands it
        the manifest and the sets. Returns whether one is connected (a failed handshake is
        among the next :meth:`poll`'s problems)."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._accept_pending(self._unreported)
            if self._channel is not None:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(_POLL_SECONDS * 10)

    def wait_for_commit(self, version: int, timeout: Optional[float] = 30.0) -> bool:
        """Reads the trainer's messages (accepting one if none is connected) until ``version``
        or a newer one is committed, or ``timeout`` seconds pass (forever with ``None``).
        Binds nothing and talks to no other rank, so it is safe asleep and in a group: for a
        colocated loop that learns of a publish from elsewhere and must not wake before its
        commit is here. Returns whether it arrived."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._read_trainer(self._unreported)
            if self._versions.last >= version:
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(_POLL_SECONDS)

    def _accept_pending(self, problems: List[str]) -> None:
        while True:
            channel = self._listener.accept()
            if channel is None:
                return
            if self._channel is not None:
                # One writer per set: a second trainer could write the set the first one is
                # writing. Refuse it, clearly.
                refuse_trainer(
                    channel,
                    f"engine `{self.tag}` already has a trainer: one trainer per engine (a "
                    "trainer publishes to several engines with one Trainer each)",
                )
                continue
            try:
                self._handshake(channel)
            except PublishError as error:  # PeerClosed, OfferMismatch, PublishTimeout included
                problems.append(f"a trainer's handshake failed: {type(error).__name__}: {error}")

    def _handshake(self, channel: Any) -> None:
        deadline = time.monotonic() + self.handshake_timeout
        try:
            channel.send_manifest(self.manifest.with_published(self._versions.last).to_json())
            for ws in self._sets:
                channel.offer(ws, self.manifest.fingerprint)
            for ws in self._sets:
                # A trainer that never answers must not hang the serving loop.
                _wait_for_message(channel, deadline, "the trainer to import the weight sets")
                channel.wait_ack(ws.id)
            held = {id(h) for h in self._switcher.held()}
            for ws in self._sets:
                if id(ws) not in held:
                    channel.send("released", set=ws.id)
        except PublishError:
            channel.close()
            raise
        self._channel = channel

    def _drop_trainer(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # ----------------------------------------------------------------- serving

    def poll(self) -> PollStatus:
        """Call at every step boundary; never blocks for long and never raises for what a peer
        did. Accepts a trainer, takes its commits, and binds the newest committed version (one
        remap; the region's graphs replay on it from the next replay). Returns a
        :class:`PollStatus`: the version bound now, the version this call bound, the versions
        refused, the trainer's and the group's state, and what went wrong.

        With a ``group``, every rank calls it at the same boundary; a version is bound once
        every rank has it (at the agreement boundary after the one that found that), on every
        rank or on none. Between agreement boundaries (every ``agree_every``-th call) it only
        counts the boundary and returns the same status as the last quiet one: nothing read,
        nothing started. At one it waits only for the group's answer to the offers of the
        agreement boundary before, which is there unless another rank has not reached that
        boundary yet. The engine keeps serving what it had bound whatever the trainer does (goes
        away, commits a version not newer, dies mid-write).

        Raises :class:`PublishError` only on a closed engine."""
        if self._closed:
            raise PublishError(f"engine `{self.tag}` is closed")
        if not self._asleep and not self._unreported and self._switcher.pass_boundary():
            # A group's boundary between agreement boundaries: nothing is due, nothing to say.
            quiet = self._quiet
            if quiet is None or quiet.trainer_connected is not (self._channel is not None):
                quiet = self._quiet = self._quiet_status()
            return quiet
        problems, self._unreported = self._unreported, []
        self._read_trainer(problems)
        switch = Switch()
        if not self._asleep:
            switch = self._switcher.step(self._bind)
        elif self._group is None:
            # Asleep, the newest commit waits for the wake; older ones go back to the trainer,
            # which may go on publishing. (A group keeps them: a rank may lack the newest.)
            switch = Switch(None, self._switcher.keep_newest())
        return self._status(switch, problems)

    def rollback(self) -> PollStatus:
        """Binds the version bound before the last switch again (one remap; with a
        ``group``, on every rank or on none, every rank calling it at the same boundary in
        place of :meth:`poll`). One step back only: ``status.bound`` is the version gone back
        to, or ``None`` with the reason in ``status.problems`` (none kept, a bind failed). The
        set left goes back to the trainer; versions committed since stay ready, and a later
        :meth:`poll` binds the newest of them, so stop the trainer first to stay on the old
        version.

        Raises :class:`PublishError` (misuse) without ``keep_previous=True``, asleep, or on a
        closed engine."""
        self._check_open()
        if self._asleep:
            raise PublishError(f"engine `{self.tag}` is asleep: wake it before a rollback")
        try:
            switch = self._switcher.rollback(self._bind)
        except SwitchFailed as misuse:
            raise PublishError(str(misuse)) from None
        problems, self._unreported = self._unreported, []
        return self._status(switch, problems)

    def _quiet_status(self) -> PollStatus:
        """Where the engine stands, with nothing bound, refused or said."""
        return PollStatus(
            version=self._switcher.version,
            trainer_connected=self._channel is not None,
            group_in_step=self._switcher.in_step,
        )

    def _status(self, switch: Switch, problems: List[str]) -> PollStatus:
        self._quiet = None  # the version or the group's state may have changed
        self._apply(switch, problems)
        if switch.problem is not None:
            problems.append(switch.problem)
        return PollStatus(
            version=self._switcher.version,
            bound=switch.version,
            refused=tuple(switch.refused),
            trainer_connected=self._channel is not None,
            group_in_step=self._switcher.in_step,
            problems=tuple(problems),
        )

    def _read_trainer(self, problems: List[str]) -> None:
        """Accepts a waiting trainer and takes every message it sent; what goes wrong is added
        to ``problems`` (the trainer is dropped where it can no longer be trusted)."""
        self._accept_pending(problems)
        while self._channel is not None and self._channel.message_waiting():
            try:
                self._take_message()
            except PublishError as error:  # PeerClosed and VersionConflict included
                problems.append(f"{type(error).__name__}: {error}")

    def _take_message(self) -> None:
        """Takes one message from the trainer; a commit becomes a ready version."""
        channel = self._channel
        try:
            kind, set_id, version, reason = channel.receive()
        except PeerClosed as closed:
            self._drop_trainer()
            raise PeerClosed(
                f"the trainer went away ({closed}); the engine keeps serving version "
                f"{self.version}, and a new trainer may connect"
            ) from None
        if kind == "commit":
            self._on_commit(set_id, version)
        elif kind == "reject":
            self._drop_trainer()
            raise PublishError(f"the trainer refused: {reason}")
        else:
            self._drop_trainer()
            raise PublishError(f"protocol: a `{kind}` message from the trainer")

    def _on_commit(self, set_id: int, version: int) -> None:
        ws = self._by_id.get(set_id)
        if ws is None or any(ws is held for held in self._switcher.held()):
            self._drop_trainer()
            raise PublishError(
                f"the trainer committed set {set_id}, which it may not write: it was dropped"
            )
        problem = self._versions.problem(version)
        if problem is not None:
            self._channel.send("released", set=set_id)  # the trainer may write it again
            raise VersionConflict(f"{problem}: the set went back to the trainer")
        self._versions.advance(version)
        self._switcher.committed(ws, version)

    def _bind(self, weight_set: Any) -> None:
        with _guard.REMAPS:  # never between another thread's check and launch
            _native.bind(self.tag, weight_set)

    def _wake_onto(self, weight_set: Any) -> None:
        with _guard.REMAPS:
            _native.wake_onto(self.tag, weight_set)

    def _apply(self, switch: Switch, problems: List[str]) -> None:
        """Hands the sets a switch released back to the trainer."""
        for weight_set in switch.released:
            if self._channel is None:
                break  # the next trainer gets every set the engine does not hold
            if self._is_spare(weight_set):
                try:
                    self._channel.send("released", set=weight_set.id)
                except PeerClosed as closed:
                    self._drop_trainer()
                    problems.append(f"PeerClosed: the trainer went away ({closed})")

    # ----------------------------------------------------------------- colocation

    def sleep(self) -> None:
        """Releases the region's memory (discarding it) while the trainer trains; the spare
        sets stay resident for the trainer to write."""
        self._check_open()
        _sleep.sleep(self.tag, keep=False)
        self._asleep = True

    def wake(self) -> int:
        """Wakes onto the newest committed set (one mapping, no copy), else onto the set bound
        before the sleep; returns the version now bound. Reads the trainer's messages first
        (to be sure a publish made before the call is seen, call :meth:`wait_for_commit`).
        With a ``group`` it wakes onto the set bound before the sleep, and a later
        :meth:`poll` switches on every rank together.

        Raises :class:`PublishError` when waking onto the newest commit failed and the
        engine's own weights were discarded by the sleep: its set went back to the trainer,
        the engine is still asleep; publish again and wake."""
        self._check_open()
        self._read_trainer(self._unreported)
        if not self._asleep:
            return self.version
        switcher = self._switcher
        if self._group is None and switcher.ready:
            # The region's own backing was discarded by the sleep: neither kept nor handed back.
            switch = switcher.step(self._wake_onto, before_is_gone=switcher.bound is None)
            self._apply(switch, self._unreported)
            if switch.version is not None:
                self._asleep = False
                return self.version
            if switcher.bound is None:
                raise PublishError(
                    f"{switch.problem}; the engine's own weights were discarded by the sleep, so "
                    "it stays asleep: publish again and wake"
                )
            self._unreported.append(f"{switch.problem}; woke onto the set bound before the sleep")
        if switcher.bound is not None:
            self._wake_onto(switcher.bound)
        else:
            _sleep.wake(self.tag)  # the region's own backing: its contents were discarded
        self._asleep = False
        return self.version

    def close(self) -> None:
        """Disconnects the trainer and stops listening (the sets stay bound or held)."""
        self._drop_trainer()
        self._listener.close()
        self._closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Trainer:
    """The training side of one engine: its weight sets imported and mapped, as torch tensors.

    Use :meth:`connect`. :meth:`publish` writes a state dict (casting to the engine's dtypes)
    into a free set and commits it; :meth:`writing` gives the tensors of a free set to fill
    yourself."""

    def __init__(
        self,
        channel: Any,
        manifest: Manifest,
        sets: Sequence[Any],
        torch: Any,
        writer: Optional[int] = None,
    ) -> None:
        self._channel = channel
        self.manifest = manifest
        self._sets = {imported.set_id: imported for imported in sets}
        self._torch = torch
        #: The device whose streams write the sets (their views live there): see
        #: :func:`choose_writer`. ``None``: each set's own device.
        self.writer = writer
        #: Where the last :meth:`publish` spent its time (seconds) and what it did:
        #: ``acquire_s``, ``issue_s`` (queuing the copies), ``wait_s`` (waiting for them:
        #: the chunks' synchronisations and the last one), ``gpu_s`` (first copy to last on
        #: the writer's stream, pauses included; ``nan`` unless :attr:`gpu_timing`),
        #: ``paused_s``, ``commit_s``, ``check_s`` (the names, shapes and version checked),
        #: ``prepare_s`` (the views cut), ``total_s`` (from the checks to the commit);
        #: ``chunks``, ``copies``, ``cross_device`` (copies between two devices: see
        #: :func:`stablebuf._share.crosses_devices`), ``bytes``, ``writer``, ``set_device``.
        self.last_write: Dict[str, float] = {}
        self._bytes = sum(math.prod(e.shape) * e.itemsize for e in manifest.entries)
        self._views: Dict[int, Dict[str, Any]] = {}
        self._free: List[int] = []
        # Versions continue after what the engine has taken (from an earlier trainer, say).
        self._versions = VersionBook(manifest.published)
        #: ``time.monotonic_ns()`` just before the last commit was sent (0: none yet), to time
        #: a publish against the engine's clock (the same clock in every process of a host).
        self.last_commit_at_ns = 0
        #: Streams a full-speed write (share 1) spreads its copies over
        #: (:func:`stablebuf._share.write_shared`); 1: the current stream alone.
        self.copy_streams = DEFAULT_COPY_STREAMS
        self._lanes: Dict[int, List[Any]] = {}  # device -> its copy streams, made on first use
        # (device, flat buffer, its views): see twin().
        self._twin: Optional[Tuple[int, Any, Dict[str, Any]]] = None
        # set id -> the whole set as one uint8 tensor on the writer (DLPack is built once).
        self._flats: Dict[int, Any] = {}
        # (set id, pieces) -> (the twin flat they were cut for, (views, weights)) of a twin's
        # write: cut once, not per publish.
        self._twin_cuts: Dict[Tuple[int, int], Tuple[Any, _Cut]] = {}
        self._spans: Dict[int, _GpuSpan] = {}  # writer device -> its write's timing events
        #: Time each write on the GPU (two timing events around it: ``gpu_s`` in
        #: :attr:`last_write`, ``nan`` when off). Off by default: on 2 x H200 the events
        #: around a 1 GiB copy over NVLink cost it 3% (0.08 ms).
        self.gpu_timing = False

    def _copy_lanes(self) -> List[Any]:
        if self.copy_streams < 2:
            return []
        device = self._torch.cuda.current_device()
        lanes = self._lanes.get(device)
        if lanes is None or len(lanes) != self.copy_streams:
            lanes = [self._torch.cuda.Stream(device) for _ in range(self.copy_streams)]
            self._lanes[device] = lanes
        return lanes

    @classmethod
    def connect(
        cls,
        path: str,
        *,
        expect: Optional[Mapping[str, Any]] = None,
        check_dtypes: bool = False,
        device: Optional[int] = None,
        access: Optional[Sequence[int]] = None,
        timeout: Optional[float] = 30.0,
        writer: Optional[int] = None,
    ) -> "Trainer":
        """Connects to the engine at ``path`` (retrying until ``timeout``), receives its
        manifest and imports its sets on ``device`` (default: the current device; it must be
        the engine's GPU, else :class:`OfferMismatch`: a tensor-parallel rank's trainer passes
        its engine's GPU). ``access`` adds devices that may write the sets (a peer GPU).

        ``writer``: the device that writes the sets; :meth:`tensors` are views on it. Default:
        the current device when it may write them (it is ``device`` or in ``access``), else
        ``device``. A trainer on GPU 0 publishing to an engine on GPU 1
        (``device=1, access=[1, 0]``, GPU 0 current) thus writes from GPU 0 with copies on
        one device, at the link's speed, and queues nothing on the engine's GPU
        (:func:`choose_writer` says why that matters). ``ValueError`` for a ``writer`` the
        sets are not mapped for.

        ``expect`` (name → tensor or ``(shape, dtype)``): raise :class:`OfferMismatch` naming
        the first difference in names or shapes (and dtypes with ``check_dtypes``) before
        anything is imported."""
        torch = cuda_torch()
        current = torch.cuda.current_device()
        if device is None:
            device = current
        writer = choose_writer(device, access, current, writer)  # misuse: before connecting
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                channel = _native.PublishChannel.connect(path)
                break
            except PeerClosed:
                if deadline is not None and time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        imported: List[Any] = []
        try:
            _wait_for_message(channel, deadline, "the engine's manifest")
            try:
                manifest = Manifest.from_json(channel.receive_manifest())
            except ValueError as bad:
                raise PublishError(str(bad)) from None
            problem = (
                None if expect is None else manifest.first_mismatch(expect, dtypes=check_dtypes)
            )
            if problem is not None:
                channel.send("reject", reason=problem)
                raise OfferMismatch(problem)
            for _ in range(manifest.sets):
                _wait_for_message(channel, deadline, "a weight set")
                try:
                    imported.append(
                        channel.receive_set(
                            device,
                            tag=manifest.tag,
                            fingerprint=manifest.fingerprint,
                            nbytes=manifest.nbytes,
                            access=list(access) if access else None,
                        )
                    )
                except OfferMismatch as mismatch:
                    # The extension's message for a set of another GPU says what, not how to
                    # fix it: a trainer that built its weights on its own current device.
                    if "on another device" not in str(mismatch):
                        raise
                    raise OfferMismatch(
                        f"{mismatch}: the sets live on the engine's GPU; import them there "
                        f"(Trainer.connect(..., device=<the engine's GPU>); device {device} was "
                        "asked) and write them from there, or from another GPU with peer access "
                        "on purpose (access=[<the engine's GPU>, <the writing GPU>])"
                    ) from None
        except BaseException:
            channel.close()
            raise
        return cls(channel, manifest, imported, torch, writer)

    # ----------------------------------------------------------------- tensors

    @property
    def set_ids(self) -> List[int]:
        return sorted(self._sets)

    def tensors(self, set_id: int) -> Dict[str, Any]:
        """``name → tensor`` over set ``set_id`` (zero-copy views of the imported memory), on
        the :attr:`writer` device."""
        views = self._views.get(set_id)
        if views is None:
            views = _views_over(self._torch, self._set_flat(set_id), self.manifest)
            self._views[set_id] = views
        return views

    def _flat(self, imported: Any) -> Any:
        """The whole of ``imported`` as one ``uint8`` tensor on the :attr:`writer` device."""
        device = imported.device if self.writer is None else self.writer
        return _flat_on(self._torch, imported, device)

    def _set_flat(self, set_id: int) -> Any:
        """:meth:`_flat` of set ``set_id``, made once (a publish should not pay for DLPack).
        The DLPack is built in Rust over the imported mapping: zero-copy, keeps the set alive,
        and needs no NumPy (torch parses ``__cuda_array_interface__`` with NumPy)."""
        flat = self._flats.get(set_id)
        if flat is None:
            flat = self._flats[set_id] = self._flat(self._sets[set_id])
        return flat

    def _twin_targets(self, set_id: int, lanes: int) -> _Cut:
        """:func:`_twin_pieces` of the twin into set ``set_id``, made once per set and count."""
        flat = self._twin[1]
        cached = self._twin_cuts.get((set_id, lanes))
        if cached is None or cached[0] is not flat:
            cached = (flat, _twin_pieces(self._set_flat(set_id)[: flat.numel()], flat, lanes))
            self._twin_cuts[(set_id, lanes)] = cached
        return cached[1]

    def twin(self, device: Optional[int] = None) -> Dict[str, Any]:
        """``name -> tensor``: the engine's weights laid out as in its weight sets, in one buffer
        of this process on ``device`` (default: the current device), made once and kept.

        Train into these tensors (or gather into them); :meth:`publish` of exactly these
        tensors then writes the whole set with one copy at the link's speed, instead of one
        copy per tensor and the per-tensor checks (on 2 x H200 over NVLink, 1 GiB of Llama
        tensors: one copy 392 GB/s, a copy per tensor 352-360 GB/s). Costs one more copy of
        the weights in the trainer's memory only where the trainer would otherwise keep its
        own."""
        torch = self._torch
        if device is None:
            device = torch.cuda.current_device()
        if self._twin is None or self._twin[0] != int(device):
            end = max((e.offset + e.span for e in self.manifest.entries), default=0)
            flat = torch.empty(end, dtype=torch.uint8, device=f"cuda:{int(device)}")
            self._twin = (int(device), flat, _views_over(torch, flat, self.manifest))
        return dict(self._twin[2])

    def _is_twin(self, weights: Mapping[str, Any]) -> bool:
        """Whether ``weights`` are exactly :meth:`twin`'s tensors (the same objects)."""
        if self._twin is None:
            return False
        views = self._twin[2]
        return len(weights) == len(views) and all(
            views.get(name) is tensor for name, tensor in weights.items()
        )

    # ----------------------------------------------------------------- publishing

    @property
    def version(self) -> int:
        """The last version committed."""
        return self._versions.last

    def _drain(self) -> None:
        while self._channel.message_waiting():
            kind, set_id, _, reason = self._channel.receive()
            if kind == "released" and set_id in self._sets:
                if set_id not in self._free:
                    self._free.append(set_id)
            elif kind == "reject":
                raise PublishError(f"the engine refused: {reason}")
            else:
                raise PublishError(f"protocol: a `{kind}` message from the engine")

    def acquire(self, timeout: Optional[float] = 30.0) -> int:
        """A set the trainer may write now (waiting for the engine to release one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._drain()
            if self._free:
                return self._free[0]
            _wait_for_message(self._channel, deadline, "the engine to release a weight set")

    def try_acquire(self) -> Optional[int]:
        """A set the trainer may write now, or ``None``: reads the engine's messages, never
        waits."""
        self._drain()
        return self._free[0] if self._free else None

    def commit(self, set_id: int, version: int) -> None:
        """Tells the engine set ``set_id`` holds ``version``, completely written (synchronise
        the streams that wrote it first; :meth:`publish` and :meth:`writing` do)."""
        problem = self._versions.problem(version)
        if problem is not None:
            raise VersionConflict(problem)
        if set_id not in self._free:
            raise PublishError(f"set {set_id} is not the trainer's to commit (acquire one first)")
        self.last_commit_at_ns = time.monotonic_ns()
        self._channel.send("commit", set=set_id, version=version)
        self._free.remove(set_id)
        self._versions.advance(version)

    @contextlib.contextmanager
    def writing(self, version: int, timeout: Optional[float] = 30.0) -> Iterator[Dict[str, Any]]:
        """The tensors of a free set; on a normal exit the devices are synchronised and
        ``version`` committed. On an exception nothing is committed (the set stays free)."""
        problem = self._versions.problem(version)
        if problem is not None:
            raise VersionConflict(problem)
        set_id = self.acquire(timeout)
        yield self.tensors(set_id)
        self._synchronize(set_id)
        self.commit(set_id, version)

    def _other_devices(self, set_id: int) -> List[int]:
        """The devices besides the current one whose streams may have written set
        ``set_id``: the writer and the set's own (each once)."""
        current = self._torch.cuda.current_device()
        out: List[int] = []
        for device in (self.writer, self._sets[set_id].device):
            if device is not None and device != current and device not in out:
                out.append(device)
        return out

    def _synchronize(self, set_id: int) -> None:
        # The writes may run on this device's streams, the writer's and the set's own device
        # (a peer). Nothing queued on a device makes its synchronisation a host call only.
        self._torch.cuda.synchronize()
        for device in self._other_devices(set_id):
            self._torch.cuda.synchronize(device)

    def publish(
        self,
        weights: Mapping[str, Any],
        version: int,
        timeout: Optional[float] = 30.0,
        *,
        share: float = 1.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> int:
        """Copies ``weights`` (name → tensor; cast to the engine's dtypes) into a free set,
        synchronises and commits ``version``; returns the set's id. Every name and shape is
        checked before anything is written (:class:`OfferMismatch`).

        ``share`` below 1 leaves the engine the rest of the GPU or link: the copies go in
        chunks of ``chunk_bytes``, each followed by a pause so that writing takes about
        ``share`` of the wall time (:func:`stablebuf._share.write_shared`); the write then
        takes about 1/``share`` as long. :attr:`last_write` says where the time went."""
        checked_at = time.perf_counter()
        SharePacer(share)  # ValueError for a share outside (0, 1], before anything else
        twin = self._is_twin(weights)
        problem = None if twin else self.manifest.first_mismatch(weights, dtypes=False)
        if problem is not None:
            raise OfferMismatch(problem)
        problem = self._versions.problem(version)
        if problem is not None:
            raise VersionConflict(problem)
        t0 = time.perf_counter()
        set_id = self.acquire(timeout)
        t1 = time.perf_counter()
        parts = self._write_synchronized(set_id, weights, share, chunk_bytes, twin)
        t2 = time.perf_counter()
        self.commit(set_id, version)
        t3 = time.perf_counter()
        parts.update(
            check_s=t0 - checked_at, acquire_s=t1 - t0, commit_s=t3 - t2, total_s=t3 - checked_at
        )
        self.last_write = parts
        return set_id

    def _write_synchronized(
        self,
        set_id: int,
        weights: Mapping[str, Any],
        share: float,
        chunk_bytes: int,
        twin: Optional[bool] = None,
    ) -> Dict[str, float]:
        """Writes ``weights`` into set ``set_id`` and waits for the writes; returns where the
        time went (the keys of :attr:`last_write` but ``acquire_s``, ``commit_s``,
        ``total_s``). ``twin``: whether ``weights`` are :meth:`twin`'s (asked when ``None``).

        The twin at full speed takes the shortest way: cut once per set, one ``copy_`` (or one
        per copy stream), and only the devices that ran it synchronised. Each step before the
        copy is queued delays the whole write (on 2 x H200, 1 GiB: 0.3 ms of host before the
        copy, four times as long as the same code run warm, when the trainer's thread has just
        woken)."""
        set_device = self._sets[set_id].device
        writer = set_device if self.writer is None else self.writer
        prepared_at = time.perf_counter()
        if twin is None:
            twin = self._is_twin(weights)
        whole = twin and share >= 1.0
        if twin:  # one copy of the whole layout: the twin's bytes are the set's, padding too
            views, weights = self._twin_targets(set_id, self.copy_streams if whole else 1)
        else:
            views = self.tensors(set_id)
        span = self._spans.get(writer) if self.gpu_timing else _NO_SPAN
        if span is None:  # its two events are reused: each publish reads them before the next
            span = self._spans[writer] = _GpuSpan(self._torch, writer)
        span.start()
        prepare = time.perf_counter() - prepared_at
        if whole and len(views) == 1:
            start = time.perf_counter()
            target, source = views["twin"], weights["twin"]
            target.copy_(source, non_blocking=True)
            info = {"issue_s": time.perf_counter() - start, "wait_s": 0.0, "paused_s": 0.0,
                    "chunks": 1.0, "copies": 1.0,
                    "cross_device": float(crosses_devices(target, source))}
        else:
            info = write_shared(
                self._torch,
                views,
                weights,
                share=share,
                chunk_bytes=chunk_bytes,
                devices=self._other_devices(set_id),
                # Made only for a full-speed write on one device.
                lanes=self._copy_lanes if self.copy_streams > 1 else (),
            )
        span.stop()
        start = time.perf_counter()
        if whole:  # the copies ran on the twin's device and the writer's, nowhere else
            for device in {int(self._twin[0]), int(writer)}:
                self._torch.cuda.synchronize(device)
        else:
            self._synchronize(set_id)
        waited = time.perf_counter() - start
        return {
            "prepare_s": prepare,
            "issue_s": info["issue_s"],
            "wait_s": info["wait_s"] + waited,
            "gpu_s": span.seconds(),
            "paused_s": info["paused_s"],
            "chunks": info["chunks"],
            "copies": info["copies"],
            "cross_device": info["cross_device"],
            "lanes": info.get("lanes", 1.0),
            "twin": float(twin),
            "bytes": float(self._bytes),
            "writer": float(writer),
            "set_device": float(set_device),
        }

    def close(self) -> None:
        """Closes the connection and lets go of the imported sets (their memory is freed once
        no tensor over it is left)."""
        self._channel.close()
        self._views.clear()
        self._flats.clear()
        self._twin_cuts.clear()
        self._sets.clear()
        self._free.clear()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# Cross-node sync over NCCL (issue 42; stablebuf._nccl_sync): loaded on first use.
_LAZY: Dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name in ("RemoteEngine", "RemoteTrainer", "control_store", "PairGroup"):
        if name not in _LAZY:
            from . import _nccl_sync

            _LAZY["RemoteEngine"] = _nccl_sync.make_remote_engine_class(
                Engine, _tensors_of, _entries_of, torch_start_min
            )
            _LAZY["RemoteTrainer"] = _nccl_sync.RemoteTrainer
            _LAZY["control_store"] = _nccl_sync.control_store
            _LAZY["PairGroup"] = _nccl_sync.PairGroup
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
