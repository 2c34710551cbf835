"""Pure helpers of weight publishing that need no GPU: the trainer's bandwidth share (writes in
chunks of whole rows, paced so the writes take about ``share`` of the wall time), the latency
statistics (median, nearest-rank p99) and the engine time a publish costs.

:func:`write_shared` is the one function here that touches tensors (``torch`` is passed in, so
importing this module imports no torch)."""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

#: Default chunk of a shared write: small enough that a step waits for at most one chunk on
#: the copy engine, large enough that the per-chunk synchronisation costs little.
DEFAULT_CHUNK_BYTES = 64 << 20

#: Streams a trainer's full-speed write spreads its copies over (Trainer.copy_streams). One:
#: on 2 x H200 over NVLink (75 copies, 1 GiB) two streams carried 307 GB/s against one
#: stream's 322 GB/s in the same run, and the twin's one copy cut in 2 or 4 pieces on as many
#: streams 326-340 GB/s on the GPU against 342; more streams are there to try on other links.
DEFAULT_COPY_STREAMS = 1

Chunk = List[Tuple[str, int, int]]  # (tensor name, first row, row after the last)


def plan_chunks(items: Iterable[Tuple[str, Sequence[int], int]], chunk_bytes: int) -> List[Chunk]:
    """Splits tensors ``(name, shape, itemsize)`` into chunks of at most ``chunk_bytes`` bytes,
    each a list of ``(name, lo, hi)`` row ranges along dimension 0 (a 0-d tensor is one row;
    an empty tensor is left out: nothing to copy). Every row of every tensor is in exactly one
    chunk, in order; a single row larger than ``chunk_bytes`` makes a chunk of its own."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be positive")
    chunks: List[Chunk] = []
    current: Chunk = []
    used = 0
    for name, shape, itemsize in items:
        shape = tuple(int(d) for d in shape)
        rows = shape[0] if shape else 1
        row_bytes = int(itemsize) * math.prod(shape[1:]) if shape else int(itemsize)
        if rows == 0 or row_bytes == 0:
            continue
        lo = 0
        while lo < rows:
            take = (chunk_bytes - used) // row_bytes
            if take == 0:
                if current:
                    chunks.append(current)
                    current, used = [], 0
                    continue
                take = 1  # one row larger than a chunk: alone
            take = min(take, rows - lo)
            current.append((name, lo, lo + take))
            used += take * row_bytes
            lo += take
            if used >= chunk_bytes:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


#: One byte copy: (destination offset, source offset, bytes).
ByteCopy = Tuple[int, int, int]


def plan_byte_copies(pieces: Iterable[ByteCopy], chunk_bytes: int) -> List[List[ByteCopy]]:
    """Chunks of at most ``chunk_bytes`` bytes over ``pieces`` ``(destination offset, source
    offset, bytes)`` (one per tensor, each its own bytes only), as few copies as can be.

    Pieces that touch or overlap in both the source and the destination by the same shift (the
    tensors of one model allocated side by side, alike in both places) become one run: copying
    the run copies exactly their bytes, and a gap between tensors (another allocation's bytes)
    is never in a run. Each run is then cut into chunks, in source order; a chunk may hold the
    end of one run and the start of the next. Empty pieces are left out."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be positive")
    runs: List[List[int]] = []  # [destination, source, bytes]
    for dst, src, nbytes in sorted((int(d), int(s), int(n)) for d, s, n in pieces):
        if nbytes <= 0:
            continue
        if dst < 0 or src < 0:
            raise ValueError(f"a byte copy at ({dst}, {src}): offsets must not be negative")
        last = runs[-1] if runs else None
        if last is not None and dst - src == last[0] - last[1] and dst <= last[0] + last[2]:
            last[2] = max(last[2], dst + nbytes - last[0])
        else:
            runs.append([dst, src, nbytes])
    chunks: List[List[ByteCopy]] = []
    current: List[ByteCopy] = []
    used = 0
    for dst, src, nbytes in runs:
        done = 0
        while done < nbytes:
            take = min(nbytes - done, chunk_bytes - used)
            current.append((dst + done, src + done, take))
            done += take
            used += take
            if used == chunk_bytes:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


class SharePacer:
    """How long to yield after each chunk so that the writes take about ``share`` of the wall
    time: after ``busy`` seconds of writing, ``busy * (1 - share) / share`` seconds of nothing.
    ``share`` 1 is off (no pause, and :func:`write_shared` does not chunk at all)."""

    def __init__(self, share: float) -> None:
        share = float(share)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share={share}: must be in (0, 1]")
        self.share = share

    @property
    def off(self) -> bool:
        return self.share >= 1.0

    def pause_after(self, busy: float) -> float:
        if self.off or busy <= 0.0:
            return 0.0
        return busy * (1.0 - self.share) / self.share


def crosses_devices(target: Any, source: Any) -> bool:
    """Whether ``target.copy_(source)`` is a copy between two devices (both tensors say where
    they are and the places differ). PyTorch runs such a copy on the source's device and puts a
    two-way barrier around *each one* between the current streams of both devices (an event
    recorded on each and waited for on the other), so the copies of a write are serialised
    through the destination device's queue, one round trip per tensor: where another process
    keeps that device busy (a serving engine), every copy waits for its turn there."""
    a, b = getattr(target, "device", None), getattr(source, "device", None)
    return a is not None and b is not None and a != b


def balance_lanes(sizes: Mapping[str, int], lanes: int) -> List[List[str]]:
    """Names split into ``lanes`` lists of about equal bytes (largest first, each to the
    lightest lane so far); every name in exactly one list."""
    if lanes < 1:
        raise ValueError(f"lanes={lanes}: at least 1")
    plan: List[List[str]] = [[] for _ in range(lanes)]
    loads = [0] * lanes
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        plan[lightest].append(name)
        loads[lightest] += sizes[name]
    return plan


#: Copies queued on one lane before switching to the next (switching streams costs the host
#: a few microseconds each time).
LANE_BATCH = 8


def _all_on_current_device(torch: Any, dst: Mapping[str, Any], src: Mapping[str, Any]) -> bool:
    current = torch.cuda.current_device()
    return all(
        getattr(getattr(t, "device", None), "type", None) == "cuda"
        and getattr(t.device, "index", None) == current
        for name in src for t in (dst[name], src[name])
    )


def _copy_over_lanes(torch: Any, dst: Mapping[str, Any], src: Mapping[str, Any],
                     lanes: Sequence[Any]) -> None:
    plan = balance_lanes(
        {n: src[n].numel() * src[n].element_size() for n in src}, len(lanes)
    )
    current = torch.cuda.current_stream()
    for lane in lanes:
        lane.wait_stream(current)  # the sources' producers (an optimizer step) come first
    position = [0] * len(lanes)
    while any(position[i] < len(plan[i]) for i in range(len(lanes))):
        for i, lane in enumerate(lanes):  # round robin, a batch at a time: the lanes start together
            names = plan[i][position[i] : position[i] + LANE_BATCH]
            if not names:
                continue
            position[i] += len(names)
            with torch.cuda.stream(lane):
                for name in names:
                    dst[name].copy_(src[name], non_blocking=True)
    for lane in lanes:
        current.wait_stream(lane)


def write_shared(
    torch: Any,
    dst: Mapping[str, Any],
    src: Mapping[str, Any],
    *,
    share: float = 1.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    devices: Sequence[int] = (),
    lanes: Any = (),
) -> Dict[str, float]:
    """Copies ``src[name]`` into ``dst[name]`` (same shapes; cast by ``copy_``). With ``share``
    1 every copy is queued at once (the caller synchronises); given two or more ``lanes``
    (streams of the current device, or a function that makes them, called only then) and
    copies all on that device, they are spread over the
    lanes, balanced by bytes, after the current stream's work, and the current stream waits
    for them (meant to hide one copy's start-up behind another's transfer; see
    :data:`DEFAULT_COPY_STREAMS` for what it did on NVLink). Below 1 the copies go in chunks
    (:func:`plan_chunks`); after each chunk the current device and ``devices`` are synchronised
    and the writer sleeps :meth:`SharePacer.pause_after` the chunk's time, so the engine sharing
    the GPU or the link gets the rest.

    Returns where the time went (seconds) and what was done: ``chunks``; ``copies`` (``copy_``
    calls); ``cross_device`` (those between two devices, see :func:`crosses_devices`: 0 when
    the destination's views live on the source's device, as a trainer's are); ``issue_s``
    (queuing the copies); ``wait_s`` (in the chunks' synchronisations: 0 at share 1);
    ``busy_s`` (``issue_s + wait_s``); ``paused_s`` (the pacer's sleeps)."""
    pacer = SharePacer(share)
    if pacer.off and lanes and _all_on_current_device(torch, dst, src):
        lanes = lanes() if callable(lanes) else lanes
    else:
        lanes = ()
    if len(lanes) > 1:
        start = time.perf_counter()
        _copy_over_lanes(torch, dst, src, lanes)
        issue = time.perf_counter() - start
        return {
            "chunks": 1.0,
            "copies": float(len(src)),
            "cross_device": 0.0,
            "issue_s": issue,
            "wait_s": 0.0,
            "busy_s": issue,
            "paused_s": 0.0,
            "lanes": float(len(lanes)),
        }
    if pacer.off:
        cross = 0
        start = time.perf_counter()
        for name, source in src.items():
            target = dst[name]
            cross += crosses_devices(target, source)
            target.copy_(source, non_blocking=True)
        issue = time.perf_counter() - start
        return {
            "chunks": 1.0,
            "copies": float(len(src)),
            "cross_device": float(cross),
            "issue_s": issue,
            "wait_s": 0.0,
            "busy_s": issue,
            "paused_s": 0.0,
        }
    plan = plan_chunks(
        ((n, tuple(dst[n].shape), dst[n].element_size()) for n in src), chunk_bytes
    )
    issue = wait = paused = 0.0
    copies = cross = 0
    for chunk in plan:
        start = time.perf_counter()
        for name, lo, hi in chunk:
            target, source = dst[name], src[name]
            cross += crosses_devices(target, source)
            copies += 1
            if target.dim() == 0:
                target.copy_(source, non_blocking=True)
            else:
                target[lo:hi].copy_(source[lo:hi], non_blocking=True)
        queued = time.perf_counter()
        torch.cuda.synchronize()
        for device in devices:
            torch.cuda.synchronize(device)
        done = time.perf_counter()
        issue += queued - start
        wait += done - queued
        pause = pacer.pause_after(done - start)
        if pause > 0.0:
            time.sleep(pause)
            paused += pause
    return {
        "chunks": float(len(plan)),
        "copies": float(copies),
        "cross_device": float(cross),
        "issue_s": issue,
        "wait_s": wait,
        "busy_s": issue + wait,
        "paused_s": paused,
    }


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (``q`` in (0, 100]): with 20 values the p99 is the
    largest, so a p99 over fewer than 100 samples is never optimistic."""
    if not values:
        raise ValueError("no values")
    if not 0.0 < q <= 100.0:
        raise ValueError(f"q={q}: must be in (0, 100]")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """``n``, ``median``, ``p99`` (nearest rank), ``max``, ``mean`` of ``values``."""
    if not values:
        return {"n": 0, "median": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan}
    ordered = sorted(values)
    n = len(ordered)
    middle = n // 2
    median = ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2.0
    return {
        "n": n,
        "median": median,
        "p99": percentile(ordered, 99.0),
        "max": ordered[-1],
        "mean": sum(ordered) / n,
    }


def time_lost(
    steps: Sequence[Tuple[float, float]],
    write_start: float,
    window_end: float,
    period: float,
) -> Dict[str, float]:
    """The engine time one publish cost. ``steps`` are ``(start, end)`` of the engine's steps
    (serving continuously: one after the other), ``write_start`` when the trainer began to
    write, ``window_end`` the end of the first step on the new weights, ``period`` the
    undisturbed step period (step plus the loop's own overhead).

    The window opens at the start of the first step that ends at or after ``write_start`` (the
    step in flight when the write began) and closes at ``window_end``; the time lost is the
    window's length less ``period`` per step completed in it (a pause with no step, as in
    pause-and-copy, is lost whole). Returns ``lost``, ``longest`` (the longest single step in
    the window), ``steps`` and ``window``."""
    inside = [(s, e) for s, e in steps if e >= write_start and e <= window_end]
    if not inside:
        return {"lost": math.nan, "longest": math.nan, "steps": 0.0, "window": 0.0}
    start = min(s for s, _ in inside)
    window = window_end - start
    return {
        "lost": window - len(inside) * period,
        "longest": max(e - s for s, e in inside),
        "steps": float(len(inside)),
        "window": window,
    }


def undisturbed_period(ends: Sequence[float]) -> Optional[float]:
    """The median gap between successive step ends (``None`` with fewer than two)."""
    if len(ends) < 2:
        return None
    return summarize([b - a for a, b in zip(ends, ends[1:])])["median"]
