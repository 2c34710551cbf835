"""Tests that need no GPU and no torch: import, API surface, errors, the C entry points, tag
bookkeeping and the type stubs. They run in CI on the built wheel."""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import inspect
import os

import pytest

import stablebuf
from stablebuf import _native

STUB = os.path.join(os.path.dirname(_native.__file__), "_native.pyi")
HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_public_names_exist_and_are_documented():
    for name in stablebuf.__all__:
        if name == "CUDAGraph" and not HAS_TORCH:
            continue
        value = getattr(stablebuf, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"stablebuf.{name} has no docstring"


def test_native_functions_are_documented():
    for name, value in vars(_native).items():
        if name.startswith("_") or not callable(value):
            continue
        assert (value.__doc__ or "").strip(), f"_native.{name} has no docstring"


def test_exceptions_form_one_hierarchy_under_error():
    for cls in (
        stablebuf.OutOfMemory,
        stablebuf.OverBudget,
        stablebuf.Asleep,
        stablebuf.Unbound,
        stablebuf.UnknownTag,
        stablebuf.SnapshotMismatch,
        stablebuf.DeviceMismatch,
    ):
        assert issubclass(cls, stablebuf.Error)
        assert cls.__module__ == "stablebuf"
        assert (cls.__doc__ or "").strip()
    assert issubclass(stablebuf.Error, Exception)
    assert len({stablebuf.Asleep, stablebuf.Unbound, stablebuf.OutOfMemory}) == 3


@pytest.mark.parametrize(
    "call",
    [
        lambda: stablebuf.sleep("no-such-tag"),
        lambda: stablebuf.sleep(["no-such-tag"], keep=False),
        lambda: stablebuf.wake("no-such-tag"),
        lambda: stablebuf.snapshot("no-such-tag"),
        lambda: stablebuf.bound("no-such-tag"),
        lambda: stablebuf.unbind("no-such-tag"),
        lambda: stablebuf.check("no-such-tag"),
        lambda: stablebuf.guard(object(), ["no-such-tag"]).replay(),
        lambda: stablebuf.note_use(["no-such-tag"]),
    ],
)
def test_unknown_tags_raise_unknown_tag_naming_the_tag(call):
    before = stablebuf.stats()
    with pytest.raises(stablebuf.UnknownTag, match="no-such-tag"):
        call()
    assert stablebuf.stats() == before


def test_tags_must_be_strings():
    with pytest.raises(TypeError, match="strings"):
        stablebuf.sleep(["a", 3])  # type: ignore[list-item]


def test_bind_refuses_what_is_not_a_weight_set():
    with pytest.raises(TypeError):
        stablebuf.bind("weights", "not a weight set")  # type: ignore[arg-type]


def test_switch_checks_its_arguments_before_anything_else():
    before = stablebuf.stats()
    for strategy in ("fast", "Auto", "copy-in", ""):
        with pytest.raises(ValueError, match="auto.*copy.*remap"):
            stablebuf.switch("no-such-tag", None, strategy=strategy)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WeightSet"):
        stablebuf.switch("no-such-tag", "not a weight set")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        stablebuf.switch("no-such-tag", None, "copy")  # type: ignore[misc]  # keyword only
    with pytest.raises(TypeError):
        _native.switch("no-such-tag", "not a weight set", "auto", 0)  # type: ignore[arg-type]
    assert stablebuf.stats() == before


def test_switch_documents_how_it_differs_from_bind():
    doc = stablebuf.switch.__doc__ or ""
    for words in ("bind", "live", "bound", "current stream", "crossover_bytes", "Memory"):
        assert words in doc, words
    assert inspect.signature(stablebuf.switch).parameters["strategy"].default == "auto"
    assert (stablebuf.crossover_bytes.__doc__ or "").strip()


@pytest.mark.skipif(stablebuf.driver_present(), reason="this machine has a CUDA driver")
def test_without_a_driver_the_crossover_says_so():
    with pytest.raises(stablebuf.Error, match="CUDA driver"):
        stablebuf.crossover_bytes()
    with pytest.raises(stablebuf.Error, match="CUDA driver"):
        stablebuf.crossover_bytes(0)


def test_empty_tag_lists_do_nothing():
    assert stablebuf.sleep([]) == {}
    assert stablebuf.wake([]) == {}
    stablebuf.check([])


def test_a_fence_that_does_not_exist_is_refused_before_anything_is_created():
    with pytest.raises(ValueError, match="last-use"):
        stablebuf.pool("fence_typo", fence="last use")
    assert "fence_typo" not in stablebuf.tags()


def test_guard_checks_before_launching():
    launched = []

    class FakeGraph:
        def replay(self):
            launched.append(True)

        def pool(self):
            return "pool-token"

    guarded = stablebuf.guard(FakeGraph(), ["missing"])
    with pytest.raises(stablebuf.UnknownTag):
        guarded.replay()
    assert launched == [], "nothing is launched when the check fails"
    unguarded = stablebuf.guard(FakeGraph(), [])
    unguarded.replay()
    assert launched == [True]
    assert unguarded.pool() == "pool-token", "other attributes are the graph's"
    assert "missing" in repr(guarded)


def test_allocator_entry_points_are_exported_and_fail_cleanly_without_a_region():
    lib = ctypes.CDLL(stablebuf.library_path())
    alloc_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    free_type = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    )
    for slot in range(_native.MAX_TAGS):
        assert hasattr(lib, _native.alloc_symbol(slot))
    registered = len(stablebuf.tags())
    unused = _native.alloc_symbol(_native.MAX_TAGS - 1)
    assert registered < _native.MAX_TAGS
    alloc = alloc_type((unused, lib))
    assert alloc(1 << 20, 0, None) is None, "NULL for a slot with no region"
    error = _native.take_alloc_error()
    assert isinstance(error, stablebuf.UnknownTag), error
    assert "1048576" in str(error)
    assert _native.take_alloc_error() is None, "reading clears it"

    free = free_type((_native.FREE_SYMBOL, lib))
    free(0x7F00_DEAD_0000, 4096, 0, None)  # not ours: recorded, no crash
    messages = _native.take_free_errors()
    assert any("0x7f00dead0000" in m for m in messages), messages


def test_alloc_symbol_range_is_checked():
    assert _native.alloc_symbol(0) == "stablebuf_alloc_0"
    with pytest.raises(stablebuf.Error):
        _native.alloc_symbol(_native.MAX_TAGS)


@pytest.mark.skipif(stablebuf.driver_present(), reason="this machine has a CUDA driver")
def test_without_a_driver_regions_and_pinning_say_so_and_change_nothing():
    with pytest.raises(stablebuf.Error, match="CUDA driver"):
        _native.register("weights", 0)
    with pytest.raises(stablebuf.Error, match="CUDA driver"):
        _native.reserve_host(1 << 20, 0)
    assert stablebuf.tags() == []
    assert stablebuf.stats() == {}
    assert stablebuf.host_arena() is None


def test_bad_tags_are_refused_before_any_driver_call():
    for bad in ["", "tab\there", "x" * 129]:
        with pytest.raises(stablebuf.Error, match="tag"):
            _native.register(bad, 0)


def test_timeline_of_no_regions_is_an_svg(tmp_path):
    path = stablebuf.timeline(tmp_path / "empty.svg", title="nothing yet")
    text = open(path, encoding="utf-8").read()
    assert "<svg" in text


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed")
def test_the_torch_glue_says_torch_is_missing():
    with pytest.raises(ImportError, match="torch"):
        with stablebuf.region("weights"):
            pass
    with pytest.raises(ImportError):
        stablebuf.CUDAGraph  # noqa: B018


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_cuda_graph_subclasses_torchs():
    import torch

    assert issubclass(stablebuf.CUDAGraph, torch.cuda.CUDAGraph)
    assert (stablebuf.CUDAGraph.replay.__doc__ or "").strip()


def _stub_tree():
    with open(STUB, encoding="utf-8") as source:
        return ast.parse(source.read())


def _public(names):
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def test_stub_declares_exactly_the_module_names():
    tree = _stub_tree()
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
        elif isinstance(node, ast.Assign):
            declared.update(t.id for t in node.targets if isinstance(t, ast.Name))
    runtime = _public(vars(_native))
    assert _public(declared) == runtime


def test_stub_signatures_match_the_module():
    for node in _stub_tree().body:
        if not isinstance(node, ast.FunctionDef):
            continue
        stub_params = [a.arg for a in node.args.args]
        runtime = inspect.signature(getattr(_native, node.name))
        assert list(runtime.parameters) == stub_params, node.name
        stub_defaults = len(node.args.defaults)
        runtime_defaults = sum(
            p.default is not inspect.Parameter.empty for p in runtime.parameters.values()
        )
        assert stub_defaults == runtime_defaults, node.name


def test_stub_weight_set_members_exist():
    for node in _stub_tree().body:
        if isinstance(node, ast.ClassDef) and node.name == "WeightSet":
            members = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            for member in members:
                assert hasattr(_native.WeightSet, member), member
            assert {"tag", "id", "nbytes"} <= members
            return
    raise AssertionError("WeightSet missing from the stub")


def test_wheel_ships_the_stub_and_py_typed():
    package = os.path.dirname(stablebuf.__file__)
    assert os.path.exists(STUB)
    assert os.path.exists(os.path.join(package, "py.typed"))


@pytest.mark.skipif(
    stablebuf.driver_present(), reason="a CUDA driver is here: the no-GPU report cannot be seen"
)
def test_doctor_without_a_gpu_says_so_and_exits_1():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "stablebuf"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("stablebuf "), done.stdout
    assert "CUDA driver" in done.stdout and "none" in done.stdout, done.stdout
    assert lines[-1].startswith("verdict: no NVIDIA GPU driver here"), done.stdout


def test_doctor_is_the_console_script_and_finds_nccl_in_ld_library_path(tmp_path, monkeypatch):
    from stablebuf import __main__ as doctor

    assert callable(doctor.main)
    fake = tmp_path / "libnccl.so.2"
    fake.write_bytes(b"")
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(doctor.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/no/such/folder:{tmp_path}")
    assert doctor.find_nccl() == (str(fake), "LD_LIBRARY_PATH")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/no/such/folder")
    path, reason = doctor.find_nccl()
    assert path is None and "LD_LIBRARY_PATH" in reason
