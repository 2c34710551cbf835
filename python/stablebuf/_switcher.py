"""Which weight version an engine serves, and when it switches: the committed sets waiting to
be bound, the set bound, the one kept for a rollback and, across the ranks of a
tensor-parallel group, one agreed switch per step boundary, made on every rank or on none.

Pure Python (no torch, no GPU): the engine (:mod:`stablebuf.publish`) hands it a function that
binds a set and, for a group, one that starts the minimum of a few integers over the ranks, so
every rule is tested on the CPU with simulated ranks (``python/tests/test_switcher_cpu.py``).

Across a group, the ranks agree at every ``agree_every``-th step boundary (an *agreement
boundary*; every rank counts the boundaries alike, since every rank calls :meth:`step` at
every one): it reads one reduction of three integers, started at the agreement boundary before
(so it runs while the steps between run, and an agreement boundary only collects it and starts
the next), and a switch adds one reduction of one integer. The boundaries between do nothing
(:meth:`VersionSwitcher.pass_boundary`): no reduction, no bind, nothing read. So the
agreement's cost is spread over ``agree_every`` steps, and the reduction has that long to
finish; the price is latency: a version every rank has is bound up to ``2 * agree_every``
boundaries after it arrived (``agree_every`` to be offered, as many to be read), against 2 for
``agree_every=1``, and every further round of the rules below takes ``agree_every`` more.

1. every rank offers the newest version it has ready, and the group takes the minimum and the
   maximum. Equal, and newer than the version bound (the same on every rank, since they switch
   together): every rank has it, and the boundary that reads the answer binds it. Otherwise
   each rank offers, at the next agreement boundary, the newest version it has at or below
   that minimum, and so on, until the ranks agree or have nothing newer in common (a rank's
   trainer may have skipped a version, or be a step behind): the newest version every rank
   holds. Versions that arrive meanwhile are newer than any offer made, so they never change
   an answer: they are offered once the ranks start over. The same reduction carries the
   oldest of the ranks' newest commits: commits arrive in order, so a version no newer than
   that and than the ceiling, which some rank lacks, will never be common, and its sets go back
   to the trainers (else two ranks each holding a version the other lacks would wait for each
   other with no free set). Nothing leaves a rank's ready versions between agreement
   boundaries (a rollback is one), so what a rank offered it still has when the answer is
   read.
2. every rank binds it, or reports that its bind failed, and the minimum of those answers
   decides: all bound, and the switch stands; otherwise each rank that bound goes back to the
   set it had, which it still holds, because nothing is released before the decision, and the
   refused version goes back to the trainer on every rank (its set, and every older one
   waiting), so that no trainer waits for a set that a failing rank would hold forever.

A rollback is an agreement boundary of its own, whenever it comes: every rank reads the
offers pending (sets their answer aside) and starts the next, so the count starts over from it
on every rank alike.

A set is never handed back to the trainer while it is bound, kept for a rollback, or waiting
to be bound; every other set is handed back.

Nothing here raises for what another rank or the group did: :meth:`VersionSwitcher.step` and
:meth:`VersionSwitcher.rollback` return a :class:`Switch` that says what was refused and why.
:class:`SwitchFailed` is for misuse only (a commit that names a set the engine holds or a
version not newer, a rollback without ``keep_previous``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: ``start_min(values)``: starts the element-wise minimum of ``values`` over the ranks of a
#: group and returns a function that waits for it and returns it. Every rank starts one, with
#: as many values, at the same point; either call may raise when the group is broken.
StartMin = Callable[[Sequence[int]], Callable[[], List[int]]]
#: ``bind(weight_set)``: put ``weight_set`` under the region; on an exception nothing changed.
Bind = Callable[[Any], None]

#: The engine's default ``agree_every`` (:class:`stablebuf.publish.Engine`): the group agrees at
#: every 8th step boundary. At 2 ranks on H100s an agreement boundary cost 291 us against a
#: 6 ms decode step (4.8%) when every boundary was one; an eighth of that would be 0.6%
#: (python/examples/tp_publish_cost.py measures it). A version every rank has is bound within
#: 16 boundaries (about 0.1 s at 6 ms a step).
DEFAULT_AGREE_EVERY = 8

#: What a rank offers when it has no version at or below the one asked for (and what a rank
#: that can no longer switch offers, so that the group never switches without it).
NOTHING_NEW = -1
# A bind's answers; the minimum over the ranks decides.
_FAILED, _BOUND = 0, 2


def check_agree_every(agree_every: int) -> None:
    """Raises ``ValueError`` unless ``agree_every`` is a whole number, at least 1."""
    if isinstance(agree_every, bool) or not isinstance(agree_every, int) or agree_every < 1:
        raise ValueError(f"agree_every={agree_every!r}: a whole number of boundaries, at least 1")


class SwitchFailed(RuntimeError):
    """Misuse: a commit that names a set the engine holds or a version that is not newer, or a
    rollback on an engine that keeps no previous version. Nothing changed."""


@dataclass
class Switch:
    """What one step boundary (or rollback) did: the version bound by it (``None``: none), the
    sets the engine may hand back to the trainer, the versions the group refused (a bind
    failed on some rank; their sets are among ``released``), and ``problem``: what went wrong,
    in words, for the caller's log (``None``: nothing)."""

    version: Optional[int] = None
    released: List[Any] = field(default_factory=list)
    refused: List[int] = field(default_factory=list)
    problem: Optional[str] = None


class VersionSwitcher:
    """One engine's versions: ``ready`` (committed, not bound: version → set), the set
    ``bound`` now and its ``version``, and ``previous`` (set, version) when rollbacks are kept.

    ``bound`` is ``None`` for the region's own backing until the first switch; ``current()``
    returns it as a set when a rollback or a failed switch needs it back. ``start_min`` makes
    every switch and rollback a decision of the whole group (``None``: this engine alone, which
    binds the newest ready version at the boundary it is called at). ``agree_every``: with a
    group, agree at every ``agree_every``-th call of :meth:`step` (the same on every rank; 1:
    at every one); :meth:`pass_boundary` says which calls are not agreement boundaries.

    ``split``: why this rank serves another version than the rest of its group (it bound a
    version the group refused and could not bind its old set back); ``lost``: why the group's
    agreement stopped (a reduction raised). Either way the rank switches no more, and hands
    every set that arrives back to its trainer; the caller has to rebuild the group.
    """

    def __init__(
        self,
        current: Callable[[], Any],
        *,
        keep_previous: bool = False,
        start_min: Optional[StartMin] = None,
        agree_every: int = 1,
    ) -> None:
        check_agree_every(agree_every)
        self.ready: Dict[int, Any] = {}
        self.bound: Any = None
        self.version = 0
        #: The newest version ever committed here.
        self.last = 0
        self.previous: Optional[Tuple[Any, int]] = None
        self.split: Optional[str] = None
        self.lost: Optional[str] = None
        self._current = current
        self._keep_previous = keep_previous
        self._start_min = start_min
        # The offers started at the last boundary, read at the next one, and the ceiling they
        # were made under (None: each rank's newest).
        self._offers: Optional[Callable[[], List[int]]] = None
        self._ceiling: Optional[int] = None
        #: With a group: agree at every ``agree_every``-th boundary (the same on every rank).
        self.agree_every = agree_every
        # Boundaries still to pass before the next agreement boundary (0: the next one is).
        self._wait = 0

    # ----------------------------------------------------------------- state

    @property
    def in_step(self) -> bool:
        """Whether this rank serves the version its group serves and can still switch with it
        (always, alone)."""
        return self.split is None and self.lost is None

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

    def pass_boundary(self) -> bool:
        """With a group, at a step boundary that is not an agreement boundary: counts it and
        returns ``True``; nothing else is done or due there (no reduction, no bind, nothing to
        hand back), so a caller may skip reading its trainer too. Returns ``False``, counting
        nothing, at an agreement boundary, alone, and once the group is lost: :meth:`step` has
        work there. :meth:`step` calls it first, so call one or the other per boundary."""
        if self._wait:
            self._wait -= 1
            return True
        return False

    def step(self, bind: Bind, *, before_is_gone: bool = False) -> Switch:
        """At a step boundary: binds the newest version ready (alone) or, with a group, at an
        agreement boundary, the newest every rank of the group had ready at the agreement
        boundary before (on every rank, or on none; between agreement boundaries it only
        counts the boundary). Returns what it bound, released and refused; raises nothing for
        what a bind or another rank did.

        ``before_is_gone``: what was bound cannot be bound again (the region's own backing,
        discarded by a sleep; ``bind`` then wakes the region): it is neither kept for a
        rollback nor handed back. This engine alone only."""
        if self._start_min is None:
            if not self.ready:
                return Switch()
            return self._switch_to(bind, max(self.ready), before_is_gone)
        if before_is_gone:
            raise ValueError(
                "a group switch must be able to go back: before_is_gone is for one engine"
            )
        if self.lost is not None:
            return Switch(None, self._release_ready())
        if self._wait:  # pass_boundary(), inlined: most boundaries end here
            self._wait -= 1
            return Switch()
        ceiling = self._ceiling
        try:
            answer = self._read_offers()
        except Exception as error:  # the group is broken: no agreement is possible any more
            return self._lose(error)
        switch = Switch()
        if self.split is not None:
            switch = Switch(None, self._release_ready())  # it never binds again
        elif answer is not None:
            lowest, highest, settled = answer
            self._ceiling = None  # unless the offers differ: then the next ones stay below
            if lowest > self.version and lowest == highest:
                switch = self._switch_to(bind, lowest)  # every rank offered it: every rank has it
            elif lowest > self.version:
                self._ceiling = lowest  # strictly lower each time round, so this ends
            else:
                # Some rank has nothing newer at or below the ceiling, so no version in common
                # is newer than the one bound; every rank has received all it ever will up to
                # `settled`, so what it lacks up to there (and the ceiling) is never coming.
                limit = settled if ceiling is None else min(settled, ceiling)
                dead = sorted(v for v in self.ready if v <= limit)
                switch = Switch(None, [self.ready.pop(v) for v in dead])
        return _joined(switch, self._start_offers())

    def rollback(self, bind: Bind) -> Switch:
        """Binds the version bound before the last switch again (on every rank of the group,
        or on none); the set it leaves goes back to the trainer. Versions still waiting stay
        ready: a later step boundary binds the newest of them. With a group it is an agreement
        boundary, whenever it comes (see the module's docstring). Raises :class:`SwitchFailed`
        only without ``keep_previous``; a refusal is in the returned :class:`Switch`."""
        if not self._keep_previous:
            raise SwitchFailed("rollbacks are off: make the engine with keep_previous=True")
        if self.lost is not None:
            return Switch(problem=f"no rollback: the group's agreement is lost ({self.lost})")
        try:
            # Every rank rolls back at the same boundary, so every rank sets the offers pending
            # (started at the last agreement boundary) aside here, and starts new ones after:
            # the count of boundaries starts over here on every rank.
            self._read_offers()
            self._ceiling = None
            here = self.previous is not None and self.split is None
            everywhere = self._agree(1 if here else 0)
        except Exception as error:
            return self._lose(error)
        if everywhere == 0:
            why = (
                "this rank serves another version than its group"
                if self.split is not None
                else "none was kept: no switch since the start or the last rollback"
                if self.previous is None
                else "another rank has none"
            )
            switch = Switch(problem=f"no version to roll back to ({why})")
        else:
            assert self.previous is not None  # every rank has one
            back, back_version = self.previous
            leaving = self.bound if self.bound is not None else self._current()
            switch = self._bind_agreed(
                bind, back, back_version, leaving, lambda: self._rolled_back(leaving), True
            )
        return _joined(switch, self._start_offers())

    # ----------------------------------------------------------------- helpers

    def _switch_to(self, bind: Bind, target: int, before_is_gone: bool = False) -> Switch:
        """Binds ready version ``target`` (with a group: every rank has it) and, with a group,
        agrees on the outcome. A refusal hands ``target``'s set and every older ready one back."""
        chosen = self.ready[target]
        before = self.bound
        if before is None and not before_is_gone and (self._keep_previous or self._start_min):
            # The region's own backing, asked for only where it may be bound again: kept for
            # a rollback, or bound back if the group refuses. Otherwise the bind frees it.
            before = self._current()
        return self._bind_agreed(
            bind, chosen, target, before, lambda: self._switched(chosen, target, before), False
        )

    def _bind_agreed(
        self,
        bind: Bind,
        weight_set: Any,
        version: int,
        before: Any,
        done: Callable[[], Switch],
        is_rollback: bool,
    ) -> Switch:
        """Binds ``weight_set`` (``version``) here and takes the group's answer: ``done()`` when
        every rank bound it, else every rank that bound it binds ``before`` again. A refused
        switch hands its version and every older ready one back to the trainer; a refused
        rollback keeps the previous version (it may be tried again)."""
        answer, failure = self._try_bind(bind, weight_set)
        try:
            agreed = self._agree(answer)
        except Exception as error:
            # Whether the others bound is unknown: go back (so that this rank at least serves
            # what it served) and switch no more.
            freed, split = (
                self._go_back(bind, before, weight_set, version) if answer == _BOUND else ([], None)
            )
            lost = self._lose(error)
            return Switch(None, lost.released + freed, problem=_sentences(lost.problem, split))
        if agreed == _BOUND:
            return done()
        where = f"this rank's bind failed: {failure}" if failure else "another rank's bind failed"
        problem = (
            f"{'the rollback to ' if is_rollback else ''}version {version} was refused: {where}; "
            f"every rank is still on version {self.version}"
        )
        freed, split = (
            self._go_back(bind, before, weight_set, version) if answer == _BOUND else ([], None)
        )
        if is_rollback:
            return Switch(None, freed, problem=_sentences(problem, split))
        # The refused version and every older one waiting go back: binding them later could
        # fail the same way, and holding them could leave a trainer without a free set.
        refused_and_older = sorted(v for v in self.ready if v <= version)
        released = [self.ready.pop(v) for v in refused_and_older] + freed
        problem += ", and the refused set went back to the trainer"
        return Switch(None, released, refused=[version], problem=_sentences(problem, split))

    def _switched(self, chosen: Any, target: int, before: Any) -> Switch:
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

    def _rolled_back(self, leaving: Any) -> Switch:
        assert self.previous is not None
        self.bound, self.version = self.previous
        self.previous = None
        return Switch(self.version, [leaving])

    def _release_ready(self) -> List[Any]:
        """Every ready set, handed back (for a rank that no longer switches)."""
        released = [s for _, s in sorted(self.ready.items())]
        self.ready = {}
        return released

    def _start_offers(self) -> Optional[Switch]:
        """Starts this boundary's offers: the newest version ready at or below the ceiling
        (``NOTHING_NEW`` from a split rank), negated for the maximum, and the newest commit.
        Returns what losing the group did, if starting them raised."""
        if self._start_min is None or self.lost is not None:
            return None  # alone, nothing is agreed ahead
        offer = NOTHING_NEW
        if self.split is None:
            offer = max(
                (v for v in self.ready if self._ceiling is None or v <= self._ceiling),
                default=NOTHING_NEW,
            )
        try:
            self._offers = self._start_min([offer, -offer, self.last])
        except Exception as error:
            return self._lose(error)
        self._wait = self.agree_every - 1  # read at the agree_every-th boundary from here
        return None

    def _read_offers(self) -> Optional[Tuple[int, int, int]]:
        """The group's answer to the offers started at the last agreement boundary: (lowest offer,
        highest offer, oldest newest commit); ``None`` when none were started."""
        offers, self._offers = self._offers, None
        if offers is None:
            return None
        low, negated_high, last = offers()
        return int(low), -int(negated_high), int(last)

    def _agree(self, value: int) -> int:
        """The minimum of ``value`` over the group, now."""
        if self._start_min is None:
            return value
        return int(self._start_min([value])()[0])

    def _lose(self, error: BaseException) -> Switch:
        """The group's reduction raised: no rank can agree with this one any more."""
        self.lost = f"{type(error).__name__}: {error}"
        self._offers = None
        self._wait = 0  # a lost rank hands every set back at every boundary
        return Switch(
            None,
            self._release_ready(),
            problem=f"the group's agreement is lost ({self.lost}): this rank stays on version "
            f"{self.version} and switches no more; rebuild the group",
        )

    @staticmethod
    def _try_bind(bind: Bind, weight_set: Any) -> Tuple[int, Optional[BaseException]]:
        try:
            bind(weight_set)
        except Exception as failure:  # the region is as it was (stablebuf's rule)
            return _FAILED, failure
        return _BOUND, None

    def _go_back(
        self, bind: Bind, before: Any, now_bound: Any, now_version: int
    ) -> Tuple[List[Any], Optional[str]]:
        """Binds ``before`` again after the group refused ``now_version``, which this rank
        bound (``now_bound``). Returns the sets that freed and ``None``, or, when that bind
        failed, what is true now: this rank serves ``now_version``, split from its group (it
        switches no more, so ``before`` and the set kept for a rollback are free)."""
        try:
            bind(before)
        except Exception as failure:
            stale = self.version
            freed = [before]
            if self.previous is not None and self.previous[0] is not now_bound:
                freed.append(self.previous[0])  # no rollback is agreed with a split rank
            self.ready = {v: s for v, s in self.ready.items() if s is not now_bound}
            self.bound, self.version = now_bound, now_version
            self.previous = None
            self.split = (
                f"binding version {stale} back failed ({failure}): this rank serves version "
                f"{now_version}, the others version {stale}"
            )
            return freed, f"Split from the group: {self.split}; rebuild the group"
        return [], None


def _joined(switch: Switch, more: Optional[Switch]) -> Switch:
    """``switch`` with what ``more`` released and said added."""
    if more is None:
        return switch
    switch.released.extend(more.released)
    switch.problem = _sentences(switch.problem, more.problem)
    return switch


def _sentences(*parts: Optional[str]) -> Optional[str]:
    said = [p for p in parts if p]
    return ". ".join(said) if said else None
