"""A tensor-parallel group simulated on threads, for the CPU tests of the version switch
(test_switcher_cpu.py) and of the engine (test_publish_engine_cpu.py): one thread per rank,
and the group's reduction as a barrier.

``Group(ranks).start_min(rank)`` is what ``VersionSwitcher(start_min=...)`` takes: every rank
puts its values and waits for the others (so a rank that calls it out of step with the others
breaks the barrier: a failure, not a hang), and gets back a function returning the minimum.
The reduction is made when it starts; the switcher reads it later, as it reads a gloo
reduction started at the (agreement) boundary before."""

from __future__ import annotations

import threading
from typing import Callable, List, Sequence


class Group:
    def __init__(self, ranks: int, timeout: float = 20.0) -> None:
        self.barrier = threading.Barrier(ranks, timeout=timeout)
        self.slots: list = [None] * ranks
        #: Reductions started, per rank (the same on every rank when they keep in step).
        self.rounds = [0] * ranks
        #: Per rank, the values of every reduction it started.
        self.values: List[list] = [[] for _ in range(ranks)]

    def start_min(self, rank: int) -> Callable[[Sequence[int]], Callable[[], List[int]]]:
        def start_min(values: Sequence[int]) -> Callable[[], List[int]]:
            self.rounds[rank] += 1
            self.values[rank].append(list(values))
            self.slots[rank] = list(values)
            self.barrier.wait()
            result = [min(column) for column in zip(*self.slots)]
            # Nobody writes the next round's values before everyone has read this one's.
            self.barrier.wait()
            return lambda: list(result)

        return start_min


def run_ranks(ranks: int, body: Callable[[int], object], group: Group) -> list:
    """Runs ``body(rank)`` on one thread per rank; returns their results in rank order and
    raises the first rank's error (after breaking the barrier, so the others stop too)."""
    results: list = [None] * ranks
    errors: list = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # reported from the calling thread
            errors.append((rank, error))
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # The first error raised; the others are mostly BrokenBarrierError from the abort.
        errors.sort(key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
        rank, error = errors[0]
        raise AssertionError(f"rank {rank}: {error!r}") from error
    return results
