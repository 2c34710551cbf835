"""Seeded random sequences over the Python API, each step checked against a model.

Two regions take a random sequence of: tensor allocations by PyTorch inside ``region()``,
frees (also while asleep), eager writes and reads (only where the model says the memory is
there), snapshots, binds and switches by copy, remap or auto (also of another region's weight
set, and while asleep; a copy switch fills the region's own live set, which the model tracks),
unbinds, sleeps with the contents kept (in the pinned arena, or streamed through it into
pageable memory when it is full; the API offers no other choice) or discarded, of one region
or of both in one call (all or nothing: an unbound region refuses it before anything sleeps),
wakes of one or both, pinning the host arena up front (refused while sleeping regions hold a
smaller one), replays of a hand-captured graph and calls of a ``torch.compile``
(``mode="reduce-overhead"``) function over a region tensor. Before each step the model says
what must happen: the typed exception (``Asleep``, ``Unbound``, ``SnapshotMismatch``, ``Error``)
or success, and, on success, every byte the step can observe: every live tensor whose contents
the model knows is compared after every wake, bind and switch, and at the end, where every
weight set still held is bound and compared too. Every 100 steps the device's free memory is
checked against the model's physical memory (no drift). A second test runs a replay thread
beside a bind thread.

``STABLEBUF_SEED`` replays a run, ``STABLEBUF_STEPS`` sets its length (2,000 by default).
GPU tests: they skip (with the reason) without torch or a CUDA device.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Dict, List, Optional, Tuple

import pytest

import stablebuf

pytestmark = pytest.mark.gpu

MiB = 1 << 20
TAGS = ("random_a", "random_b")
SIZES_MIB = (1, 2, 3, 5, 8)
MAX_TENSORS = 10
MAX_HELD_SETS = 3
DRIFT_LIMIT = 64 * MiB
# Sizes asked of reserve_host: below, at and above what two sleeping regions hold.
RESERVE_MIB = (16, 64, 160, 320)
STAGED = "pageable (staged through the pinned arena)"


@pytest.fixture(scope="module")
def torch():
    import torch as torch_module

    torch_module.cuda.init()
    return torch_module


class RegionModel:
    """What one region must hold: its tensors, and their contents per backing."""

    def __init__(self, torch, tag: str, rng: random.Random) -> None:
        self.torch, self.tag, self.rng = torch, tag, rng
        self.tensors: Dict[int, object] = {}
        # Contents per backing: the id of a weight set (or "initial") -> tensor id -> values on
        # the CPU, or None where the contents are unknown (woken after a discard).
        self.contents: Dict[object, Dict[int, Optional[object]]] = {"initial": {}}
        self.key: object = "initial"
        self.asleep = False
        self.kept = True
        self.unbound = False
        self.held: List[stablebuf.WeightSet] = []
        # The region's live set (made by a copy switch) as (id, nbytes): no handle is kept, so
        # that its memory goes when the region drops it (sleep, unbind, outgrown at a snapshot).
        self.live_set: Optional[Tuple[int, int]] = None
        self.next_id = 0
        with stablebuf.region(tag):
            self.probe = torch.empty(MiB // 4, device="cuda")
        self.probe_id = self._add(self.probe)
        self.write(self.probe_id)
        self.out = torch.empty(MiB // 4, device="cuda")  # outside the region
        self.graph = stablebuf.CUDAGraph(tags=[tag])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.out.copy_(self.probe * 2 + 1)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.out.copy_(self.probe * 2 + 1)
        torch.cuda.synchronize()

    def _add(self, tensor) -> int:
        self.next_id += 1
        self.tensors[self.next_id] = tensor
        return self.next_id

    def random_values(self, count: int):
        generator = self.torch.Generator().manual_seed(self.rng.getrandbits(63))
        return self.torch.randn(count, generator=generator) + 3.0  # never zeros

    def live(self) -> Dict[int, Optional[object]]:
        return self.contents[self.key]

    def usable(self) -> bool:
        return not self.asleep and not self.unbound

    def expected_gate(self):
        """The error a replay, an allocation or a snapshot must raise now, if any."""
        if self.asleep:
            return stablebuf.Asleep
        if self.unbound:
            return stablebuf.Unbound
        return None

    def verify(self, what: str) -> None:
        """Every live tensor holds what the model says it must (where the model knows)."""
        assert self.usable(), f"{self.tag}: {what}: verified while asleep or unbound"
        self.torch.cuda.synchronize()
        for tensor_id, values in self.live().items():
            if values is not None:
                got = self.tensors[tensor_id].cpu()
                assert self.torch.equal(got, values), f"{self.tag}: {what}: tensor {tensor_id}"

    def bindable(self, weight_set) -> bool:
        """Whether a bind or switch of one of this region's sets may succeed now (no pieces
        past the consolidated span, and the set covers the span)."""
        stats = stablebuf.stats()[self.tag]
        return self.pieces() == 0 and weight_set.nbytes >= stats["span"]

    def slept(self, keep: bool) -> None:
        """The model of a sleep of this awake region."""
        self.asleep, self.kept = True, keep
        self.live_set = None

    def woken(self) -> None:
        """The model of a wake of this sleeping region, then the check of its contents."""
        self.asleep = False
        self.follow_bound(carried=self.kept)
        if not self.unbound:
            self.verify("after the wake")

    def write(self, tensor_id: int) -> None:
        tensor = self.tensors[tensor_id]
        values = self.random_values(tensor.numel())
        tensor.copy_(values.to("cuda"))
        self.live()[tensor_id] = values

    def follow_bound(self, carried: bool) -> None:
        """After a snapshot or a wake the region may be backed by a new weight set of its own:
        the live contents move there (kept), or become unknown (discarded)."""
        bound = stablebuf.bound(self.tag)
        if bound is None or bound.id == self.key:
            return
        if carried:
            self.contents[bound.id] = dict(self.live())
        else:
            self.contents[bound.id] = {tensor_id: None for tensor_id in self.tensors}
        self.key = bound.id

    def pieces(self) -> int:
        """Mappings past the consolidated span (allocations made since the last snapshot)."""
        stats = stablebuf.stats()[self.tag]
        return stats["mappings"] - (0 if stablebuf.bound(self.tag) is None else 1)

    def physical(self) -> int:
        """Device bytes this region holds: what is mapped, plus held weight sets and the live
        set where not bound."""
        bound = stablebuf.bound(self.tag)
        unmapped = sum(w.nbytes for w in self.held if bound is None or w != bound)
        if self.live_set is not None and (bound is None or bound.id != self.live_set[0]):
            unmapped += self.live_set[1]
        return stablebuf.stats()[self.tag]["mapped"] + unmapped


def run(expected, action):
    """Runs ``action``; it must raise exactly ``expected`` (a type), or succeed if ``None``."""
    if expected is None:
        return action()
    with pytest.raises(expected):
        action()
    return None


def step(torch, rng: random.Random, regions: Dict[str, RegionModel], compiled, log: List[str]):
    model = regions[rng.choice(TAGS)]
    other = regions[TAGS[1] if model.tag == TAGS[0] else TAGS[0]]
    ops = [
        "alloc", "free", "write", "read", "snapshot", "bind", "bind", "foreign_bind",
        "switch", "switch", "foreign_switch", "unbind", "sleep", "wake", "wake", "replay",
        "replay", "compiled", "drop_set", "sleep_all", "wake_all", "reserve_host",
    ]
    op = rng.choice(ops)
    log.append(f"{model.tag}: {op}")
    tag = model.tag

    if op == "alloc":
        if len(model.tensors) >= MAX_TENSORS:
            return
        count = rng.choice(SIZES_MIB) * MiB // 4

        def alloc():
            with stablebuf.region(tag):
                return torch.empty(count, device="cuda")

        tensor = run(model.expected_gate(), alloc)
        if tensor is not None:
            model.write(model._add(tensor))
    elif op == "free":
        # Also while asleep: PyTorch keeps the block for the next allocation in the region.
        candidates = [i for i in model.tensors if i != model.probe_id]
        if model.asleep:
            log[-1] += " (asleep)"
        if candidates:
            victim = rng.choice(candidates)
            del model.tensors[victim]
            for contents in model.contents.values():
                contents.pop(victim, None)
    elif op == "write":
        # Eager kernels over a released region are not guarded: only where memory is there.
        if model.usable():
            model.write(rng.choice(list(model.tensors)))
    elif op == "read":
        if model.usable():
            model.verify("a read")
    elif op == "snapshot":
        if len(model.held) >= MAX_HELD_SETS:
            return
        if model.asleep:
            log[-1] += " (asleep)"
        weight_set = run(model.expected_gate(), lambda: stablebuf.snapshot(tag))
        if weight_set is not None:
            model.follow_bound(carried=True)
            model.contents[weight_set.id] = dict(model.live())
            model.held.append(weight_set)
            if model.live_set is not None and model.live_set[1] < stablebuf.stats()[tag]["span"]:
                model.live_set = None  # outgrown: the region let it go
    elif op in ("bind", "foreign_bind"):
        source = model if op == "bind" else other
        if not source.held:
            return
        weight_set = rng.choice(source.held)
        if source is not model:
            expected = stablebuf.SnapshotMismatch
        elif model.asleep:
            expected = stablebuf.Asleep
        elif stablebuf.bound(tag) == weight_set:
            expected = None
        elif not model.bindable(weight_set):
            expected = stablebuf.SnapshotMismatch
        else:
            expected = None
        if model.asleep:
            log[-1] += " (asleep)"
        before = stablebuf.bound(tag)
        run(expected, lambda: stablebuf.bind(tag, weight_set))
        if expected is None:
            model.key = weight_set.id
            model.unbound = False
            model.verify("after the bind")
        else:
            assert stablebuf.bound(tag) == before, f"{tag}: a refused bind changed the binding"
    elif op in ("switch", "foreign_switch"):
        source = model if op == "switch" else other
        if not source.held:
            return
        weight_set = rng.choice(source.held)
        strategy = rng.choice(("auto", "copy", "remap"))
        log[-1] += f" ({strategy}{', asleep' if model.asleep else ''})"
        before = stablebuf.bound(tag)
        if source is not model:
            expected = stablebuf.SnapshotMismatch
        elif model.asleep:
            expected = stablebuf.Asleep
        elif before == weight_set:
            expected = None
        elif not model.bindable(weight_set):
            expected = stablebuf.SnapshotMismatch
        else:
            expected = None
        way = run(expected, lambda: stablebuf.switch(tag, weight_set, strategy=strategy))
        if expected is not None:
            assert stablebuf.bound(tag) == before, f"{tag}: a refused switch changed the binding"
            return
        if before == weight_set or strategy == "remap":
            assert way == "remap", f"{tag}: {strategy} switch went by {way}"
        elif strategy == "copy":
            assert way == "copy", f"{tag}: copy switch went by {way}"
        bound = stablebuf.bound(tag)
        if way == "remap":
            assert bound == weight_set, f"{tag}: a remap switch did not bind the set"
            model.key = weight_set.id
        else:
            assert way == "copy", way
            assert bound not in model.held, f"{tag}: a copy switch bound a caller's set"
            model.contents[bound.id] = dict(model.contents[weight_set.id])
            model.key = bound.id
            model.live_set = (bound.id, bound.nbytes)
        del bound  # no handle to the live set may outlive the step
        model.unbound = False
        model.verify(f"after a {way} switch")
    elif op == "unbind":
        if model.asleep:
            expected = stablebuf.Asleep
        elif model.pieces() > 0:
            expected = stablebuf.SnapshotMismatch
        else:
            expected = None
        run(expected, lambda: stablebuf.unbind(tag))
        if expected is None:
            model.unbound = True
            model.live_set = None
    elif op in ("sleep", "sleep_all"):
        keep = rng.random() < 0.6
        group = [model] if op == "sleep" else [regions[t] for t in rng.sample(TAGS, len(TAGS))]
        # Sleeping a sleeping region does nothing; an awake unbound one refuses the whole call
        # before anything sleeps (so nothing is discarded by a call that fails).
        refused = any(m.unbound and not m.asleep for m in group)
        expected = stablebuf.Unbound if refused else None
        newly = [m for m in group if not m.asleep]
        log[-1] += f" ({'keep' if keep else 'discard'}: {', '.join(m.tag for m in group)})"
        report = run(expected, lambda: stablebuf.sleep([m.tag for m in group], keep=keep))
        if report is not None:
            for m in newly:
                storage = report[m.tag]["storage"]
                if keep:
                    assert storage in ("pinned", STAGED), f"{m.tag}: kept in {storage}"
                    log[-1] += f" [{m.tag} {storage.split(' ')[0]}]"
                else:
                    assert storage == "discarded", f"{m.tag}: discarded into {storage}"
                m.slept(keep)
        for m in group:
            assert stablebuf.stats()[m.tag]["asleep"] == m.asleep, f"{m.tag}: asleep"
    elif op in ("wake", "wake_all"):
        group = [model] if op == "wake" else [regions[t] for t in rng.sample(TAGS, len(TAGS))]
        sleeping = [m for m in group if m.asleep]
        stablebuf.wake([m.tag for m in group])
        for m in group:
            assert stablebuf.stats()[m.tag]["asleep"] is False, f"{m.tag}: still asleep"
        for m in sleeping:
            m.woken()
    elif op == "reserve_host":
        nbytes = rng.choice(RESERVE_MIB) * MiB
        arena = stablebuf.host_arena()
        log[-1] += f" ({nbytes // MiB} MiB)"
        if arena is not None and arena["capacity"] >= nbytes:
            assert stablebuf.reserve_host(nbytes) == arena["capacity"], "a big enough arena stays"
        elif arena is not None and arena["free"] != arena["capacity"]:
            with pytest.raises(stablebuf.Error, match="wake them first"):
                stablebuf.reserve_host(nbytes)
            assert stablebuf.host_arena() == arena, "a refused pin changed the arena"
        else:
            assert stablebuf.reserve_host(nbytes) >= nbytes
    elif op == "replay":
        model.out.fill_(float("nan"))
        expected = model.expected_gate()
        run(expected, model.graph.replay)
        torch.cuda.synchronize()
        if expected is None:
            values = model.live().get(model.probe_id)
            if values is not None:
                assert torch.equal(model.out.cpu(), values * 2 + 1), f"{tag}: replay output"
        else:
            assert torch.isnan(model.out).all().item(), f"{tag}: a refused replay launched"
    elif op == "compiled":
        if compiled is None or tag != TAGS[0]:
            return
        expected = model.expected_gate()
        result = run(expected, lambda: compiled(model.probe).clone())
        if result is not None:
            values = model.live().get(model.probe_id)
            if values is not None:
                want = (values * 3 + 1).to("cuda")
                assert torch.allclose(result, want, rtol=1e-6, atol=1e-5), f"{tag}: compiled"
    elif op == "drop_set":
        bound = stablebuf.bound(tag)
        candidates = [w for w in model.held if bound is None or w != bound]
        if candidates:
            victim = rng.choice(candidates)
            model.held.remove(victim)
            # The contents the region reads now stay known while it is unbound over them.
            if victim.id != model.key:
                model.contents.pop(victim.id, None)


def operation_counts(log: List[str]) -> Dict[str, int]:
    """How often each operation ran (``(asleep)``: on a sleeping region), and how many kept
    sleeps went to the pinned arena and how many were streamed into pageable memory."""
    counts: Dict[str, int] = {}
    for entry in log:
        text = entry.split(": ", 1)[1]
        name = text.split(" ")[0] + (" (asleep)" if "asleep" in text else "")
        counts[name] = counts.get(name, 0) + 1
        for storage in ("pinned", "pageable"):
            found = text.count(f" {storage}]")
            if found:
                counts[f"kept {storage}"] = counts.get(f"kept {storage}", 0) + found
    return dict(sorted(counts.items()))


def final_check(model: RegionModel) -> None:
    """Wakes the region, compares its live tensors, then binds every weight set it still holds
    that can be bound and compares the tensors with what the model says that set holds. Leaves
    the region awake, and bound unless it was unbound with no set to bind."""
    if model.asleep:
        stablebuf.wake(model.tag)
        model.woken()
    elif not model.unbound:
        model.verify("at the end")
    for weight_set in list(model.held):
        if model.bindable(weight_set) or stablebuf.bound(model.tag) == weight_set:
            stablebuf.bind(model.tag, weight_set)
            model.key = weight_set.id
            model.unbound = False
            model.verify(f"weight set {weight_set.id} at the end")


def test_a_random_sequence_matches_the_model_with_no_memory_drift(torch):
    seed = int(os.environ.get("STABLEBUF_SEED", time.time_ns() % (1 << 63)))
    steps = int(os.environ.get("STABLEBUF_STEPS", "2000"))
    print(f"test_random: seed {seed} (set STABLEBUF_SEED to replay), {steps} steps")
    rng = random.Random(seed)
    regions = {tag: RegionModel(torch, tag, rng) for tag in TAGS}

    compiled = torch.compile(lambda t: t * 3 + 1, mode="reduce-overhead")
    for _ in range(3):  # warm-up and recording while everything is awake
        compiled(regions[TAGS[0]].probe).clone()
    torch.cuda.synchronize()

    def device_total() -> int:
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        # Memory stablebuf gave back is held for release in the background (issue 43): it is
        # neither free to the driver nor in a region; count it, so the check does not trim
        # (which would change what the run exercises).
        held = stablebuf.release_stats(torch.cuda.current_device())["held_bytes"]
        return free + held + sum(model.physical() for model in regions.values())

    log: List[str] = []
    baseline = None
    for index in range(steps):
        before = len(log)
        try:
            step(torch, rng, regions, compiled, log)
        except AssertionError as error:
            raise AssertionError(
                f"step {index} (seed {seed}): {log[before:]}: {error}; last steps {log[-10:]}"
            ) from error
        if index % 100 == 99:
            total = device_total()
            baseline = total if baseline is None else baseline
            drift = total - baseline
            assert abs(drift) <= DRIFT_LIMIT, (
                f"step {index} (seed {seed}): device memory drifted {drift / MiB:.1f} MiB from "
                f"the model; last steps {log[-10:]}"
            )
    try:
        for model in regions.values():
            final_check(model)
    except AssertionError as error:
        raise AssertionError(
            f"at the end (seed {seed}): {error}; last steps {log[-10:]}"
        ) from error
    print(f"test_random: {steps} steps checked, operations {operation_counts(log)}")


def test_a_replay_thread_beside_a_bind_thread_always_sees_one_whole_weight_set(torch):
    tag = "random_threads"
    with stablebuf.region(tag):
        weights = torch.randn(4 * MiB // 4, device="cuda") + 3.0
    first_values = weights.detach().clone()
    second = stablebuf.snapshot(tag)
    first = stablebuf.bound(tag)
    with stablebuf.writing(second):
        weights.copy_(torch.randn_like(weights) - 3.0)
    with stablebuf.writing(second):
        second_values = weights.detach().clone()
    outcomes = [(first_values * 2 + 1).cpu(), (second_values * 2 + 1).cpu()]

    out = torch.empty_like(weights)
    graph = stablebuf.CUDAGraph(tags=[tag])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(weights * 2 + 1)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out.copy_(weights * 2 + 1)
    torch.cuda.synchronize()

    errors: List[BaseException] = []
    seen = [0, 0]
    stop = threading.Event()

    def replays() -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(300):
                    out.fill_(float("nan"))
                    graph.replay()
                    got = out.cpu()  # synchronises this stream
                    matches = [torch.equal(got, want) for want in outcomes]
                    assert any(matches), "a replay saw neither weight set whole"
                    seen[matches.index(True)] += 1
        except BaseException as error:  # reported by the main thread
            errors.append(error)
        finally:
            stop.set()

    def binds() -> None:
        try:
            sets = [first, second]
            index = 0
            while not stop.is_set():
                index += 1
                stablebuf.bind(tag, sets[index % 2])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=replays), threading.Thread(target=binds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert not errors, errors
    assert seen[0] > 0 and seen[1] > 0, f"the binds never showed under the replays: {seen}"
    stablebuf.bind(tag, first)
