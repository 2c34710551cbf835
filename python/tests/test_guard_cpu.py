"""The process-wide replay guard, tested without a GPU: error types, the patches on stand-in
classes (idempotent, checking before the original runs, refusals that change nothing), the
graph-tags bookkeeping and the refusal of remaps during a capture. Tests that need torch
(installing into torch itself, guard_module) skip with the reason where torch is missing; they
run on a CPU-only torch."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types

import pytest

import stablebuf
from stablebuf import _guard

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def _stand_in_graph_class(launched):
    class StandInGraph:
        def capture_end(self):
            launched.append("capture_end")

        def replay(self):
            launched.append("replay")

    return StandInGraph


def _delta(before, name):
    return stablebuf.guard_stats()[name] - before[name]


def test_error_types_exist_under_error_and_are_exported():
    assert issubclass(stablebuf.CaptureActive, stablebuf.Error)
    assert stablebuf.CaptureActive.__module__ == "stablebuf"
    assert (stablebuf.CaptureActive.__doc__ or "").strip()
    for name in ("CaptureActive", "graph_tags", "guard_stats", "guard_module"):
        assert name in stablebuf.__all__
    stats = stablebuf.guard_stats()
    for key in ("checked", "refused", "captures", "graphs", "trees", "trees_error"):
        assert key in stats, key


def test_patching_a_graph_class_is_idempotent():
    cls = _stand_in_graph_class([])
    original_replay = cls.replay
    assert _guard.patch_graph_class(cls) is True
    patched_replay, patched_capture_end = cls.replay, cls.capture_end
    assert patched_replay is not original_replay
    assert _guard.patch_graph_class(cls) is False, "the second patch finds the first"
    assert cls.replay is patched_replay and cls.capture_end is patched_capture_end
    assert cls.replay.__wrapped__ is original_replay, "wrapped once, not twice"


def test_each_capture_clears_the_cublas_workspace_cache_before_it_begins(monkeypatch):
    # Issue 38: a workspace cached before the capture is freed by CUDA graph trees' clear
    # while the graph still writes through it; cleared first, the capture allocates its own
    # in the graph's pool. A stand-in torch records the clear between the caller and the
    # original capture_begin.
    launched = []

    class StandInGraph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            launched.append(("capture_begin", pool, capture_error_mode))

        def capture_end(self):
            launched.append("capture_end")

        def replay(self):
            launched.append("replay")

    fake_torch = types.SimpleNamespace(
        _C=types.SimpleNamespace(_cuda_clearCublasWorkspaces=lambda: launched.append("clear"))
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert _guard.patch_graph_class(StandInGraph) is True
    assert _guard.patch_graph_class(StandInGraph) is False, "the second patch finds the first"
    StandInGraph().capture_begin((0, 7), capture_error_mode="thread_local")
    assert launched == ["clear", ("capture_begin", (0, 7), "thread_local")]
    launched.clear()
    monkeypatch.setattr(_guard, "OWN_CUBLAS_WORKSPACES", False)
    StandInGraph().capture_begin()
    assert launched == [("capture_begin", None, "global")], "the seam turns the clear off"
    # A torch without the private function: the capture begins as it would without us.
    monkeypatch.setattr(_guard, "OWN_CUBLAS_WORKSPACES", True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(_C=types.SimpleNamespace()))
    launched.clear()
    StandInGraph().capture_begin()
    assert launched == [("capture_begin", None, "global")]


def test_a_graph_captured_before_any_region_replays_unchecked():
    launched = []
    cls = _stand_in_graph_class(launched)
    _guard.patch_graph_class(cls)
    before = stablebuf.guard_stats()
    cls().replay()
    assert launched == ["replay"]
    assert _delta(before, "checked") == 0


def test_capture_end_records_the_regions_holding_memory_and_replay_checks_them():
    launched = []
    cls = _stand_in_graph_class(launched)
    _guard.patch_graph_class(cls)
    graph = cls()
    before = stablebuf.guard_stats()
    graph.capture_end()
    assert _delta(before, "captures") == 1
    holding = []
    device = _guard._capture_device()  # None without CUDA: then every device's regions
    for tag, entry in stablebuf._native.stats().items():
        if device is not None and entry["device"] != device:
            continue  # a graph of this device uses no region of another
        try:
            stablebuf.check(tag)
        except stablebuf.Error:
            continue  # asleep or unbound at capture end: left out
        if entry["allocations"]:
            holding.append(tag)
    holding = tuple(holding)
    assert stablebuf.graph_tags(graph) == holding
    graph.replay()
    assert launched == ["capture_end", "replay"]
    assert _delta(before, "checked") == 1 and _delta(before, "refused") == 0


def test_graph_tags_override_narrows_and_a_refused_replay_launches_nothing():
    launched = []
    cls = _stand_in_graph_class(launched)
    _guard.patch_graph_class(cls)
    graph = cls()
    graph.capture_end()
    captured = stablebuf.graph_tags(graph)
    assert stablebuf.graph_tags(graph, ["no-such-region"]) == ("no-such-region",)
    before = stablebuf.guard_stats()
    with pytest.raises(stablebuf.UnknownTag, match="no-such-region"):
        graph.replay()
    assert launched == ["capture_end"], "nothing replayed after a refusal"
    assert _delta(before, "refused") == 1 and _delta(before, "checked") == 1
    assert stablebuf.graph_tags(graph, "no-such-region") == ("no-such-region",), "one tag"
    assert stablebuf.graph_tags(graph, None) == captured, "None goes back to the capture's"
    graph.replay()
    assert launched == ["capture_end", "replay"]


def test_graph_tags_checks_its_arguments():
    cls = _stand_in_graph_class([])
    with pytest.raises(TypeError, match="strings"):
        stablebuf.graph_tags(cls(), ["ok", 3])
    with pytest.raises(TypeError, match="neither attributes nor weak references"):
        stablebuf.graph_tags(object(), ["weights"])
    assert stablebuf.graph_tags(object()) is None
    _guard.set_graph_tags_if_possible(object(), ["weights"])  # no error: best effort


def test_graph_tags_of_objects_without_attributes_live_in_a_side_table():
    class Slotted:
        __slots__ = ("__weakref__",)

    graph = Slotted()
    assert stablebuf.graph_tags(graph, ["w"]) == ("w",)
    assert stablebuf.graph_tags(graph) == ("w",)


def test_a_replay_inside_an_already_checked_call_is_not_checked_again():
    launched = []
    cls = _stand_in_graph_class(launched)
    _guard.patch_graph_class(cls)
    graph = cls()
    stablebuf.graph_tags(graph, ["no-such-region"])
    with _guard.already_checked(("no-such-region",)):
        graph.replay()
    assert launched == ["replay"]
    with pytest.raises(stablebuf.UnknownTag):
        graph.replay()


def test_stablebuf_guard_records_its_tags_on_the_graph():
    launched = []
    cls = _stand_in_graph_class(launched)
    _guard.patch_graph_class(cls)
    graph = cls()
    guarded = stablebuf.guard(graph, [])
    assert stablebuf.graph_tags(graph) == ()
    before = stablebuf.guard_stats()
    guarded.replay()
    assert launched == ["replay"]
    assert _delta(before, "checked") == 1, "checked once, by the wrapper"


def _stand_in_tree_manager(calls, graph_class=None):
    class StandInManager:
        def __init__(self):
            self.ids_to_funcs = {}
            self.generation = 0

        def run(self, new_inputs, function_id):
            calls.append(("run", function_id))
            return self._run(new_inputs, function_id)

        def _run(self, new_inputs, function_id):
            calls.append(("_run", function_id))
            self.generation += 1
            if graph_class is not None:
                graph = graph_class()
                graph.capture_end()
                self.recorded = graph
            new_inputs.clear()
            return "outputs"

    return StandInManager


def test_a_tree_call_is_checked_once_before_the_manager_runs(monkeypatch):
    calls = []
    cls = _stand_in_tree_manager(calls)
    assert _guard.patch_tree_manager(cls) is True
    assert _guard.patch_tree_manager(cls) is False, "idempotent"
    manager = cls()
    before = stablebuf.guard_stats()
    assert manager.run([1, 2], function_id="f") == "outputs"
    assert calls == [("run", "f"), ("_run", "f")]
    assert _delta(before, "checked") == 1, "run and the _run it calls: one check"

    monkeypatch.setattr(_guard, "tags_of_tensors", lambda values: ("no-such-region",))
    inputs = [1, 2]
    with pytest.raises(stablebuf.UnknownTag, match="no-such-region"):
        manager.run(inputs, function_id="f")
    assert calls == [("run", "f"), ("_run", "f")], "the manager did not run"
    assert manager.generation == 1 and inputs == [1, 2], "refusal left its state and inputs"
    assert _delta(before, "refused") == 1
    with pytest.raises(stablebuf.UnknownTag):
        manager._run(inputs, "f")  # functions compiled before the patch enter here
    assert manager.generation == 1


def test_a_graph_recorded_inside_a_tree_call_uses_the_calls_regions(monkeypatch):
    calls = []
    graph_cls = _stand_in_graph_class([])
    _guard.patch_graph_class(graph_cls)
    cls = _stand_in_tree_manager(calls, graph_class=graph_cls)
    _guard.patch_tree_manager(cls)
    manager = cls()
    monkeypatch.setattr(_guard, "tags_of_tensors", lambda values: ())
    manager.run([], function_id="f")
    assert stablebuf.graph_tags(manager.recorded) == ()


def test_the_tree_call_looks_at_inputs_and_the_functions_constants(monkeypatch):
    seen = []
    monkeypatch.setattr(_guard, "tags_of_tensors", lambda values: seen.extend(values) or ())
    cls = _stand_in_tree_manager([])
    _guard.patch_tree_manager(cls)
    manager = cls()
    manager.ids_to_funcs["f"] = types.SimpleNamespace(constants=("const",))
    manager.run(["input"], function_id="f")
    assert seen == ["input", "const"]


def test_tags_of_tensors_ignores_what_is_not_a_cuda_tensor():
    assert _guard.tags_of_tensors([1, None, "x", 2.5]) == ()
    if HAS_TORCH:
        import torch

        assert _guard.tags_of_tensors([torch.ones(3)]) == ()


class _CapturingTorch(types.ModuleType):
    """A stand-in ``torch`` whose current stream is capturing."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(
            is_initialized=lambda: True, is_current_stream_capturing=lambda: True
        )


@pytest.mark.parametrize(
    "call",
    [
        lambda: stablebuf.sleep("no-such-tag"),
        lambda: stablebuf.wake("no-such-tag"),
        lambda: stablebuf.bind("no-such-tag", None),
        lambda: stablebuf.unbind("no-such-tag"),
        lambda: stablebuf.snapshot("no-such-tag"),
        lambda: stablebuf.switch("no-such-tag", None),  # type: ignore[arg-type]
        lambda: stablebuf.switch("no-such-tag", None, strategy="copy"),  # type: ignore[arg-type]
        lambda: stablebuf.crossover_bytes(),
    ],
)
def test_remaps_during_a_capture_raise_capture_active_before_anything_else(monkeypatch, call):
    monkeypatch.setitem(sys.modules, "torch", _CapturingTorch())
    before = stablebuf.stats()
    # CaptureActive, not UnknownTag: the capture is checked before the tag is even looked up.
    with pytest.raises(stablebuf.CaptureActive, match="capture"):
        call()
    assert stablebuf.stats() == before


def test_without_a_capture_the_same_calls_reach_the_tag_check(monkeypatch):
    fake = _CapturingTorch()
    fake.cuda.is_current_stream_capturing = lambda: False
    monkeypatch.setitem(sys.modules, "torch", fake)
    with pytest.raises(stablebuf.UnknownTag):
        stablebuf.unbind("no-such-tag")


class _TwoDeviceTorch(types.ModuleType):
    """A stand-in ``torch`` with two CUDA devices: ``torch.cuda.device(i)`` switches the
    current one, each device's current stream has handle ``1000 + i``, and the current stream
    of device ``capturing_on`` (if any) is capturing."""

    def __init__(self, capturing_on=None):
        super().__init__("torch")
        current = [0]

        @contextlib.contextmanager
        def device(index):
            before, current[0] = current[0], index
            try:
                yield
            finally:
                current[0] = before

        def current_stream(index=None):
            return types.SimpleNamespace(
                cuda_stream=1000 + (current[0] if index is None else index)
            )

        self.cuda = types.SimpleNamespace(
            is_initialized=lambda: True,
            current_device=lambda: current[0],
            device=device,
            current_stream=current_stream,
            is_current_stream_capturing=lambda: current[0] == capturing_on,
        )


@pytest.fixture
def two_devices(monkeypatch):
    """Tags ``on_zero`` and ``on_one`` as if their regions lived on devices 0 and 1 (the
    device cache the package keeps; no region exists), under a two-device stand-in torch."""
    monkeypatch.setitem(stablebuf._devices._TAG_DEVICES, "on_zero", 0)
    monkeypatch.setitem(stablebuf._devices._TAG_DEVICES, "on_one", 1)

    def install(capturing_on=None):
        fake = _TwoDeviceTorch(capturing_on)
        monkeypatch.setitem(sys.modules, "torch", fake)
        return fake

    return install


def test_each_region_gets_the_current_stream_of_its_own_device(two_devices):
    two_devices()
    assert stablebuf._devices.stream_of("on_one") == 1001, "device 1's stream with device 0 current"
    streams = stablebuf._devices.streams_of(["on_one", "on_zero", "on_one", "no-such-tag"])
    assert streams == {1: 1001, 0: 1000}, "one stream per device; unknown tags left to the call"


def test_a_capture_on_the_regions_device_refuses_even_while_another_device_is_current(
    two_devices,
):
    fake = two_devices(capturing_on=1)
    with pytest.raises(stablebuf.CaptureActive, match="capture"):
        stablebuf.unbind("on_one")
    assert fake.cuda.current_device() == 0, "the check put the current device back"
    with pytest.raises(stablebuf.UnknownTag):  # device 0 is not capturing: reaches the tag check
        stablebuf.unbind("on_zero")
    two_devices(capturing_on=None)
    with pytest.raises(stablebuf.UnknownTag):
        stablebuf.sleep(["on_zero", "on_one"])


def test_a_capture_records_its_device_and_a_guard_defaults_to_that_devices_regions(two_devices):
    fake = two_devices()
    cls = _stand_in_graph_class([])
    _guard.patch_graph_class(cls)
    graph = cls()
    assert _guard.graph_device(graph) is None, "no capture ended yet"
    with fake.cuda.device(1):
        graph.capture_end()
    assert _guard.graph_device(graph) == 1
    on_one = tuple(t for t, e in stablebuf.stats().items() if e["device"] == 1)
    readable = []
    for tag in on_one:
        try:
            stablebuf.check(tag)
        except stablebuf.Error:
            continue  # asleep or unbound at capture end: left out
        if stablebuf.stats()[tag]["allocations"]:
            readable.append(tag)
    assert stablebuf.graph_tags(graph) == tuple(readable), "the capture's device's regions only"
    assert stablebuf.guard(graph).tags == on_one, "guard() defaults to the graph's device"


def test_guard_module_needs_a_torch_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        stablebuf.guard_module(object())


@needs_torch
def test_installing_into_torch_is_idempotent_and_thread_safe():
    import torch

    threads = [threading.Thread(target=_guard.install) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _guard.install()
    replay = torch.cuda.CUDAGraph.replay
    assert getattr(replay, "__stablebuf_guard__", False)
    assert not getattr(replay.__wrapped__, "__stablebuf_guard__", False), "wrapped once"
    assert getattr(torch.cuda.CUDAGraph.capture_end, "__stablebuf_guard__", False)
    stats = stablebuf.guard_stats()
    assert stats["graphs"] is True
    if stats["trees"]:
        from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

        assert getattr(CUDAGraphTreeManager.run, "__stablebuf_guard__", False)
        assert getattr(CUDAGraphTreeManager._run, "__stablebuf_guard__", False)
        assert not getattr(CUDAGraphTreeManager.run.__wrapped__, "__stablebuf_guard__", False)
    else:
        assert stats["trees_error"], "says why the trees are not guarded"


@needs_torch
def test_guard_module_checks_before_an_eager_forward():
    import torch

    ran = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            ran.append(True)
            return x * self.weight

    module = Probe()
    with pytest.raises(ValueError, match="region"):
        stablebuf.guard_module(module)  # its weights are in no region
    handle = stablebuf.guard_module(module, ["no-such-region"])
    with pytest.raises(stablebuf.UnknownTag):
        module(torch.randn(4))
    assert ran == [], "forward did not run"
    handle.remove()
    module(torch.randn(4))
    assert ran == [True]
