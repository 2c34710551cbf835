"""The engine's side of publishing (stablebuf.publish.Engine) without a GPU: its messages and
binds around the version switch, on a fake channel and with the extension's bind, wake and
sleep replaced by recorders, and the :class:`~stablebuf.publish.PollStatus` a serving loop
gets from ``poll`` and ``rollback`` (a peer's failure is reported there, never raised; only
misuse raises). Tensor-parallel ranks are threads (simulated_group.py). The engine is
assembled by hand (its constructor needs a CUDA device); what it does with the pieces is the
code under test. The GPU tests (test_publish.py, test_tp_publish.py) run the same paths on
real memory."""

from __future__ import annotations

import inspect
import math
import statistics
import sys
import time
import types

import pytest
from simulated_group import Group, run_ranks

import stablebuf
from stablebuf import _native, publish
from stablebuf._manifest import VersionBook
from stablebuf._switcher import DEFAULT_AGREE_EVERY, VersionSwitcher


class FakeSet:
    def __init__(self, set_id: int) -> None:
        self.id = set_id

    def __repr__(self) -> str:
        return f"set{self.id}"


class FakeChannel:
    """What the trainer sent (``inbox``: tuples as ``receive`` returns them, or ``"closed"``)
    and what the engine sent back."""

    def __init__(self) -> None:
        self.inbox: list = []
        self.sent: list = []
        self.closed = False

    def message_waiting(self) -> bool:
        return bool(self.inbox)

    def receive(self):
        item = self.inbox.pop(0)
        if item == "closed":
            raise stablebuf.PeerClosed("the trainer went away")
        return item

    def send(self, kind: str, **fields) -> None:
        self.sent.append((kind, fields.get("set")))

    def close(self) -> None:
        self.closed = True

    def commit(self, set_id: int, version: int) -> None:
        self.inbox.append(("commit", set_id, version, ""))

    def released(self) -> list:
        out = [s for kind, s in self.sent if kind == "released"]
        self.sent.clear()
        return out


class NoListener:
    def accept(self):
        return None

    def close(self) -> None:
        pass


class Calls:
    """The extension's calls the engine makes, recorded."""

    def __init__(self, home) -> None:
        self.log: list = []
        self.under = home
        self.fail = False

    def bind(self, tag, weight_set) -> None:
        if self.fail:
            self.fail = False
            raise stablebuf.Error("injected bind failure")
        self.log.append(("bind", weight_set))
        self.under = weight_set

    def wake_onto(self, tag, weight_set) -> None:
        self.log.append(("wake_onto", weight_set))
        self.under = weight_set


@pytest.fixture
def make_engine(monkeypatch):
    """``make(...)`` assembles an engine (each with its own tag, region and recorder, so that
    several can run side by side as the ranks of a group). ``agree_every`` is 1 unless given
    (the engine's own default is ``DEFAULT_AGREE_EVERY``)."""
    regions: dict = {}
    monkeypatch.setattr(_native, "bind", lambda tag, ws: regions[tag].bind(tag, ws))
    monkeypatch.setattr(_native, "wake_onto", lambda tag, ws: regions[tag].wake_onto(tag, ws))
    monkeypatch.setattr(publish._sleep, "sleep", lambda tag, keep: regions[tag].log.append("sleep"))
    monkeypatch.setattr(publish._sleep, "wake", lambda tag: regions[tag].log.append("wake"))

    def make(
        sets: int = 2,
        keep_previous: bool = False,
        start_min=None,
        tag: str = "weights",
        agree_every: int = 1,
    ):
        home = FakeSet(100)
        calls = Calls(home)
        regions[tag] = calls
        engine = object.__new__(publish.Engine)
        engine.tag = tag
        engine._sets = [FakeSet(i) for i in range(1, sets + 1)]
        engine._by_id = {ws.id: ws for ws in engine._sets}
        engine._listener = NoListener()
        engine._channel = FakeChannel()
        engine._versions = VersionBook()
        engine._group = None if start_min is None else "a group"
        engine._switcher = VersionSwitcher(
            lambda: calls.under,
            keep_previous=keep_previous,
            start_min=start_min,
            agree_every=agree_every,
        )
        engine._asleep = False
        engine._closed = False
        engine._unreported = []
        engine._quiet = None
        return engine, engine._channel, calls, home

    return make


def test_poll_binds_only_the_newest_commit_and_hands_back_the_rest(make_engine):
    engine, channel, calls, home = make_engine(sets=3)
    s1, s2, s3 = engine._sets
    channel.commit(1, 1)
    channel.commit(2, 2)
    status = engine.poll()
    assert status == publish.PollStatus(version=2, bound=2, trainer_connected=True)
    assert calls.log == [("bind", s2)]  # one remap, not one per commit
    assert channel.released() == [1]  # the superseded commit; the home backing is not offered
    assert engine.version == 2 and engine.bound_set is s2 and engine.ready_versions == []
    assert engine.last_committed == 2
    channel.commit(3, 3)
    assert engine.poll().bound == 3 and channel.released() == [2]
    assert engine.poll().bound is None and calls.log[-1] == ("bind", s3)


def test_a_commit_of_a_set_the_engine_holds_drops_the_trainer_and_is_reported(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    engine.poll()
    channel.commit(1, 2)  # set 1 is bound
    status = engine.poll()
    assert not status.trainer_connected and len(status.problems) == 1
    assert "may not write" in status.problems[0]
    assert channel.closed and engine._channel is None and engine.version == 1


def test_a_version_not_newer_goes_back_to_the_trainer_and_is_reported(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    engine.poll()
    channel.released()
    channel.commit(2, 1)
    status = engine.poll()
    assert status.trainer_connected and status.bound is None
    assert status.problems and status.problems[0].startswith("VersionConflict")
    assert channel.released() == [2] and engine.version == 1 and len(calls.log) == 1


def test_a_closed_trainer_is_reported_after_the_commits_before_it_are_bound(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    channel.inbox.append("closed")
    status = engine.poll()
    assert status.bound == 1 and status.version == 1 and not status.trainer_connected
    assert len(status.problems) == 1 and "PeerClosed" in status.problems[0]
    assert "keeps serving" in status.problems[0]
    assert engine.poll() == publish.PollStatus(version=1)  # no trainer: nothing new to say


def test_a_failed_bind_is_reported_and_its_set_goes_back_to_the_trainer(make_engine):
    engine, channel, calls, home = make_engine()
    channel.commit(1, 1)
    calls.fail = True
    status = engine.poll()
    assert status.bound is None and status.refused == (1,) and status.version == 0
    assert "injected bind failure" in status.problems[0]
    assert calls.under is home and engine.ready_versions == []
    assert channel.released() == [1], "the refused set is the trainer's again"
    channel.commit(1, 2)  # the trainer writes that set again, as a newer version
    assert engine.poll().bound == 2


def test_misuse_raises(make_engine):
    engine, channel, calls, _ = make_engine()
    with pytest.raises(stablebuf.PublishError, match="keep_previous"):
        engine.rollback()
    kept, _, _, _ = make_engine(sets=3, keep_previous=True, tag="kept")
    kept.sleep()
    with pytest.raises(stablebuf.PublishError, match="asleep"):
        kept.rollback()
    engine.close()
    with pytest.raises(stablebuf.PublishError, match="closed"):
        engine.poll()


def test_asleep_the_newest_commit_waits_and_the_wake_maps_it_once(make_engine):
    engine, channel, calls, _ = make_engine(sets=3)
    s1, s2, s3 = engine._sets
    engine.sleep()
    channel.commit(1, 1)
    channel.commit(2, 2)
    assert engine.poll().bound is None and channel.released() == [1]  # the trainer may go on
    assert engine.wake() == 2
    assert calls.log == ["sleep", ("wake_onto", s2)]  # no bind, no second mapping
    assert channel.released() == []  # the discarded home backing is not offered


def test_wait_for_commit_reads_the_commit_and_binds_nothing(make_engine):
    engine, channel, calls, _ = make_engine(sets=3)
    engine.sleep()
    start = time.monotonic()
    assert not engine.wait_for_commit(1, timeout=0.05)
    assert time.monotonic() - start >= 0.05
    channel.commit(1, 1)
    assert engine.wait_for_commit(1, timeout=5)
    assert engine.ready_versions == [1] and calls.log == ["sleep"]
    assert engine.wake() == 1 and calls.log[-1] == ("wake_onto", engine._sets[0])


def test_a_failed_wake_onto_a_commit_hands_it_back_and_stays_asleep(make_engine):
    engine, channel, calls, _ = make_engine()
    engine.sleep()
    channel.commit(1, 1)
    engine.wait_for_commit(1)

    def failing_wake_onto(tag, weight_set):
        raise stablebuf.Error("injected wake failure")

    calls.wake_onto = failing_wake_onto
    with pytest.raises(stablebuf.PublishError, match="injected wake failure.*stays asleep"):
        engine.wake()
    assert engine._asleep and engine.ready_versions == [] and channel.released() == [1]


def test_a_wake_with_nothing_new_maps_the_bound_set_back(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    engine.poll()
    engine.sleep()
    assert engine.wake() == 1 and calls.log[-1] == ("wake_onto", engine._sets[0])


def test_a_rollback_is_one_bind_and_the_set_left_goes_back(make_engine):
    engine, channel, calls, home = make_engine(sets=3, keep_previous=True)
    s1, s2, _ = engine._sets
    channel.commit(1, 1)
    engine.poll()
    channel.commit(2, 2)
    engine.poll()
    channel.released()
    assert engine.previous_version == 1
    status = engine.rollback()
    assert status.bound == 1 and status.version == 1 and not status.problems
    assert calls.log[-1] == ("bind", s1) and channel.released() == [2]
    again = engine.rollback()  # one step back only: said, not raised
    assert again.bound is None and "no version to roll back to" in again.problems[0]
    assert engine.version == 1 and engine.previous_version is None


def test_keep_previous_needs_three_sets():
    with pytest.raises(ValueError, match="at least 3"):
        publish.Engine("weights", "/nonexistent/engine.sock", {}, sets=2, keep_previous=True)


def test_a_group_engine_agrees_at_every_boundary_and_binds_at_the_next(make_engine):
    rounds = []

    def alone(values):
        rounds.append(list(values))
        return lambda: list(values)

    engine, channel, calls, _ = make_engine(start_min=alone)
    assert engine.poll() == publish.PollStatus(version=0, trainer_connected=True)
    assert rounds == [[-1, 1, 0]]  # the offers, read at the next boundary
    channel.commit(1, 1)
    assert engine.poll().bound is None  # reads the offers made before version 1 came
    assert engine.poll().bound == 1  # reads the offer of version 1: binds it
    # One reduction of three integers per boundary; the bind's answer (2: bound) with a switch.
    assert rounds == [[-1, 1, 0], [1, -1, 1], [2], [-1, 1, 1]]


def test_a_version_one_rank_fails_to_bind_goes_back_to_every_ranks_trainer(make_engine):
    """Three ranks' engines on threads; rank 1's bind fails: every rank reports the refusal,
    none switches, and every rank hands the set back to its trainer, which publishes the
    next version, bound on every rank."""
    ranks = 3
    group = Group(ranks)
    engines = [
        make_engine(sets=3, keep_previous=True, start_min=group.start_min(r), tag=f"rank{r}")
        for r in range(ranks)
    ]

    def body(rank: int):
        engine, channel, calls, _ = engines[rank]
        engine.poll()
        channel.commit(1, 1)
        engine.poll()
        channel.released()
        calls.fail = rank == 1
        refused = engine.poll()
        handed_back = channel.released()
        channel.commit(1, 2)
        engine.poll()
        bound = engine.poll()
        return refused, handed_back, bound, engine.version

    for rank, (refused, handed_back, bound, version) in enumerate(run_ranks(ranks, body, group)):
        assert refused.refused == (1,) and refused.bound is None and refused.version == 0
        assert refused.group_in_step and len(refused.problems) == 1
        expected = "this rank's bind failed" if rank == 1 else "another rank's bind failed"
        assert expected in refused.problems[0], refused.problems
        assert handed_back == [1], f"rank {rank} kept the refused set from its trainer"
        assert bound.bound == 2 and version == 2 and not bound.problems


def test_a_lost_group_is_reported_and_the_engine_serves_on(make_engine):
    calls_made = []

    def broken(values):
        calls_made.append(values)
        if len(calls_made) > 1:
            raise RuntimeError("[gloo] Connection closed by peer")
        return lambda: list(values)

    engine, channel, calls, _ = make_engine(start_min=broken)
    engine.poll()
    channel.commit(1, 1)
    status = engine.poll()
    assert not status.group_in_step and status.bound is None and status.version == 0
    assert "Connection closed by peer" in status.problems[0]
    assert channel.released() == [1], "a set that can never be bound goes back"
    assert engine.poll() == publish.PollStatus(
        version=0, trainer_connected=True, group_in_step=False
    )


def test_a_failed_handshake_is_reported_once_and_changes_nothing(make_engine):
    class HangsUp:
        """A trainer that hung up before the handshake."""

        closed = False

        def send_manifest(self, text) -> None:
            raise stablebuf.PeerClosed("the peer closed the connection")

        def close(self) -> None:
            self.closed = True

    class Manifest:
        fingerprint = 7

        def with_published(self, version):
            return self

        def to_json(self) -> str:
            return "{}"

    class Listener:
        def __init__(self, *channels) -> None:
            self.waiting = list(channels)

        def accept(self):
            return self.waiting.pop(0) if self.waiting else None

    engine, _, _, _ = make_engine()
    engine._channel = None
    engine.manifest = Manifest()
    early = HangsUp()
    engine._listener = Listener(early)
    status = engine.poll()
    assert early.closed and not status.trainer_connected and status.version == 0
    assert status.problems == (
        "a trainer's handshake failed: PeerClosed: the peer closed the connection",
    )
    assert engine.poll().problems == (), "said once"


# ------------------------------------------------------------------ agreeing every K boundaries


class CountingChannel(FakeChannel):
    """A fake channel that counts the engine's looks for a message."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def message_waiting(self) -> bool:
        self.looks += 1
        return super().message_waiting()


class CountingListener(NoListener):
    def __init__(self) -> None:
        self.accepts = 0

    def accept(self):
        self.accepts += 1


def reduction_of_one_rank(rounds: list):
    """``start_min`` for a group of one rank: records the values, answers them."""

    def start_min(values):
        rounds.append(list(values))
        return lambda: list(values)

    return start_min


def test_the_engine_agrees_every_few_boundaries_by_default_and_refuses_misuse_first():
    default = inspect.signature(publish.Engine).parameters["agree_every"].default
    assert default == DEFAULT_AGREE_EVERY > 1
    # Refused before anything is made (no torch, no region, no socket needed for that).
    for wrong in (0, -3, 2.5):
        with pytest.raises(ValueError, match="agree_every"):
            publish.Engine("weights", "/nonexistent/engine.sock", {}, agree_every=wrong)


def test_between_agreement_boundaries_poll_reads_nothing_and_starts_nothing(make_engine):
    rounds: list = []
    engine, _, calls, _ = make_engine(start_min=reduction_of_one_rank(rounds), agree_every=3)
    channel = engine._channel = CountingChannel()
    listener = engine._listener = CountingListener()
    quiet = publish.PollStatus(version=0, trainer_connected=True)
    assert engine.poll() == quiet  # boundary 0: an agreement boundary; offers start
    assert (listener.accepts, channel.looks, len(rounds)) == (1, 1, 1)
    channel.commit(1, 1)
    first, second = engine.poll(), engine.poll()  # boundaries 1 and 2: nothing due
    assert first == quiet and second is first, "a quiet boundary builds no new status"
    assert (listener.accepts, channel.looks, len(rounds)) == (1, 1, 1), "a native call was made"
    assert engine.ready_versions == [], "the commit waits in the socket until boundary 3"
    assert engine.poll().bound is None  # 3: reads the commit, offers version 1
    assert engine.ready_versions == [1] and (listener.accepts, len(rounds)) == (2, 2)
    assert engine.poll() is engine.poll()  # 4, 5
    done = engine.poll()  # 6: the offers of 3 agree: version 1 binds
    assert done.bound == 1 and done.version == 1 and calls.log == [("bind", engine._sets[0])]
    assert rounds == [[-1, 1, 0], [1, -1, 1], [2], [-1, 1, 1]]
    after = engine.poll()  # 7: quiet again, on the new version
    assert after == publish.PollStatus(version=1, trainer_connected=True)
    assert engine.agree_every == 3


def test_a_quiet_boundary_says_what_is_unreported_and_who_is_connected(make_engine):
    rounds: list = []
    engine, channel, _, _ = make_engine(start_min=reduction_of_one_rank(rounds), agree_every=4)
    engine._channel = None
    assert not engine.poll().trainer_connected  # 0: agreement boundary
    engine._channel = channel  # as accept() between polls would
    assert engine.poll().trainer_connected, "the quiet status kept a stale connection state"
    engine._unreported.append("a trainer's handshake failed: injected")
    said = engine.poll()  # 2: not an agreement boundary, but there is something to say
    assert said.problems == ("a trainer's handshake failed: injected",) and len(rounds) == 1
    assert engine.poll().problems == () and len(rounds) == 1  # 3
    engine.poll()  # 4: agreement boundary (the boundary with a problem counted once)
    assert len(rounds) == 2
    channel.inbox.append("closed")
    assert [engine.poll().trainer_connected for _ in range(3)] == [True] * 3  # 5, 6, 7
    gone = engine.poll()  # 8: the trainer's departure is read at the agreement boundary
    assert not gone.trainer_connected and "PeerClosed" in gone.problems[0]


def test_with_agree_every_a_refusal_goes_back_to_every_ranks_trainer(make_engine):
    ranks, every = 3, 4
    group = Group(ranks)
    engines = [
        make_engine(
            sets=3,
            keep_previous=True,
            start_min=group.start_min(r),
            tag=f"every{r}",
            agree_every=every,
        )
        for r in range(ranks)
    ]

    def body(rank: int):
        engine, channel, calls, _ = engines[rank]
        engine.poll()
        channel.commit(1, 1)
        calls.fail = rank == 1  # armed: fires at the first bind, at boundary 8
        statuses = [engine.poll() for _ in range(8)]
        handed_back = channel.released()
        channel.commit(1, 2)
        statuses += [engine.poll() for _ in range(8)]
        return statuses, handed_back, engine.version

    results = run_ranks(ranks, body, group)
    for rank, (statuses, handed_back, version) in enumerate(results):
        refused = [(i + 1, s.refused) for i, s in enumerate(statuses) if s.refused]
        bound = [(i + 1, s.bound) for i, s in enumerate(statuses) if s.bound is not None]
        assert refused == [(8, (1,))], f"rank {rank}: {refused}"
        assert bound == [(16, 2)], f"rank {rank}: {bound}"
        assert handed_back == [1], f"rank {rank} kept the refused set from its trainer"
        assert version == 2 and all(s.group_in_step for s in statuses)
    assert len(set(group.rounds)) == 1


def test_torch_start_min_reuses_a_host_buffer_only_once_its_answer_is_read(monkeypatch):
    """torch_start_min on a (fake) gloo group: each reduction in a CPU tensor over a buffer of
    its own, used again only after its answer was read; the answer is the minimum."""
    others = [3, -9, 2]  # the other rank's values

    class Tensor:
        def __init__(self, buffer, dtype) -> None:
            assert dtype == "int64"
            self.memory = memoryview(buffer)  # shares the buffer, as torch.frombuffer does

    class Work:
        def __init__(self, tensor) -> None:
            self.tensor, self.done = tensor, False

        def wait(self) -> None:  # the reduction lands when it is waited for, at the latest
            if not self.done:
                for i, v in enumerate(others[: len(self.tensor.memory)]):
                    self.tensor.memory[i] = min(self.tensor.memory[i], v)
                self.done = True

    dist = types.ModuleType("torch.distributed")
    dist.ReduceOp = types.SimpleNamespace(MIN="min")
    dist.get_backend = lambda group: "gloo"
    started: list = []

    def all_reduce(tensor, op, group, async_op):
        assert op == "min" and group == "the group" and async_op
        started.append(tensor)
        return Work(tensor)

    dist.all_reduce = all_reduce
    torch = types.ModuleType("torch")
    torch.int64 = "int64"
    torch.frombuffer = Tensor
    torch.distributed = dist
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.setattr(publish, "cuda_torch", lambda: torch)

    start_min = publish.torch_start_min("the group")
    first = start_min([5, -5, 1])
    second = start_min([7, -7, 4])  # the first is still in flight: another buffer
    assert started[0] is not started[1]
    assert first() == [3, -9, 1] and first() == [3, -9, 1]
    third = start_min([1, -1, 9])  # the first's buffer, read: used again
    assert started[2] is started[0]
    assert second() == [3, -9, 2] and third() == [1, -9, 2]
    one = start_min([2])  # another length: a buffer of its own
    assert one() == [2] and started[3] is not started[0]
    assert start_min([0]) is not None and started[4] is started[3]


def test_poll_between_agreement_boundaries_is_cheap(make_engine, capsys):
    """A micro-benchmark, not a timing contract: a group engine on a fake channel and a group
    of one rank (no torch, no syscall), ``agree_every`` at the default and at 1, polled as a
    serving loop does. Prints the cost per poll; asserts only a generous bound."""
    polls = 40_000
    lines, between_median = [], {}
    for every in (DEFAULT_AGREE_EVERY, 1):
        rounds: list = []
        engine, _, _, _ = make_engine(
            start_min=reduction_of_one_rank(rounds), agree_every=every, tag=f"bench{every}"
        )
        for _ in range(1000):  # warm up
            engine.poll()
        agreeing, between = [], []
        clock, poll = time.perf_counter_ns, engine.poll
        for _ in range(polls):
            before = len(rounds)
            start = clock()
            poll()
            spent = clock() - start
            (agreeing if len(rounds) != before else between).append(spent / 1e3)
        assert len(agreeing) == polls // every and len(between) == polls - polls // every
        mean = statistics.fmean(agreeing + between)
        line = (
            f"poll, agree_every={every}: {mean:.2f} us a boundary on average; agreement "
            f"boundaries median {statistics.median(agreeing):.2f} us"
        )
        if between:
            between_median[every] = statistics.median(between)
            line += f", the others median {between_median[every]:.2f} us"
        lines.append(line + f" ({polls} polls, fake channel, a group of one rank, no torch)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert between_median[DEFAULT_AGREE_EVERY] < 200, lines


# ---------------------------------------------------------------------------- the trainer's write
#
# A trainer on GPU 0 publishing to an engine on GPU 1 (issue 41): the sets are imported on the
# engine's GPU and mapped for GPU 0 too; the trainer's views of them must live on GPU 0, so that
# each copy is a copy on one device (PyTorch fences every copy between two devices against both
# devices' queues). On the CPU: the set is an extension's DLPack probe (host bytes) whose
# capsule is retargeted to a made-up device, and torch is a recorder.


def test_the_writer_is_the_current_device_when_the_sets_are_mapped_for_it():
    choose = publish.choose_writer
    assert choose(1, [1, 0], current=0) == 0  # trainer on GPU 0, engine on GPU 1
    assert choose(1, None, current=0) == 1  # not mapped for GPU 0: the set's device, as before
    assert choose(0, None, current=0) == 0  # one GPU
    assert choose(1, [1, 0], current=2) == 1
    assert choose(1, [1, 0], current=0, writer=1) == 1  # asked for: the old way, on purpose
    with pytest.raises(ValueError, match="access"):
        choose(1, [1], current=0, writer=0)


def _capsule_device(capsule):
    """(device type, device id, ndim) of an unconsumed "dltensor" capsule: read here, in the
    test, with ctypes (the library itself never looks inside a capsule)."""
    import ctypes

    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi)
    )
    # DLTensor: void* data; {int32 device_type; int32 device_id}; int32 ndim; ...
    fields = (ctypes.c_int32 * 3).from_address(get(capsule, b"dltensor") + ctypes.sizeof(ctypes.c_void_p))
    return tuple(fields)


def test_an_export_names_a_peer_device_only_when_its_mapping_grants_it():
    probe = _native._DlpackProbe([7, 8, 9, 10, 11], peers=[3])
    assert probe.__dlpack_device__() == (1, 0)
    assert _capsule_device(probe.__dlpack__()) == (1, 0, 1)
    assert _capsule_device(probe.__dlpack__(dl_device=(1, 0))) == (1, 0, 1)
    assert _capsule_device(probe.__dlpack__(dl_device=(1, 3))) == (1, 3, 1)
    with pytest.raises(BufferError, match="mapped for devices"):
        probe.__dlpack__(dl_device=(1, 4))  # not granted: no capsule, no copy
    with pytest.raises(BufferError):
        probe.__dlpack__(dl_device=(2, 3))  # another device type
    with pytest.raises(BufferError):
        _native._DlpackProbe([1]).__dlpack__(dl_device=(1, 3))  # no peers at all


class _View:
    """A view of a fake set: says where it lives, records the copies into it."""

    def __init__(self, device, log, shape=(), dtype="uint8"):
        self.device, self.log, self.shape, self.dtype = device, log, tuple(shape), dtype

    def __getitem__(self, rows):
        return _View(self.device, self.log, self.shape, self.dtype)

    def view(self, dtype):
        return _View(self.device, self.log, self.shape, dtype)

    def as_strided(self, shape, stride):
        return _View(self.device, self.log, shape, self.dtype)

    def reshape(self, shape):
        return _View(self.device, self.log, shape, self.dtype)

    def element_size(self):
        return {"bfloat16": 2, "float32": 4}.get(self.dtype, 1)

    def numel(self):
        return math.prod(self.shape)

    def dim(self):
        return len(self.shape)

    def copy_(self, source, non_blocking=False):
        self.log.append(("copy", self.device, source.device))


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("event", stream))

    def elapsed_time(self, other):
        return 1.5  # ms


class _TrainerCuda:
    def __init__(self, current, log):
        self.current, self.log = current, log

    def current_device(self):
        return self.current

    def current_stream(self, device=None):
        return f"stream{self.current if device is None else device}"

    def synchronize(self, device=None):
        self.log.append(("sync", device))

    def Event(self, enable_timing=False):  # torch's name
        return _Event(self.log)


class _TrainerTorch:
    bfloat16, float32, uint8 = "bfloat16", "float32", "uint8"

    def __init__(self, current, log):
        self.cuda = _TrainerCuda(current, log)
        self.log = log

    def from_dlpack(self, source):
        if hasattr(source, "__dlpack_device__"):
            device = source.__dlpack_device__()[1]
        else:  # a capsule: the device it says
            device = _capsule_device(source)[1]
        self.log.append(("from_dlpack", device))
        return _View(device, self.log)

    def empty(self, *shape, dtype=None, device=None):
        return _View(device, self.log, shape, dtype)


class _ImportedProbe:
    """An imported set as the trainer sees it, over host bytes (the extension's probe), on
    "device" 0 and mapped for "devices" 1 to 3 as well."""

    def __init__(self, set_id, nbytes):
        self.set_id, self.device = set_id, 0
        self._probe = _native._DlpackProbe([0] * nbytes, peers=[1, 2, 3])

    def __dlpack_device__(self):
        return self._probe.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self._probe.__dlpack__(**kwargs)


class _TrainerChannel:
    def __init__(self, log, released):
        self.log, self.inbox = log, [("released", s, 0, "") for s in released]

    def message_waiting(self):
        return bool(self.inbox)

    def receive(self):
        return self.inbox.pop(0)

    def send(self, kind, **fields):
        self.log.append((kind, fields.get("set"), fields.get("version")))


def _trainer(writer, current=3):
    from stablebuf._manifest import Entry, Manifest

    entries = [
        Entry("a", 0, (4, 2), (2, 1), "bfloat16"),  # 16 bytes
        Entry("b", 16, (3,), (1,), "float32"),  # 12 bytes
    ]
    manifest = Manifest.build("w", 32, 2, entries)
    log: list = []
    sets = [_ImportedProbe(1, 32), _ImportedProbe(2, 32)]
    trainer = publish.Trainer(
        _TrainerChannel(log, [1]), manifest, sets, _TrainerTorch(current, log), writer
    )
    weights = {
        "a": _View(current, [], (4, 2), "bfloat16"),
        "b": _View(current, [], (3,), "float32"),
    }
    return trainer, weights, log


def test_a_peer_trainer_writes_through_views_on_its_own_device_then_waits_then_commits():
    trainer, weights, log = _trainer(writer=3)  # the trainer's GPU 3; the set on "device" 0
    trainer.gpu_timing = True
    assert trainer.publish(weights, version=1) == 1
    assert ("from_dlpack", 3) in log  # the views live on the writer
    copies = [e for e in log if e[0] == "copy"]
    assert copies == [("copy", 3, 3), ("copy", 3, 3)]  # copies on one device: no fences
    syncs = [i for i, e in enumerate(log) if e[0] == "sync"]
    commit = log.index(("commit", 1, 1))
    assert [log[i] for i in syncs] == [("sync", None), ("sync", 0)] and syncs[-1] < commit
    assert log.index(copies[-1]) < syncs[0]
    parts = trainer.last_write
    assert parts["cross_device"] == 0.0 and parts["copies"] == 2.0 and parts["chunks"] == 1.0
    assert (parts["writer"], parts["set_device"], parts["bytes"]) == (3.0, 0.0, 28.0)
    assert parts["gpu_s"] == pytest.approx(1.5e-3)
    for key in ("acquire_s", "issue_s", "wait_s", "paused_s", "commit_s", "total_s"):
        assert parts[key] >= 0.0
    assert parts["total_s"] >= parts["issue_s"] + parts["wait_s"]


def test_a_twin_publish_is_one_copy_of_the_whole_layout_and_skips_the_checks(monkeypatch):
    from stablebuf._manifest import Manifest

    trainer, weights, log = _trainer(writer=3)
    twin = trainer.twin()  # on the current device, 3
    assert set(twin) == {"a", "b"} and twin["a"].shape == (4, 2) and twin["b"].dtype == "float32"
    again = trainer.twin()
    assert all(again[n] is twin[n] for n in twin), "made once and kept"
    assert ("from_dlpack", 3) not in log  # nothing of the sets touched yet

    def no_checks(*_, **__):
        raise AssertionError("a twin's tensors need no per-tensor checks")

    monkeypatch.setattr(Manifest, "first_mismatch", no_checks)
    assert trainer.publish(twin, version=1) == 1
    assert [e for e in log if e[0] == "copy"] == [("copy", 3, "cuda:3")]  # the whole layout at once
    parts = trainer.last_write
    assert parts["twin"] == 1.0 and parts["copies"] == 1.0 and parts["chunks"] == 1.0
    assert log.index(("commit", 1, 1)) > max(i for i, e in enumerate(log) if e[0] == "sync")
    # Other tensors (even with the twin's names) go tensor by tensor, checked.
    assert not trainer._is_twin(weights) and not trainer._is_twin({"a": twin["a"]})


def test_a_twin_publish_cuts_once_per_set_and_waits_only_where_it_copied(monkeypatch):
    trainer, _, log = _trainer(writer=3)  # the twin and the views on GPU 3, the set on 0
    twin = trainer.twin()
    cuts = []
    real = publish._twin_pieces
    monkeypatch.setattr(publish, "_twin_pieces", lambda *a: cuts.append(a[2]) or real(*a))
    trainer.publish(twin, version=1)
    first = [e for e in log if e[0] == "sync"]
    assert first == [("sync", 3)], "the copy ran on GPU 3 alone: nothing to wait for elsewhere"
    trainer._channel.inbox.append(("released", 1, 0, ""))
    trainer.publish(twin, version=2)
    assert log.count(("from_dlpack", 3)) == 1, "DLPack once per set, not per publish"
    assert cuts == [1], "the twin's cut into the set is made once"
    assert not [e for e in log if e[0] == "event"] and math.isnan(trainer.last_write["gpu_s"]), (
        "no timing events unless gpu_timing"
    )
    assert log.index(("commit", 1, 2)) > max(i for i, e in enumerate(log) if e[0] == "sync")
    assert trainer.last_write["prepare_s"] >= 0.0
    # Below share 1 the write goes in chunks, waited for as any other write (every device).
    trainer._channel.inbox.append(("released", 1, 0, ""))
    del log[:]
    trainer.publish(twin, version=3, share=0.5, chunk_bytes=1 << 20)
    assert ("sync", 0) in log and cuts == [1]


class _Span:
    """Stands for a flat tensor: ``[lo:hi]`` is ``(lo, hi)``."""

    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n

    def __getitem__(self, cut):
        return (cut.start, cut.stop)


@pytest.mark.parametrize(
    "pages_and_tail, lanes, cuts",
    [
        ((5, 3), 1, [(None, None)]),  # one copy: the whole tensors
        ((5, 3), 2, [(0, 3), (3, 5)]),  # page-aligned halves, the tail in the last
        ((1, 1), 4, [(0, 1), (1, 1)]),  # no more pieces than pages
        ((0, 100), 4, [(None, None)]),  # under a page: one copy
        ((8, 0), 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ],
)
def test_a_twin_write_over_lanes_is_page_aligned_pieces_that_cover_it_once(pages_and_tail, lanes, cuts):
    page = publish.TRANSLATION_PAGE
    n = pages_and_tail[0] * page + pages_and_tail[1]
    target, source = _Span(n), _Span(n)
    views, weights = publish._twin_pieces(target, source, lanes)
    assert list(views) == list(weights)
    if cuts == [(None, None)]:
        assert views == {"twin": target} and weights == {"twin": source}
        return
    got = [views[k] for k in views]
    assert got == [weights[k] for k in weights]
    expect = [(lo * page, hi * page) for lo, hi in cuts[:-1]] + [(cuts[-1][0] * page, n)]
    assert got == expect
    assert got[0][0] == 0 and got[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(got, got[1:])), "contiguous, no gap, no overlap"
    assert all(hi % page == 0 for _, hi in got[:-1])


def test_views_on_the_sets_device_copy_between_devices_and_say_so():
    trainer, weights, log = _trainer(writer=None)  # the old way: views on the set's device
    trainer.publish(weights, version=1)
    assert ("from_dlpack", 0) in log
    assert trainer.last_write["cross_device"] == 2.0


def test_a_shared_write_from_a_peer_waits_for_every_chunk_on_both_devices():
    trainer, weights, log = _trainer(writer=3)
    trainer.publish(weights, version=1, share=0.5, chunk_bytes=8)
    # "a" in two chunks of 8 bytes, "b" in two (8 + 4): each chunk, then the last wait.
    syncs = [e for e in log if e[0] == "sync"]
    assert syncs == [("sync", None), ("sync", 0)] * 5
    assert trainer.last_write["chunks"] == 4.0 and trainer.last_write["cross_device"] == 0.0
    assert trainer.last_write["paused_s"] > 0.0
