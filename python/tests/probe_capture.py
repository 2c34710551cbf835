"""Which ways of capturing a torch CUDA graph work with stablebuf regions?

Run on a GPU machine with the wheel installed: ``python python/tests/probe_capture.py``.
Each case runs in its own subprocess (a fault in one cannot poison the next) and prints one
line; the last line is a summary. Exit status 0 when case (a) works: the package's
recommended way depends on it.

(a) weights allocated in a region, graph captured with PyTorch's own private pool: replays
    right, then after sleep/wake, and after binding another weight set (the new weights'
    result, no re-capture).
(b) ``torch.cuda.graph(g, pool=stablebuf.pool("graph").id)``: the graph's own memory
    (intermediates, output) is allocated by our pluggable allocator, which makes VMM calls
    (cuMemCreate/cuMemMap) during capture; replays right; the output lives in region "graph";
    that region sleeps with keep=False (device memory released) and after wake the replay
    recomputes the output.
(c) capture inside ``with stablebuf.region("graph_c"):`` (capture inside ``use_mem_pool``):
    same checks as (b).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

N = 1024


def _setup():
    import torch

    import stablebuf

    torch.manual_seed(1234)
    with stablebuf.region("weights"):
        w1 = torch.randn(N, N, device="cuda") / N**0.5
        w2 = torch.randn(N, N, device="cuda") / N**0.5
    x = torch.randn(16, N, device="cuda")
    return torch, stablebuf, w1, w2, x


def _forward(torch, w1, w2, x):
    return torch.relu(x @ w1) @ w2


def _check(torch, got, want, what):
    if torch.isnan(got).any():
        raise AssertionError(f"{what}: output still holds the NaN poison (graph did not write it)")
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        diff = (got - want).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3g}")


def case_a() -> str:
    torch, stablebuf, w1, w2, x = _setup()
    want = _forward(torch, w1, w2, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _forward(torch, w1, w2, x)  # warm up cuBLAS outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = stablebuf.CUDAGraph(tags=["weights"])
    with torch.cuda.graph(g):
        out = _forward(torch, w1, w2, x)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(torch, out, want, "first replay")

    stablebuf.sleep("weights")
    try:
        g.replay()
        raise AssertionError("replay while asleep did not raise")
    except stablebuf.Asleep:
        pass
    stablebuf.wake("weights")
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(torch, out, want, "replay after sleep/wake")

    original = stablebuf.bound("weights") or stablebuf.snapshot("weights")
    other = stablebuf.snapshot("weights")
    with stablebuf.writing(other):
        w1.copy_(torch.randn_like(w1) / N**0.5)
        w2.copy_(torch.randn_like(w2) / N**0.5)
        want_other = _forward(torch, w1, w2, x)
    stablebuf.bind("weights", other)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(torch, out, want_other, "replay on another weight set")
    stablebuf.bind("weights", original)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(torch, out, want, "replay after binding the original back")
    return "replays right, after sleep/wake, and on a bound second weight set"


def _graph_memory_case(capture) -> str:
    torch, stablebuf, w1, w2, x = _setup()
    want = _forward(torch, w1, w2, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _forward(torch, w1, w2, x)
    torch.cuda.current_stream().wait_stream(side)
    g = stablebuf.CUDAGraph(tags=["weights", capture.tag])
    out = capture(torch, stablebuf, g, lambda: _forward(torch, w1, w2, x))
    owner = stablebuf._native.owner(out.data_ptr())
    if owner != capture.tag:
        raise AssertionError(f"graph output lives in {owner!r}, not in region {capture.tag!r}")
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(torch, out, want, "first replay")

    free_before, _ = torch.cuda.mem_get_info()
    mapped = stablebuf.stats()[capture.tag]["mapped"]
    stablebuf.sleep(capture.tag, keep=False)
    free_asleep, _ = torch.cuda.mem_get_info()
    try:
        g.replay()
        raise AssertionError("replay while the graph's memory sleeps did not raise")
    except stablebuf.Asleep:
        pass
    stablebuf.wake(capture.tag)
    g.replay()  # the output's contents were discarded: the replay must recompute them
    torch.cuda.synchronize()
    _check(torch, out, want, "replay after discarding and waking the graph's memory")
    released = free_asleep - free_before
    return (
        f"graph memory in region {capture.tag!r} ({mapped >> 20} MiB mapped); "
        f"sleep(keep=False) released {released >> 20} MiB; replay after wake right"
    )


def _capture_with_pool(torch, stablebuf, g, fn):
    with torch.cuda.graph(g, pool=stablebuf.pool("graph").id):
        return fn()


_capture_with_pool.tag = "graph"


def _capture_in_region(torch, stablebuf, g, fn):
    with stablebuf.region("graph_c"):
        with torch.cuda.graph(g):
            return fn()


_capture_in_region.tag = "graph_c"


def case_b() -> str:
    return _graph_memory_case(_capture_with_pool)


def case_c() -> str:
    return _graph_memory_case(_capture_in_region)


CASES = {
    "a": ("PyTorch's own graph pool over weights in a region", case_a),
    "b": ("torch.cuda.graph(g, pool=stablebuf.pool(tag).id)", case_b),
    "c": ("capture inside `with stablebuf.region(tag):`", case_c),
}


def run_one(name: str) -> int:
    title, fn = CASES[name]
    start = time.perf_counter()
    try:
        detail = fn()
        result = {"case": name, "ok": True, "detail": detail}
    except Exception as error:  # noqa: BLE001 - the probe reports whatever happened
        result = {
            "case": name,
            "ok": False,
            "detail": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }
    result["seconds"] = round(time.perf_counter() - start, 3)
    print("PROBE_RESULT " + json.dumps(result), flush=True)
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        return run_one(sys.argv[2])
    try:
        import torch
    except ImportError:
        print("probe: torch is not installed")
        return 2
    if not torch.cuda.is_available():
        print("probe: no CUDA device")
        return 2
    print(f"probe: torch {torch.__version__}, {torch.cuda.get_device_name()}")
    worked = {}
    for name, (title, _) in CASES.items():
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--case", name],
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE_RESULT ")]
        if lines:
            result = json.loads(lines[-1][len("PROBE_RESULT ") :])
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            result = {
                "ok": False,
                "detail": f"process died (exit {proc.returncode}): " + " | ".join(tail),
            }
        worked[name] = result["ok"]
        status = "WORKS " if result["ok"] else "FAILED"
        print(f"probe ({name}) {status} {title}: {result['detail']}", flush=True)
        if not result["ok"] and result.get("traceback"):
            print(result["traceback"], file=sys.stderr)
    summary = ", ".join(f"({k}) {'works' if v else 'fails'}" for k, v in worked.items())
    print(f"probe summary: {summary}")
    return 0 if worked["a"] else 1


if __name__ == "__main__":
    sys.exit(main())
