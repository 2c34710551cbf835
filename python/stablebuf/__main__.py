"""``python -m stablebuf`` / ``stablebuf-doctor``: is this machine ready for stablebuf?

Prints the CUDA driver, the GPU, torch and its CUDA, whether PyTorch's pluggable allocator takes
stablebuf's entry points, where libnccl is (if anywhere), and the verdict of a tiny weight swap
under a captured graph: a 256x256 matmul captured once over a region, replayed on two weight
sets bound in turn, each output checked against eager PyTorch on fresh random data. The last
line is always ``verdict: ...``. Exits 0 when the swap worked, 1 otherwise (no driver, no GPU,
no torch, or a failed check).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
from typing import List, Optional, Tuple

from . import _native


def _driver_version() -> Optional[str]:
    """The CUDA version the driver supports, e.g. ``13.0``, or None without libcuda."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{(version.value % 1000) // 10}"


def find_nccl() -> Tuple[Optional[str], str]:
    """Where libnccl is, and how it was found: the ``nvidia.nccl`` package's folder (what a
    PyTorch wheel brings), the linker's search (``ctypes.util.find_library``), or a folder of
    ``LD_LIBRARY_PATH``. ``(None, reason)`` when none has it."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(folder, "lib")
        for name in sorted(os.listdir(lib)) if os.path.isdir(lib) else []:
            if name.startswith("libnccl.so"):
                return os.path.join(lib, name), "the nvidia.nccl package"
    found = ctypes.util.find_library("nccl")
    if found:
        return found, "the linker's search path"
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.startswith("libnccl.so"):
                return os.path.join(folder, name), "LD_LIBRARY_PATH"
    return None, "not in the nvidia.nccl package, the linker's path or LD_LIBRARY_PATH"


def _tiny_swap(torch) -> str:  # type: ignore[no-untyped-def]
    """A matmul captured once over region ``doctor-weights``, replayed on two weight sets bound in
    turn; raises AssertionError naming the first mismatch."""
    import stablebuf

    tag = "doctor-weights"
    seed = int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    n = 256

    def fresh():  # type: ignore[no-untyped-def]
        return torch.randn(n, n, device="cuda", generator=generator)

    with stablebuf.region(tag):
        weight = fresh()
    first = weight.clone()  # outside the region: the reference's copy of set A
    second = fresh()
    set_b = stablebuf.snapshot(tag)
    set_a = stablebuf.bound(tag)
    with stablebuf.writing(set_b):
        weight.copy_(second)
    torch.cuda.synchronize()

    static_x = fresh()
    graph = stablebuf.CUDAGraph(tags=[tag])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as PyTorch asks
        static_x @ weight
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = static_x @ weight

    turns = (("A", set_a, first), ("B", set_b, second), ("A", set_a, first))
    for name, weight_set, values in turns:
        static_x.copy_(fresh())
        stablebuf.bind(tag, weight_set)
        out.fill_(float("nan"))  # poison: a replay that wrote nothing cannot pass
        graph.replay()
        expected = static_x @ values
        torch.cuda.synchronize()
        if not torch.allclose(out, expected, rtol=1e-3, atol=1e-3):
            worst = (out - expected).abs().nan_to_num(float("inf")).max().item()
            raise AssertionError(f"replay on weight set {name} differs from eager by {worst}")
    stablebuf.sleep(tag)
    try:
        graph.replay()
    except stablebuf.Asleep:
        pass
    else:
        raise AssertionError("a replay while the region slept was not refused")
    stablebuf.wake(tag)
    return (
        "one graph replayed on weight sets A, B, A (bound, not copied), outputs equal to "
        "eager; a replay while asleep raised Asleep"
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Prints the report; returns the exit code (0: ready, 1: not)."""
    del argv  # no options: the report is the same for everyone
    import stablebuf

    def show(what: str, value: str) -> None:
        print(f"{what:<22} {value}", flush=True)

    show("stablebuf", f"{stablebuf.__version__} ({os.path.dirname(stablebuf.__file__)})")
    show("python", sys.version.split()[0])
    version = _driver_version()
    if not _native.driver_present() or version is None:
        show("CUDA driver", "none: libcuda.so.1 does not load")
        print("verdict: no NVIDIA GPU driver here; stablebuf needs an NVIDIA GPU with a CUDA "
              "driver >= 12.4", flush=True)
        return 1
    show("CUDA driver", f"supports CUDA {version}")
    nccl, how = find_nccl()
    show(
        "libnccl",
        f"{nccl} (from {how})" if nccl else f"not found ({how}); only needed for collectives",
    )
    try:
        import torch
    except ImportError:
        show("torch", "not installed (pip install 'stablebuf[torch]')")
        print("verdict: the driver is here, but the PyTorch glue needs torch", flush=True)
        return 1
    show("torch", f"{torch.__version__}, built for CUDA {torch.version.cuda}")
    if not torch.cuda.is_available():
        show("GPU", "none visible to torch")
        print("verdict: torch sees no CUDA device (a CPU-only torch, or CUDA_VISIBLE_DEVICES)",
              flush=True)
        return 1
    props = torch.cuda.get_device_properties(0)
    show("GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"compute {props.major}.{props.minor} ({torch.cuda.device_count()} visible)")
    try:
        stablebuf.pool("doctor-allocator")
        show("pluggable allocator", f"works ({stablebuf.library_path()})")
    except Exception as error:  # noqa: BLE001 - reported, then the verdict says it
        show("pluggable allocator", f"FAILED: {type(error).__name__}: {error}")
        print("verdict: PyTorch refused stablebuf's allocator; regions cannot work here",
              flush=True)
        return 1
    try:
        outcome = _tiny_swap(torch)
    except Exception as error:  # noqa: BLE001 - the verdict names it
        print(f"verdict: FAILED: the tiny swap under a captured graph: {type(error).__name__}: "
              f"{error}", flush=True)
        return 1
    print(f"verdict: ready: {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
