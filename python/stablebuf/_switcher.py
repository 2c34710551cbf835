"""Which weight version an engine serves, and when it switches: the committed sets waiting to
be bound, the set bound, the one kept for a rollback and, across the ranks of a
tensor-parallel group, one agreed switch per step boundary, made on every rank or on none.

Pure Python (no torch, no GPU): the engine (:mod:`stablebuf.publish`) hands it a function that
binds a set and, for a group, one that takes the minimum of a few integers over the ranks, so
every rule is tested on the CPU with simulated ranks (``python/tests/test_switcher_cpu.py``).

Across a group, a step boundary costs one reduction (of two integers) when nothing new has
arrived, and two when a switch is made:

1. every rank offers the newest version it has ready, and the group takes the minimum and the
   maximum. Equal, and newer than the version bound (the same on every rank, since they switch
   together): every rank has it. Otherwise each rank offers the newest version it has at or
   below that minimum, and so on, until the ranks agree or have nothing newer in common (a
   rank's trainer may have skipped a version, or be a step behind): the newest version every
   rank holds. The same reduction carries the oldest of the ranks' newest commits: commits
   arrive in order, so a version no newer than that which some rank lacks will never be
   common, and its sets go back to the trainers (else two ranks each holding a version the
   other lacks would wait for each other with no free set).
2. every rank binds it, or reports that its bind failed, and the minimum of those answers
   decides: all bound, and the switch stands; otherwise each rank that bound goes back to the
   set it had, which it still holds, because nothing is released before the decision.

A set is never handed back to the trainer while it is bound, kept for a rollback, or waiting
to be bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: ``reduce_min(values)``: the element-wise minimum of ``values`` over the ranks of a group;
#: every rank calls it with as many values, at the same point.
ReduceMin = Callable[[Sequence[int]], List[int]]
#: ``bind(weight_set)``: put ``weight_set`` under the region; on an exception nothing changed.
Bind = Callable[[Any], None]

#: What a rank offers when it has no version at or below the one asked for.
NOTHING_NEW = -1
# A bind's answers; the minimum over the ranks decides.
_FAILED, _BOUND = 0, 2


class SwitchFailed(RuntimeError):
    """A switch or rollback was refused or failed; every rank is still on the version it had."""


@dataclass
class Switch:
    """What one step boundary (or rollback) did: the version bound by it (``None``: none) and
    the sets the engine may hand back to the trainer."""

    version: Optional[int] = None
    released: List[Any] = field(default_factory=list)


class VersionSwitcher:
    """One engine's versions: ``ready`` (committed, not bound: version → set), the set
    ``bound`` now and its ``version``, and ``previous`` (set, version) when rollbacks are kept.

    ``bound`` is ``None`` for the region's own backing until the first switch; ``current()``
    returns it as a set when a rollback or a failed switch needs it back. ``reduce_min`` makes
    every switch and rollback a decision of the whole group (``None``: this engine alone).
    """

    def __init__(
        self,
        current: Callable[[], Any],
        *,
        keep_previous: bool = False,
        reduce_min: Optional[ReduceMin] = None,
    ) -> None:
        self.ready: Dict[int, Any] = {}
        self.bound: Any = None
        self.version = 0
        #: The newest version ever committed here.
        self.last = 0
        self.previous: Optional[Tuple[Any, int]] = None
        self._current = current
        self._keep_previous = keep_previous
        self._reduce = reduce_min

    # ----------------------------------------------------------------- state

    def held(self) -> List[Any]:
        """The sets the trainer may not write now: bound, kept for a rollback, or ready."""
        held = [] if self.bound is None else [self.bound]
        if self.previous is not None:
            held.append(self.previous[0])
        held.extend(self.ready.values())
        return held

    def committed(self, weight_set: Any, version: int) -> None:
        """The trainer committed ``version`` (checked newer than any earlier commit) in
        ``weight_set`` (one it may write)."""
        if any(weight_set is held for held in self.held()):
            raise SwitchFailed(f"a commit of version {version} names a set the engine holds")
        if version <= self.last:
            raise SwitchFailed(f"version {version} is not newer than version {self.last}")
        self.ready[version] = weight_set
        self.last = version

    def keep_newest(self) -> List[Any]:
        """Hands back every ready set but the newest, for one engine that binds nothing for
        now (asleep): its trainer may go on publishing. Returns them."""
        if len(self.ready) < 2:
            return []
        newest = max(self.ready)
        released = [s for v, s in sorted(self.ready.items()) if v != newest]
        self.ready = {newest: self.ready[newest]}
        return released

    # ----------------------------------------------------------------- switching

    def step(self, bind: Bind, *, before_is_gone: bool = False) -> Switch:
        """At a step boundary: binds the newest version ready (on every rank of the group, or
        on none). Returns what it bound and released; raises :class:`SwitchFailed` when a
        bind failed (here or on another rank), with every rank left on the version it had.

        ``before_is_gone``: what was bound cannot be bound again (the region's own backing,
        discarded by a sleep; ``bind`` then wakes the region): it is neither kept for a
        rollback nor handed back. This engine alone only."""
        if before_is_gone and self._reduce is not None:
            raise ValueError(
                "a group switch must be able to go back: before_is_gone is for one engine"
            )
        target, settled = self._newest_in_common()
        if target is None:
            # What no rank will ever receive again and some rank lacks can never be bound.
            dead = [v for v in self.ready if v <= settled]
            return Switch(None, [self.ready.pop(v) for v in sorted(dead)])
        chosen = self.ready[target]
        before = self.bound
        if before is None and not before_is_gone and (self._keep_previous or self._reduce):
            # The region's own backing, asked for only where it may be bound again: kept for
            # a rollback, or bound back if the group refuses. Otherwise the bind frees it.
            before = self._current()
        answer, failure = self._try_bind(bind, chosen)
        if self._agree(answer) != _BOUND:
            if answer == _BOUND:
                self._go_back(bind, before, chosen, target)
            raise SwitchFailed(
                f"version {target} was not bound: "
                + (f"this rank's bind failed: {failure}" if failure else "another rank's failed")
                + f"; every rank is still on version {self.version}"
            ) from failure
        released = [s for v, s in self.ready.items() if v < target]
        self.ready = {v: s for v, s in self.ready.items() if v > target}
        if self._keep_previous and self.previous is not None:
            released.append(self.previous[0])
            self.previous = None
        if before is not None:
            if self._keep_previous:
                self.previous = (before, self.version)
            else:
                released.append(before)
        self.bound, self.version = chosen, target
        return Switch(target, released)

    def rollback(self, bind: Bind) -> Switch:
        """Binds the version bound before the last switch again (on every rank of the group,
        or on none); the set it leaves goes back to the trainer. Versions still waiting stay
        ready: the next step boundary binds the newest of them."""
        if not self._keep_previous:
            raise SwitchFailed("rollbacks are off: make the engine with keep_previous=True")
        here = self.previous is not None
        if self._agree(1 if here else 0) == 0:
            raise SwitchFailed(
                "no version to roll back to "
                + ("on another rank" if here else "(none was kept: no switch since the last)")
            )
        assert self.previous is not None  # every rank has one
        back, back_version = self.previous
        leaving = self.bound if self.bound is not None else self._current()
        answer, failure = self._try_bind(bind, back)
        if self._agree(answer) != _BOUND:
            if answer == _BOUND:
                self._go_back(bind, leaving, back, back_version)
            raise SwitchFailed(
                f"rollback to version {back_version} failed "
                + (f"on this rank: {failure}" if failure else "on another rank")
                + f"; every rank is still on version {self.version}"
            ) from failure
        self.previous = None
        self.bound, self.version = back, back_version
        return Switch(back_version, [leaving])

    # ----------------------------------------------------------------- helpers

    def _agree(self, value: int) -> int:
        """The minimum of ``value`` over the group."""
        return value if self._reduce is None else int(self._reduce([value])[0])

    def _newest_in_common(self) -> Tuple[Optional[int], int]:
        """The newest version newer than the one bound that every rank of the group has ready
        (``None``: none), and the oldest of the ranks' newest commits (every rank has received
        all it ever will up to there); the same answers on every rank."""
        ceiling: Optional[int] = None
        while True:
            offer = max(
                (v for v in self.ready if ceiling is None or v <= ceiling), default=NOTHING_NEW
            )
            if self._reduce is None:
                lowest, highest, settled = offer, offer, self.last
            else:
                low, negated_high, last = self._reduce([offer, -offer, self.last])
                lowest, highest, settled = int(low), -int(negated_high), int(last)
            if lowest <= self.version:
                return None, settled  # some rank has nothing newer at or below the ceiling
            if lowest == highest:
                return lowest, settled  # every rank offered it: every rank has it
            ceiling = lowest  # strictly lower each time round, so this ends

    @staticmethod
    def _try_bind(bind: Bind, weight_set: Any) -> Tuple[int, Optional[BaseException]]:
        try:
            bind(weight_set)
        except Exception as failure:  # the region is as it was (stablebuf's rule)
            return _FAILED, failure
        return _BOUND, None

    def _go_back(self, bind: Bind, before: Any, now_bound: Any, now_version: int) -> None:
        """Binds ``before`` again after the group refused ``now_version``, which this rank
        bound (``now_bound``)."""
        try:
            bind(before)
        except Exception as failure:
            # Say what is true: this rank serves `now_version` (the others do not); `before`
            # stays out of the trainer's hands, and the caller has to set the group right.
            stale = self.version
            self.ready = {v: s for v, s in self.ready.items() if s is not now_bound}
            if self.previous is not None and self.previous[0] is now_bound:
                self.previous = None
            self.bound, self.version = now_bound, now_version
            raise SwitchFailed(
                f"the group refused version {now_version}, which this rank had bound, and "
                f"binding version {stale} back failed: {failure}. This rank now serves "
                f"version {now_version}, the others version {stale}"
            ) from failure
