"""PyTorch under the preload layer, unmodified except for setting a tag with ctypes.

Run:  LD_PRELOAD=libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm python torch_graph_pause.py

Builds an MLP whose weights are allocated under the tag "weights", captures it as a
torch.cuda.CUDAGraph, replays it, pauses the tag with contents kept (device free memory must
rise by at least the weights' size), resumes, replays, and checks the output is the pre-pause
output bit for bit. Twice: the first cycle pins the host arena, the second reuses it.
Prints one RESULT line (JSON) and exits non-zero if any check failed.
"""

import ctypes
import json
import sys
import time

import torch


def fail(message):
    print(f"FAILED: {message}", flush=True)
    print("RESULT " + json.dumps({"script": "torch_graph_pause", "ok": False, "error": message}))
    sys.exit(1)


def layer():
    """The layer's C ABI from the global namespace (it is there when LD_PRELOADed)."""
    lib = ctypes.CDLL(None)
    try:
        lib.stablebuf_set_tag
    except AttributeError:
        fail("stablebuf_set_tag not found: run with LD_PRELOAD=.../libstablebuf_preload.so")
    lib.stablebuf_set_tag.argtypes = [ctypes.c_char_p]
    lib.stablebuf_pause.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.stablebuf_resume.argtypes = [ctypes.c_char_p]
    lib.stablebuf_error_string.argtypes = [ctypes.c_int]
    lib.stablebuf_error_string.restype = ctypes.c_char_p
    return lib


class Driver:
    """Free device memory as the driver sees it. Looked up through libcuda's own handle, so the
    answer does not go through the layer's cuMemGetInfo (which adds the pool's cache)."""

    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2

    def free(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        result = self.cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        if result != 0:
            fail(f"cuMemGetInfo_v2 returned {result}")
        return free.value


def call(lib, name, *args):
    code = getattr(lib, name)(*args)
    if code != 0:
        fail(f"{name}{args} returned {code}: {lib.stablebuf_error_string(code).decode()}")


def main():
    lib = layer()
    driver = Driver()
    torch.manual_seed(0)
    device = torch.device("cuda")
    width, depth, batch = 4096, 8, 64

    # The weights: allocated under the tag, in a pool of their own so the caching allocator
    # does not put other tensors in their segments.
    weights_pool = torch.cuda.MemPool()
    call(lib, "stablebuf_set_tag", b"weights")
    with torch.cuda.use_mem_pool(weights_pool):
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width, device=device), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers)
    torch.cuda.synchronize()
    call(lib, "stablebuf_set_tag", None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    x = torch.randn(batch, width, device=device)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
        graph.replay()
        torch.cuda.synchronize()
        reference = y.clone()

    cycles = []
    for cycle in range(2):
        torch.cuda.synchronize()
        before = driver.free()
        t0 = time.perf_counter()
        call(lib, "stablebuf_pause", b"weights", 1)
        t1 = time.perf_counter()
        paused = driver.free()
        freed = paused - before
        if freed < weight_bytes:
            fail(f"cycle {cycle}: pause freed {freed} bytes of device memory, "
                 f"expected at least the weights' {weight_bytes}")
        call(lib, "stablebuf_pause", b"weights", 1)  # a second pause does nothing
        t2 = time.perf_counter()
        call(lib, "stablebuf_resume", b"weights")
        t3 = time.perf_counter()
        call(lib, "stablebuf_resume", b"weights")  # idempotent
        with torch.no_grad():
            graph.replay()
            torch.cuda.synchronize()
        same = torch.equal(y.view(torch.int32), reference.view(torch.int32))
        if not same:
            diff = (y - reference).abs().max().item()
            fail(f"cycle {cycle}: output after resume differs (max abs diff {diff})")
        cycles.append({
            "pause_ms": round((t1 - t0) * 1e3, 2),
            "resume_ms": round((t3 - t2) * 1e3, 2),
            "freed_bytes": freed,
        })
        print(f"cycle {cycle}: pause {cycles[-1]['pause_ms']} ms, resume "
              f"{cycles[-1]['resume_ms']} ms, freed {freed / 2**20:.0f} MiB "
              f"(weights {weight_bytes / 2**20:.0f} MiB), output bit-identical", flush=True)

    unknown = lib.stablebuf_pause(b"never-set", 1)
    if unknown != 3:
        fail(f"pause of an unknown tag returned {unknown}, expected 3 (STABLEBUF_ERR_UNKNOWN_TAG)")
    print("RESULT " + json.dumps({
        "script": "torch_graph_pause", "ok": True, "weight_bytes": weight_bytes,
        "cycles": cycles,
    }), flush=True)


if __name__ == "__main__":
    main()
