"""CPU tests (no torch, no GPU) of stablebuf._share: the chunk plan of a shared write, the
pacer, the latency statistics and the engine time a publish costs; and that the pipelined
engine's module imports without torch."""

from __future__ import annotations

import math
import random
import time

import pytest

from stablebuf._share import (
    SharePacer,
    balance_lanes,
    crosses_devices,
    percentile,
    plan_chunks,
    summarize,
    time_lost,
    undisturbed_period,
    write_shared,
)


def _rows_covered(plan):
    seen = {}
    for chunk in plan:
        for name, lo, hi in chunk:
            assert lo < hi
            seen.setdefault(name, []).append((lo, hi))
    return seen


@pytest.mark.parametrize("seed", range(20))
def test_every_row_is_in_exactly_one_chunk_in_order_and_chunks_stay_small(seed):
    rng = random.Random(seed)
    items = []
    for k in range(rng.randint(1, 12)):
        dims = rng.randint(0, 3)
        shape = tuple(rng.choice([0, 1, 3, 17, 64]) for _ in range(dims))
        items.append((f"t{k}", shape, rng.choice([1, 2, 4])))
    chunk_bytes = rng.choice([1, 7, 64, 1000, 1 << 20])
    plan = plan_chunks(items, chunk_bytes)
    seen = _rows_covered(plan)
    order = [name for chunk in plan for name, _, _ in chunk]
    assert order == sorted(order, key=lambda n: int(n[1:]))  # tensors in the order given
    for name, shape, itemsize in items:
        rows = shape[0] if shape else 1
        row_bytes = itemsize * math.prod(shape[1:]) if shape else itemsize
        if rows == 0 or row_bytes == 0:
            assert name not in seen
            continue
        ranges = seen[name]
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = {name: (shape, itemsize) for name, shape, itemsize in items}
    for chunk in plan:
        total = 0
        for name, lo, hi in chunk:
            shape, itemsize = sizes[name]
            row_bytes = itemsize * math.prod(shape[1:]) if shape else itemsize
            total += (hi - lo) * row_bytes
        assert total <= chunk_bytes or len(chunk) == 1 and chunk[0][2] - chunk[0][1] == 1


def test_chunks_fill_up_and_an_oversized_row_goes_alone():
    plan = plan_chunks([("a", (4, 2), 2), ("b", (3,), 4), ("c", (1, 100), 1)], 8)
    assert plan == [[("a", 0, 2)], [("a", 2, 4)], [("b", 0, 2)], [("b", 2, 3)], [("c", 0, 1)]]
    assert plan_chunks([("s", (), 4)], 64) == [[("s", 0, 1)]]
    with pytest.raises(ValueError):
        plan_chunks([], 0)


def test_the_pacer_leaves_the_rest_of_the_time():
    assert SharePacer(1.0).off and SharePacer(1.0).pause_after(0.5) == 0.0
    assert SharePacer(0.5).pause_after(0.01) == pytest.approx(0.01)
    assert SharePacer(0.2).pause_after(0.01) == pytest.approx(0.04)
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError):
            SharePacer(bad)


class _Sliceable:
    """A stand-in tensor: records the copies made into it."""

    def __init__(self, name, shape, log):
        self.name, self.shape, self.log = name, shape, log

    def element_size(self):
        return 2

    def dim(self):
        return len(self.shape)

    def __getitem__(self, rows):
        return ("slice", self.name, rows.start, rows.stop)

    def copy_(self, source, non_blocking=False):
        self.log.append(("whole", self.name, source))


class _FakeCuda:
    def __init__(self):
        self.syncs = []

    def synchronize(self, device=None):
        self.syncs.append(device)


class _FakeTorch:
    def __init__(self):
        self.cuda = _FakeCuda()


def test_write_shared_queues_everything_at_share_one_and_chunks_below():
    log = []
    dst = {"a": _Sliceable("a", (4, 2), log), "b": _Sliceable("b", (), log)}
    fake = _FakeTorch()
    info = write_shared(fake, dst, {"a": "A", "b": "B"}, share=1.0)
    assert log == [("whole", "a", "A"), ("whole", "b", "B")] and fake.cuda.syncs == []
    assert info["chunks"] == 1.0

    class Rows(_Sliceable):
        def __getitem__(self, rows):
            outer = self

            class View:
                def copy_(self, source, non_blocking=False):
                    outer.log.append(("rows", outer.name, rows.start, rows.stop, source))

            return View()

    log.clear()
    dst = {"a": Rows("a", (4, 2), log), "b": Rows("b", (), log)}
    src = {"a": _Sliceable("A", (4, 2), []), "b": "B"}
    fake = _FakeTorch()
    info = write_shared(fake, dst, src, share=0.99, chunk_bytes=8, devices=[3])
    assert [entry[:4] for entry in log] == [
        ("rows", "a", 0, 2),
        ("rows", "a", 2, 4),
        ("whole", "b", "B"),
    ]
    assert log[0][4] == ("slice", "A", 0, 2)
    assert fake.cuda.syncs == [None, 3] * 3 and info["chunks"] == 3.0


class _OnDevice:
    """A stand-in tensor that says where it lives and records its copies."""

    def __init__(self, device, log, shape=(4, 2)):
        self.device, self.log, self.shape = device, log, shape

    def element_size(self):
        return 2

    def dim(self):
        return len(self.shape)

    def __getitem__(self, rows):
        return self

    def copy_(self, source, non_blocking=False):
        self.log.append((self.device, getattr(source, "device", None), non_blocking))


class _SlowCuda(_FakeCuda):
    def synchronize(self, device=None):
        super().synchronize(device)
        time.sleep(0.002)


def test_a_copy_between_devices_is_counted_and_one_on_a_device_is_not():
    log = []
    assert crosses_devices(_OnDevice("cuda:1", log), _OnDevice("cuda:0", log))
    assert not crosses_devices(_OnDevice("cuda:0", log), _OnDevice("cuda:0", log))
    assert not crosses_devices(_OnDevice("cuda:0", log), "no device")  # cannot tell: not counted
    fake = _FakeTorch()
    peer = {n: _OnDevice("cuda:1", log) for n in "ab"}
    mine = {n: _OnDevice("cuda:0", log) for n in "ab"}
    info = write_shared(fake, peer, mine, share=1.0)
    assert info["copies"] == 2.0 and info["cross_device"] == 2.0
    info = write_shared(fake, {n: _OnDevice("cuda:0", log) for n in "ab"}, mine, share=1.0)
    assert info["cross_device"] == 0.0
    assert all(blocking for _, _, blocking in log)  # every copy queued, none waited for


def test_write_shared_says_where_the_time_went():
    log = []
    src = {n: _OnDevice("cuda:0", log) for n in "abc"}
    fake = _FakeTorch()
    fake.cuda = _SlowCuda()
    info = write_shared(fake, {n: _OnDevice("cuda:0", log) for n in "abc"}, src, share=1.0)
    # Share 1: queued at once, no synchronisation (the caller's), no pause.
    assert fake.cuda.syncs == [] and info["wait_s"] == 0.0 and info["paused_s"] == 0.0
    assert info["issue_s"] >= 0.0 and info["busy_s"] == info["issue_s"]
    fake.cuda = _SlowCuda()
    dst = {n: _OnDevice("cuda:0", log) for n in "abc"}
    info = write_shared(fake, dst, src, share=0.5, chunk_bytes=16, devices=[1])
    # One chunk per tensor (16 bytes each); each chunk waits for the current device and GPU 1.
    assert info["chunks"] == 3.0 and info["copies"] == 3.0 and info["cross_device"] == 0.0
    assert fake.cuda.syncs == [None, 1] * 3
    assert info["wait_s"] >= 3 * 2 * 0.002 * 0.9
    assert info["busy_s"] == pytest.approx(info["issue_s"] + info["wait_s"])
    # Share 0.5: as long paused as busy.
    assert info["paused_s"] == pytest.approx(info["busy_s"], rel=1e-6)


def test_percentiles_are_nearest_rank_and_the_summary_is_right():
    values = list(range(1, 21))  # 20 samples: the p99 is the largest
    assert percentile(values, 99) == 20
    assert percentile(values, 50) == 10
    assert percentile([5.0], 99) == 5.0
    s = summarize([3.0, 1.0, 2.0, 4.0])
    assert s == {"n": 4, "median": 2.5, "p99": 4.0, "max": 4.0, "mean": 2.5}
    assert summarize([])["n"] == 0 and math.isnan(summarize([])["median"])
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 0)


def test_time_lost_counts_slow_steps_and_pauses_from_the_step_in_flight():
    period = 1.0
    # Undisturbed back-to-back steps of 1.0: nothing lost.
    steps = [(float(k), float(k + 1)) for k in range(10)]
    got = time_lost(steps, write_start=3.5, window_end=8.0, period=period)
    assert got["lost"] == pytest.approx(0.0) and got["steps"] == 5.0 and got["window"] == 5.0
    # Two steps slowed to 1.5 each: 1.0 lost; the longest 1.5.
    steps = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.5), (3.5, 5.0), (5.0, 6.0)]
    got = time_lost(steps, write_start=2.2, window_end=6.0, period=period)
    assert got["lost"] == pytest.approx(1.0) and got["longest"] == pytest.approx(1.5)
    # Pause-and-copy: a 3.0 pause then the first step: the pause is lost whole.
    steps = [(0.0, 1.0), (1.0, 2.0), (2.0, 6.0)]  # (pause start, end of the first new step)
    got = time_lost(steps, write_start=1.5, window_end=6.0, period=period)
    assert got["lost"] == pytest.approx(3.0) and got["longest"] == pytest.approx(4.0)
    assert time_lost([], 0.0, 1.0, 1.0)["steps"] == 0.0
    assert undisturbed_period([0.0, 1.0, 2.5, 3.5]) == 1.0
    assert undisturbed_period([1.0]) is None


def test_the_pipelined_module_imports_without_torch():
    import stablebuf._pipelined as pipelined

    assert pipelined.region_paths("/tmp/e") == ("/tmp/e.a", "/tmp/e.b")
    assert pipelined.PARTS == ("message", "poll", "fence", "remap", "launch")


def test_the_pipelined_classes_are_exported():
    import stablebuf

    assert stablebuf.PipelinedEngine.__name__ == "PipelinedEngine"
    assert stablebuf.PipelinedTrainer.__name__ == "PipelinedTrainer"


@pytest.mark.parametrize("seed", range(10))
def test_lanes_take_every_name_once_and_about_equal_bytes(seed):
    rng = random.Random(seed)
    sizes = {f"t{i}": rng.choice([4, 4096, 1 << 20, 23 << 20, 131 << 20]) for i in range(rng.randint(1, 80))}
    lanes = rng.randint(1, 4)
    plan = balance_lanes(sizes, lanes)
    assert len(plan) == lanes
    assert sorted(n for lane in plan for n in lane) == sorted(sizes)
    loads = [sum(sizes[n] for n in lane) for lane in plan]
    # Largest first to the lightest lane: no lane exceeds another by more than one tensor.
    assert max(loads) - min(loads) <= max(sizes.values())
    with pytest.raises(ValueError):
        balance_lanes(sizes, 0)


class _Stream:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def wait_stream(self, other):
        self.events.append(("wait", self.name, other.name))


class _LaneCuda(_FakeCuda):
    def __init__(self, events):
        super().__init__()
        self.events, self.now = events, _Stream("current", events)
        self.default = self.now

    def current_device(self):
        return 0

    def current_stream(self):
        return self.now

    def stream(self, lane):
        cuda = self

        class Use:
            def __enter__(self):
                cuda.now = lane

            def __exit__(self, *exc):
                cuda.now = cuda.default

        return Use()


class _Dev:
    def __init__(self, index, kind="cuda"):
        self.index, self.type = index, kind


class _LaneTensor:
    def __init__(self, name, nbytes, cuda, device=0):
        self.name, self.nbytes, self.cuda, self.device = name, nbytes, cuda, _Dev(device)

    def numel(self):
        return self.nbytes // 2

    def element_size(self):
        return 2

    def copy_(self, source, non_blocking=False):
        self.cuda.events.append(("copy", self.cuda.now.name, self.name, source.name))


def test_a_full_speed_write_spreads_its_copies_over_the_lanes_after_and_before_the_current_stream():
    events = []
    fake = _FakeTorch()
    fake.cuda = _LaneCuda(events)
    sizes = {f"w{i}": (i + 1) << 20 for i in range(20)}
    dst = {n: _LaneTensor(n, b, fake.cuda) for n, b in sizes.items()}
    src = {n: _LaneTensor(n.upper(), b, fake.cuda) for n, b in sizes.items()}
    lanes = [_Stream("lane0", events), _Stream("lane1", events)]
    info = write_shared(fake, dst, src, share=1.0, lanes=lanes)
    assert info["lanes"] == 2.0 and info["copies"] == 20.0
    copies = [e for e in events if e[0] == "copy"]
    assert sorted(c[2] for c in copies) == sorted(sizes)  # each tensor once
    assert all(c[3] == c[2].upper() for c in copies)
    assert {c[1] for c in copies} == {"lane0", "lane1"}
    first_copy = events.index(copies[0])
    last_copy = events.index(copies[-1])
    # Both lanes wait for the current stream before any copy; it waits for both after all.
    assert {e for e in events[:first_copy] if e[0] == "wait"} == {
        ("wait", "lane0", "current"), ("wait", "lane1", "current")}
    assert {e for e in events[last_copy:] if e[0] == "wait"} == {
        ("wait", "current", "lane0"), ("wait", "current", "lane1")}
    # A tensor on another device: one stream, as before.
    events.clear()
    src["w0"] = _LaneTensor("W0", 1 << 20, fake.cuda, device=1)
    info = write_shared(fake, dst, src, share=1.0, lanes=lanes)
    assert "lanes" not in info and not [e for e in events if e[0] == "wait"]
