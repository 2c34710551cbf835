"""Pause and resume a model's weights with their contents kept: stablebuf vs torch_memory_saver.

The same model (a stack of bf16 8192×8192 weight matrices, 1 GiB and 8 GiB, forward captured as
a CUDA graph) is paused and resumed by

- ``stablebuf.sleep(tag)`` / ``stablebuf.wake(tag)``: one batch of copies into a pinned host
  arena that is pinned once and reused; wake backs the region with one allocation and one
  mapping;
- ``torch_memory_saver`` 0.0.10 in its PyTorch-allocator mode (``hook_mode = "torch"``) with
  ``enable_cpu_backup=True``: ``pause(tag)`` / ``resume(tag)``.

For each: device memory released, first cycle (stablebuf's includes pinning its arena: there is
no ``reserve_host`` call here) and steady-state cycles, weights bit-exact and the captured graph
giving the same output after resume, and what a replay while paused does. torch_memory_saver's
replay-while-paused runs in a subprocess, because it faults and takes the CUDA context down.

Exit status 1 if a check fails; the speed target (≥ 10× faster pause+resume than
torch_memory_saver, steady state) is reported, not enforced.

Run: ``python python/examples/sleep_wake.py [--sizes 1,8] [--cycles 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import stablebuf

GiB = 1 << 30
MiB = 1 << 20
DIM = 8192  # one 8192x8192 bf16 matrix is 128 MiB


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,8", help="model sizes in GiB, comma-separated")
    parser.add_argument("--cycles", type=int, default=2, help="steady-state cycles per tool")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--require-tms", action="store_true", help="fail if torch_memory_saver is missing"
    )
    parser.add_argument(
        "--tms-replay-while-paused",
        action="store_true",
        help="(internal) run torch_memory_saver's replay-while-paused case and exit",
    )
    return parser.parse_args()


def build(size_gib: float, generator: torch.Generator):
    count = max(1, int(size_gib * GiB) // (DIM * DIM * 2))
    return [
        (torch.randn(DIM, DIM, device="cuda", dtype=torch.bfloat16, generator=generator) / 90)
        for _ in range(count)
    ]


def forward(weights, x):
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
    return h


def fingerprint(weights) -> torch.Tensor:
    """Per-matrix sums of the raw 16-bit patterns: any changed bit shows."""
    return torch.stack([w.view(torch.int16).sum(dtype=torch.int64) for w in weights])


def capture(weights, x, graph):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(weights, x)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = forward(weights, x)
    graph.replay()
    torch.cuda.synchronize()
    return out, out.clone()


def synced(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class Row:
    def __init__(self, size: float, tool: str):
        self.size, self.tool = size, tool
        self.first = self.pause = self.resume = float("nan")
        self.released = 0
        self.graph_ok = False
        self.bits_ok = False
        self.asleep_replay = "-"

    @property
    def steady(self) -> float:
        return self.pause + self.resume


def run_stablebuf(size: float, args, generator, failures) -> Row:
    row = Row(size, "stablebuf")
    tag = f"model_{size:g}g"
    with stablebuf.region(tag):
        weights = build(size, generator)
    x = torch.randn(args.batch, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    graph = stablebuf.CUDAGraph(tags=[tag])
    out, reference = capture(weights, x, graph)
    prints = fingerprint(weights)

    arena = stablebuf.host_arena()
    before = free_bytes()
    first_pause = synced(lambda: stablebuf.sleep(tag))
    row.released = free_bytes() - before
    try:
        out.fill_(float("nan"))
        graph.replay()
        row.asleep_replay = "NOT refused"
        failures.append(f"stablebuf {size:g} GiB: replay while asleep was not refused")
    except stablebuf.Asleep:
        torch.cuda.synchronize()
        row.asleep_replay = (
            "raises stablebuf.Asleep; process fine"
            if torch.isnan(out).all()
            else "raised, but launched"
        )
    first_resume = synced(lambda: stablebuf.wake(tag))
    row.first = first_pause + first_resume
    pinned = stablebuf.host_arena() or {}
    if pinned.get("pins", 0) > (arena or {}).get("pins", 0):
        pin_note = (
            f"includes pinning {pinned['capacity'] / GiB:.1f} GiB: {pinned['pin_seconds']:.2f} s"
        )
    else:
        pin_note = "arena already pinned"
    pauses, resumes = [], []
    for _ in range(args.cycles):
        pauses.append(synced(lambda: stablebuf.sleep(tag)))
        resumes.append(synced(lambda: stablebuf.wake(tag)))
    row.pause, row.resume = statistics.median(pauses), statistics.median(resumes)
    row.bits_ok = torch.equal(fingerprint(weights), prints)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    row.graph_ok = torch.equal(out, reference)
    print(
        f"  stablebuf {size:g} GiB: first cycle {row.first:.3f} s ({pin_note}), steady pause "
        f"{row.pause * 1e3:.1f} ms + resume {row.resume * 1e3:.1f} ms, released "
        f"{row.released / GiB:.2f} GiB, mappings after wake: {stablebuf.stats()[tag]['mappings']}"
    )
    stablebuf.sleep(tag, keep=False)  # give the device memory back for the next case
    return row


def run_tms(size: float, args, generator, failures) -> Row:
    from torch_memory_saver import torch_memory_saver as tms

    row = Row(size, "torch_memory_saver")
    tag = f"tms_{size:g}g"
    with tms.region(tag=tag, enable_cpu_backup=True):
        weights = build(size, generator)
    x = torch.randn(args.batch, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    graph = torch.cuda.CUDAGraph()
    out, reference = capture(weights, x, graph)
    prints = fingerprint(weights)
    pauses, resumes = [], []
    for cycle in range(args.cycles + 1):
        before = free_bytes()
        pauses.append(synced(lambda: tms.pause(tag)))
        if cycle == 0:
            row.released = free_bytes() - before
        resumes.append(synced(lambda: tms.resume(tag)))
    row.first = pauses[0] + resumes[0]
    row.pause, row.resume = statistics.median(pauses[1:]), statistics.median(resumes[1:])
    row.bits_ok = torch.equal(fingerprint(weights), prints)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    row.graph_ok = torch.equal(out, reference)
    print(
        f"  torch_memory_saver {size:g} GiB: first cycle {row.first:.3f} s, steady pause "
        f"{row.pause * 1e3:.1f} ms + resume {row.resume * 1e3:.1f} ms, released "
        f"{row.released / GiB:.2f} GiB"
    )
    return row


def tms_replay_while_paused() -> int:
    """Runs in a subprocess: pause, then replay a graph over the paused weights."""
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    generator = torch.Generator(device="cuda").manual_seed(3)
    with tms.region(tag="paused", enable_cpu_backup=True):
        weights = build(0.25, generator)
    x = torch.randn(16, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    graph = torch.cuda.CUDAGraph()
    out, _ = capture(weights, x, graph)
    tms.pause("paused")
    print("SUBPROCESS paused; replaying", flush=True)
    try:
        graph.replay()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - what happens is what we report
        first = str(error).strip().splitlines()[0]
        try:
            torch.ones(1, device="cuda").sum().item()
            after = "context still usable"
        except Exception:  # noqa: BLE001
            after = "CUDA context unusable afterwards"
        print(f"SUBPROCESS error: {type(error).__name__}: {first}; {after}", flush=True)
        return 3
    print("SUBPROCESS replay returned without an error", flush=True)
    return 0


def tms_subprocess_outcome() -> str:
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--tms-replay-while-paused"],
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired:
        return "subprocess hung (killed after 90 s)"
    said = [
        line[len("SUBPROCESS ") :]
        for line in proc.stdout.splitlines()
        if line.startswith("SUBPROCESS ")
    ]
    last = said[-1] if said else ""
    if proc.returncode < 0:
        return f"subprocess killed by signal {-proc.returncode} ({last or 'no output'})"
    if proc.returncode == 3:
        return f"subprocess: {last}"
    if proc.returncode == 0:
        return f"subprocess: {last} (garbage read, no error)"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"subprocess exit {proc.returncode}: {tail[:160]}"


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("sleep_wake: no CUDA device")
        return 2
    if args.tms_replay_while_paused:
        return tms_replay_while_paused()
    sizes = [float(s) for s in args.sizes.split(",") if s]
    generator = torch.Generator(device="cuda").manual_seed(11)
    try:
        import torch_memory_saver

        torch_memory_saver.torch_memory_saver.hook_mode = "torch"
        have_tms = True
    except ImportError as missing:
        have_tms = False
        print(f"sleep_wake: torch_memory_saver not importable ({missing}): stablebuf only")
    print(f"sleep_wake on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures: list = []
    rows = []
    for size in sizes:
        rows.append(run_stablebuf(size, args, generator, failures))
        if have_tms:
            rows.append(run_tms(size, args, generator, failures))
    outcome = tms_subprocess_outcome() if have_tms else "-"
    for row in rows:
        if row.tool == "torch_memory_saver":
            row.asleep_replay = outcome

    print()
    print(
        "| size | tool | first pause+resume (s) | steady pause (ms) | steady resume (ms) | "
        "steady pause+resume (ms) | speedup (steady / first) | released (GiB) | weights bit-exact | "
        "graph after resume | replay while paused |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    verdicts = []
    for row in rows:
        peer = next(
            (r for r in rows if r.size == row.size and r.tool == "torch_memory_saver"), None
        )
        if row.tool == "stablebuf" and peer is not None:
            steady_x = peer.steady / row.steady
            first_x = peer.first / row.first
            speed = f"{steady_x:.1f}x / {first_x:.1f}x"
            verdicts.append((row.size, steady_x))
        else:
            speed = "-"
        print(
            f"| {row.size:g} GiB | {row.tool} | {row.first:.3f} | {row.pause * 1e3:.1f} | "
            f"{row.resume * 1e3:.1f} | {row.steady * 1e3:.1f} | {speed} | "
            f"{row.released / GiB:.2f} | {'yes' if row.bits_ok else 'NO'} | "
            f"{'same output' if row.graph_ok else 'WRONG'} | {row.asleep_replay} |"
        )
        if not row.bits_ok:
            failures.append(f"{row.tool} {row.size:g} GiB: weights changed across pause/resume")
        if not row.graph_ok:
            failures.append(f"{row.tool} {row.size:g} GiB: graph output changed after resume")
        if row.released < 0.95 * row.size * GiB:
            failures.append(
                f"{row.tool} {row.size:g} GiB: pause released only {row.released / GiB:.2f} GiB"
            )
    for size, speedup in verdicts:
        verdict = "met" if speedup >= 10 else "NOT met"
        print(
            f"sleep_wake: {size:g} GiB: target ≥ 10x faster pause+resume than "
            f"torch_memory_saver (steady state): {verdict} ({speedup:.1f}x)"
        )
    if have_tms and "raises" not in outcome and "error" not in outcome and "signal" not in outcome:
        print(f"sleep_wake: note: torch_memory_saver's replay while paused: {outcome}")
    if args.require_tms and not have_tms:
        failures.append("torch_memory_saver is required (--require-tms) but not importable")
    if failures:
        print("sleep_wake: FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("sleep_wake: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
