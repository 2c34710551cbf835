"""CPU tests of issue 42's pure parts (stablebuf._remote): the byte ranges a transfer moves,
the stall watch, and the control protocol between a remote trainer and an engine rank, over a
dictionary store (TCPStore's set/get/check/add)."""

from __future__ import annotations

import json

import pytest

import stablebuf.publish
from stablebuf._manifest import Entry
from stablebuf._remote import (
    PAIR_GROUP_ENV,
    ControlTimeout,
    EngineControl,
    Keys,
    TrainerControl,
    Watch,
    entry_spans,
    operation_error,
    overlaps,
    plan_ranges,
    scoped_env,
    wait_key,
)


class DictStore:
    def __init__(self):
        self.data = {}
        self.calls = 0

    def set(self, key, value):
        self.calls += 1
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key):
        self.calls += 1
        if key not in self.data:
            raise AssertionError(f"get of a missing key {key}: the engine must check first")
        return self.data[key]

    def check(self, keys):
        self.calls += 1
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self.calls += 1
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value


class Op:
    def __init__(self, done=False, error=None, raises=None):
        self.done, self.error, self.raises = done, error, raises

    def is_completed(self):
        if self.raises:
            raise self.raises
        return self.done

    def exception(self):
        return self.error


def test_ranges_merge_spans_leave_gaps_and_cut_chunks():
    assert plan_ranges([(0, 10), (10, 20), (30, 35), (5, 8), (40, 40)], 8) == [
        (0, 8), (8, 16), (16, 20), (30, 35)]
    assert plan_ranges([], 4) == []
    with pytest.raises(ValueError):
        plan_ranges([(0, 1)], 0)


def test_entry_spans_and_overlaps():
    a = Entry("a", 0, (4,), (1,), "float32")  # bytes 0..16
    b = Entry("b", 32, (2, 2), (2, 1), "bfloat16")  # bytes 32..40
    e = Entry("e", 0, (0,), (1,), "float32")
    assert entry_spans([a, b, e]) == [(0, 16), (32, 40)]
    assert [(x.name, lo, hi) for x, lo, hi in overlaps([a, b, e], (8, 36))] == [
        ("a", 8, 16), ("b", 32, 36)]


def test_watch_done_waiting_stalled_failed():
    ops = [Op(), Op()]
    w = Watch(ops, stall_timeout=1.0, started=0.0)
    assert w.check(0.5) == "waiting"
    ops[0].done = True
    assert w.check(0.9) == "waiting" and w.first_open == 1
    assert w.check(1.8) == "waiting"  # progress at 0.9: the stall clock restarted
    assert w.check(2.0) == "stalled" and "no progress" in w.failure
    assert w.check(2.1) == "failed"  # stays failed

    ops = [Op(done=True), Op(done=True)]
    w = Watch(ops, 1.0, 0.0)
    assert w.check(0.1) == "done" and w.finished == 0.1 and w.check(5.0) == "done"

    w = Watch([Op(done=True, error=RuntimeError("NCCL error"))], 1.0, 0.0)
    assert w.check(0.1) == "failed" and "NCCL error" in w.failure
    w = Watch([Op(raises=RuntimeError("aborted"))], 1.0, 0.0)
    assert w.check(0.1) == "failed" and "aborted" in w.failure


def test_protocol_round_trip_join_offer_ready_done_leave():
    store = DictStore()
    engine = EngineControl(store, "sync/tp0", '{"m": 1}')
    assert engine.look() is None
    trainer = TrainerControl(store, "sync/tp0")
    assert trainer.manifest(None) == '{"m": 1}'
    assert trainer.join('{"pid": 1}') == 1
    assert engine.look() == ("join", 1)
    assert engine.look() is None  # not joined yet: no offers read
    engine.joined(1, last=7)
    assert trainer.wait_joined(None) == 7
    seq = trainer.offer(8)
    kind, offer = engine.look()
    assert kind == "offer" and (offer.epoch, offer.seq, offer.version) == (1, 1, 8)
    engine.ready(offer, [(0, 4), (8, 12)])
    assert engine.look() is None  # the next offer is seq 2
    assert trainer.wait_ready(seq, None) == ([(0, 4), (8, 12)], "")
    engine.done(offer, "received")
    assert trainer.wait_done(seq, None) == "received"
    seq2 = trainer.offer(8)
    _, offer2 = engine.look()
    engine.refuse(offer2, "version 8 is not newer than version 8")
    assert trainer.wait_ready(seq2, None) == (None, "version 8 is not newer than version 8")
    trainer.leave()
    assert engine.look() == ("leave", 1)


def test_newest_trainer_wins_and_a_dropped_trainer_hears_it():
    store = DictStore()
    engine = EngineControl(store, "p", "{}")
    first = TrainerControl(store, "p")
    first.join()
    assert engine.look() == ("join", 1)
    engine.joined(1, 0)
    # Two trainers join before the engine looks: it takes the newest only.
    TrainerControl(store, "p").join()
    third = TrainerControl(store, "p")
    third.join()
    assert engine.look() == ("join", 3)
    engine.drop(1, "a newer trainer (epoch 3) joined")
    assert first.dropped() == "a newer trainer (epoch 3) joined"
    with pytest.raises(ConnectionError, match="newer trainer"):
        first.wait_ready(first.offer(1), None)
    assert engine.epoch == 0
    engine.joined(3, 0)
    assert third.wait_joined(None) == 0


def test_engine_never_gets_a_missing_key_and_trainer_waits_time_out():
    store = DictStore()
    engine = EngineControl(store, "p", "{}")
    t = TrainerControl(store, "p")
    t.join()
    store.data.pop(Keys("p").join(1))  # the add done, the join key not yet set
    assert engine.look() is None  # checked, not read
    clock = iter([0.0, 0.5, 1.0, 1.5, 2.5, 3.0])
    with pytest.raises(ControlTimeout, match="the thing"):
        wait_key(store, "p/none", 2.0, "the thing", clock=lambda: next(clock), sleep=lambda s: None)


def test_keys_layout():
    k = Keys("sync/tp1/")
    assert k.offer(3, 2) == "sync/tp1/offer/3/2" and k.epoch() == "sync/tp1/epoch"
    assert json.loads('{"ranges": [[0, 4]]}')["ranges"] == [[0, 4]]


def test_publish_lists_the_remote_classes_without_importing_torch():
    assert "RemoteEngine" in stablebuf.publish.__all__
    assert "RemoteTrainer" in stablebuf.publish.__all__
    with pytest.raises(AttributeError):
        stablebuf.publish.NoSuchThing  # noqa: B018


class TorchLikeWork:
    """A torch.distributed Work as torch 2.11 has it: ``exception()`` cannot be converted
    (TypeError), ``wait()`` raises the operation's error."""

    def __init__(self, error=None):
        self.error = error

    def is_completed(self):
        return True

    def exception(self):
        raise TypeError("Unable to convert function return value to a Python type!")

    def wait(self):
        if self.error is not None:
            raise self.error
        return True


def test_a_completed_torch_work_is_asked_through_wait_not_exception():
    assert operation_error(TorchLikeWork()) is None
    failure = RuntimeError("NCCL error: remote process exited")
    assert operation_error(TorchLikeWork(failure)) is failure
    watch = Watch([TorchLikeWork(), TorchLikeWork()], stall_timeout=1.0, started=0.0)
    assert watch.check(0.1) == "done"
    watch = Watch([TorchLikeWork(), TorchLikeWork(failure)], stall_timeout=1.0, started=0.0)
    assert watch.check(0.1) == "failed" and "remote process exited" in watch.failure


def test_pair_group_env_has_no_watchdog_and_never_tears_down():
    # Blocking-wait mode: torch starts neither the watchdog (whose error path sleeps 60 s and
    # signals a flight-recorder dump) nor the heartbeat monitor (which sleeps 480 s and may
    # kill the process) for the trainer's communicator.
    assert PAIR_GROUP_ENV["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert PAIR_GROUP_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # clean up only
    assert PAIR_GROUP_ENV["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_scoped_env_sets_then_restores_set_and_unset_variables_also_on_error():
    env = {"KEEP": "k", "A": "old"}
    with scoped_env({"A": "new", "B": "b"}, env):
        assert env == {"KEEP": "k", "A": "new", "B": "b"}
    assert env == {"KEEP": "k", "A": "old"}  # B was unset: removed again
    with pytest.raises(RuntimeError):
        with scoped_env({"A": "x", "B": "y"}, env):
            raise RuntimeError("the constructor failed")
    assert env == {"KEEP": "k", "A": "old"}


def test_scoped_env_bodies_never_interleave():
    import threading

    env, seen, errors = {}, [], []
    inside = threading.Event()
    release = threading.Event()

    def first():
        with scoped_env({"V": "1"}, env):
            inside.set()
            release.wait(5)
            seen.append(("first", env.get("V")))

    def second():
        inside.wait(5)
        with scoped_env({"V": "2"}, env):
            seen.append(("second", env.get("V")))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside.wait(5)
    import time

    time.sleep(0.05)  # the second thread is at the lock by now
    try:
        assert seen == []  # the second waits for the first body to end
    except AssertionError as e:  # pragma: no cover - reported below
        errors.append(e)
    release.set()
    for t in threads:
        t.join(5)
    assert not errors
    assert seen == [("first", "1"), ("second", "2")] and env == {}


def _fake_torch(monkeypatch):
    """A torch stand-in with just what ``_nccl_sync.PairGroup`` touches: its
    ``ProcessGroupNCCL`` records the environment its constructor saw and the calls made."""
    import os
    import sys
    import types

    calls = []

    class PairOptions:
        pass

    class BroadcastOptions:
        asyncOp = False  # as if torch's default were the caller's stream

    class ProcessGroupNCCL:
        Options = PairOptions

        def __init__(self, store, rank, size, options):
            self.env = {k: os.environ.get(k) for k in PAIR_GROUP_ENV}
            calls.append(("init", rank, size))

        def broadcast(self, tensors, opts):
            calls.append(("broadcast", opts.rootRank, opts.asyncOp))
            return "work"

        def abort(self):
            calls.append(("abort",))

        def shutdown(self):  # pragma: no cover - must never be called
            calls.append(("shutdown",))

    dist = types.SimpleNamespace(
        PrefixStore=lambda prefix, store: (prefix, store), ProcessGroupNCCL=ProcessGroupNCCL,
        BroadcastOptions=BroadcastOptions)
    torch = types.SimpleNamespace(distributed=dist,
                                  cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    return calls


def test_pair_group_is_built_without_watchdog_and_aborted_never_shut_down(monkeypatch):
    import os

    from stablebuf._nccl_sync import PairGroup

    calls = _fake_torch(monkeypatch)
    for name in PAIR_GROUP_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the user's, for other groups
    pair = PairGroup(object(), "sync/tp0/pg/1/", 1, 0, timeout=5.0)
    assert pair.backend.env == PAIR_GROUP_ENV  # what the constructor read
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # put back
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    assert pair.broadcast(object()) == "work"
    assert calls[-1] == ("broadcast", 0, True)  # NCCL's own stream, never the caller's
    assert pair.abort_seconds is None
    pair.abort()
    pair.abort()  # idempotent
    assert [c for c in calls if c[0] in ("abort", "shutdown")] == [("abort",)]
    assert pair.backend is None and pair.abort_seconds is not None


def test_two_joins_read_in_one_look_each_come_up_on_their_own_epoch(monkeypatch):
    # The engine brings a trainer's communicator up on a helper thread, which calls the
    # factory later: a factory closing over the loop's variables would build epoch 1's
    # communicator on epoch 2's store prefix when both joins are read in one call.
    from stablebuf import _nccl_sync

    built = []

    class LateJoining:  # the helper thread, run only after _look returns
        def __init__(self, epoch, factory, deadline):
            self.epoch, self.factory = epoch, factory
            built.append(self)

    monkeypatch.setattr(_nccl_sync, "_Joining", LateJoining)
    monkeypatch.setattr(_nccl_sync, "PairGroup", lambda store, prefix, rank, device, timeout:
                        (prefix, rank, device, timeout))

    class JoinDuringLook(DictStore):
        def check(self, keys):
            found = super().check(keys)
            if found and keys == ["p/join/1"] and "p/join/2" not in self.data:
                TrainerControl(self, "p").join()  # a second trainer, while the engine reads
            return found

    store = JoinDuringLook()
    engine = object.__new__(stablebuf.publish.RemoteEngine)
    engine.__dict__.update(
        _pending=None, _control=EngineControl(store, "p", "{}"), _transfer=None, _free=[],
        _channel=None, _joining=None, _orphans=[], _store=store, _prefix="p", _device=3,
        nccl_timeout=5.0, join_timeout=5.0, timeline=[])
    TrainerControl(store, "p").join()
    problems = []
    engine._look(problems)
    assert [j.epoch for j in built] == [1, 2] and problems == []
    assert [j.factory() for j in built] == [("p/pg/1/", 1, 3, 5.0), ("p/pg/2/", 1, 3, 5.0)]
    assert engine._orphans == [built[0]] and engine._joining is built[1]
