"""Pure logic of the KV cache's Python side (issue 45): no torch, no driver, tested on the CPU.

What `stablebuf.hf.StableCache` grows to, what memory a cache may hold (the issue's bound:
the tokens' bytes plus one granule per sequence, layer and K/V), admission under a memory
budget, the continuous-batching schedule `examples/kv_serve.py` drives, and its verdicts.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple

GRANULE = 2 << 20


def grow_target(length: int, ahead: int, max_len: int) -> int:
    """Tokens a sequence of `length` tokens is grown to: `ahead` more, at most `max_len`."""
    if length < 0 or ahead < 0:
        raise ValueError(f"length {length} and ahead {ahead} must be >= 0")
    if length > max_len:
        raise ValueError(f"{length} tokens asked of a cache of max_len {max_len}")
    return min(length + ahead, max_len)


def granules_for(tokens: int, token_bytes: int, granule: int = GRANULE) -> int:
    """Granules one (sequence, layer, K/V) row maps for `tokens` tokens."""
    return -(-tokens * token_bytes // granule)


def row_stride(max_len: int, token_bytes: int, granule: int = GRANULE) -> int:
    """Bytes from one sequence's row to the next (whole granules), as the Rust layout."""
    return max(1, granules_for(max_len, token_bytes, granule)) * granule


def mapped_bytes(lengths: Iterable[int], layers: int, token_bytes: int, granule: int = GRANULE) -> int:
    """Data bytes a cache maps for sequences of `lengths` (no look-ahead, no sharing)."""
    per_row = sum(granules_for(n, token_bytes, granule) for n in lengths if n > 0)
    return 2 * layers * per_row * granule


def memory_bound(lengths: Iterable[int], layers: int, token_bytes: int, granule: int = GRANULE) -> int:
    """The issue's bound: the tokens' bytes plus one granule per (sequence, layer, K/V)."""
    lengths = [n for n in lengths if n > 0]
    tokens = sum(lengths)
    return 2 * layers * (tokens * token_bytes + len(lengths) * granule)


def static_bytes(layers: int, batch: int, max_len: int, token_bytes: int) -> int:
    """Bytes of a StaticCache of `batch` sequences of `max_len` tokens."""
    return 2 * layers * batch * max_len * token_bytes


def fits(
    held_bytes: int,
    tokens: int,
    budget: int,
    layers: int,
    token_bytes: int,
    granule: int = GRANULE,
) -> bool:
    """Whether one more sequence that will reach `tokens` tokens fits `budget` beside
    `held_bytes` (what is mapped now, plus what the admitted sequences will still map)."""
    need = 2 * layers * granules_for(tokens, token_bytes, granule) * granule
    return held_bytes + need <= budget


@dataclass
class Request:
    """One request: it arrives at step `arrival` with `prompt` tokens and wants `output`."""

    rid: int
    arrival: int
    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def make_requests(
    count: int,
    max_len: int,
    mean_total: int,
    arrivals_per_step: float,
    seed: int = 0,
) -> List[Request]:
    """`count` requests of random prompt and output lengths (their totals uniform on
    `[mean_total / 2, 3 mean_total / 2]`, at most `max_len`), arriving at random steps."""
    if mean_total * 3 // 2 > max_len:
        raise ValueError(f"mean length {mean_total} too long for max_len {max_len}")
    rng = random.Random(seed)
    out: List[Request] = []
    step = 0.0
    for rid in range(count):
        total = rng.randint(max(2, mean_total // 2), max(2, mean_total * 3 // 2))
        prompt = rng.randint(1, max(1, total // 2))
        out.append(Request(rid, int(step), prompt, total - prompt))
        step += rng.expovariate(arrivals_per_step) if arrivals_per_step > 0 else 0.0
    return out


@dataclass
class Slot:
    request: Request
    length: int  # tokens in the cache
    generated: int = 0


@dataclass
class Scheduler:
    """Continuous batching over `max_batch` slots: requests are admitted when they have
    arrived, a slot is free and `admit` agrees; each decode step adds one token to every
    running sequence; a sequence leaves when it has its output."""

    max_batch: int
    requests: List[Request]
    pending: Deque[Request] = field(default_factory=deque)
    slots: Dict[int, Slot] = field(default_factory=dict)
    done: List[int] = field(default_factory=list)
    step: int = 0
    peak_running: int = 0

    def __post_init__(self) -> None:
        # A deque: admission pops from the front (a list's pop(0) is linear per request).
        self.pending = deque(sorted(self.requests, key=lambda r: (r.arrival, r.rid)))

    def free_slots(self) -> List[int]:
        return [s for s in range(self.max_batch) if s not in self.slots]

    def admit(self, accept=lambda request, slot: True) -> List[Tuple[int, Request]]:
        """Admits arrived requests in order while slots are free and `accept` agrees (the
        first refusal stops admission: no overtaking). Returns `(slot, request)` pairs; the
        caller prefills them (their length is their prompt)."""
        admitted = []
        free = self.free_slots()
        while self.pending and free and self.pending[0].arrival <= self.step:
            request = self.pending[0]
            slot = free[0]
            if not accept(request, slot):
                break
            self.pending.popleft()
            free.pop(0)
            self.slots[slot] = Slot(request, request.prompt)
            admitted.append((slot, request))
        self.peak_running = max(self.peak_running, len(self.slots))
        return admitted

    def advance(self) -> Tuple[List[Tuple[int, int]], List[int]]:
        """One decode step: each running sequence gains a token. Returns `(slot, new length)`
        for every running slot (grow these before the step) and the slots that finished
        after it (release these)."""
        grown = []
        finished = []
        for slot, state in sorted(self.slots.items()):
            state.length += 1
            state.generated += 1
            grown.append((slot, state.length))
            if state.generated >= state.request.output:
                finished.append(slot)
        return grown, finished

    def finish(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.done.append(self.slots.pop(slot).request.rid)
        self.step += 1

    @property
    def idle(self) -> bool:
        return not self.pending and not self.slots

    def lengths(self) -> List[int]:
        """Every slot's length (0 when free)."""
        return [self.slots[s].length if s in self.slots else 0 for s in range(self.max_batch)]


class Admission:
    """Admission under a memory budget, as `examples/kv_serve.py` runs it: a request is admitted
    when the granules its rows will map at its full length (`request.total`) fit `budget`
    beside those projected for the sequences admitted before it; `budget=None` admits all.

    The projection is recorded when a request is accepted: `Scheduler.admit` asks about every
    request that arrived in one step before the caller sees any of them, so a projection made
    by the caller after `admit` returns would let each of them see the same, stale total."""

    def __init__(self, budget: Optional[int], layers: int, token_bytes: int, granule: int = GRANULE):
        self.budget = budget
        self.layers = layers
        self.token_bytes = token_bytes
        self.granule = granule
        self.projected: Dict[int, int] = {}

    def need(self, tokens: int) -> int:
        """Bytes a sequence of `tokens` tokens maps in every layer's K and V."""
        return 2 * self.layers * granules_for(tokens, self.token_bytes, self.granule) * self.granule

    @property
    def held(self) -> int:
        return sum(self.projected.values())

    def __call__(self, request: Request, slot: int) -> bool:
        if self.budget is not None and not fits(
            self.held, request.total, self.budget, self.layers, self.token_bytes, self.granule
        ):
            return False
        self.projected[slot] = self.need(request.total)
        return True

    def release(self, slot: int) -> None:
        self.projected.pop(slot, None)


# Sizes of examples/kv_serve.py. "quick" is its default: about a minute on one H100, and it
# still measures every target (rows cross granules while decoding, and the budget run can
# exceed 2 x max_batch sequences); "issue" is the table (batch 16, 8 layers, 256
# requests: several minutes). `tests/test_kv_cpu.py` checks both with `simulate`.
SIZES: Dict[str, Dict[str, int]] = {
    "quick": {"max_batch": 8, "max_len": 4096, "requests": 48, "layers": 4},
    "issue": {"max_batch": 16, "max_len": 4096, "requests": 256, "layers": 8},
}


def workload(
    count: int, max_batch: int, max_len: int, mean_total: int, budget_slots: int, seed: int = 0
) -> Tuple[List[Request], List[Request]]:
    """kv_serve's two request streams: one arriving fast enough to keep `max_batch` slots busy
    (static and stable at the same batch), one for the `budget_slots * max_batch` slots of the
    run at the budget."""
    mean_out = max(1, mean_total // 2)
    same = make_requests(count, max_len, mean_total, arrivals_per_step=max_batch / mean_out, seed=seed)
    budget = make_requests(
        count, max_len, mean_total, arrivals_per_step=budget_slots * max_batch / mean_out, seed=seed + 1
    )
    return same, budget


@dataclass
class Plan:
    """What a schedule does, without a GPU (see `simulate`)."""

    steps: int  # decode steps (each running sequence gains a token)
    idle_steps: int  # steps with nothing running (no decode)
    peak_running: int
    map_steps: int  # decode steps where some row's new token opens a granule (they map)
    crossings: int  # (sequence, step) pairs that open a granule
    tokens: int  # tokens decoded
    peak_held: int  # most bytes the admission had projected at once


def simulate(
    max_batch: int,
    requests: Sequence[Request],
    layers: int,
    token_bytes: int,
    budget: Optional[int] = None,
    granule: int = GRANULE,
    max_steps: Optional[int] = None,
) -> Plan:
    """Runs kv_serve's schedule on the host only: how many decode steps a backend of
    `max_batch` slots takes, how many of them map (rows mapped for the prompt at admission,
    then a granule whenever a new token opens one), and how many sequences run at once."""
    sched = Scheduler(max_batch, list(requests))
    admission = Admission(budget, layers, token_bytes, granule)
    backed: Dict[int, int] = {}
    steps = idle = map_steps = crossings = tokens = peak_held = 0
    while not sched.idle and (max_steps is None or sched.step < max_steps):
        for slot, request in sched.admit(admission):
            backed[slot] = granules_for(request.prompt, token_bytes, granule)
        peak_held = max(peak_held, admission.held)
        if not sched.slots:
            sched.finish([])
            idle += 1
            continue
        grown, finished = sched.advance()
        steps += 1
        tokens += len(grown)
        crossed = 0
        for slot, length in grown:
            need = granules_for(length, token_bytes, granule)
            if need > backed[slot]:
                backed[slot] = need
                crossed += 1
        crossings += crossed
        map_steps += crossed > 0
        for slot in finished:
            admission.release(slot)
        sched.finish(finished)
    return Plan(steps, idle, sched.peak_running, map_steps, crossings, tokens, peak_held)


def map_spike(step_seconds: Sequence[float], mapped: Sequence[bool]) -> Tuple[float, Optional[float]]:
    """`(median step, slowest step that mapped memory)` (None when no step mapped)."""
    if not step_seconds:
        return 0.0, None
    mid = median(step_seconds)
    spikes = [t for t, m in zip(step_seconds, mapped) if m]
    return mid, (max(spikes) if spikes else None)


def map_on_path(before: bool, outlasted: bool, device_s: float, median_device_s: float) -> bool:
    """Whether a mapping step's time can be its map's.

    It can where the step mapped before its replay (host time between steps), where its maps
    behind outlasted the replay (the host was still mapping when the GPU was done, so the
    synchronize waited on the map), or where the replay itself ran over 1.1 x the median
    replay (an unmap or an access change can slow the GPU under it). A mapping step that is
    none of these finished its maps while its replay still ran and replayed at the usual
    speed: whatever made it slow on the host is what makes steps that map nothing slow too.
    """
    return before or outlasted or device_s > 1.1 * median_device_s


def over(step_seconds: Sequence[float], flags: Sequence[bool], factor: float = 1.1) -> Tuple[int, int]:
    """`(steps over factor x the median of all steps, steps)` among the steps whose flag is set."""
    if not step_seconds:
        return 0, 0
    mid = median(step_seconds)
    picked = [t for t, f in zip(step_seconds, flags) if f]
    return sum(t > factor * mid for t in picked), len(picked)


def verdict(name: str, ok: Optional[bool], detail: str) -> str:
    """One verdict line: `PASS`, `FAIL` or `N/A` (not measured)."""
    word = "N/A " if ok is None else ("PASS" if ok else "FAIL")
    return f"verdict {word} {name}: {detail}"
