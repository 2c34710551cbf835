"""The engine's version switch (stablebuf._switcher): which committed set is bound, which go
back to the trainer, rollbacks, and, across simulated tensor-parallel ranks (threads with a
barrier for the group's reduction: simulated_group.py), one version on every rank after every
step boundary whatever the ranks receive, skip or fail, and every set back with its trainer
unless the engine binds, keeps or holds it (a refused version's set on every rank), whether
the group agrees at every boundary or at every ``agree_every``-th. Pure Python: no torch, no
GPU."""

from __future__ import annotations

import random
from typing import List, Optional

import pytest
from simulated_group import Group, run_ranks

from stablebuf._switcher import (
    DEFAULT_AGREE_EVERY,
    NOTHING_NEW,
    Switch,
    SwitchFailed,
    VersionSwitcher,
)


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


def test_a_failed_bind_refuses_the_version_and_hands_its_set_back():
    region, switcher, home = lone()
    a, b = WeightSet("a"), WeightSet("b")
    switcher.committed(a, 1)
    switcher.committed(b, 2)
    region.fail_next = True
    done = switcher.step(region.bind)
    assert done.version is None and done.refused == [2]
    assert done.released == [a, b], "the refused set and the older one go back to the trainer"
    assert "injected bind failure" in done.problem and "still on version 0" in done.problem
    assert region.under is home and switcher.version == 0 and switcher.ready == {}
    assert switcher.step(region.bind) == Switch(), "a refused version is not tried again"
    c = WeightSet("c")
    switcher.committed(c, 3)
    assert switcher.step(region.bind) == Switch(3, [])  # the next version binds


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
    again = switcher.rollback(region.bind)  # one step back only: said, not raised
    assert again.version is None and "no version to roll back to" in again.problem
    assert region.binds == binds + 1
    assert switcher.step(region.bind) == Switch(3, [])  # the waiting version, a kept again
    assert switcher.previous == (a, 1)


def test_rollbacks_need_keep_previous():
    region, switcher, _ = lone()
    switcher.committed(WeightSet("a"), 1)
    switcher.step(region.bind)
    with pytest.raises(SwitchFailed, match="keep_previous"):
        switcher.rollback(region.bind)


def test_a_failed_rollback_changes_nothing_and_keeps_the_previous_version():
    region, switcher, home = lone(keep_previous=True)
    a = WeightSet("a")
    switcher.committed(a, 1)
    switcher.step(region.bind)
    region.fail_next = True
    done = switcher.rollback(region.bind)
    assert done.version is None and done.released == [] and done.refused == []
    assert "rollback to version 0 was refused" in done.problem
    assert region.under is a and switcher.version == 1 and switcher.previous == (home, 0)
    assert switcher.rollback(region.bind) == Switch(0, [a])  # it may be tried again


# ------------------------------------------------------------------ ranks


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


class SimulatedRank:
    """One rank: its region, its switcher and its trainer (commits in order, each into a set
    the engine handed back), with the rules checked after every boundary."""

    def __init__(
        self, rank: int, group: Group, spare_sets: int, keep_previous: bool, agree_every: int = 1
    ) -> None:
        self.home = WeightSet(f"r{rank}-home")
        self.region = Region(self.home)
        self.switcher = VersionSwitcher(
            lambda: self.region.under,
            keep_previous=keep_previous,
            start_min=group.start_min(rank),
            agree_every=agree_every,
        )
        self.spares = [WeightSet(f"r{rank}-s{i}") for i in range(spare_sets)]
        self.free = list(self.spares)  # the trainer's
        self.version_of = {id(self.home): 0}
        self.refused: set = set()
        self.bound: set = set()

    def commit(self, version: int) -> bool:
        """The trainer publishes ``version`` if it has a free set; returns whether it did."""
        if not self.free:
            return False
        weight_set = self.free.pop(0)
        self.version_of[id(weight_set)] = version
        self.switcher.committed(weight_set, version)
        return True

    def boundary(self, *, rollback: bool = False, fail: bool = False) -> tuple:
        """One step boundary (or rollback); returns what every rank must agree on."""
        switcher, region = self.switcher, self.region
        region.fail_next = fail
        done = switcher.rollback(region.bind) if rollback else switcher.step(region.bind)
        region.fail_next = False
        held = switcher.held()
        for weight_set in done.released:
            assert weight_set is not region.under, "released the set under the region"
            assert all(weight_set is not h for h in held), "released a set it holds"
            assert all(weight_set is not f for f in self.free), "released a set twice"
            if weight_set is not self.home:
                self.free.append(weight_set)
        for version in done.refused:
            assert version not in switcher.ready, "a refused version is still waiting"
            self.refused.add(version)
        if done.version is not None and not rollback:
            assert done.version not in self.refused, "a refused version was bound later"
            self.bound.add(done.version)
        assert region.under is (switcher.bound or self.home)
        assert self.version_of[id(region.under)] == switcher.version
        # Every set is the trainer's, or bound, kept or waiting here: none is lost.
        mine = [id(s) for s in self.free] + [id(s) for s in held if s is not self.home]
        assert sorted(mine) == sorted(map(id, self.spares)), "a set was lost or doubled"
        refused_rollback = rollback and done.problem is not None and "refused" in done.problem
        return (switcher.version, done.version, tuple(done.refused), refused_rollback)


@pytest.mark.parametrize("agree_every", [1, 3])
@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("keep_previous", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_every_rank_serves_the_same_version_after_every_step(
    ranks, keep_previous, seed, agree_every
):
    # As many agreement boundaries whatever agree_every is (the boundaries between do nothing).
    steps, settle = 120 * agree_every, 240 * agree_every
    per_rank, rollbacks = plan(seed * 31 + ranks, ranks, steps, versions=60)
    group = Group(ranks)

    def body(rank: int):
        commits, arrivals, failures = per_rank[rank]
        me = SimulatedRank(rank, group, 2 + keep_previous, keep_previous, agree_every)
        queue = list(commits)
        log = []
        for step in range(steps):
            for _ in range(arrivals[step]):
                if queue and me.commit(queue[0]):
                    queue.pop(0)
            rollback = rollbacks[step] and keep_previous
            log.append(me.boundary(rollback=rollback, fail=failures[step]))
        # Then the trainer publishes the rest as fast as sets come back, nothing fails: every
        # trainer gets to its last version (no set is kept from it for good), and the group
        # binds the newest every rank has.
        for _ in range(settle):
            while queue and me.commit(queue[0]):
                queue.pop(0)
            log.append(me.boundary())
        return me, queue, log

    results = run_ranks(ranks, body, group)
    logs = [log for _, _, log in results]
    for step in range(steps + settle):
        seen = {logs[r][step] for r in range(ranks)}
        assert len(seen) == 1, f"seed {seed}, step {step}: the ranks disagree: {seen}"
    versions = [entry[0] for entry in logs[0]]
    assert max(versions[:steps]) > 10, f"seed {seed}: the group hardly moved: {versions}"
    assert any(entry[2] for entry in logs[0]), "no refused switch was exercised"
    for rank, (me, queue, _) in enumerate(results):
        assert queue == [], f"rank {rank}'s trainer never got a set for {queue[:3]}..."
    # What every rank has received: nothing older than that may still wait anywhere.
    settled = min(me.switcher.last for me, _, _ in results)
    common = set.intersection(*(set(me.switcher.ready) for me, _, _ in results))
    for rank, (me, _, _) in enumerate(results):
        stuck = [v for v in me.switcher.ready if v <= settled or v in common]
        assert not stuck, f"rank {rank}: versions {stuck} still wait after the group settled"
    # An agreement boundary with nothing new costs one reduction, a switch two, a rollback two
    # or three: the same count on every rank. The offers (three integers) start at every
    # agree_every-th boundary, and again at each rollback (the count starts over there).
    assert len(set(group.rounds)) == 1
    offers = sum(1 for values in group.values[0] if len(values) == 3)
    rolled = sum(1 for step in range(steps) if rollbacks[step] and keep_previous)
    boundaries = steps + settle
    assert offers <= -(-boundaries // agree_every) + rolled, (offers, boundaries, rolled)
    assert offers >= boundaries // agree_every, (offers, boundaries)


def ranks_run(ranks: int, body, group: Optional[Group] = None) -> list:
    return run_ranks(ranks, body, group or Group(ranks))


def test_a_version_every_rank_has_is_bound_at_the_boundary_after_the_one_that_found_it():
    group = Group(2)

    def body(rank: int) -> List[tuple]:
        me = SimulatedRank(rank, group, 2, keep_previous=False)
        seen = [me.boundary()]  # starts the first offers: nothing to read yet
        me.commit(1)
        seen.append(me.boundary())  # reads the offers made before version 1 arrived
        seen.append(me.boundary())  # reads the offers of version 1: binds it
        return seen

    first, second = ranks_run(2, body, group)
    assert first == second == [(0, None, (), False), (0, None, (), False), (1, 1, (), False)]
    # Offers (newest, its negation, newest commit), then the bind's answer (2: bound).
    assert group.values[0] == [[-1, 1, 0], [1, -1, 1], [2], [-1, 1, 1]]


def test_a_version_refused_by_one_rank_goes_back_to_the_trainer_on_every_rank():
    group = Group(3)

    def body(rank: int):
        me = SimulatedRank(rank, group, 2, keep_previous=False)
        me.boundary()
        me.commit(1)
        me.boundary()
        refused = me.boundary(fail=rank == 1)
        free_after = len(me.free)
        me.commit(2)
        me.boundary()
        bound = me.boundary()
        return refused, free_after, bound, me

    results = ranks_run(3, body, group)
    for rank, (refused, free_after, bound, me) in enumerate(results):
        assert refused == (0, None, (1,), False), f"rank {rank}: {refused}"
        assert free_after == 2, f"rank {rank}: the refused set did not come back"
        assert bound == (2, 2, (), False), f"rank {rank}: the next version was not bound"
        # Rank 1's bind of version 1 failed; the others bound it, went back, then bound 2.
        assert me.region.binds == (1 if rank == 1 else 3)
        assert me.version_of[id(me.region.under)] == 2


def test_a_rank_whose_binds_always_fail_keeps_no_trainer_waiting():
    """The fault the random test of the first protocol could not show: a rank that never
    binds. Every version is refused on every rank, every set comes back to every trainer, and
    each trainer publishes all its versions; nobody switches."""
    ranks, versions = 3, 20
    group = Group(ranks)

    def body(rank: int):
        me = SimulatedRank(rank, group, 3, keep_previous=True)
        queue = list(range(1, versions + 1))
        for _ in range(6 * versions):
            while queue and me.commit(queue[0]):
                queue.pop(0)
            me.boundary(fail=rank == 2)
        return me, queue

    for rank, (me, queue) in enumerate(ranks_run(ranks, body, group)):
        assert queue == [], f"rank {rank}: its trainer was left without a set at {queue[0]}"
        assert me.switcher.version == 0 and me.bound == set()
        assert me.refused, f"rank {rank}: nothing was refused"
        assert len(me.free) + len(me.switcher.ready) == 3


def test_versions_arriving_while_the_ranks_narrow_down_are_not_thrown_away():
    """Rank 0 has version 5, rank 1 version 3: the next offers stay at or below 3. Meanwhile
    rank 1 receives 4 and 5: 5 is then common and must be bound, not dropped as a version
    some rank lacks (the answer under the ceiling says nothing above it)."""
    group = Group(2)

    def body(rank: int):
        me = SimulatedRank(rank, group, 4, keep_previous=False)
        me.boundary()
        me.commit(5 if rank == 0 else 3)
        me.boundary()  # offers 5 and 3
        if rank == 1:
            me.commit(4)
            me.commit(5)
        me.boundary()  # reads 5/3: the next offers stay at or below 3
        me.boundary()  # reads -1/3: nothing common up to 3; rank 1's 3 is dead, 5 stays
        return [me.boundary(), me.boundary()], sorted(me.switcher.ready), me

    for rank, (last_two, ready, me) in enumerate(ranks_run(2, body, group)):
        assert (5, 5, (), False) in last_two, f"rank {rank}: version 5 was never bound"
        assert ready == [] and me.switcher.version == 5
        assert len(me.free) == 3, f"rank {rank}: a set did not come back"


def test_a_rank_that_cannot_bind_back_is_split_and_the_group_switches_no_more():
    group = Group(2)

    class BackFails(Region):
        """Binds the new set, then fails: both the other rank's refusal and the way back."""

        def bind(self, weight_set):
            if self.binds >= 1:
                raise RuntimeError("the way back failed")
            super().bind(weight_set)

    def body(rank: int):
        me = SimulatedRank(rank, group, 3, keep_previous=True)
        if rank == 0:
            me.region = BackFails(me.home)
        me.boundary()
        me.commit(1)
        me.boundary()
        me.region.fail_next = rank == 1
        done = me.switcher.step(me.region.bind)
        me.region.fail_next = False
        me.commit(2)
        later = [me.switcher.step(me.region.bind) for _ in range(3)]
        rollback = me.switcher.rollback(me.region.bind)
        return done, later, rollback, me

    (done0, later0, rollback0, r0), (done1, later1, rollback1, r1) = ranks_run(2, body, group)
    assert done0.refused == done1.refused == [1]
    assert "Split from the group" in done0.problem and not r0.switcher.in_step
    assert r0.switcher.version == 1 and r0.region.under is r0.switcher.bound  # says what is true
    assert r1.switcher.in_step and r1.switcher.version == 0
    assert all(s.version is None for s in later0 + later1), "a split group switched"
    assert rollback0.version is None and rollback1.version is None
    assert "no version to roll back to" in rollback1.problem
    # The split rank hands every new set back, and what it cannot use any more.
    released0 = [s for switch in [done0, *later0] for s in switch.released]
    assert r0.home in released0 and any(s.name.endswith("s1") for s in released0)


def test_a_lost_group_hands_every_set_back_and_switches_no_more():
    region, _, home = lone(keep_previous=True)
    calls = []

    def broken(values):
        calls.append(list(values))
        if len(calls) > 1:
            raise RuntimeError("Connection closed by peer")
        return lambda: list(values)

    switcher = VersionSwitcher(lambda: region.under, keep_previous=True, start_min=broken)
    a, b = WeightSet("a"), WeightSet("b")
    assert switcher.step(region.bind) == Switch()  # the first offers start
    switcher.committed(a, 1)
    lost = switcher.step(region.bind)  # reads them, starts the next: raises
    assert not switcher.in_step and "Connection closed by peer" in lost.problem
    assert lost.released == [a] and switcher.ready == {}
    switcher.committed(b, 2)
    assert switcher.step(region.bind) == Switch(None, [b])
    assert "agreement is lost" in switcher.rollback(region.bind).problem
    assert region.binds == 0 and region.under is home and len(calls) == 2


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
    switcher = VersionSwitcher(lambda: None, start_min=lambda values: lambda: list(values))
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


# ------------------------------------------------------------------ agreeing every K boundaries


def test_the_default_agrees_every_few_boundaries_and_misuse_is_refused():
    assert 1 < DEFAULT_AGREE_EVERY <= 16
    for wrong in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="agree_every"):
            VersionSwitcher(lambda: None, agree_every=wrong)


def test_with_agree_every_a_version_binds_on_every_rank_at_the_same_agreement_boundary():
    """agree_every=3: offers start at boundaries 0, 3, 6, ...; the boundaries between start
    nothing and bind nothing. Version 1 arrives (on every rank) after boundary 0: offered at
    boundary 3, read and bound at boundary 6, on every rank at that boundary."""
    group = Group(2)

    def body(rank: int) -> List[tuple]:
        me = SimulatedRank(rank, group, 2, keep_previous=False, agree_every=3)
        seen = [me.boundary()]
        me.commit(1)
        rounds = []
        for _ in range(7):
            seen.append(me.boundary())
            rounds.append(group.rounds[rank])
        return seen, rounds

    (first, rounds0), (second, rounds1) = ranks_run(2, body, group)
    assert first == second
    assert [entry[1] for entry in first] == [None] * 6 + [1, None]
    assert [entry[0] for entry in first] == [0] * 6 + [1, 1]
    # Reductions started by boundaries 1..7: none between agreement boundaries.
    assert rounds0 == rounds1 == [1, 1, 2, 2, 2, 4, 4]
    assert group.values[0] == [[-1, 1, 0], [1, -1, 1], [2], [-1, 1, 1]]


def test_pass_boundary_counts_only_a_groups_boundaries_between_agreements():
    lone_switcher = VersionSwitcher(lambda: None, agree_every=4)
    assert not lone_switcher.pass_boundary()  # alone: every step binds, nothing to pass
    started = []

    def alone(values):
        started.append(list(values))
        return lambda: list(values)

    switcher = VersionSwitcher(lambda: None, start_min=alone, agree_every=4)
    assert not switcher.pass_boundary()  # the first boundary is an agreement boundary
    assert switcher.step(lambda s: None) == Switch() and len(started) == 1
    passed = [switcher.pass_boundary() for _ in range(4)]
    assert passed == [True, True, True, False] and len(started) == 1
    switcher.step(lambda s: None)  # the agreement boundary pass_boundary() left to step
    assert len(started) == 2
    # step() counts a boundary between agreements itself, as pass_boundary() does.
    assert [switcher.step(lambda s: None) for _ in range(3)] == [Switch()] * 3
    assert len(started) == 2 and not switcher.pass_boundary()


def test_with_agree_every_a_refused_version_goes_back_on_every_rank_at_the_same_boundary():
    group = Group(3)

    def body(rank: int):
        me = SimulatedRank(rank, group, 2, keep_previous=False, agree_every=3)
        me.boundary()
        me.commit(1)
        # Rank 1's binds fail from boundary 1 to 6; the only bind among them is at boundary 6.
        seen = [me.boundary(fail=rank == 1) for _ in range(6)]
        free_after = len(me.free)
        me.commit(2)
        seen += [me.boundary() for _ in range(6)]
        return seen, free_after, me

    results = ranks_run(3, body, group)
    logs = [seen for seen, _, _ in results]
    assert logs[0] == logs[1] == logs[2]
    assert [entry[2] for entry in logs[0]][:6] == [()] * 5 + [(1,)]
    assert [entry[1] for entry in logs[0]][6:] == [None] * 5 + [2]
    for rank, (_, free_after, me) in enumerate(results):
        assert free_after == 2, f"rank {rank}: the refused set did not come back"
        assert me.switcher.version == 2 and me.version_of[id(me.region.under)] == 2
        assert me.region.binds == (1 if rank == 1 else 3)


def test_a_rollback_between_agreement_boundaries_is_one_and_the_count_starts_over():
    group = Group(2)

    def body(rank: int):
        me = SimulatedRank(rank, group, 3, keep_previous=True, agree_every=4)
        me.boundary()  # boundary 0: offers start
        me.commit(1)
        seen = [me.boundary() for _ in range(8)]  # version 1 offered at 4, bound at 8
        me.commit(2)
        seen += [me.boundary() for _ in range(6)]  # 9..14: offered at 12
        rounds = group.rounds[rank]
        seen.append(me.boundary(rollback=True))  # 15: between agreement boundaries
        after = group.rounds[rank] - rounds
        # The count starts over at 15: the offers it started (version 2) are read at 19.
        seen += [me.boundary() for _ in range(4)]
        return seen, after, me

    (seen0, after0, r0), (seen1, after1, r1) = ranks_run(2, body, group)
    assert seen0 == seen1
    bound = [(i + 1, entry[1]) for i, entry in enumerate(seen0) if entry[1] is not None]
    assert bound == [(8, 1), (15, 0), (19, 2)], bound
    # The rollback read the offers pending (started at 12, version 2's: set aside), agreed (one
    # integer), bound and agreed again, and started new offers: three reductions on each rank.
    assert after0 == after1 == 3
    assert r0.switcher.version == r1.switcher.version == 2
