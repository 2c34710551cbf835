"""The engine's version switch (stablebuf._switcher): which committed set is bound, which go
back to the trainer, rollbacks, and, across simulated tensor-parallel ranks (threads with a
barrier for the group's reduction), one version on every rank after every step boundary,
whatever the ranks receive, skip or fail. Pure Python: no torch, no GPU."""

from __future__ import annotations

import random
import threading

import pytest

from stablebuf._switcher import NOTHING_NEW, Switch, SwitchFailed, VersionSwitcher


class WeightSet:
    """A stand-in for a weight set: identity is all the switcher looks at."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class Region:
    """What is under the region, and binds that fail on demand."""

    def __init__(self, home: WeightSet) -> None:
        self.under = home
        self.fail_next = False
        self.binds = 0

    def bind(self, weight_set: WeightSet) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected bind failure")
        self.binds += 1
        self.under = weight_set


def lone(keep_previous: bool = False):
    home = WeightSet("home")
    region = Region(home)
    switcher = VersionSwitcher(lambda: region.under, keep_previous=keep_previous)
    return region, switcher, home


def test_a_lone_engine_binds_the_newest_version_once_and_hands_back_the_rest():
    region, switcher, home = lone()
    a, b, c = WeightSet("a"), WeightSet("b"), WeightSet("c")
    assert switcher.step(region.bind) == Switch()  # nothing ready: no bind
    switcher.committed(a, 1)
    switcher.committed(b, 2)
    done = switcher.step(region.bind)
    assert done.version == 2 and region.under is b and region.binds == 1  # one remap, not two
    # The superseded commit; the region's own backing is not asked for (the bind frees it).
    assert done.released == [a]
    assert switcher.held() == [b]
    switcher.committed(c, 3)
    assert switcher.step(region.bind) == Switch(3, [b])
    assert switcher.version == 3 and switcher.bound is c


def test_a_commit_naming_a_held_set_is_refused_and_changes_nothing():
    region, switcher, _ = lone()
    a = WeightSet("a")
    switcher.committed(a, 1)
    with pytest.raises(SwitchFailed, match="holds"):
        switcher.committed(a, 2)
    switcher.step(region.bind)
    with pytest.raises(SwitchFailed, match="holds"):
        switcher.committed(a, 3)  # bound now
    assert switcher.ready == {} and switcher.version == 1


def test_a_failed_bind_changes_nothing_and_the_version_stays_ready():
    region, switcher, home = lone()
    a = WeightSet("a")
    switcher.committed(a, 1)
    region.fail_next = True
    with pytest.raises(SwitchFailed, match="injected") as failed:
        switcher.step(region.bind)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert region.under is home and switcher.version == 0 and switcher.ready == {1: a}
    assert switcher.step(region.bind) == Switch(1, [])  # the next boundary binds it


def test_a_kept_previous_version_comes_back_in_one_bind():
    region, switcher, home = lone(keep_previous=True)
    a, b, c = WeightSet("a"), WeightSet("b"), WeightSet("c")
    switcher.committed(a, 1)
    assert switcher.step(region.bind) == Switch(1, [])  # home is kept, not released
    switcher.committed(b, 2)
    assert switcher.step(region.bind) == Switch(2, [home])  # a is kept now
    assert set(map(id, switcher.held())) == {id(b), id(a)}
    switcher.committed(c, 3)  # a newer version arrives before the rollback
    binds = region.binds
    assert switcher.rollback(region.bind) == Switch(1, [b])
    assert region.under is a and region.binds == binds + 1 and switcher.version == 1
    with pytest.raises(SwitchFailed, match="no version to roll back to"):
        switcher.rollback(region.bind)  # one step back only
    assert switcher.step(region.bind) == Switch(3, [])  # the waiting version, a kept again
    assert switcher.previous == (a, 1)


def test_rollbacks_need_keep_previous():
    region, switcher, _ = lone()
    switcher.committed(WeightSet("a"), 1)
    switcher.step(region.bind)
    with pytest.raises(SwitchFailed, match="keep_previous"):
        switcher.rollback(region.bind)


def test_a_failed_rollback_changes_nothing():
    region, switcher, home = lone(keep_previous=True)
    a = WeightSet("a")
    switcher.committed(a, 1)
    switcher.step(region.bind)
    region.fail_next = True
    with pytest.raises(SwitchFailed, match="rollback to version 0 failed"):
        switcher.rollback(region.bind)
    assert region.under is a and switcher.version == 1 and switcher.previous == (home, 0)


# ------------------------------------------------------------------ ranks


class Group:
    """The group's reduction for threads: every rank puts its values, waits for the others,
    takes the minimum, and waits again so that nobody writes the next round's values early.
    A rank that calls it out of step with the others breaks the barrier (a failure, not a
    hang)."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=20)
        self.slots: list = [None] * ranks
        self.rounds = [0] * ranks

    def reduce_min(self, rank: int):
        def reduce_min(values):
            self.rounds[rank] += 1
            self.slots[rank] = list(values)
            self.barrier.wait()
            result = [min(column) for column in zip(*self.slots)]
            self.barrier.wait()
            return result

        return reduce_min


def plan(seed: int, ranks: int, steps: int, versions: int):
    """Per rank, the versions its trainer commits (every one, bar a few skipped) and, per
    step, how many arrive and whether the rank's bind fails; per step, whether the group
    rolls back."""
    rng = random.Random(seed)
    per_rank = []
    for _ in range(ranks):
        commits = [v for v in range(1, versions + 1) if rng.random() > 0.05]
        arrivals = [rng.choice([0, 0, 0, 1, 1, 2]) for _ in range(steps)]
        failures = [rng.random() < 0.06 for _ in range(steps)]
        per_rank.append((commits, arrivals, failures))
    rollbacks = [rng.random() < 0.08 for _ in range(steps)]
    return per_rank, rollbacks


def run_rank(rank, group, per_rank, rollbacks, spare_sets, keep_previous, log, errors):
    try:
        commits, arrivals, failures = per_rank[rank]
        home = WeightSet(f"r{rank}-home")
        region = Region(home)
        switcher = VersionSwitcher(
            lambda: region.under,
            keep_previous=keep_previous,
            reduce_min=group.reduce_min(rank),
        )
        free = [WeightSet(f"r{rank}-s{i}") for i in range(spare_sets)]
        version_of = {id(home): 0}
        queue = list(commits)
        for step, (arriving, fail) in enumerate(zip(arrivals, failures)):
            # The trainer commits what it can: a version needs a set the engine released.
            for _ in range(arriving):
                if queue and free:
                    weight_set, version = free.pop(0), queue.pop(0)
                    version_of[id(weight_set)] = version
                    switcher.committed(weight_set, version)
            region.fail_next = fail
            try:
                if rollbacks[step] and keep_previous:
                    done = switcher.rollback(region.bind)
                else:
                    done = switcher.step(region.bind)
                outcome = "ok"
            except SwitchFailed:
                done, outcome = Switch(), "refused"
            region.fail_next = False
            held = switcher.held()
            for weight_set in done.released:
                assert weight_set is not region.under, "released the set under the region"
                assert all(weight_set is not h for h in held), "released a set it holds"
                if weight_set is not home:
                    free.append(weight_set)
            assert region.under is (switcher.bound or home)
            assert version_of[id(region.under)] == switcher.version
            log[rank].append((switcher.version, outcome))
    except BaseException as error:  # report it from the main thread
        errors.append((rank, error))
        group.barrier.abort()


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("keep_previous", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_every_rank_serves_the_same_version_after_every_step(ranks, keep_previous, seed):
    steps = 120
    per_rank, rollbacks = plan(seed * 31 + ranks, ranks, steps, versions=60)
    group = Group(ranks)
    log: list = [[] for _ in range(ranks)]
    errors: list = []
    threads = [
        threading.Thread(
            target=run_rank,
            args=(r, group, per_rank, rollbacks, 2 + keep_previous, keep_previous, log, errors),
        )
        for r in range(ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"seed {seed}: {errors[0][1]!r} on rank {errors[0][0]}"
    for step in range(steps):
        seen = {log[r][step] for r in range(ranks)}
        assert len(seen) == 1, f"seed {seed}, step {step}: the ranks disagree: {seen}"
    versions = [log[0][s][0] for s in range(steps)]
    assert max(versions) > 10, f"seed {seed}: the group hardly moved: {versions}"
    assert any(outcome == "refused" for _, outcome in log[0]), "no failure was exercised"
    # One reduction per boundary with nothing new, two with a switch: the same count on every rank.
    assert len(set(group.rounds)) == 1


def test_nothing_new_is_below_every_version():
    assert NOTHING_NEW < 0


def test_a_wake_onto_a_new_version_neither_keeps_nor_hands_back_the_discarded_backing():
    region, switcher, _ = lone(keep_previous=True)
    a = WeightSet("a")
    switcher.committed(a, 1)
    asked = []
    switcher._current = lambda: asked.append("current")  # the discarded backing: never asked
    assert switcher.step(region.bind, before_is_gone=True) == Switch(1, [])
    assert switcher.previous is None and not asked and region.under is a


def test_a_group_switch_must_be_able_to_go_back():
    switcher = VersionSwitcher(lambda: None, reduce_min=lambda values: list(values))
    with pytest.raises(ValueError, match="before_is_gone"):
        switcher.step(lambda weight_set: None, before_is_gone=True)


def test_asleep_only_the_newest_commit_waits_and_the_rest_go_back():
    region, switcher, _ = lone()
    a, b, c = WeightSet("a"), WeightSet("b"), WeightSet("c")
    assert switcher.keep_newest() == []
    switcher.committed(a, 1)
    assert switcher.keep_newest() == []
    switcher.committed(b, 2)
    switcher.committed(c, 3)
    assert switcher.keep_newest() == [a, b]
    assert switcher.ready == {3: c} and region.binds == 0
