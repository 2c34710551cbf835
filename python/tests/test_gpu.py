"""GPU tests: regions under PyTorch, sleep/wake, weight sets under captured graphs, the replay
guard, and typed errors that leave state intact. They skip (with the reason) without torch or
a CUDA device.

Regions live for the whole process, so every test uses tags of its own. Outputs are poisoned
with NaN before every replay, and inputs are fresh random data, so a replay that did not run,
or ran on the wrong memory, cannot pass.
"""

from __future__ import annotations

import time

import pytest

import stablebuf
from stablebuf import _native

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def torch():
    import torch as torch_module

    torch_module.cuda.init()
    torch_module.manual_seed(20261123)
    return torch_module


def _same_bits(torch, a, b) -> bool:
    return torch.equal(
        a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()
    )


def _random_tensors(torch, shapes_and_dtypes):
    out = []
    for shape, dtype in shapes_and_dtypes:
        if dtype.is_floating_point:
            t = torch.randn(shape, device="cuda", dtype=dtype)
        else:
            t = torch.randint(1, 120, shape, device="cuda", dtype=dtype)
        out.append(t)
    return out


def _warm_then_capture(torch, graph, fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = fn()
    return out


def _mlp_forward(torch, w1, w2, x):
    return torch.relu(x @ w1) @ w2


def test_tensors_made_in_a_region_live_in_its_reservation(torch):
    with stablebuf.region("place") as pool:
        small = torch.randn(1000, device="cuda")
        big = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    outside = torch.randn(1000, device="cuda")
    assert isinstance(pool, torch.cuda.MemPool)
    assert _native.owner(small.data_ptr()) == "place"
    assert _native.owner(big.data_ptr()) == "place"
    assert _native.owner(outside.data_ptr()) is None
    stats = stablebuf.stats()["place"]
    assert stats["allocated"] >= big.nbytes + small.nbytes
    assert stats["mapped"] >= stats["allocated"]
    assert stats["asleep"] is False
    assert stats["tensor_bytes"] >= big.nbytes + small.nbytes
    assert stats["cached"] >= 0


def test_sleep_wake_round_trips_are_bit_exact(torch):
    with stablebuf.region("round_trip"):
        tensors = _random_tensors(
            torch,
            [
                ((4096, 1024), torch.float32),
                ((777,), torch.float16),
                ((3, 1000, 333), torch.bfloat16),
                ((12345,), torch.int64),
                ((5 * MiB + 3,), torch.uint8),
            ],
        )
    references = [t.cpu().clone() for t in tensors]
    for cycle in range(3):
        report = stablebuf.sleep("round_trip")
        assert report["round_trip"]["bytes"] >= sum(t.nbytes for t in tensors)
        asleep = stablebuf.stats()["round_trip"]
        assert asleep["asleep"] and asleep["mapped"] == 0 and asleep["host_bytes"] > 0
        stablebuf.wake("round_trip")
        awake = stablebuf.stats()["round_trip"]
        assert not awake["asleep"] and awake["mappings"] == 1, awake
        for t, reference in zip(tensors, references):
            assert _same_bits(torch, t, reference), f"cycle {cycle}: {t.dtype} {tuple(t.shape)}"


def test_discarded_regions_come_back_usable(torch):
    with stablebuf.region("discard"):
        kv = torch.randn(8 * MiB // 4, device="cuda")
    stablebuf.sleep("discard", keep=False)
    assert stablebuf.stats()["discard"]["host_bytes"] == 0
    stablebuf.wake("discard")
    fresh = torch.randn_like(kv)
    kv.copy_(fresh)
    assert torch.equal(kv, fresh)


def test_free_memory_rises_by_the_region_on_sleep_and_is_back_after_100_cycles(torch):
    with stablebuf.region("cycles"):
        data = torch.randn(256 * MiB // 4, device="cuda")
    reference = data.cpu().clone()
    mapped = stablebuf.stats()["cycles"]["mapped"]
    stablebuf.reserve_host(mapped)  # pin once: the cycles below must not pin again
    pins = stablebuf.host_arena()["pins"]
    torch.cuda.synchronize()
    stablebuf.trim()  # memory held for release (issue 43) would be released by the sleep too
    baseline, _ = torch.cuda.mem_get_info()
    stablebuf.sleep("cycles")
    asleep, _ = torch.cuda.mem_get_info()
    released = asleep - baseline
    assert mapped - 2 * MiB <= released <= mapped + 32 * MiB, (released, mapped)
    stablebuf.wake("cycles")
    start = time.perf_counter()
    for _ in range(100):
        stablebuf.sleep("cycles")
        stablebuf.wake("cycles")
    per_cycle = (time.perf_counter() - start) / 100
    torch.cuda.synchronize()
    after, _ = torch.cuda.mem_get_info()
    print(
        f"\n  256 MiB sleep+wake: {per_cycle * 1e3:.2f} ms per cycle; released {released >> 20} MiB"
    )
    assert abs(after - baseline) <= 4 * MiB, (
        f"free memory drifted by {(after - baseline) / MiB:.1f} MiB"
    )
    assert stablebuf.host_arena()["pins"] == pins, "a steady-state sleep pinned memory again"
    assert _same_bits(torch, data, reference)


def test_a_captured_graph_replays_after_wake_and_refuses_while_asleep(torch):
    with stablebuf.region("graph_weights"):
        w1 = torch.randn(1024, 1024, device="cuda") / 32
        w2 = torch.randn(1024, 1024, device="cuda") / 32
    x = torch.randn(64, 1024, device="cuda")
    g = stablebuf.CUDAGraph(tags=["graph_weights"])
    out = _warm_then_capture(torch, g, lambda: _mlp_forward(torch, w1, w2, x))
    plain = torch.cuda.CUDAGraph()
    plain_out = _warm_then_capture(torch, plain, lambda: _mlp_forward(torch, w1, w2, x))
    guarded = stablebuf.guard(plain, ["graph_weights"])

    x.copy_(torch.randn_like(x))
    want = _mlp_forward(torch, w1, w2, x)
    stablebuf.sleep("graph_weights")
    out.fill_(float("nan"))
    plain_out.fill_(float("nan"))
    with pytest.raises(stablebuf.Asleep, match="graph_weights"):
        g.replay()
    with pytest.raises(stablebuf.Asleep):
        guarded.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(plain_out).all(), "a refused replay launched"

    stablebuf.wake("graph_weights")
    g.replay()
    guarded.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(plain_out, want)


def test_uploaded_graphs_replay_like_the_cpu_and_unready_ones_are_left_alone(torch):
    with stablebuf.region("upload_weights"):
        w1 = torch.randn(1024, 1024, device="cuda") / 32
        w2 = torch.randn(1024, 1024, device="cuda") / 32
    x = torch.randn(64, 1024, device="cuda")
    g = stablebuf.CUDAGraph(tags=["upload_weights"])
    out = _warm_then_capture(torch, g, lambda: _mlp_forward(torch, w1, w2, x))
    assert g.upload() is True
    side = torch.cuda.Stream()
    assert stablebuf.upload_graph(g, side) is True  # again, on another stream: harmless
    # keep_graph=True: no executable until instantiate(); the upload leaves it alone.
    kept = torch.cuda.CUDAGraph(keep_graph=True)
    kept_out = _warm_then_capture(torch, kept, lambda: _mlp_forward(torch, w1, w2, x))
    assert stablebuf.upload_graph(kept) is False
    kept.instantiate()
    assert stablebuf.upload_graph(kept) is True
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        want = _mlp_forward(torch, w1.cpu().double(), w2.cpu().double(), x.cpu().double())
        out.fill_(float("nan"))
        kept_out.fill_(float("nan"))
        g.replay()
        kept.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().double(), want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(kept_out.cpu().double(), want, rtol=2e-3, atol=2e-3)


def test_a_graph_guards_every_region_when_given_no_tags(torch):
    with stablebuf.region("default_guard"):
        w = torch.randn(256, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda")
    g = stablebuf.CUDAGraph()
    _warm_then_capture(torch, g, lambda: x @ w)
    here = torch.cuda.current_device()
    on_this_device = {t for t, e in stablebuf.stats().items() if e["device"] == here}
    assert set(g.guarded_tags) == on_this_device, "every region of the graph's device, no other"
    assert "default_guard" in g.guarded_tags
    g.guard(["default_guard"])
    assert g.guarded_tags == ("default_guard",)


def test_weight_set_swap_under_a_graph_equals_eager_with_that_set(torch):
    def build():
        return torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
        ).cuda()

    with stablebuf.region("swap"):
        model = build()
    state_a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state_b = {k: torch.randn_like(v) * 0.05 for k, v in state_a.items()}
    reference_a, reference_b = build(), build()
    reference_a.load_state_dict(state_a)
    reference_b.load_state_dict(state_b)

    ws_b = stablebuf.snapshot("swap")
    ws_a = stablebuf.bound("swap")
    assert ws_a is not None and ws_a != ws_b and ws_b.tag == "swap"
    assert ws_b.nbytes >= sum(v.nbytes for v in state_a.values())
    with stablebuf.writing(ws_b):
        model.load_state_dict(state_b)
    assert stablebuf.bound("swap") == ws_a, "writing() binds back what was bound"

    x = torch.randn(32, 512, device="cuda")
    g = stablebuf.CUDAGraph(tags=["swap"])
    with torch.no_grad():
        out = _warm_then_capture(torch, g, lambda: model(x))
        for step in range(6):
            weights, reference = (ws_b, reference_b) if step % 2 == 0 else (ws_a, reference_a)
            x.copy_(torch.randn_like(x))
            previous = stablebuf.bind("swap", weights)
            assert previous == (ws_a if step % 2 == 0 else ws_b)
            out.fill_(float("nan"))
            g.replay()
            torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-4)


def test_a_weight_sets_memory_is_what_the_region_reads_where_it_is_bound(torch):
    """``WeightSet.memory()``: the set at its own address. Written there (bound or not, on a
    side stream ordered by an event), the region's graph reads it; the other set is untouched."""
    with stablebuf.region("home_weights"):
        w1 = torch.randn(1024, 1024, device="cuda") / 32
        w2 = torch.randn(1024, 1024, device="cuda") / 32
    x = torch.randn(64, 1024, device="cuda")
    g = stablebuf.CUDAGraph(tags=["home_weights"])
    out = _warm_then_capture(torch, g, lambda: _mlp_forward(torch, w1, w2, x))
    base = _native.region_base("home_weights")
    ws_b = stablebuf.snapshot("home_weights")
    ws_a = stablebuf.bound("home_weights")
    home_a = torch.from_dlpack(ws_a.memory())
    home_b = torch.from_dlpack(ws_b.memory())
    assert home_b.dtype == torch.uint8 and home_b.numel() == ws_b.nbytes

    def view(home, w):
        at = int(w.data_ptr()) - base
        return home[at : at + w.nbytes].view(w.dtype).view(w.shape)

    old = (w1.clone(), w2.clone())
    side = torch.cuda.Stream()

    def write_and_check(home, expect_bound):
        new = [torch.randn_like(w1) / 32, torch.randn_like(w2) / 32]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            view(home, w1).copy_(new[0])
            view(home, w2).copy_(new[1])
        done = torch.cuda.Event()
        done.record(side)
        torch.cuda.current_stream().wait_event(done)
        assert stablebuf.bound("home_weights") == expect_bound
        x.copy_(torch.randn_like(x))
        want = _mlp_forward(torch, new[0].cpu().double(), new[1].cpu().double(), x.cpu().double())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().double(), want, rtol=2e-3, atol=2e-3)

    for _ in range(2):
        stablebuf.bind("home_weights", ws_b)
        write_and_check(home_b, ws_b)  # written where it is bound: read at once
    torch.testing.assert_close(view(home_a, w1), old[0], rtol=0, atol=0)
    torch.testing.assert_close(view(home_a, w2), old[1], rtol=0, atol=0)
    stablebuf.bind("home_weights", ws_a)
    torch.testing.assert_close(w1, old[0], rtol=0, atol=0)  # set a came back untouched
    write_and_check(home_a, ws_a)


def _read_set(torch, weights, params):
    """What ``weights`` holds, read through the region's tensors: :func:`stablebuf.writing`
    binds it for the block, then binds back what was bound (nothing is written)."""
    with stablebuf.writing(weights):
        values = [p.detach().clone() for p in params]
    torch.cuda.synchronize()
    return values


def _switch_fixture(torch, tag, fence="device"):
    """A small MLP in region ``tag`` with three weight sets (the bound one and two snapshots
    holding fresh random values), their states and eager references outside the region."""

    def build():
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
        ).cuda()

    with stablebuf.region(tag, fence=fence):
        model = build()
    torch.cuda.synchronize()  # the build's kernels wrote the region unnoted
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    states = [{n: p.detach().clone() for n, p in zip(names, params)}]
    states += [
        {n: torch.randn_like(v) * 0.05 + 0.01 for n, v in states[0].items()} for _ in range(2)
    ]
    sets = [stablebuf.snapshot(tag), stablebuf.snapshot(tag)]
    sets.insert(0, stablebuf.bound(tag))
    for weights, state in zip(sets[1:], states[1:]):
        with stablebuf.writing(weights):
            with torch.no_grad():
                torch._foreach_copy_(params, [state[n] for n in names])
    references = []
    for state in states:
        reference = build()
        reference.load_state_dict(state)
        references.append(reference)
    torch.cuda.synchronize()
    stablebuf.note_use([tag])  # the writes were eager
    return model, names, params, states, sets, references


def _assert_sets_unchanged(torch, sets, states, names, params, what):
    for i, weights in enumerate(sets):
        for name, got in zip(names, _read_set(torch, weights, params)):
            assert torch.equal(got, states[i][name]), f"{what}: set {i}, {name} changed"


def test_switches_by_copy_and_remap_interleaved_equal_eager_and_keep_the_callers_sets(torch):
    tag = "switch"
    model, names, params, states, sets, references = _switch_fixture(torch, tag)
    x = torch.randn(64, 512, device="cuda")
    graph = torch.cuda.CUDAGraph()  # a plain PyTorch graph, captured once
    with torch.no_grad():
        out = _warm_then_capture(torch, graph, lambda: model(x))
    span = stablebuf.stats()[tag]["span"]
    crossover = stablebuf.crossover_bytes()
    print(f"switch: span {span} bytes, crossover {crossover} bytes")
    auto_way = None  # unknown where the model says "one way always wins" or near the crossover
    if crossover is not None and abs(span - crossover) > MiB:
        auto_way = "copy" if span < crossover else "remap"

    plan = [
        (1, "copy"),
        (2, "copy"),  # the live set is bound: one copy
        (0, "remap"),
        (2, "copy"),  # after a remap: the live set is bound again
        (2, "remap"),
        (2, "copy"),  # set 2 is bound: nothing to do, "remap"
        (1, "auto"),
        (0, "copy"),
        (1, "remap"),
        (0, "auto"),
        (0, "copy"),
    ]
    bound_set = 0  # the caller's set bound now (None: the region's live set)
    live = None
    for step, (k, strategy) in enumerate(plan):
        what = f"step {step}: set {k}, {strategy}"
        x.copy_(torch.randn_like(x))
        way = stablebuf.switch(tag, sets[k], strategy=strategy)
        if bound_set == k:
            assert way == "remap", what
        elif strategy != "auto":
            assert way == strategy, what
        elif auto_way is not None:
            assert way == auto_way, what
        bound = stablebuf.bound(tag)
        if way == "remap":
            assert bound == sets[k], what
            bound_set = k
        else:
            assert way == "copy", what
            assert bound not in sets, f"{what}: a copy switch bound a caller's set"
            assert bound.tag == tag and bound.nbytes >= span
            live = live or bound
            assert bound == live, f"{what}: one live set, reused"
            bound_set = None
        del bound
        out.fill_(float("nan"))
        graph.replay()
        with torch.no_grad():
            want = references[k](x)
            eager = model(x)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(eager, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
        if way == "copy":
            _assert_sets_unchanged(torch, sets, states, names, params, what)
    assert live is not None, "the plan copies"

    # After a copy switch, writes to the region land in the live set, not in the caller's set;
    # the next copy switch overwrites them.
    stablebuf.bind(tag, sets[0])
    assert stablebuf.switch(tag, sets[1], strategy="copy") == "copy"
    with torch.no_grad():
        params[0].add_(1.0)
    assert torch.equal(params[0], states[1][names[0]] + 1.0)
    _assert_sets_unchanged(torch, sets, states, names, params, "a write after a copy switch")
    assert torch.equal(params[0], states[1][names[0]] + 1.0), "writing() bound the live set back"
    assert stablebuf.switch(tag, sets[1], strategy="copy") == "copy"
    assert torch.equal(params[0], states[1][names[0]])
    stablebuf.bind(tag, sets[0])


def test_a_last_use_region_remaps_only_after_its_copy_switch_ran(torch):
    # A copy switch does not wait for the device; it is noted as a use of the region, so a
    # later remap (which unmaps the live set the copy writes) waits for it, and for the work
    # queued before it on the stream, but a copy switch itself waits for nothing unnoted.
    tag = "switch_last_use"
    model, names, params, states, sets, references = _switch_fixture(torch, tag, "last-use")
    busy = torch.randn(4096, 4096, device="cuda") / 64  # outside the region
    for _ in range(24):
        busy = torch.tanh(busy @ busy)
    assert stablebuf.switch(tag, sets[1], strategy="copy") == "copy"
    copy_queued = not torch.cuda.current_stream().query()
    assert stablebuf.switch(tag, sets[2], strategy="remap") == "remap"
    done_before_the_remap = torch.cuda.current_stream().query()
    assert copy_queued, "the copy switch waited for unrelated work"
    assert done_before_the_remap, "the remap did not wait for the copy it unmaps under"
    x = torch.randn(64, 512, device="cuda")
    for k, strategy in ((2, "remap"), (1, "copy"), (0, "copy"), (2, "remap"), (0, "copy")):
        assert stablebuf.switch(tag, sets[k], strategy=strategy) == strategy
        with torch.no_grad():
            got = model(x)
        stablebuf.note_use([tag])  # an eager forward over a "last-use" region
        torch.testing.assert_close(got, references[k](x), rtol=1e-4, atol=1e-4)
    _assert_sets_unchanged(torch, sets, states, names, params, "last-use")


def test_switch_refusals_are_typed_and_change_nothing(torch):
    with stablebuf.region("switch_keep"):
        w = torch.randn(1024, 1024, device="cuda")
    with stablebuf.region("switch_other"):
        torch.randn(1 << 18, device="cuda")
    reference = w.clone()
    kept = stablebuf.snapshot("switch_keep")
    bound_before = stablebuf.bound("switch_keep")
    foreign = stablebuf.snapshot("switch_other")

    def unchanged(what):
        assert stablebuf.bound("switch_keep") == bound_before, what
        assert _same_bits(torch, w, reference), what

    for strategy in ("auto", "copy", "remap"):
        with pytest.raises(stablebuf.SnapshotMismatch, match="switch_other.*switch_keep"):
            stablebuf.switch("switch_keep", foreign, strategy=strategy)
        with pytest.raises(stablebuf.UnknownTag, match="nope"):
            stablebuf.switch("nope", kept, strategy=strategy)
        unchanged(f"{strategy}: foreign set, unknown tag")
    with pytest.raises(ValueError, match="strategy"):
        stablebuf.switch("switch_keep", kept, strategy="bind")

    x = torch.randn(8, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ w
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = x @ w
        for strategy in ("auto", "copy", "remap"):
            with pytest.raises(stablebuf.CaptureActive):
                stablebuf.switch("switch_keep", kept, strategy=strategy)
        with pytest.raises(stablebuf.CaptureActive):
            stablebuf.crossover_bytes()
    unchanged("during a capture")
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, x @ w)

    stablebuf.sleep("switch_keep")
    for strategy in ("auto", "copy", "remap"):
        with pytest.raises(stablebuf.Asleep):
            stablebuf.switch("switch_keep", kept, strategy=strategy)
    assert stablebuf.stats()["switch_keep"]["asleep"]
    stablebuf.wake("switch_keep")
    assert _same_bits(torch, w, reference), "asleep: nothing changed"
    bound_before = stablebuf.bound("switch_keep")  # a wake backs the region anew

    with stablebuf.region("switch_keep"):
        grown = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")  # past the set's span
    for strategy in ("auto", "copy", "remap"):
        with pytest.raises(stablebuf.SnapshotMismatch):
            stablebuf.switch("switch_keep", kept, strategy=strategy)
    assert _same_bits(torch, w, reference), "grown: nothing changed"
    del grown


def test_a_last_use_bind_waits_for_the_noted_replay_and_not_for_later_work(torch):
    # Two regions with the "last-use" fence, a long graph over each, queued back to back.
    # Binding the first region must wait for its replay (noted by the guarded replay), so that
    # replay reads the old weight set; it must not wait for the other region's replay queued
    # after it, which is still running when the bind returns.
    n, rounds = 4096, 24

    def chain(w, x):
        out = x
        for _ in range(rounds):
            out = torch.tanh(out @ w)
        return out

    graphs, outs, weights, inputs = [], [], [], []
    for tag in ("last_use_a", "last_use_b"):
        with stablebuf.region(tag, fence="last-use"):
            w = torch.randn(n, n, device="cuda") / n**0.5
        x = torch.randn(n, n, device="cuda")
        g = stablebuf.CUDAGraph(tags=[tag])
        with torch.no_grad():
            out = _warm_then_capture(torch, g, lambda w=w, x=x: chain(w, x))
        stablebuf.note_use([tag])  # the warm-up read the weights eagerly
        graphs.append(g)
        outs.append(out)
        weights.append(w)
        inputs.append(x)
    first_values = weights[0].detach().clone()
    second_set = stablebuf.snapshot("last_use_a")
    first_set = stablebuf.bound("last_use_a")  # a region has a weight set from its first snapshot
    assert first_set is not None and first_set != second_set
    second_values = torch.randn(n, n, device="cuda") / n**0.5
    with stablebuf.writing(second_set):
        weights[0].copy_(second_values)
    torch.cuda.synchronize()
    torch.testing.assert_close(weights[0], first_values, rtol=0, atol=0)

    for out in outs:
        out.fill_(float("nan"))
    graphs[0].replay()  # on the first weight set
    on_first = outs[0].clone()  # stream order: after that replay, before the next one
    graphs[1].replay()  # queued behind it, over the other region
    assert stablebuf.bind("last_use_a", second_set) == first_set
    still_running = not torch.cuda.current_stream().query()
    graphs[0].replay()  # on the second weight set
    on_second = outs[0].clone()
    torch.cuda.synchronize()
    assert still_running, "the bind waited for work queued after the region's last use"
    with torch.no_grad():
        torch.testing.assert_close(on_first, chain(first_values, inputs[0]), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(on_second, chain(second_values, inputs[0]), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(outs[1], chain(weights[1], inputs[1]), rtol=1e-3, atol=1e-3)
    stablebuf.bind("last_use_a", first_set)
    torch.testing.assert_close(weights[0], first_values, rtol=0, atol=0)


def test_graph_memory_in_a_region_can_be_discarded_and_replayed(torch):
    with stablebuf.region("act_weights"):
        w = torch.randn(2048, 2048, device="cuda") / 45
    x = torch.randn(256, 2048, device="cuda")
    g = stablebuf.CUDAGraph(tags=["act_weights", "activations"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.relu(x @ w) @ w
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g, pool=stablebuf.pool("activations").id):
        out = torch.relu(x @ w) @ w
    assert _native.owner(out.data_ptr()) == "activations"
    want = torch.relu(x @ w) @ w
    stablebuf.sleep("activations", keep=False)
    with pytest.raises(stablebuf.Asleep):
        g.replay()
    stablebuf.wake("activations")
    out.fill_(float("nan"))
    g.replay()
    torch.testing.assert_close(out, want)


def test_unbind_makes_guarded_replays_raise_until_bound_again(torch):
    with stablebuf.region("unbind"):
        w = torch.randn(512, 512, device="cuda")
    x = torch.randn(16, 512, device="cuda")
    stablebuf.snapshot("unbind")
    kept = stablebuf.bound("unbind")
    g = stablebuf.CUDAGraph(tags=["unbind"])
    out = _warm_then_capture(torch, g, lambda: x @ w)
    want = x @ w
    stablebuf.unbind("unbind")
    with pytest.raises(stablebuf.Unbound, match="unbind"):
        g.replay()
    with pytest.raises(stablebuf.Unbound):
        stablebuf.check("unbind")
    with pytest.raises(stablebuf.Unbound):
        with stablebuf.region("unbind"):
            pass
    stablebuf.bind("unbind", kept)
    out.fill_(float("nan"))
    g.replay()
    torch.testing.assert_close(out, want)


def test_unknown_tags_and_foreign_weight_sets_raise_and_keep_state(torch):
    with stablebuf.region("keep_a"):
        a = torch.randn(1 << 20, device="cuda")
    with stablebuf.region("keep_b"):
        torch.randn(1 << 18, device="cuda")
    reference = a.cpu().clone()
    stablebuf.snapshot("keep_a")
    bound_before = stablebuf.bound("keep_a")
    foreign = stablebuf.snapshot("keep_b")

    with pytest.raises(stablebuf.UnknownTag, match="nope"):
        stablebuf.sleep(["keep_a", "nope"])
    assert not stablebuf.stats()["keep_a"]["asleep"], "nothing slept when one tag was unknown"

    with pytest.raises(stablebuf.SnapshotMismatch, match="keep_b.*keep_a"):
        stablebuf.bind("keep_a", foreign)
    assert stablebuf.bound("keep_a") == bound_before
    assert _same_bits(torch, a, reference)

    stablebuf.sleep("keep_a")
    with pytest.raises(stablebuf.Asleep):
        stablebuf.bind("keep_a", bound_before)
    with pytest.raises(stablebuf.Asleep):
        stablebuf.snapshot("keep_a")
    with pytest.raises(stablebuf.Asleep, match="keep_a"):
        with stablebuf.region("keep_a"):
            pass
    stablebuf.wake("keep_a")
    assert _same_bits(torch, a, reference)


def test_waking_on_a_full_device_raises_out_of_memory_and_stays_asleep(torch):
    with stablebuf.region("full"):
        data = torch.randn(1 << 28, device="cuda")  # 1 GiB
    reference = data.cpu().clone()
    stablebuf.sleep("full")
    host_bytes = stablebuf.stats()["full"]["host_bytes"]
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - 256 * MiB, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(stablebuf.OutOfMemory, match="asked") as raised:
            stablebuf.wake("full")
        assert "free" in str(raised.value)
        stats = stablebuf.stats()["full"]
        assert stats["asleep"] and stats["host_bytes"] == host_bytes, stats
        with pytest.raises(stablebuf.Asleep):
            stablebuf.check("full")
    finally:
        del filler
        torch.cuda.empty_cache()
    stablebuf.wake("full")
    assert _same_bits(torch, data, reference)


def test_an_allocation_the_device_cannot_hold_raises_out_of_memory(torch):
    with stablebuf.region("too_big"):
        kept = torch.randn(1024, device="cuda")
    reference = kept.cpu().clone()
    before = stablebuf.stats()["too_big"]
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(stablebuf.OutOfMemory, match="asked") as raised:
        with stablebuf.region("too_big"):
            torch.empty(free + (4 << 30), dtype=torch.uint8, device="cuda")
    assert isinstance(raised.value.__cause__, RuntimeError), "PyTorch's own error is the cause"
    after = stablebuf.stats()["too_big"]
    assert after["allocations"] == before["allocations"]
    assert after["mapped"] == before["mapped"]
    assert _same_bits(torch, kept, reference)


def test_stats_and_timeline(torch, tmp_path):
    with stablebuf.region("report"):
        torch.randn(3 * MiB, device="cuda")
    stablebuf.snapshot("report")
    assert stablebuf.stats()["report"]["mappings"] == 1
    stablebuf.sleep("report")
    assert stablebuf.stats()["report"]["mapped"] == 0
    stablebuf.wake("report")
    path = stablebuf.timeline(tmp_path / "regions.svg", title="test regions")
    text = open(path, encoding="utf-8").read()
    assert "<svg" in text and len(text) > 1000
