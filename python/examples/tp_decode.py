"""Tensor-parallel decode over stablebuf regions: a weight-set swap per step, every rank.

Weight sets are swapped on every rank under a captured CUDA graph that holds the NCCL
all-reduces.

Run, with N = 2 or 4 GPUs of one host (one process per GPU, NCCL)::

    torchrun --nproc-per-node N python/examples/tp_decode.py [--small] [options: --help]

The model: a stack of ``--layers`` decoder layers (default 8), each pre-RMSNorm, a
column-parallel linear (this rank's weight shard ``[ffn/N, hidden]``), SiLU, a row-parallel
linear (shard ``[hidden, ffn/N]``) whose partial output is all-reduced (SUM) over the ranks,
and a residual; bf16, batch ``--batch`` (default 4), the input replicated on every rank. By
default hidden 4096 and ffn 16384: 1 GiB of weights per rank at N = 2 (``--small``: hidden
1024, ffn 4096, 64 MiB per rank at N = 2). Each rank's shards live in
``stablebuf.region("weights")``; ``--sets`` weight sets (default 3) are resident: set 0 is the
one the region was built with, sets 1.. are snapshots (``stablebuf.snapshot``) filled through
``stablebuf.writing``. Set k's full (unsharded) matrices come from one seed per (set, layer),
the same on every rank, so any rank can rebuild them.

What it proves, on every rank:

- the decode step, captured once with ``torch.cuda.graph`` (a ``stablebuf.CUDAGraph``, so its
  replay is guarded) with the all-reduces inside, replays on whichever weight set is bound: a
  new set every step, the same on every rank. Each checked output is bit-equal to the eager
  forward (the same module code, no graph) with that set, within bf16 tolerance (1e-2 of each
  value plus 2e-2 of the largest) of an fp32 reference computed on one device from the full
  weights, and outside that tolerance of the output of this rank's shard alone (no
  all-reduce): the all-reduced output depends on every rank's shard, so a replay whose
  collective did not run cannot pass (at one rank the shard is the whole model, so that
  contrast is left out). Static outputs are poisoned with NaN before each checked
  replay, so a replay that did not run cannot pass either;
- ``torch.compile(mode="reduce-overhead", fullgraph=True)`` of the same module, all-reduces
  inside, swaps weight sets the same way (outputs within bf16 tolerance of eager). If this
  PyTorch cannot compile a collective into a CUDA graph, that is reported as a failure;
- ``stablebuf.sleep("weights")`` on all ranks: the guarded replay (and the compiled call)
  raises ``stablebuf.Asleep`` on every rank and launches nothing; after ``stablebuf.wake``
  the same graph replays correctly again.

Then it times, per rank, the median step over ``--steps`` steps (CUDA events between step
ends; the mean from the wall clock beside it): (a) replay only; (b) bind + replay, serial;
(c) the bind hidden behind the step (two ``fence="last-use"`` regions with a graph each, used
on alternate steps, see ``Pipe``); (d) copy-in: the next set copied into the static parameters,
then replay; (e) bind + compiled call. Rank 0 prints the checks, a timing table per rank, the
worst rank's ratios and whether (c) ≤ 1.05x (a) (reported, not enforced), then one final line:
``tp_decode: N ranks, all outputs correct`` or ``tp_decode: N ranks, FAILED: ...``. Exit
status 1 if any check failed on any rank.

All ranks must be GPUs of one model: the weights come from CUDA random generators, whose
streams are the same on identical GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import stablebuf

MiB = 1 << 20
TAG = "weights"
EPS = 1e-6
# Tolerances of a bf16 output against the fp32 reference (and of the compiled output against
# eager): |got - want| ≤ RTOL·|want| + ATOL_OF_MAX·max|want|. A NumPy model of this stack's
# bf16 roundings (8 layers, 2 or 4 shards, batch 1-8) stays within 0.45 of that bound against
# fp32 and within 0.65 between two bf16 rounding orders; a rank's shard alone is tens of times out.
RTOL = 1e-2
ATOL_OF_MAX = 2e-2
FIRST_CHECKED = 6  # every step of a checked run up to here, then every SAMPLE_EVERY-th
SAMPLE_EVERY = 4
TIMED_SAMPLE_EVERY = 10  # timed loops keep a copy of every 10th output, checked after

# Step i of a method: runs it, returns the weight set it used and its output tensor.
Step = Callable[[int], tuple[int, torch.Tensor]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="hidden 1024, ffn 4096: 64 MiB")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=None, help="default 4096 (--small 1024)")
    parser.add_argument("--ffn", type=int, default=None, help="default 16384 (--small 4096)")
    parser.add_argument("--batch", type=int, default=4, help="decode batch, 1-8")
    parser.add_argument("--sets", type=int, default=3, help="weight sets resident (K >= 2)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per method (>= 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before each")
    parser.add_argument("--check-steps", type=int, default=12, help="steps of each checked run")
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip torch.compile and method (e), to narrow a problem down",
    )
    parser.add_argument("--pg-timeout", type=int, default=300, help="NCCL timeout, seconds")
    args = parser.parse_args()
    args.hidden = args.hidden or (1024 if args.small else 4096)
    args.ffn = args.ffn or (4096 if args.small else 16384)
    if args.sets < 2 or not 1 <= args.batch <= 8 or args.steps < 1:
        parser.error("need --sets >= 2, --batch 1-8 and --steps >= 1")
    return args


def say(*parts: Any) -> None:
    """Print on rank 0 only (the other ranks' lines would interleave)."""
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def trace(what: str) -> None:
    """With ``STABLEBUF_TP_TRACE=1``: wait for the GPU, then say on every rank that ``what``
    finished (a fault shows up at the wait, after the last phase that finished)."""
    if os.environ.get("STABLEBUF_TP_TRACE") == "1":
        torch.cuda.synchronize()
        print(f"rank {dist.get_rank()}: {what} done", flush=True)


def all_ranks(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective: every rank must call it)."""
    flag = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class TPDecoder(torch.nn.Module):
    """This rank's shard of the stack. ``forward(x)`` all-reduces each layer's partial output;
    ``forward(x, reduce=False)`` leaves the all-reduce out: what this rank's shard alone gives.
    The parameters are made (empty, bf16) where the caller is: inside a region."""

    def __init__(self, layers: int, hidden: int, ffn_shard: int) -> None:
        super().__init__()

        def weight(*shape: int) -> torch.nn.Parameter:
            empty = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
            return torch.nn.Parameter(empty, requires_grad=False)

        self.up = torch.nn.ParameterList([weight(ffn_shard, hidden) for _ in range(layers)])
        self.down = torch.nn.ParameterList([weight(hidden, ffn_shard) for _ in range(layers)])

    def weights(self) -> list[torch.Tensor]:
        return [*self.up, *self.down]

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            partial = F.linear(F.silu(F.linear(rms_norm(x), up)), down)
            if reduce:
                dist.all_reduce(partial)  # SUM over the ranks' shards
            x = x + partial
        return x


def full_layer(args: argparse.Namespace, k: int, layer: int) -> tuple[torch.Tensor, ...]:
    """Weight set k's full matrices of one layer, ``[ffn, hidden]`` and ``[hidden, ffn]`` in
    bf16, from one seed per (set, layer): the same on every rank."""
    generator = torch.Generator(device="cuda").manual_seed(args.seed + 1000 * k + layer)
    up = torch.randn(args.ffn, args.hidden, generator=generator, device="cuda")
    down = torch.randn(args.hidden, args.ffn, generator=generator, device="cuda")
    return (up / math.sqrt(args.hidden)).bfloat16(), (down / math.sqrt(args.ffn)).bfloat16()


def shards(args: argparse.Namespace, k: int, rank: int, world: int) -> list[torch.Tensor]:
    """Weight set k's shards for ``rank``, in ``TPDecoder.weights()`` order (plain tensors
    outside any region: the copy-in method's sources)."""
    width = args.ffn // world
    ups, downs = [], []
    for layer in range(args.layers):
        up, down = full_layer(args, k, layer)
        ups.append(up[rank * width : (rank + 1) * width].contiguous())
        downs.append(down[:, rank * width : (rank + 1) * width].contiguous())
    return ups + downs


def reference(args: argparse.Namespace, k: int, x: torch.Tensor) -> torch.Tensor:
    """fp32 forward of weight set k on one device, with the full weights rebuilt from the seeds
    one layer at a time (no all-reduce: nothing is sharded)."""
    y = x.float()
    for layer in range(args.layers):
        up, down = full_layer(args, k, layer)
        y = y + F.linear(F.silu(F.linear(rms_norm(y), up.float())), down.float())
    return y


def build(
    tag: str, args: argparse.Namespace, world: int, sources: list[list[torch.Tensor]], fence: str
) -> tuple[TPDecoder, list[Any]]:
    """A ``TPDecoder`` whose parameters live in region ``tag``, and its weight sets: set 0 is
    the backing the region was built with, sets 1.. are snapshots written through
    ``stablebuf.writing``."""
    with stablebuf.region(tag, fence=fence):
        model = TPDecoder(args.layers, args.hidden, args.ffn // world).eval()
    params = model.weights()
    torch._foreach_copy_(params, sources[0])
    # Eager writes: a "last-use" region's remaps wait only for noted uses, so note them (after
    # they finished). The default fence waits for the device anyway.
    torch.cuda.synchronize()
    stablebuf.note_use([tag])
    sets: list[Any] = [None] * len(sources)
    for k in range(1, len(sources)):
        sets[k] = stablebuf.snapshot(tag)
        torch.cuda.synchronize()
        with stablebuf.writing(sets[k]):  # notes its own writes
            torch._foreach_copy_(params, sources[k])
    sets[0] = stablebuf.bound(tag)
    torch.cuda.synchronize()
    return model, sets


def capture(model: TPDecoder, x: torch.Tensor, tag: str) -> tuple[Any, torch.Tensor]:
    """The decode step captured once, all-reduces included, as a guarded graph.

    PyTorch's guidance for NCCL in CUDA graphs: run the collective eagerly first (NCCL sets up
    its connections for this size and algorithm then, not during the capture), on the stream
    that will capture (cuBLAS caches its handle and workspace per stream), with every rank
    capturing. ``capture_error_mode="thread_local"``: ProcessGroupNCCL's watchdog thread may
    still query the warm-up's events, which a global-mode capture forbids on every thread
    (``torch.compile``'s CUDA graph trees capture the same way)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph = stablebuf.CUDAGraph(tags=[tag])
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = model(x)
    torch.cuda.synchronize()
    stablebuf.note_use([tag])  # the warm-up read the region eagerly
    dist.barrier()
    return graph, out


class Pipe:
    """One of the two copies of the model behind method (c), in its own region made with
    ``fence="last-use"``, with its own K weight sets and its own graph.

    Why two: a bind unmaps the weights the previous replay reads, so with one region it must
    wait for that replay, and the GPU idles while the remap runs (method (b)). The README's
    way to hide it is a ``fence="last-use"`` region, whose bind waits only for the last noted
    use of that region (every guarded replay notes its own), plus a second region for the
    steps between: step i replays copy i % 2, so copy i % 2's bind waits for step i - 2, which
    the GPU finished while step i - 1 was queued behind it, and the remap runs on the host
    while the GPU computes step i - 1 over the other copy."""

    def __init__(
        self,
        index: int,
        args: argparse.Namespace,
        world: int,
        sources: list[list[torch.Tensor]],
        x: torch.Tensor,
    ) -> None:
        self.tag = f"{TAG}_pipe_{index}"
        self.model, self.sets = build(self.tag, args, world, sources, fence="last-use")
        self.graph, self.out = capture(self.model, x, self.tag)
        self.bound = 0  # the weight set bound now


def pipe_set(i: int, sets: int) -> int:
    """The weight set of pipelined step i: each copy gets another set at each of its steps."""
    return (i // 2 + i % 2) % sets


def tolerance_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (RTOL·|want| + ATOL_OF_MAX·max|want|): ≤ 1 is within bf16
    tolerance; inf where anything is not finite."""
    got, want = got.float(), want.float()
    bound = RTOL * want.abs() + ATOL_OF_MAX * want.abs().max()
    ratio = ((got - want).abs() / bound).max().item()
    return ratio if math.isfinite(ratio) else math.inf


class Checks:
    """Each checked output against this rank's expectations for its weight set: ``eager`` (the
    module without a graph), ``ref`` (fp32, full weights) and ``alone`` (this rank's shard, no
    all-reduce); per-phase worst numbers and the failures, for the summary."""

    def __init__(self, rank: int, world: int, eager, ref, alone) -> None:
        self.rank, self.eager, self.ref, self.alone = rank, eager, ref, alone
        # At one rank the shard is the whole model: "alone" is the full output, no contrast.
        self.sharded = world > 1
        self.phases: dict[str, dict[str, Any]] = {}
        self.failures: list[str] = []

    def fail(self, message: str) -> None:
        self.failures.append(f"rank {self.rank}: {message}")

    def check(self, phase: str, step: int, k: int, got: torch.Tensor, exact: bool = True) -> None:
        p = self.phases.setdefault(
            phase, {"checks": 0, "bit_equal": exact, "eager": 0.0, "ref": 0.0, "alone": math.inf}
        )
        equal = torch.equal(got, self.eager[k])
        to_eager = tolerance_ratio(got, self.eager[k])
        to_ref = tolerance_ratio(got, self.ref[k])
        to_alone = tolerance_ratio(got, self.alone[k])
        p["checks"] += 1
        p["bit_equal"] = p["bit_equal"] and equal
        p["eager"] = max(p["eager"], to_eager)
        p["ref"] = max(p["ref"], to_ref)
        p["alone"] = min(p["alone"], to_alone)
        problems = []
        if torch.isnan(got).any().item():
            problems.append("NaN in the output (the replay did not write it)")
        if exact and not equal:
            problems.append(f"not bit-equal to eager ({to_eager:.3g} of the bf16 tolerance)")
        if not exact and to_eager > 1:
            problems.append(f"{to_eager:.3g}x the bf16 tolerance from eager")
        if to_ref > 1:
            problems.append(f"{to_ref:.3g}x the bf16 tolerance from the fp32 reference")
        if self.sharded and to_alone <= 1:
            problems.append("matches this rank's shard alone: the all-reduce did not run")
        if problems:
            self.fail(f"{phase}, step {step}, set {k}: " + "; ".join(problems))


def timed(step: Step, args: argparse.Namespace) -> tuple[dict[str, float], list[Any]]:
    """Median and mean time per step (µs) of ``step(i)`` over ``args.steps`` steps after
    ``args.warmup``, every rank starting together. Step i's time is the GPU time between the
    ends of steps i - 1 and i (CUDA events), so host work that leaves the GPU idle (a bind)
    counts; the mean comes from the wall clock. Also returns copies of every 10th step's output
    (taken in stream order, no wait), to check afterwards."""
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    samples = []
    start = time.perf_counter()
    ends[0].record()
    for j in range(args.steps):
        i = args.warmup + j
        k, out = step(i)
        ends[j + 1].record()
        if j % TIMED_SAMPLE_EVERY == TIMED_SAMPLE_EVERY - 1:
            samples.append((i, k, out.clone()))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    per_step = [ends[j].elapsed_time(ends[j + 1]) * 1e3 for j in range(args.steps)]
    return {"median": statistics.median(per_step), "mean": wall / args.steps * 1e6}, samples


def compiled_call(compiled: Any, x: torch.Tensor) -> torch.Tensor:
    torch.compiler.cudagraph_mark_step_begin()  # the last call's output may be overwritten
    return compiled(x)


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


# (key, label, TPRun method giving step i, output bit-equal to eager?)
METHODS = [
    ("a", "no swap: replay only", "replay_only", True),
    ("b", "bind + replay, serial", "bind_replay", True),
    ("c", "bind hidden: 2 last-use regions, alternating", "pipelined", True),
    ("c0", "floor of (c): its 2 graphs alternating, no bind", "pipes_alone", True),
    ("d", "copy-in (param.copy_ of the next set) + replay", "copy_in", True),
    ("e", "bind + compiled call (reduce-overhead)", "bind_compiled", False),
]


class TPRun:
    """One rank's part of the run. The step methods run step i of a method and return the
    weight set it used and its output (a static buffer: copy it before the next step)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world, self.K = args, rank, world, args.sets
        self.sources = [shards(args, k, rank, world) for k in range(self.K)]
        t0 = time.perf_counter()
        self.model, self.sets = build(TAG, args, world, self.sources, fence="device")
        self.params = self.model.weights()
        weight_bytes = sum(p.nbytes for p in self.params)
        span = stablebuf.stats()[TAG]["span"]
        nccl = torch.cuda.nccl.version()
        say(
            f"tp_decode: {world} ranks ({torch.cuda.get_device_name()}), {args.layers} "
            f"layers, hidden {args.hidden}, ffn {args.ffn} ({args.ffn // world} per rank), "
            f"batch {args.batch}, bf16: {weight_bytes / MiB:.0f} MiB of weights per rank "
            f"(region span {span / MiB:.0f} MiB), {self.K} weight sets, built in "
            f"{time.perf_counter() - t0:.1f} s; torch {torch.__version__}, NCCL "
            f"{'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
        )
        # The input is replicated, as in tensor parallelism; it lives outside every region.
        generator = torch.Generator(device="cuda").manual_seed(args.seed - 1)
        self.x = torch.randn(args.batch, args.hidden, generator=generator, device="cuda")
        self.x = self.x.bfloat16()

        # What each checked output must match, per weight set.
        eager, ref, alone = [], [], []
        for k in range(self.K):
            stablebuf.bind(TAG, self.sets[k])
            eager.append(self.model(self.x))
            alone.append(self.model(self.x, reduce=False))
            ref.append(reference(args, k, self.x))
        stablebuf.bind(TAG, self.sets[0])
        self.checks = Checks(rank, world, eager, ref, alone)
        for k in range(self.K):
            if tolerance_ratio(eager[k], ref[k]) > 1:
                self.checks.fail(f"set {k}: eager is outside bf16 tolerance of the reference")
            if world > 1 and tolerance_ratio(alone[k], ref[k]) <= 1:
                self.checks.fail(f"set {k}: this rank's shard alone matches the full model")
        if any(torch.equal(eager[0], eager[k]) for k in range(1, self.K)):
            self.checks.fail("two weight sets give the same output")
        # Every rank's eager outputs must be the same bits (the output is replicated).
        self.fingerprint = [float(e.float().pow(2).sum().item()) for e in eager]

        self.graph, self.out = capture(self.model, self.x, TAG)
        self.pipes = [Pipe(index, args, world, self.sources, self.x) for index in range(2)]
        say("tp_decode: decode step captured, all-reduces inside, over region weights and over")
        say("  each of the 2 pipelined copies (regions weights_pipe_0/1, fence last-use)")
        self.compiled: Any | None = None
        self.compile_ok = self.in_graphs = False

    # The methods' steps.
    def replay_only(self, i: int) -> tuple[int, torch.Tensor]:
        self.graph.replay()
        return 0, self.out

    def bind_replay(self, i: int) -> tuple[int, torch.Tensor]:
        k = i % self.K
        stablebuf.bind(TAG, self.sets[k])
        self.graph.replay()
        return k, self.out

    def pipelined(self, i: int) -> tuple[int, torch.Tensor]:
        pipe, k = self.pipes[i % 2], pipe_set(i, self.K)
        stablebuf.bind(pipe.tag, pipe.sets[k])
        pipe.bound = k
        pipe.graph.replay()
        return k, pipe.out

    def pipes_alone(self, i: int) -> tuple[int, torch.Tensor]:
        pipe = self.pipes[i % 2]
        pipe.graph.replay()
        return pipe.bound, pipe.out

    def copy_in(self, i: int) -> tuple[int, torch.Tensor]:
        # param.copy_(the next set's tensor) for every parameter, as one multi-tensor copy,
        # into the set bound now (set 0's backing; restore() gives it its values back).
        k = i % self.K
        torch._foreach_copy_(self.params, self.sources[k])
        self.graph.replay()
        return k, self.out

    def bind_compiled(self, i: int) -> tuple[int, torch.Tensor]:
        k = i % self.K
        stablebuf.bind(TAG, self.sets[k])
        return k, compiled_call(self.compiled, self.x)

    def restore(self) -> None:
        """Set 0 bound in region "weights", holding set 0's values."""
        stablebuf.bind(TAG, self.sets[0])
        torch._foreach_copy_(self.params, self.sources[0])

    def check_run(self, key: str, method: str, exact: bool) -> None:
        """``--check-steps`` steps of a method, its static output poisoned with NaN before
        each step; the first 6 outputs and every 4th after are copied in stream order (no wait
        between steps, so a bind that did not wait for a replay would show) and checked once
        all steps are done."""
        step: Step = getattr(self, method)
        kept = []
        for i in range(self.args.check_steps):
            if method in ("replay_only", "bind_replay", "copy_in"):
                self.out.fill_(float("nan"))
            elif method in ("pipelined", "pipes_alone"):
                self.pipes[i % 2].out.fill_(float("nan"))
            k, out = step(i)
            if i < FIRST_CHECKED or i % SAMPLE_EVERY == 0:
                kept.append((i, k, out.clone()))
        torch.cuda.synchronize()
        for i, k, out in kept:
            self.checks.check(f"({key}) checked run", i, k, out, exact)
        self.restore()

    def compile(self) -> None:
        """``torch.compile(mode="reduce-overhead", fullgraph=True)`` of the same module: the
        all-reduces inside one graph (a graph break at a collective would run it eagerly
        between two CUDA graphs). A failure is reported, not skipped."""
        self.compiled = torch.compile(self.model, mode="reduce-overhead", fullgraph=True)
        skips, captures = cudagraph_skips(), stablebuf.guard_stats()["captures"]
        t0 = time.perf_counter()
        error = None
        try:
            for _ in range(3):  # warm-up run, recording, first replay
                compiled_call(self.compiled, self.x)
            torch.cuda.synchronize()
        except Exception as failure:  # noqa: BLE001 - reported as a failure
            lines = str(failure).strip().splitlines() or [""]
            error = f"{type(failure).__name__}: {lines[0][:300]}"
        self.compile_ok = all_ranks(error is None)
        recorded = cudagraph_skips() == skips and stablebuf.guard_stats()["captures"] > captures
        self.in_graphs = self.compile_ok and all_ranks(recorded)
        what = "torch.compile(mode='reduce-overhead') with all-reduces inside"
        if error is not None:
            self.checks.fail(f"{what} failed: {error}")
        elif not self.compile_ok:
            self.checks.fail(f"{what} failed on another rank")
        elif not self.in_graphs:
            self.checks.fail(f"{what} ran without CUDA graphs (see 'skipping cudagraphs')")
        else:
            say(f"tp_decode: compiled (reduce-overhead) in {time.perf_counter() - t0:.1f} s")

    def sleep_wake(self) -> None:
        """Sleep region "weights" on every rank with set 1 bound: the guarded replay and the
        compiled call must raise ``Asleep`` and launch nothing (a launched collective would
        leave the other ranks waiting), then after the wake replay correctly again."""
        stablebuf.bind(TAG, self.sets[1])
        torch.cuda.synchronize()
        dist.barrier()
        self.out.fill_(float("nan"))
        slept = stablebuf.sleep(TAG)[TAG]
        refused = {"guarded replay": False}
        try:
            self.graph.replay()
        except stablebuf.Asleep:
            refused["guarded replay"] = True
        if self.in_graphs:  # compiled code outside CUDA graphs is not guarded: it would fault
            refused["compiled call"] = False
            try:
                compiled_call(self.compiled, self.x)
            except stablebuf.Asleep:
                refused["compiled call"] = True
        torch.cuda.synchronize()
        launched = not torch.isnan(self.out).all().item()
        stablebuf.wake(TAG)
        dist.barrier()
        for what, ok in refused.items():
            if not ok:
                self.checks.fail(f"asleep: the {what} did not raise stablebuf.Asleep")
        if launched:
            self.checks.fail("asleep: a refused replay launched work")
        # The same graph, on the set it slept with, then on every set (outputs poisoned).
        for step, k in enumerate([1, *range(self.K)]):
            stablebuf.bind(TAG, self.sets[k])
            self.out.fill_(float("nan"))
            self.checks.check("after sleep/wake", step, k, self.replay_only(step)[1].clone())
            if self.in_graphs:
                got = compiled_call(self.compiled, self.x).clone()
                self.checks.check("after sleep/wake, compiled", step, k, got, exact=False)
        self.restore()
        say(
            f"tp_decode: sleep/wake on every rank ({slept['bytes'] / MiB:.0f} MiB to host in "
            f"{slept['seconds'] * 1e3:.0f} ms on rank 0); while asleep, "
            + ", ".join(
                f"the {what} {'refused' if ok else 'did NOT refuse'}"
                for what, ok in refused.items()
            )
        )

    def release_graphs(self) -> None:
        """Destroy every CUDA graph this rank holds: the compiled function's (its CUDA graph
        trees) and the hand-captured ones.

        This must happen before ``dist.destroy_process_group()``, which hangs while a CUDA
        graph holding captured NCCL collectives is alive: NCCL keeps what a captured
        collective needs for as long as the graph that holds it exists, and tearing the
        communicator down waits for it."""
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        self.compiled = None
        reset_cudagraph_trees()
        torch._dynamo.reset()
        for graph in [self.graph] + [pipe.graph for pipe in self.pipes]:
            graph.reset()
        gc.collect()
        torch.cuda.synchronize()

    def run(self) -> dict[str, Any]:
        """The checks, the compile, the timings and sleep/wake; returns this rank's results
        (after releasing every CUDA graph)."""
        for key, _, method, exact in METHODS:
            if key not in ("c0", "e"):
                self.check_run(key, method, exact)
                trace(f"checked run ({key})")
        if self.args.no_compile:
            say("tp_decode: torch.compile and method (e) skipped (--no-compile)")
        else:
            self.compile()
            trace("compile")
        if self.compile_ok:
            self.check_run("e", "bind_compiled", exact=False)
            trace("checked run (e)")

        times: dict[str, dict[str, float]] = {}
        for key, _, method, exact in METHODS:
            if key == "e" and not self.compile_ok:
                continue
            times[key], samples = timed(getattr(self, method), self.args)
            trace(f"timed ({key})")
            for i, k, out in samples:
                self.checks.check(f"({key}) timed, sampled", i, k, out, exact)
            self.restore()
            trace(f"restore after ({key})")
        say(f"tp_decode: timed {', '.join(f'({key})' for key in times)}")

        self.sleep_wake()
        # Before main() destroys the process group (see release_graphs: it would hang).
        self.release_graphs()
        return {
            "rank": self.rank,
            "times": times,
            "phases": self.checks.phases,
            "failures": self.checks.failures,
            "fingerprint": self.fingerprint,
        }


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Rank 0: print the checks and a timing table per rank; return every rank's failures."""
    failures = [failure for r in results for failure in r["failures"]]
    if len({tuple(r["fingerprint"]) for r in results}) != 1:
        failures.append("the ranks' eager outputs differ: the output is not replicated")
    phases: dict[str, dict[str, Any]] = {}
    for r in results:
        for name, p in r["phases"].items():
            total = phases.setdefault(name, dict(p, checks=0))
            total["checks"] += p["checks"]
            total["bit_equal"] = total["bit_equal"] and p["bit_equal"]
            for key, pick in (("eager", max), ("ref", max), ("alone", min)):
                total[key] = pick(total[key], p[key])
    print()
    print("checks, all ranks; numbers: the worst max |out - expected| / (1e-2·|expected|")
    print("+ 2e-2·max|expected|), ≤ 1 is within bf16 tolerance")
    print("| phase | checks | vs eager | vs fp32 reference (≤ 1) | vs shard alone (> 1) |")
    print("| --- | --- | --- | --- | --- |")
    for name, p in phases.items():
        versus = "bit-equal" if p["bit_equal"] else f"{p['eager']:.2f}"
        print(f"| {name} | {p['checks']} | {versus} | {p['ref']:.2f} | {p['alone']:.1f} |")
    labels = {key: label for key, label, _, _ in METHODS}
    for r in results:
        times = r["times"]
        print()
        print(
            f"rank {r['rank']}: per step, median of {args.steps} steps (CUDA events) and mean "
            "(wall clock)"
        )
        print("| method | median (µs) | mean (µs) | vs (a) |")
        print("| --- | --- | --- | --- |")
        for key, t in times.items():
            ratio = t["median"] / times["a"]["median"]
            print(f"| ({key}) {labels[key]} | {t['median']:.0f} | {t['mean']:.0f} | {ratio:.3f}x |")
    worst = {
        key: max(r["times"][key]["median"] / r["times"]["a"]["median"] for r in results)
        for key in ("b", "c", "d", "e")
        if all(key in r["times"] for r in results)
    }
    ratios = ", ".join(f"({key})/(a) {ratio:.3f}x" for key, ratio in worst.items())
    verdict = "met" if worst["c"] <= 1.05 else "NOT met"
    print(
        f"tp_decode: timing, worst rank: {ratios}; target (c) ≤ 1.05x no swap: {verdict} "
        f"({worst['c']:.3f}x)"
    )
    return failures


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast; read at NCCL init
    sys.stdout.reconfigure(line_buffering=True)  # each line out as it is printed
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # before anything else touches CUDA
    dist.init_process_group(
        "nccl",
        device_id=torch.device("cuda", local_rank),
        timeout=datetime.timedelta(seconds=args.pg_timeout),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ffn % world:
        raise SystemExit(f"tp_decode: --ffn {args.ffn} does not split over {world} ranks")
    if args.steps < 50:
        say(f"tp_decode: note: --steps {args.steps} < 50, medians are rough")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32
    with torch.no_grad():
        mine = TPRun(args, rank, world).run()  # its CUDA graphs are gone when it returns
    results: list[Any] = [None] * world
    dist.all_gather_object(results, mine)
    failures = report(results, args) if rank == 0 else []
    failed = not all_ranks(not failures)
    dist.destroy_process_group()
    if rank == 0:
        if failed:
            if len(failures) > 3:
                print("\n".join(["tp_decode: every problem:", *failures]), flush=True)
            first = "; ".join(failures[:3])
            print(
                f"tp_decode: {world} ranks, FAILED: {len(failures)} problems: {first}", flush=True
            )
        else:
            print(f"tp_decode: {world} ranks, all outputs correct", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
