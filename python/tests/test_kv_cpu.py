"""CPU tests of the KV cache's Python side (issue 45): the pure logic in
stablebuf._kv_logic (growth targets, the memory bound, admission under a budget, the
continuous-batching schedule, verdict lines) and the KvCache binding without a GPU."""

from __future__ import annotations

import ast
import os

import pytest

import stablebuf
from stablebuf import _kv_logic as logic
from stablebuf import _native

MiB = 1 << 20
LLAMA_TOKEN = 8 * 128 * 2  # Llama-3-8B: 8 KV heads x 128, bf16


def test_grow_target_adds_ahead_within_max_len():
    assert logic.grow_target(10, 0, 100) == 10
    assert logic.grow_target(10, 5, 100) == 15
    assert logic.grow_target(98, 5, 100) == 100
    with pytest.raises(ValueError):
        logic.grow_target(101, 0, 100)
    with pytest.raises(ValueError):
        logic.grow_target(-1, 0, 100)


def test_granules_follow_tokens():
    assert logic.granules_for(0, LLAMA_TOKEN) == 0
    assert logic.granules_for(1, LLAMA_TOKEN) == 1
    assert logic.granules_for(1024, LLAMA_TOKEN) == 1
    assert logic.granules_for(1025, LLAMA_TOKEN) == 2
    assert logic.row_stride(4096, LLAMA_TOKEN) == 4 * 2 * MiB
    assert logic.row_stride(1, 256) == 2 * MiB


def test_mapped_bytes_stay_within_the_bound():
    for lengths in ([1], [1024, 1025], [5, 0, 3000, 77], list(range(1, 200, 7))):
        mapped = logic.mapped_bytes(lengths, 32, LLAMA_TOKEN)
        bound = logic.memory_bound(lengths, 32, LLAMA_TOKEN)
        assert mapped <= bound, lengths
    # The bound is tight: one token past a granule costs a whole granule.
    assert logic.mapped_bytes([1025], 1, LLAMA_TOKEN) == 2 * 2 * 2 * MiB
    assert logic.memory_bound([1025], 1, LLAMA_TOKEN) == 2 * (1025 * LLAMA_TOKEN + 2 * MiB)


def test_static_bytes_and_fits():
    budget = logic.static_bytes(32, 8, 8192, LLAMA_TOKEN)
    assert budget == 2 * 32 * 8 * 8192 * LLAMA_TOKEN  # 8 GiB
    one = 2 * 32 * 3 * 2 * MiB  # a 3,000-token sequence: 3 granules per row
    assert logic.fits(0, 3000, budget, 32, LLAMA_TOKEN)
    assert logic.fits(budget - one, 3000, budget, 32, LLAMA_TOKEN)
    assert not logic.fits(budget - one + 1, 3000, budget, 32, LLAMA_TOKEN)


def test_requests_are_reproducible_and_bounded():
    a = logic.make_requests(50, 4096, 1024, 2.0, seed=7)
    b = logic.make_requests(50, 4096, 1024, 2.0, seed=7)
    assert a == b
    assert all(1 <= r.prompt and 1 <= r.output and r.total <= 4096 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    with pytest.raises(ValueError):
        logic.make_requests(1, 100, 90, 1.0)


def _run(scheduler, accept=lambda r, s: True):
    """Drives a schedule as kv_serve does, checking its invariants; returns per-step lengths."""
    seen = []
    while not scheduler.idle and scheduler.step < 10000:
        for slot, request in scheduler.admit(accept):
            assert scheduler.slots[slot].length == request.prompt
            assert request.arrival <= scheduler.step
        grown, finished = scheduler.advance()
        lengths = scheduler.lengths()
        for slot, length in grown:
            assert lengths[slot] == length
            assert length <= scheduler.slots[slot].request.total
        seen.append(lengths)
        scheduler.finish(finished)
    return seen


def test_scheduler_serves_every_request_once():
    requests = logic.make_requests(60, 2048, 512, 1.5, seed=3)
    scheduler = logic.Scheduler(8, requests)
    _run(scheduler)
    assert sorted(scheduler.done) == list(range(60))
    assert scheduler.peak_running <= 8


def test_scheduler_admission_respects_a_budget():
    layers, token = 4, LLAMA_TOKEN
    requests = logic.make_requests(80, 4096, 1024, 8.0, seed=5)
    budget = logic.static_bytes(layers, 4, 4096, token)
    projected = {}

    def accept(request, slot):
        if logic.fits(sum(projected.values()), request.total, budget, layers, token):
            projected[slot] = 2 * layers * logic.granules_for(request.total, token) * logic.GRANULE
            return True
        return False

    scheduler = logic.Scheduler(32, requests)
    while not scheduler.idle and scheduler.step < 100000:
        scheduler.admit(accept)
        assert sum(projected.values()) <= budget
        mapped = logic.mapped_bytes(scheduler.lengths(), layers, token)
        assert mapped <= budget
        _, finished = scheduler.advance()
        for slot in finished:
            projected.pop(slot)
        scheduler.finish(finished)
    assert sorted(scheduler.done) == list(range(80))
    # Mean length 1,024 = max_len / 4: more than twice StaticCache(4)'s sequences at once.
    assert scheduler.peak_running >= 2 * 4


def test_admission_counts_requests_accepted_in_the_same_step():
    # A budget for exactly two 1-granule sequences; three arrive at step 0. Each acceptance
    # must see the ones accepted before it in the same admit call (kv_serve recorded them
    # only after admit returned, and admitted all three).
    layers, token = 2, LLAMA_TOKEN
    admission = logic.Admission(2 * 2 * layers * 2 * MiB, layers, token)
    requests = [logic.Request(rid, 0, 10, 10) for rid in range(3)]
    scheduler = logic.Scheduler(8, requests)
    admitted = scheduler.admit(admission)
    assert [slot for slot, _ in admitted] == [0, 1]
    assert admission.held == admission.budget
    admission.release(0)
    assert admission.held == admission.budget // 2
    assert logic.Admission(None, layers, token)(requests[0], 0)


def test_simulate_agrees_with_a_manual_drive():
    requests = logic.make_requests(40, 2048, 512, 1.5, seed=11)
    plan = logic.simulate(8, requests, 4, LLAMA_TOKEN)
    seen = _run(logic.Scheduler(8, requests))
    assert plan.steps == len(seen)
    assert plan.tokens == sum(r.output for r in requests)
    assert plan.peak_running == 8
    # Lengths 256..768 with 1,024 tokens per granule: no row ever opens a second granule.
    assert plan.crossings == 0 and plan.map_steps == 0
    long = [logic.Request(0, 0, 1000, 100)]
    assert logic.simulate(1, long, 4, LLAMA_TOKEN).crossings == 1


@pytest.mark.parametrize("size", sorted(logic.SIZES))
def test_kv_serve_sizes_measure_every_target(size):
    """Each kv_serve size (defaults: mean length max_len / 4, 4 KvCache slots per StaticCache
    slot at the budget) has decode steps that map, and its budget run can hold >= 2 B sequences
    within the memory of StaticCache(B)."""
    s = logic.SIZES[size]
    b, max_len, layers = s["max_batch"], s["max_len"], s["layers"]
    mean = max_len // 4
    assert mean <= max_len // 3
    same, at_budget = logic.workload(s["requests"], b, max_len, mean, 4, seed=0)
    plan = logic.simulate(b, same, layers, LLAMA_TOKEN)
    assert plan.map_steps > 0
    budget = logic.static_bytes(layers, b, max_len, LLAMA_TOKEN)
    wide = logic.simulate(4 * b, at_budget, layers, LLAMA_TOKEN, budget=budget)
    assert wide.peak_held <= budget
    assert wide.peak_running >= 2 * b
    if size == "quick":
        # About a minute on one H100: both same-batch runs plus the budget run.
        assert 2 * plan.steps + wide.steps < 15000


def test_map_spike_and_verdicts():
    mid, spike = logic.map_spike([1.0, 1.0, 2.0, 1.0], [False, False, True, False])
    assert (mid, spike) == (1.0, 2.0)
    assert logic.map_spike([1.0], [False]) == (1.0, None)
    assert logic.map_spike([], []) == (0.0, None)
    # A map is charged where it ran before the replay, outlasted it, or slowed the replay.
    assert logic.map_on_path(True, False, 1.0, 1.0)
    assert logic.map_on_path(False, True, 1.0, 1.0)
    assert logic.map_on_path(False, False, 1.2, 1.0)
    assert not logic.map_on_path(False, False, 1.05, 1.0)
    assert logic.over([1.0, 1.0, 1.2, 1.0, 1.3], [True, False, True, False, False]) == (1, 2)
    assert logic.over([], []) == (0, 0)
    assert logic.verdict("x", True, "d") == "verdict PASS x: d"
    assert logic.verdict("x", False, "d").startswith("verdict FAIL")
    assert logic.verdict("x", None, "d").startswith("verdict N/A")


def test_kv_cache_is_bound_and_documented():
    assert (_native.KvCache.__doc__ or "").strip()
    for name in ("grow", "grow_many", "release", "share_prefix", "publish_lengths", "sleep",
                 "wake", "stats", "buffer", "lengths_buffer", "trim", "write_guard", "mark_layer_done",
                 "change_behind"):
        assert (getattr(_native.KvCache, name).__doc__ or "").strip(), name


def test_kv_cache_rejects_an_unknown_dtype_before_the_driver():
    with pytest.raises(ValueError, match="dtype"):
        _native.KvCache(0, 1, 1, 16, 1, 8, dtype="int8")


@pytest.mark.skipif(stablebuf.driver_present(), reason="a CUDA driver is here")
def test_kv_cache_without_a_driver_is_a_stablebuf_error():
    with pytest.raises(stablebuf.Error):
        _native.KvCache(0, 1, 1, 16, 1, 8)


def test_hf_module_compiles_and_imports_only_what_it_declares():
    path = os.path.join(os.path.dirname(stablebuf.__file__), "hf.py")
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    names = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert "StableCache" in names
