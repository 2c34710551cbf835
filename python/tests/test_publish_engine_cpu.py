"""The engine's side of publishing (stablebuf.publish.Engine) without a GPU: its messages and
binds around the version switch, on a fake channel and with the extension's bind, wake and
sleep replaced by recorders. The engine is assembled by hand (its constructor needs a CUDA
device); what it does with the pieces is the code under test. The GPU tests (test_publish.py,
test_tp_publish.py) run the same paths on real memory."""

from __future__ import annotations

import pytest

import stablebuf
from stablebuf import _native, publish
from stablebuf._manifest import VersionBook
from stablebuf._switcher import VersionSwitcher


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
    def make(sets: int = 2, keep_previous: bool = False, reduce_min=None):
        home = FakeSet(100)
        calls = Calls(home)
        monkeypatch.setattr(_native, "bind", calls.bind)
        monkeypatch.setattr(_native, "wake_onto", calls.wake_onto)
        monkeypatch.setattr(publish._sleep, "sleep", lambda tag, keep: calls.log.append("sleep"))
        monkeypatch.setattr(publish._sleep, "wake", lambda tag: calls.log.append("wake"))
        engine = object.__new__(publish.Engine)
        engine.tag = "weights"
        engine._sets = [FakeSet(i) for i in range(1, sets + 1)]
        engine._by_id = {ws.id: ws for ws in engine._sets}
        engine._listener = NoListener()
        engine._channel = FakeChannel()
        engine._versions = VersionBook()
        engine._group = None if reduce_min is None else "a group"
        engine._switcher = VersionSwitcher(
            lambda: calls.under, keep_previous=keep_previous, reduce_min=reduce_min
        )
        engine._asleep = False
        return engine, engine._channel, calls, home

    return make


def test_poll_binds_only_the_newest_commit_and_hands_back_the_rest(make_engine):
    engine, channel, calls, home = make_engine(sets=3)
    s1, s2, s3 = engine._sets
    channel.commit(1, 1)
    channel.commit(2, 2)
    assert engine.poll() == 2
    assert calls.log == [("bind", s2)]  # one remap, not one per commit
    assert channel.released() == [1]  # the superseded commit; the home backing is not offered
    assert engine.version == 2 and engine.bound_set is s2 and engine.ready_versions == []
    channel.commit(3, 3)
    assert engine.poll() == 3 and channel.released() == [2]
    assert engine.poll() is None and calls.log[-1] == ("bind", s3)


def test_a_commit_of_a_set_the_engine_holds_drops_the_trainer(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    engine.poll()
    channel.commit(1, 2)  # set 1 is bound
    with pytest.raises(stablebuf.PublishError, match="may not write"):
        engine.poll()
    assert channel.closed and engine._channel is None and engine.version == 1


def test_a_version_not_newer_goes_back_to_the_trainer(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    engine.poll()
    channel.released()
    channel.commit(2, 1)
    with pytest.raises(stablebuf.VersionConflict):
        engine.poll()
    assert channel.released() == [2] and engine.version == 1 and len(calls.log) == 1


def test_a_closed_trainer_is_raised_after_the_commits_before_it_are_bound(make_engine):
    engine, channel, calls, _ = make_engine()
    channel.commit(1, 1)
    channel.inbox.append("closed")
    with pytest.raises(stablebuf.PeerClosed):
        engine.poll()
    assert engine.version == 1 and engine._channel is None
    assert engine.poll() is None  # no trainer: nothing to do, nothing raised


def test_a_failed_bind_is_a_publish_error_and_the_version_stays_ready(make_engine):
    engine, channel, calls, home = make_engine()
    channel.commit(1, 1)
    calls.fail = True
    with pytest.raises(stablebuf.PublishError, match="injected"):
        engine.poll()
    assert engine.version == 0 and calls.under is home and engine.ready_versions == [1]
    assert engine.poll() == 1


def test_asleep_the_newest_commit_waits_and_the_wake_maps_it_once(make_engine):
    engine, channel, calls, _ = make_engine(sets=3)
    s1, s2, s3 = engine._sets
    engine.sleep()
    channel.commit(1, 1)
    channel.commit(2, 2)
    assert engine.poll() is None and channel.released() == [1]  # the trainer may go on
    assert engine.wake() == 2
    assert calls.log == ["sleep", ("wake_onto", s2)]  # no bind, no second mapping
    assert channel.released() == []  # the discarded home backing is not offered


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
    assert engine.rollback() == 1
    assert calls.log[-1] == ("bind", s1) and channel.released() == [2]
    with pytest.raises(stablebuf.PublishError, match="no version to roll back to"):
        engine.rollback()


def test_keep_previous_needs_three_sets():
    with pytest.raises(ValueError, match="at least 3"):
        publish.Engine("weights", "/nonexistent/engine.sock", {}, sets=2, keep_previous=True)


def test_a_group_engine_asks_the_group_at_every_boundary(make_engine):
    rounds = []

    def alone(values):
        rounds.append(list(values))
        return list(values)

    engine, channel, calls, _ = make_engine(reduce_min=alone)
    assert engine.poll() is None and rounds == [[-1, 1, 0]]  # nothing new: one round
    channel.commit(1, 1)
    assert engine.poll() == 1
    assert rounds[1:] == [[1, -1, 1], [2]]  # the version, then every rank's bind
