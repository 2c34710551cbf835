"""The cost of the tensor-parallel engines' agreement at a step boundary, against a decode step
on the same ranks.

Run, one process per rank::

    torchrun --standalone --nproc-per-node N python/examples/tp_publish_cost.py [options: --help]

With a GPU per rank (N GPUs visible) the ranks' decode step all-reduces over NCCL; with fewer
GPUs than ranks (say N = 2 on one GPU) the ranks share GPU 0 and their decode step leaves the
all-reduces out (NCCL refuses two ranks on one GPU), which the output says.

Each rank serves Llama-3-8B-shaped decoder layers (``--layers``, default 32: hidden 4096, 32
query heads and 8 key/value heads of 128, ffn 14336), sharded over the N ranks (q/k/v and
gate/up by columns, o and down by rows, each followed by an all-reduce), bf16, decoding a
batch of ``--batch`` sequences (default 8) against a KV cache of ``--context`` tokens (default
1024); the step is captured once as a CUDA graph over weights in a stablebuf region, and an
``Engine(group=<gloo group>)`` serves that region, with no trainer: every boundary then pays
the agreement for nothing new, which is what most boundaries are.

The engine agrees every ``agree_every``-th boundary (``--agree-every``, a comma-separated list:
by default the engine's default, then 1, measured side by side on the same engine and graph):
an *agreement boundary* collects the group's answer to the offers started at the agreement
boundary before (an all-reduce of three integers, which ran beside the steps between) and
starts the next; the boundaries between only count themselves. Measured per rank over
``--steps`` steps per mode (in blocks rotating through no agreement and each ``agree_every``,
each block a whole number of agreement windows, after ``--warmup`` steps):

- the decode step: ``graph.replay()`` and a synchronize (the serving loop reads its output),
  median over the blocks without the agreement;
- the boundary: ``Engine.poll()`` between the synchronize and the next replay, the place where
  no GPU work hides it: its mean per boundary (what the agreement costs a step on average,
  agreement boundaries and the others together), and the medians of the agreement boundaries
  and of the others;
- the loop: one step's wall time, poll included, mean with each ``agree_every`` against the
  mean without poll.

Then, unless ``--breakdown-steps 0``, the parts of ``poll`` are timed (``perf_counter_ns``
around the engine's reading of its trainer, the offers' read (the wait for the all-reduce) and
start, the switcher's whole step (those two included), and the status), in blocks of their own
so that the timers do not touch the numbers above.

Rank 0 prints the worst rank's numbers, for each ``agree_every``::

    agreement cost (agree_every=K): X us per boundary on average (median M; agreement
        boundaries median A, the others median B), Y us per decode step, Z% of a step
    agreement loop (agree_every=K): P us per step with the agreement, Q us without (+R%)
    agreement breakdown (agree_every=K, medians at agreement boundaries): read_trainer ...
    agreement verdict: PASS (Z% <= 2% of a step at agree_every=K)

(each line on one line; the verdict judges the first ``agree_every`` of the list: ``FAIL``, and
exit status 1, when its mean per boundary exceeds 2% of a step). The decode step here reads the KV cache but does not append to it; its
weights and cache reads are a real decode step's.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import stablebuf
from stablebuf._switcher import DEFAULT_AGREE_EVERY

TAG = "weights"
TARGET_PERCENT = 2.0
#: The parts of poll timed by --breakdown-steps: (owner, attribute) → name.
PARTS = (
    ("engine", "_read_trainer", "read_trainer"),
    ("switcher", "_read_offers", "offers_read"),
    ("switcher", "_start_offers", "offers_start"),
    ("switcher", "step", "switcher_step"),
    ("engine", "_status", "status"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2, help="blocks per mode")
    parser.add_argument(
        "--agree-every",
        default=f"{DEFAULT_AGREE_EVERY},1",
        help="comma-separated agree_every values, measured side by side; the first one is "
        f"judged (default: the engine's default, {DEFAULT_AGREE_EVERY}, then 1)",
    )
    parser.add_argument(
        "--breakdown-steps", type=int, default=160, help="steps per agree_every (0: none)"
    )
    args = parser.parse_args()
    args.agree_every = [int(k) for k in args.agree_every.split(",") if k.strip()]
    if not args.agree_every or min(args.agree_every) < 1:
        raise SystemExit(f"tp_publish_cost: --agree-every {args.agree_every}: each at least 1")
    return args


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class DecodeShard(torch.nn.Module):
    """This rank's shard of the layers and of their KV cache; ``forward(x)`` is one decode
    step of ``x`` ([batch, hidden]). Parameters are made where the caller is: in the region."""

    def __init__(self, args: argparse.Namespace, world: int, reduce: bool) -> None:
        super().__init__()
        self.reduce = reduce
        self.head_dim = args.hidden // args.heads
        self.kv_heads = args.kv_heads // world
        self.group = args.heads // args.kv_heads
        q_out = args.heads * self.head_dim // world
        kv_out = self.kv_heads * self.head_dim
        self.splits = [q_out, kv_out, kv_out]

        def weight(*shape: int) -> torch.nn.Parameter:
            w = torch.empty(*shape, device="cuda", dtype=torch.bfloat16).normal_(std=0.02)
            return torch.nn.Parameter(w, requires_grad=False)

        layers = range(args.layers)
        self.qkv = torch.nn.ParameterList([weight(sum(self.splits), args.hidden) for _ in layers])
        self.o = torch.nn.ParameterList([weight(args.hidden, q_out) for _ in layers])
        self.gate_up = torch.nn.ParameterList(
            [weight(2 * args.ffn // world, args.hidden) for _ in layers]
        )
        self.down = torch.nn.ParameterList([weight(args.hidden, args.ffn // world) for _ in layers])

    def make_cache(self, args: argparse.Namespace) -> None:
        """The KV cache, outside the region (it is not weights)."""
        shape = (args.layers, args.batch, self.kv_heads, args.context, self.head_dim)
        self.keys = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.values = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.reduce:
            dist.all_reduce(t)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        for layer in range(len(self.qkv)):
            q, _k, _v = F.linear(rms_norm(x), self.qkv[layer]).split(self.splits, dim=-1)
            q = q.view(batch, self.kv_heads, self.group, self.head_dim)
            scores = q @ self.keys[layer].transpose(-1, -2) / math.sqrt(self.head_dim)
            attended = torch.softmax(scores.float(), dim=-1).to(x.dtype) @ self.values[layer]
            x = x + self.all_reduce(F.linear(attended.reshape(batch, -1), self.o[layer]))
            gate, up = F.linear(rms_norm(x), self.gate_up[layer]).chunk(2, dim=-1)
            x = x + self.all_reduce(F.linear(F.silu(gate) * up, self.down[layer]))
        return x


def capture(model: DecodeShard, x: torch.Tensor) -> tuple:
    """The decode step as one guarded CUDA graph (NCCL's collectives warmed up eagerly first,
    on the capturing stream, as ``tp_decode.py`` does and says why)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph = stablebuf.CUDAGraph(tags=[TAG])
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = model(x)
    torch.cuda.synchronize()
    dist.barrier()
    return graph, out


def whole_windows(count: int, window: int) -> int:
    """``count`` rounded up to a whole number of ``window``s (at least one)."""
    return max(window, -(-count // window) * window)


def set_agree_every(engine, every: int) -> None:
    """Every rank changes it at the same boundary (between blocks), each block a whole number
    of windows of every value, so each block starts at an agreement boundary. (The engine has
    no public setter: this example reaches into its switcher.)"""
    engine._switcher.agree_every = every


def step_once(graph, engine, polling: bool) -> tuple:
    """One loop step: poll (unless not ``polling``), replay, synchronize. Returns the times (ns)
    of its start, the poll's end and its end."""
    start = time.perf_counter_ns()
    polled = start
    if polling:
        status = engine.poll()
        polled = time.perf_counter_ns()
        if status.problems or not status.group_in_step:
            raise SystemExit(f"tp_publish_cost: the engine reported {status}")
    graph.replay()
    torch.cuda.synchronize()
    return start, polled, time.perf_counter_ns()


def measure(graph, engine, args: argparse.Namespace) -> dict:
    """Per mode (``None``: no agreement; else ``agree_every``), in blocks rotating through the
    modes: every step (us), every boundary (us) and whether it was an agreement boundary."""
    window = math.lcm(*args.agree_every)
    per_block = whole_windows(args.steps // args.blocks, window)
    modes = [None, *args.agree_every]
    samples: dict = {mode: {"loop": [], "step": [], "boundary": [], "agreed": []} for mode in modes}
    plan = [(args.agree_every[0], whole_windows(args.warmup, window), True)]
    plan += [(mode, per_block, False) for _ in range(args.blocks) for mode in modes]
    for mode, count, warm_up in plan:
        if mode is not None:
            set_agree_every(engine, mode)
        mine = samples[mode]
        for index in range(count):
            start, polled, end = step_once(graph, engine, mode is not None)
            if warm_up:
                continue
            mine["loop"].append((end - start) / 1e3)
            mine["step"].append((end - polled) / 1e3)
            if mode is not None:
                mine["boundary"].append((polled - start) / 1e3)
                mine["agreed"].append(index % mode == 0)
        dist.barrier()
    result = {"step": statistics.median(samples[None]["step"])}
    result["loop_without"] = statistics.fmean(samples[None]["loop"])
    for every in args.agree_every:
        mine = samples[every]
        agreed = [b for b, a in zip(mine["boundary"], mine["agreed"]) if a]
        between = [b for b, a in zip(mine["boundary"], mine["agreed"]) if not a]
        result[f"{every}:mean"] = statistics.fmean(mine["boundary"])
        result[f"{every}:median"] = statistics.median(mine["boundary"])
        result[f"{every}:agreed"] = statistics.median(agreed)
        result[f"{every}:between"] = statistics.median(between) if between else 0.0
        result[f"{every}:loop_with"] = statistics.fmean(mine["loop"])
    return result


class Timers:
    """perf_counter_ns around the parts of poll (instance attributes over the methods, so the
    engine's own code calls them); ``spent``: ns per part in the poll now running."""

    def __init__(self, engine) -> None:
        self.spent: dict = {}
        self.owners = {"engine": engine, "switcher": engine._switcher}
        for owner, attribute, part in PARTS:
            target = self.owners[owner]
            setattr(target, attribute, self._timed(getattr(target, attribute), part))

    def _timed(self, call, part: str):
        spent = self.spent
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0) + clock() - start

        return timed

    def remove(self) -> None:
        for owner, attribute, _ in PARTS:
            delattr(self.owners[owner], attribute)


def breakdown(graph, engine, args: argparse.Namespace) -> dict:
    """Medians (us) of poll's parts at agreement boundaries, and of a whole poll at those and
    at the others, per ``agree_every``."""
    window = math.lcm(*args.agree_every)
    count = whole_windows(args.breakdown_steps, window)
    timers = Timers(engine)
    result = {}
    try:
        for every in args.agree_every:
            set_agree_every(engine, every)
            parts: dict = {part: [] for _, _, part in PARTS}
            parts["poll"], between = [], []
            for _ in range(count):
                timers.spent.clear()
                start, polled, _ = step_once(graph, engine, True)
                whole = (polled - start) / 1e3
                if "switcher_step" not in timers.spent:
                    between.append(whole)
                    continue
                parts["poll"].append(whole)
                for part, values in parts.items():
                    if part != "poll":
                        values.append(timers.spent.get(part, 0) / 1e3)
            dist.barrier()
            for part, values in parts.items():
                result[f"{every}:{part}"] = statistics.median(values)
            result[f"{every}:poll_between"] = statistics.median(between) if between else 0.0
    finally:
        timers.remove()
    return result


def report(results: list, args: argparse.Namespace) -> bool:
    """Prints the worst rank's numbers for each ``agree_every``, and the verdict on the first.
    Returns whether it failed."""
    worst = {key: max(r[key] for r in results) for key in results[0]}
    step = worst["step"]
    percent = {}
    for every in args.agree_every:
        k = f"{every}:"
        percent[every] = 100 * worst[k + "mean"] / step
        loop_percent = 100 * (worst[k + "loop_with"] / worst["loop_without"] - 1)
        others = f", the others median {worst[k + 'between']:.1f}" if every > 1 else ""
        print(
            f"agreement cost (agree_every={every}): {worst[k + 'mean']:.1f} us per boundary "
            f"on average (median {worst[k + 'median']:.1f}; agreement boundaries median "
            f"{worst[k + 'agreed']:.1f}{others}), {step:.1f} us per decode step, "
            f"{percent[every]:.2f}% of a step"
        )
        print(
            f"agreement loop (agree_every={every}): {worst[k + 'loop_with']:.1f} us per step "
            f"with the agreement, {worst['loop_without']:.1f} us without "
            f"({loop_percent:+.2f}%)"
        )
        if args.breakdown_steps > 0:
            named = ", ".join(f"{part} {worst[k + part]:.1f} us" for _, _, part in PARTS)
            between = (
                f"; poll between agreement boundaries {worst[k + 'poll_between']:.1f} us"
                if every > 1
                else ""
            )
            print(
                f"agreement breakdown (agree_every={every}, medians at agreement "
                f"boundaries): {named}, poll {worst[k + 'poll']:.1f} us{between}"
            )
    judged = args.agree_every[0]
    failed = percent[judged] > TARGET_PERCENT
    verdict = "FAIL" if failed else "PASS"
    relation = ">" if failed else "<="
    print(
        f"agreement verdict: {verdict} ({percent[judged]:.2f}% {relation} "
        f"{TARGET_PERCENT:g}% of a step at agree_every={judged})"
    )
    return failed


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.stdout.reconfigure(line_buffering=True)
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    own_gpu = torch.cuda.device_count() >= world
    device = local_rank if own_gpu else 0
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=300)
    if own_gpu:
        dist.init_process_group("nccl", device_id=torch.device("cuda", device), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    for name, value in (
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--ffn", args.ffn),
    ):
        if value % world:
            raise SystemExit(f"tp_publish_cost: {name} {value} does not split over {world} ranks")
    control = dist.new_group(backend="gloo")  # the engines' agreement, on the host

    with torch.no_grad():
        with stablebuf.region(TAG):
            model = DecodeShard(args, world, reduce=own_gpu)
        model.make_cache(args)
        x = torch.randn(args.batch, args.hidden, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        folder = tempfile.mkdtemp(prefix="sbcost-")
        engine = stablebuf.publish.Engine(
            TAG,
            os.path.join(folder, f"engine-{rank}.sock"),
            model,
            group=control,
            agree_every=args.agree_every[0],
        )
        graph, _ = capture(model, x)
        mine = measure(graph, engine, args)
        if args.breakdown_steps > 0:
            mine.update(breakdown(graph, engine, args))
        graph.reset()  # before the process group goes: a graph holding NCCL calls blocks it
        engine.close()

    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 30)
    results: list = [None] * world
    dist.all_gather_object(results, mine, group=control)
    failed = False
    if rank == 0:
        placement = (
            "a GPU per rank, NCCL all-reduces in the step"
            if own_gpu
            else f"{world} ranks sharing GPU 0, the step without its all-reduces"
        )
        print(
            f"tp_publish_cost: {world} ranks, {placement}; {args.layers} layers, "
            f"{weights_gib:.2f} GiB of weights per rank, batch {args.batch}, context "
            f"{args.context}; {torch.cuda.get_device_name()}; worst rank of each number"
        )
        failed = report(results, args)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
