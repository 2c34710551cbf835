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

Measured per rank, as medians over ``--steps`` steps (in blocks alternating with and without
the agreement, after ``--warmup`` steps):

- the decode step: ``graph.replay()`` and a synchronize (the serving loop reads its output);
- the boundary: ``Engine.poll()`` between the synchronize and the next replay, the place where
  no GPU work hides it (it collects the group's answer to the offers started at the boundary
  before, which ran beside the step, and starts the next: an all-reduce of three integers);
- the loop: one step's wall time, poll included, against the loop without poll.

Rank 0 prints the worst rank's numbers::

    agreement cost: X us per boundary, Y us per decode step, Z% of a step
    agreement loop: A us per step with the agreement, B us without (+C%)
    agreement verdict: PASS (Z% <= 2% of a step)

(or ``FAIL``, and exit status 1). The decode step here reads the KV cache but does not append
to it; its weights and cache reads are a real decode step's.
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

TAG = "weights"
TARGET_PERCENT = 2.0


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
    parser.add_argument("--warmup", type=int, default=30)
    return parser.parse_args()


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


def measure(graph, engine, args: argparse.Namespace) -> dict:
    """Medians (us) of the decode step, the boundary and the loop, with and without the
    agreement, in alternating blocks."""
    step_us, boundary_us = [], []
    loop_us: dict = {True: [], False: []}
    blocks = 4
    for block in range(blocks + 1):
        agreeing = block % 2 == 1
        count = args.warmup if block == 0 else args.steps // (blocks // 2)
        for _ in range(count):
            start = time.perf_counter_ns()
            if agreeing:
                status = engine.poll()
                polled = time.perf_counter_ns()
                if status.problems or not status.group_in_step:
                    raise SystemExit(f"tp_publish_cost: the engine reported {status}")
            replay_start = time.perf_counter_ns()
            graph.replay()
            torch.cuda.synchronize()
            end = time.perf_counter_ns()
            if block == 0:
                continue  # warm-up
            loop_us[agreeing].append((end - start) / 1e3)
            if agreeing:
                boundary_us.append((polled - start) / 1e3)
            else:
                step_us.append((end - replay_start) / 1e3)
        dist.barrier()
    return {
        "boundary": statistics.median(boundary_us),
        "step": statistics.median(step_us),
        "loop_with": statistics.median(loop_us[True]),
        "loop_without": statistics.median(loop_us[False]),
    }


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
            TAG, os.path.join(folder, f"engine-{rank}.sock"), model, group=control
        )
        graph, _ = capture(model, x)
        mine = measure(graph, engine, args)
        graph.reset()  # before the process group goes: a graph holding NCCL calls blocks it
        engine.close()

    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 30)
    results: list = [None] * world
    dist.all_gather_object(results, mine, group=control)
    failed = False
    if rank == 0:
        worst = {key: max(r[key] for r in results) for key in mine}
        percent = 100 * worst["boundary"] / worst["step"]
        loop_percent = 100 * (worst["loop_with"] / worst["loop_without"] - 1)
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
        print(
            f"agreement cost: {worst['boundary']:.1f} us per boundary, {worst['step']:.1f} us "
            f"per decode step, {percent:.2f}% of a step"
        )
        print(
            f"agreement loop: {worst['loop_with']:.1f} us per step with the agreement, "
            f"{worst['loop_without']:.1f} us without ({loop_percent:+.2f}%)"
        )
        failed = percent > TARGET_PERCENT
        verdict = "FAIL" if failed else "PASS"
        relation = ">" if failed else "<="
        print(
            f"agreement verdict: {verdict} ({percent:.2f}% {relation} {TARGET_PERCENT:g}% of a step)"
        )
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
