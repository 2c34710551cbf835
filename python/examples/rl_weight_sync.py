"""RL weight sync: a trainer process hands new weights to a serving engine every iteration.

Llama-shaped bf16 parameters (``--gib`` of them, default 1; ``--gib 8`` for an 8B-class set;
``--gib 1,8`` runs each size in its own process and checks that the switch does not grow with
size), an engine process (this one) that serves continuously with captured CUDA graphs over its
parameters, and a trainer process (spawned) that produces version after version, on the
engine's GPU or on another one (``--trainer-device`` / ``--engine-device``). Ways to move the
weights, side by side in one run:

- ``ipc-copy`` (pause-and-copy, as verl / OpenRLHF / vLLM ``update_weights`` do today): the
  trainer shares every parameter once as a CUDA IPC handle; per version the engine pauses,
  ``copy_``s each tensor into its live parameters and resumes;
- ``ipc-buckets`` (pause-and-copy through buckets, as checkpoint-engine and NeMo-RL's refit
  do): the trainer flattens its parameters into 512 MiB buckets shared once over IPC; per
  version it fills them, and the engine pauses, copies out of them and resumes;
- ``stablebuf``: ``stablebuf.publish.Engine``: the trainer writes straight into the engine's
  spare weight set, commits; the engine binds it at its next step boundary (one remap);
- ``pipelined``: ``stablebuf.PipelinedEngine``: two regions with a graph each; the
  trainer writes into the idle region's set, commits; the engine's next step replays the idle
  region's graph (no remap at all);
- ``raw-copy`` (item 3's floor, two GPUs): the pipelined engine, but the trainer writes by
  hand: one plain ``copy_`` of its twin into the idle region's set, a synchronisation and a
  commit, at the same moment as a publish (after the same training step) and timed the same
  way: the link's speed as a write meets it, idle before, with none of the library's path.

The trainer's writes for ``stablebuf`` and ``pipelined`` run once per ``--share`` value
(1: as fast as it goes; below 1: chunks of ``--chunk-mib`` (a list: each size) with pauses, so writing takes about
that share of the wall time). On two GPUs the trainer writes through views of the engine's
sets on its own GPU (``--views trainer``, the default: copies on one device, all queued at
once); ``--views engine`` puts them on the engine's GPU, where every ``copy_`` is a copy between
devices that PyTorch fences per tensor against the engine GPU's queue (the path issue 41
measured at 4-10 GB/s), to compare both in one run.

Per version: the trainer makes its new weights and their eager reference output ("training")
while the engine waits; the engine then serves ``--quiet-steps`` undisturbed steps and asks
for the publish, serving on until its first step on the new weights. Training is not part of a
publish, and on one GPU its kernels would share the GPU with the steps measured. With the
trainer on another GPU it runs its training step once more (the same weights) right before
each write (``--write-after train``, the default there), as an RL loop publishes right after its
optimizer step: a write after the trainer idled through the engine's undisturbed steps
(``--write-after quiet``, the default on one GPU) starts on a GPU clocked down and a thread
just woken, and ran 12% slower at 1 GiB on 2 x H200. ``--diagnose`` and ``--pre-copy`` time
those effects (see ``--help``).

Printed: per method, the trainer's write time, the engine's time lost per publish (over the
window from the step in flight when the write began to the end of the first step on the new
weights: the window less one undisturbed step period per step completed in it) and its longest
step; for the two stablebuf methods the switch by its parts (median and p99 over ``--versions``
publishes): the wait for the step in flight, message, poll, fence, remap, launch, commit → first
launch and commit → end of that step; the trainer's write by its parts (acquire, queuing the
copies, waiting for them, their span on the GPU and its GB/s, pauses, commit; copies between
two devices) and the pause-and-copy pull by its parts (queuing, span on the GPU, first step);
the share trade-off table; the peer-copy floor on two GPUs; the engine's step before any
trainer process existed; the device memory. Every engine output after a publish is checked
against the trainer's eager forward over the same weights (outputs poisoned first). Verdict lines (``rl_weight_sync:
verdict: ... PASS|MISS|SKIP``) for each target of issue 41; exit status 1 only if an output is
wrong.

Run: ``python python/examples/rl_weight_sync.py [--gib 1,8] [--versions 20] [--share 1,0.5,0.2]
[--trainer-device 0 --engine-device 1] [--views trainer|engine,...] [--layout twin,own]
[--chunk-mib 64,16]`` (``--help``). Every list runs each value in
turn; the verdicts judge the first of each, and the rest are reported beside it.

The trainer keeps its weights in ``Trainer.twin()`` by default (``--layout twin``): laid out as
the engine's sets, so a publish is one copy; ``--layout own`` keeps a tensor each (a copy per
tensor).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import stablebuf
from stablebuf._pipelined import PARTS, PipelinedEngine, PipelinedTrainer
from stablebuf._pulling import PullingEngine
from stablebuf._share import DEFAULT_COPY_STREAMS, summarize, time_lost, undisturbed_period

GiB = 1 << 30


class GcPauses:
    """The engine process's garbage-collector passes (``gc.callbacks``), to tell a switch
    slowed by Python's collector from one slowed by the GPU or the driver."""

    def __init__(self) -> None:
        self.passes = []  # (start, end), time.monotonic()
        self._start = None
        gc.callbacks.append(self._note)

    def _note(self, phase, info) -> None:
        if phase == "start":
            self._start = time.monotonic()
        elif self._start is not None:
            self.passes.append((self._start, time.monotonic()))
            self._start = None

    def within(self, start: float, end: float) -> float:
        """Seconds of collection overlapping ``[start, end]``."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.passes)


GC_PAUSES = GcPauses()
MiB = 1 << 20
BUCKET = 512 * MiB
TAG = "rl-weights"
TAGS_PIPELINED = ("rl-weights-a", "rl-weights-b")
PAUSE_METHODS = ("ipc-copy", "ipc-buckets")
PUBLISH_METHODS = ("stablebuf", "pipelined", "pulled", "raw-copy")
#: The methods with two regions and a graph each (PipelinedEngine, PullingEngine).
TWO_GRAPHS = ("pipelined", "pulled", "raw-copy")
#: Item 3's floor at the publish's moment: the trainer's own copy_ of its twin into the idle
#: region's set and a commit (the pipelined engine), none of the library's write path.
RAW = "raw-copy"
PREFIX = "rl_weight_sync:"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--gib", default="1", help="GiB of bf16 parameters; a comma list runs each size apart"
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--versions", type=int, default=20, help="versions published per run")
    parser.add_argument("--quiet-steps", type=int, default=20, help="undisturbed steps per version")
    parser.add_argument(
        "--methods",
        default="ipc-copy,ipc-buckets,stablebuf,pipelined",
        help="comma-separated subset of ipc-copy,ipc-buckets,stablebuf,pipelined,pulled "
        "(one GPU),raw-copy (two GPUs: item 3's floor)",
    )
    parser.add_argument(
        "--share",
        default="1",
        help="comma list of the trainer's bandwidth share for stablebuf and pipelined (1 = off)",
    )
    parser.add_argument(
        "--chunk-mib",
        default="64",
        help="comma list: MiB per chunk of a shared write (share below 1; the first is judged)",
    )
    parser.add_argument(
        "--copy-streams",
        default="1",
        help="comma list: streams a full-speed write spreads its copies over (Trainer.copy_streams)",
    )
    parser.add_argument(
        "--write-after",
        choices=("auto", "train", "quiet"),
        default="auto",
        help="what the trainer did just before each write: train (its training step again, "
        "as an RL loop publishes right after its optimizer step) or quiet (nothing since "
        "before the engine's undisturbed steps: its GPU idles about 20 steps). auto: train "
        "with the trainer on another GPU, quiet on one GPU, where its kernels would share "
        "the GPU with the engine's steps",
    )
    parser.add_argument(
        "--pre-copy",
        default="0",
        help="comma list of 0/1, diagnosis: before each timed publish the trainer writes the "
        "set once untimed (is the publish's copy slow as the first after training?)",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="time each write on the GPU (Trainer.gpu_timing); item 3's probes also time the "
        "publish's own write path, raw copies into the set of several kinds, and a copy into "
        "the set after 25 ms idle, after training, and after both",
    )
    parser.add_argument(
        "--layout",
        default="twin",
        help="comma list of where the trainer keeps its weights for stablebuf and pipelined: "
        "twin (Trainer.twin(): laid out as the engine's sets, a publish is one copy), own (a "
        "tensor each, a copy per tensor); the first is judged",
    )
    parser.add_argument("--trainer-device", type=int, default=0)
    parser.add_argument("--engine-device", type=int, default=0)
    parser.add_argument("--peer-mib", type=int, default=1024, help="bytes of the peer-copy probe")
    parser.add_argument(
        "--views",
        default="trainer",
        help="comma list, two GPUs: where the trainer's views of the engine's sets live "
        "(trainer: its own GPU, copies on one device; engine: the engine's GPU, a copy between "
        "devices per tensor)",
    )
    parser.add_argument("--json", default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    args.shares = [float(v) for v in args.share.split(",")]
    args.stream_list = [int(v) for v in args.copy_streams.split(",") if v]
    args.pre_list = [bool(int(v)) for v in args.pre_copy.split(",") if v] or [False]
    if args.write_after == "auto":
        args.write_after = "train" if args.trainer_device != args.engine_device else "quiet"
    args.chunk_list = [float(v) for v in args.chunk_mib.split(",") if v]
    args.layout_list = [v for v in args.layout.split(",") if v]
    if not args.layout_list or any(v not in ("twin", "own") for v in args.layout_list):
        parser.error("--layout: a comma list of twin, own")
    if not args.stream_list or any(v < 1 for v in args.stream_list):
        parser.error("--copy-streams: a comma list of counts, each at least 1")
    if not args.chunk_list or any(v <= 0 for v in args.chunk_list):
        parser.error("--chunk-mib: a comma list of positive sizes")
    args.method_list = [m for m in args.methods.split(",") if m]
    if RAW in args.method_list and args.trainer_device == args.engine_device:
        parser.error("raw-copy is item 3's floor on two GPUs: --trainer-device != --engine-device")
    args.view_list = [v for v in args.views.split(",") if v]
    if any(v not in ("trainer", "engine") for v in args.view_list) or not args.view_list:
        parser.error("--views: a comma list of trainer, engine")
    for m in args.method_list:
        if m not in PAUSE_METHODS + PUBLISH_METHODS:
            parser.error(f"unknown method {m}")
    if any(not 0.0 < v <= 1.0 for v in args.shares):
        parser.error("--share values must be in (0, 1]")
    return args


def llama_shapes(args) -> dict:
    """name → shape of a Llama-style model with about ``args.gib`` GiB of bf16 parameters."""
    h, i, v = args.hidden, args.intermediate, args.vocab
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    fixed = 2 * v * h + h
    layers = max(1, round((float(args.gib) * GiB / 2 - fixed) / per_layer))
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (h, h)
        shapes[f"{p}mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def probes(args, device):
    """Fixed random inputs, one per input width (the same in both processes: made on the CPU)."""
    g = torch.Generator().manual_seed(1234)
    widths = {args.hidden, args.intermediate}
    return {
        w: torch.randn(args.batch, w, generator=g).to(device=device, dtype=torch.bfloat16)
        for w in sorted(widths)
    }


def forward(params: dict, x: dict) -> torch.Tensor:
    """A step that reads every parameter once: one (batch × n_params) float32 result."""
    outs = []
    for w in params.values():
        if w.dim() == 2:
            outs.append((x[w.shape[1]] @ w.t()).float().sum(-1))
        else:
            outs.append((x[w.shape[0]] * w).float().sum(-1))
    return torch.stack(outs)


def fill_version(params: dict, version: int, device) -> None:
    """The trainer's weights of ``version``: fresh random values (never zeros)."""
    g = torch.Generator(device=device).manual_seed(1000 + version)
    for w in params.values():
        w.normal_(0.0, 0.02, generator=g)


def peer_copy_gbps(src_device: int, dst_device: int, nbytes: int) -> float:
    """GB/s of a plain ``copy_`` from ``src_device`` to ``dst_device`` (best of 5)."""
    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{src_device}").normal_()
    dst = torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{dst_device}")
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return n * 2 / best / 1e9


def free_set(trainer, method: str):
    """``(the region's Trainer, set id)`` of a set the trainer may write now (the idle
    region's, with two graphs)."""
    if method in TWO_GRAPHS:
        region, set_id = trainer.acquire()
        return trainer._trainers[region], set_id
    return trainer, trainer.acquire()


def link_probe(trainer, method: str, params: dict, tdev: int, edev: int, nbytes: int,
               x=None, diagnose: bool = False) -> dict:
    """GB/s (best of 3 after a first run, whose own figure is ``<name>_cold``) of three writes
    from the trainer's GPU, to tell the link from the way the trainer writes (item 3): ``peer``, a plain 1 GiB ``copy_`` into memory ``cudaMalloc``ed on
    the engine's GPU; ``flat``, one copy of as many bytes into a weight set the trainer may
    write now (a VMM mapping of the engine's memory, through its view on the trainer's GPU);
    ``write``, the library's write of every tensor into that set (what a publish queues);
    ``halves``, ``flat`` as two copies of half each on two streams at once (two copy engines).
    With ``diagnose``: ``publish``, the publish's own write path (``_write_synchronized``: the
    copy and its synchronisation, no acquire, no commit; GPU GB/s under ``publish_gpu``); and
    the median of 3 one-copy writes into the set, each after 25 ms idle (``after_idle``), after
    the trainer's training step (``after_train``), after both (``after_both``: what a publish
    meets). The set is not committed: the next publish writes it whole first."""
    from stablebuf._share import write_shared
    from stablebuf.publish import _flat_on

    owner, set_id = free_set(trainer, method)
    writer = owner.writer if owner.writer is not None else owner._sets[set_id].device
    flat = _flat_on(torch, owner._sets[set_id], writer)
    n = min(flat.numel(), nbytes)
    source = torch.empty(n, dtype=torch.uint8, device=f"cuda:{tdev}").random_(0, 255)
    peer = torch.empty(n, dtype=torch.uint8, device=f"cuda:{edev}")
    views = owner.tensors(set_id)
    total = sum(t.numel() * t.element_size() for t in params.values())

    cold = {}

    def best(name, fn, size):
        """GB/s, best of 3 after a first run (kept in ``cold``: its destination's pages were
        last touched long ago, as a publish's are)."""
        torch.cuda.synchronize(tdev)
        torch.cuda.synchronize(edev)
        fastest = math.inf
        for i in range(4):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(tdev)
            torch.cuda.synchronize(edev)
            took = time.perf_counter() - start
            if i == 0:
                cold[name] = size / took / 1e9
            else:
                fastest = min(fastest, took)
        return size / fastest / 1e9

    lanes = [torch.cuda.Stream(tdev) for _ in range(2)]
    half = n // 2

    def halves():
        for lane, lo, hi in ((lanes[0], 0, half), (lanes[1], half, n)):
            lane.wait_stream(torch.cuda.current_stream(tdev))
            with torch.cuda.stream(lane):
                flat[lo:hi].copy_(source[lo:hi], non_blocking=True)

    out = {
        "peer": best("peer", lambda: peer.copy_(source, non_blocking=True), n),
        "flat": best("flat", lambda: flat[:n].copy_(source, non_blocking=True), n),
        "write": best("write", lambda: write_shared(torch, views, params), total),
        "halves": best("halves", halves, n),
    }
    if diagnose:
        dev = f"cuda:{tdev}"
        if owner._is_twin(params):
            gpu = []

            def write_path():
                gpu.append(owner._write_synchronized(set_id, params, 1.0, 64 * MiB)["gpu_s"])

            out["publish"] = best("publish", write_path, total)
            out["publish_gpu"] = total / min(gpu) / 1e9
            out["publish_gpu_cold"] = total / gpu[0] / 1e9
            # Which part makes the twin's copy slower than the probe's: the twin as the source
            # (over the probe's range, or all of it), or the length (a fresh buffer as long).
            twin = owner._twin[1]
            m = twin.numel()
            fresh = torch.empty(m, dtype=torch.uint8, device=dev).random_(0, 255)
            out["twin_range"] = best("twin_range", lambda: flat[:n].copy_(twin[:n], True), n)
            out["twin_whole"] = best("twin_whole", lambda: flat[:m].copy_(twin, True), m)
            out["fresh_whole"] = best("fresh_whole", lambda: flat[:m].copy_(fresh, True), m)
            k = n // 8 * 8  # the same bytes by a kernel of SM stores (exact: OR with 0)
            out["sm_range"] = best("sm_range", lambda: torch.bitwise_or(
                fresh[:k].view(torch.int64), 0, out=flat[:k].view(torch.int64)), k)
            # The library's write path against the raw copy: timing events around the raw copy;
            # the raw copy into the library's own target; the write path with no events.
            from stablebuf.publish import _NO_SPAN, _GpuSpan

            span = _GpuSpan(torch, tdev)

            def spanned():
                span.start()
                flat[:m].copy_(twin, True)
                span.stop()

            out["raw_spanned"] = best("raw_spanned", spanned, m)
            target = owner._twin_targets(set_id, 1)[0]["twin"]
            out["raw_target"] = best("raw_target", lambda: target.copy_(twin, True), m)

            spans, owner._spans = owner._spans, {writer: _NO_SPAN}
            out["path_unspanned"] = best("path_unspanned", lambda: owner._write_synchronized(
                set_id, params, 1.0, 64 * MiB), total)
            owner._spans = spans
            # Data or buffer: weight-like bf16 values in a fresh buffer; random bytes in the twin
            # (the next version's training writes every tensor of it again).
            like = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_(0.0, 0.02)
            like = like.view(torch.uint8)
            out["weights_like"] = best("weights_like", lambda: flat[:n].copy_(like, True), n)
            twin.random_(0, 255)
            out["twin_random"] = best("twin_random", lambda: flat[:n].copy_(twin[:n], True), n)
            twin.zero_()
            fill_version(params, 0, dev)  # weights again, for the probe while serving
            del fresh, like

        def train():
            fill_version(params, 0, dev)
            forward(params, x).cpu()
            torch.cuda.synchronize(tdev)

        def idle():
            time.sleep(0.025)

        def both():
            train()
            idle()

        for name, before in (("after_idle", idle), ("after_train", train), ("after_both", both)):
            took = []
            for _ in range(3):
                before()
                torch.cuda.synchronize(tdev)
                start = time.perf_counter()
                flat[:n].copy_(source, non_blocking=True)
                torch.cuda.synchronize(tdev)
                took.append(time.perf_counter() - start)
            out[name] = n / sorted(took)[1] / 1e9
    out.update({f"{name}_cold": gbps for name, gbps in cold.items()})
    del source, peer
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- trainer process


def raw_copy(trainer, version: int) -> dict:
    """Item 3's floor (``raw-copy``): the twin into the idle region's set by one plain
    ``copy_``, a synchronisation of the GPU that ran it, a commit; returns its parts as
    ``last_write`` would (seconds)."""
    t0 = time.perf_counter()
    region, set_id = trainer.acquire(timeout=30)
    owner = trainer._trainers[region]
    twin = trainer._trainers[0]._twin[1]
    target = owner._set_flat(set_id)[: twin.numel()]  # made once per set (cached)
    t1 = time.perf_counter()
    target.copy_(twin, non_blocking=True)
    t2 = time.perf_counter()
    torch.cuda.synchronize(twin.device)
    t3 = time.perf_counter()
    trainer.commit(region, set_id, version)
    t4 = time.perf_counter()
    return {"acquire_s": t1 - t0, "issue_s": t2 - t1, "wait_s": t3 - t2, "commit_s": t4 - t3,
            "total_s": t4 - t0, "copies": 1.0, "chunks": 1.0, "cross_device": 0.0,
            "lanes": 1.0, "twin": 1.0, "writer": float(twin.device.index),
            "set_device": float(owner._sets[set_id].device)}


def trainer_main(method: str, args: argparse.Namespace, conn, path: str, views: str,
                 streams: int = DEFAULT_COPY_STREAMS, chunk_mib: float = 64.0,
                 layout: str = "twin", pre_copy: bool = False) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    tdev, edev = args.trainer_device, args.engine_device
    torch.cuda.set_device(tdev)
    dev = f"cuda:{tdev}"
    shapes = llama_shapes(args)
    params = {n: torch.empty(s, device=dev, dtype=torch.bfloat16) for n, s in shapes.items()}
    x = probes(args, dev)
    floor = peer_copy_gbps(tdev, edev, args.peer_mib * MiB)
    trainer = None
    buckets, where = [], {}
    setup = {"kind": method, "peer_gbps": floor}
    if method == "ipc-copy":
        setup["handles"] = {n: reduce_tensor(t) for n, t in params.items()}
    elif method == "ipc-buckets":
        used = BUCKET
        for n, t in params.items():
            if used + t.numel() * 2 > BUCKET:
                buckets.append(torch.empty(BUCKET // 2, device=dev, dtype=torch.bfloat16))
                used = 0
            where[n] = (len(buckets) - 1, used // 2, t.numel())
            used += (t.numel() * 2 + 255) // 256 * 256
        setup["buckets"] = [reduce_tensor(b) for b in buckets]
        setup["where"] = where
    else:
        expect = {n: (s, torch.bfloat16) for n, s in shapes.items()}
        kwargs = dict(expect=expect, timeout=120, device=edev)
        if edev != tdev:
            kwargs["access"] = [edev, tdev]
            kwargs["writer"] = tdev if views == "trainer" else edev
        if method in TWO_GRAPHS:  # connect() finds a pulling engine's staging socket
            trainer = PipelinedTrainer.connect(path, **kwargs)
        else:
            trainer = stablebuf.publish.Trainer.connect(path, **kwargs)
        trainer.copy_streams = streams
        trainer.gpu_timing = args.diagnose  # its events cost the copy 3% (see Trainer)
        if layout == "twin" or method == RAW:  # the weights move into the set's layout, for good
            twin = trainer.twin()
            for n, t in twin.items():
                t.copy_(params[n])
            # In the model's order, not the set's: forward() stacks one output row per tensor.
            params = {n: twin[n] for n in params}
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    conn.send(setup)
    torch.cuda.synchronize()
    chunk = int(chunk_mib * MiB)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        if message[0] == "probe":
            conn.send(("probed", link_probe(trainer, method, params, tdev, edev,
                                            args.peer_mib * MiB, x, args.diagnose)))
            continue
        if message[0] == "train":
            # "Training", not part of the publish: done before the engine's undisturbed steps,
            # so that on one GPU its kernels do not share the GPU with the steps measured.
            version = message[1]
            if method == "pulled":  # the weights are the staging set: wait until it was read
                trainer.acquire(timeout=60)
            fill_version(params, version, dev)
            reference = forward(params, x).cpu()
            torch.cuda.synchronize()
            # The reference goes now: unpickling a tensor costs the engine a fraction of a
            # millisecond, which inside the publish window would count as time lost.
            conn.send(("trained", version, reference))
            continue
        _, version, share = message
        if args.write_after == "train":
            # The training step that made this version, again (the same seed: the same
            # weights), so that the write follows it as in an RL loop, on a busy GPU and a
            # running thread. Not part of the write.
            fill_version(params, version, dev)
            forward(params, x)
            torch.cuda.synchronize()
        pre = {}
        if pre_copy and method in ("stablebuf", "pipelined") and share >= 1.0:
            # Diagnosis: the same write once, untimed by the engine's window (see --pre-copy).
            owner, set_id = free_set(trainer, method)
            pre = {"pre_gpu_s": owner._write_synchronized(set_id, params, 1.0, chunk)["gpu_s"]}
        write_start = time.monotonic()
        if method == "ipc-buckets":
            for n, t in params.items():
                b, offset, numel = where[n]
                buckets[b][offset : offset + numel].copy_(t.view(-1), non_blocking=True)
            torch.cuda.synchronize()
        elif method == RAW:
            raw = raw_copy(trainer, version)
        elif method in PUBLISH_METHODS:
            # copy (in chunks below share 1), synchronise, commit
            trainer.publish(params, version=version, share=share, chunk_bytes=chunk)
        else:
            torch.cuda.synchronize()  # the handles already point at the new values
        done = time.monotonic()
        commit_at_ns = trainer.last_commit_at_ns if trainer is not None else time.monotonic_ns()
        parts = dict(trainer.last_write) if trainer is not None else {}
        if method == RAW:
            parts = raw
        parts.update(pre)
        conn.send(("done", version, write_start, done, commit_at_ns, parts))
    if trainer is not None:
        trainer.close()


# ---------------------------------------------------------------------------- engine (this)


class Served:
    """One graph over ``params`` (in region ``tag``), its output poisoned before each replay."""

    def __init__(self, params: dict, x: dict, tag: str) -> None:
        self.graph = stablebuf.CUDAGraph(tags=[tag])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(params, x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.out = forward(params, x)
        # The warm-up read the weights eagerly: a "last-use" region must wait for it.
        stablebuf.note_use([tag])


def timed_step(out, replay):
    """Poison ``out``, launch ``replay()``, wait: (start, end, launch ns, launched_at ns)."""
    start = time.monotonic()
    out.fill_(float("nan"))
    t0 = time.perf_counter_ns()
    replay()
    launch_ns = time.perf_counter_ns() - t0
    launched_at = time.monotonic_ns()
    torch.cuda.current_stream().synchronize()
    return start, time.monotonic(), launch_ns, launched_at


class Pair:
    """The two copies of the model for ``pipelined``, each in its region (fence last-use)."""

    def __init__(self, shapes: dict, x: dict, device) -> None:
        self.params, self.served = [], []
        for tag in TAGS_PIPELINED:
            with stablebuf.region(tag, fence="last-use"):
                params = {
                    n: torch.empty(s, device=device, dtype=torch.bfloat16)
                    for n, s in shapes.items()
                }
            fill_version(params, 0, device)
            stablebuf.note_use([tag])
            self.params.append(params)
            self.served.append(Served(params, x, tag))


def pull(dst, src, staging) -> None:
    """Copies ``src`` (the trainer's memory, opened by CUDA IPC) into the engine's ``dst``
    (flat). torch issues a copy between GPUs on the *source* GPU, and the engine's weights live
    in a stablebuf region whose memory only the engine's GPU may access (``cuMemSetAccess``):
    the driver refuses such a copy (invalid argument). So across GPUs the bytes land in a plain
    buffer on the engine's GPU first (``staging``, the largest tensor's size, reused) and are
    copied on from there, on the engine's GPU: one extra copy at the engine GPU's bandwidth,
    counted in the baseline's pause."""
    if staging is None:
        dst.copy_(src, non_blocking=True)
        return
    part = staging[: src.numel()]
    part.copy_(src, non_blocking=True)
    dst.copy_(part, non_blocking=True)


def run_method(method, share, args, params, served, pair, ctx, views="trainer",
               streams=DEFAULT_COPY_STREAMS, chunk_mib=64.0, layout="twin",
               pre_copy=False) -> dict:
    conn, child_conn = ctx.Pipe()
    path = os.path.join(tempfile.mkdtemp(prefix="rl-sync-"), "engine.sock")
    engine = None
    free_before = torch.cuda.mem_get_info()[0]
    proc = ctx.Process(
        target=trainer_main,
        args=(method, args, child_conn, path, views, streams, chunk_mib, layout, pre_copy),
        daemon=True,
    )
    proc.start()
    sources, where = {}, {}
    if method == "stablebuf":
        engine = stablebuf.publish.Engine(TAG, path, params)
    elif method in ("pipelined", RAW):
        engine = PipelinedEngine(TAGS_PIPELINED, path, pair.params, lambda i: pair.served[i].graph)
    elif method == "pulled":
        engine = PullingEngine(TAGS_PIPELINED, path, pair.params, lambda i: pair.served[i].graph,
                               chunk_bytes=int(chunk_mib * MiB))
    if engine is not None and not engine.accept(timeout=300):
        raise RuntimeError("the trainer did not connect")
    setup = conn.recv()
    if "handles" in setup:
        sources = {n: fn(*a) for n, (fn, a) in setup["handles"].items()}
    elif "buckets" in setup:
        sources = [fn(*a) for fn, a in setup["buckets"]]
        where = setup["where"]
    staging = None
    if method in PAUSE_METHODS and args.trainer_device != args.engine_device:
        largest = max(p.numel() for p in params.values())
        staging = torch.empty(largest, dtype=torch.bfloat16, device=f"cuda:{args.engine_device}")
    torch.cuda.synchronize()

    def step():
        if method in TWO_GRAPHS:
            return timed_step(pair.served[engine.current].out, engine.step)
        return timed_step(served.out, served.graph.replay)

    def output():
        return (pair.served[engine.current] if method in TWO_GRAPHS else served).out

    def boundary():
        if engine is None:
            return None
        status = engine.poll()
        if status.problems:
            print(f"{PREFIX} {method}: engine: {'; '.join(status.problems)}")
        return status

    # Item 3's probes on two GPUs: the link with the engine idle, then while it serves.
    probes = {}
    if method in PUBLISH_METHODS and args.trainer_device != args.engine_device:
        conn.send(("probe",))
        probes["idle"] = conn.recv()[1]
        conn.send(("probe",))
        while not conn.poll():
            step()
        probes["serving"] = conn.recv()[1]

    quiet_steps, periods, rows, wrong = [], [], [], 0
    extra_memory = 0
    last_end = None
    for version in range(1, args.versions + 1):
        # A full collection now, before the undisturbed steps: Python's collector then has
        # little reason to run a long (oldest generation) pass inside the publish window.
        gc.collect()
        # The trainer makes this version's weights first, while the engine waits (on one GPU
        # its kernels would be time-sliced with the steps measured below).
        conn.send(("train", version))
        while not conn.poll(0.001):
            boundary()  # a pulling engine hands its staging set back at a poll
        trained = conn.recv()
        if trained[:2] != ("trained", version):
            raise RuntimeError(f"the trainer answered {trained[:2]!r} to train {version}")
        reference = trained[2]
        ends = []
        for _ in range(args.quiet_steps):
            status = boundary()
            if status is not None and status.bound is not None:
                raise RuntimeError(f"{method}: bound {status.bound} unasked")
            s, e, _, _ = step()
            quiet_steps.append(e - s)
            ends.append(e)
        period = undisturbed_period(ends)
        if period is not None:
            periods.append(period)
        last_end = ends[-1] if ends else last_end
        conn.send(("write", version, share))
        steps, done, first, row = [], None, None, {}
        while first is None or done is None:
            if done is None and conn.poll():
                done = conn.recv()
                if method in PAUSE_METHODS:
                    pause_start = time.monotonic()  # the engine stops serving: pause, copy
                    # The pull's span on the engine's stream: each copy from the trainer's GPU
                    # is fenced against it, so the span covers the copies on both GPUs.
                    span = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
                    span[0].record()
                    if method == "ipc-copy":
                        for n, p in params.items():
                            pull(p.view(-1), sources[n].view(-1), staging)
                    else:
                        for n, p in params.items():
                            b, offset, numel = where[n]
                            pull(p.view(-1), sources[b][offset : offset + numel], staging)
                    span[1].record()
                    s, e, launch_ns, launched_at = step()  # resume: the first step on new weights
                    steps.append((pause_start, e))
                    first = output().clone()
                    row = {
                        "first_end": e,
                        "pause": s - pause_start,
                        "launched_at": launched_at,
                        "pull_gpu": span[0].elapsed_time(span[1]) / 1e3,
                        "first_step": e - s,
                    }
                    last_end = e
                    continue
            if engine is not None and first is None:
                poll_at = time.monotonic_ns()
                t0 = time.perf_counter_ns()
                status = boundary()
                poll_ns = time.perf_counter_ns() - t0
                if version in status.refused:
                    raise RuntimeError(f"version {version} was refused: {status.problems}")
                if status.bound is not None and status.bound != version:
                    raise RuntimeError(f"{method}: bound {status.bound}, expected {version}")
                if status.bound == version:
                    prev_end = last_end
                    s, e, launch_ns, launched_at = step()
                    steps.append((s, e))
                    first = output().clone()
                    last_end = e
                    row = {
                        "first_end": e,
                        "poll_at": poll_at,
                        "prev_end": prev_end,
                        "launched_at": launched_at,
                        "first_step": e - s,
                    }
                    if method in TWO_GRAPHS:
                        parts = engine.switches[-1]
                        row.update({p: parts[p] / 1e6 for p in PARTS})
                        row["launched_at"] = parts["launched_at"]
                        row["poll_at"] = parts["poll_at"]
                    else:  # Engine: the poll holds message, fence and remap together
                        row.update(
                            {"message": math.nan, "poll": poll_ns / 1e6, "fence": math.nan,
                             "remap": math.nan, "launch": launch_ns / 1e6}
                        )
                    continue
            s, e, _, _ = step()
            steps.append((s, e))
            last_end = e
        _, _, write_start, trainer_done, commit_at_ns, parts = done
        row["write"] = trainer_done - write_start
        row["parts"] = parts
        commit_at = commit_at_ns / 1e9
        if method in PUBLISH_METHODS:
            poll_at = row["poll_at"] / 1e9
            launched = row["launched_at"] / 1e9
            start = max(commit_at, poll_at)
            row["in_flight"] = max(0.0, poll_at - commit_at) * 1e3
            row["to_launch"] = (launched - start) * 1e3
            # The same without the launch call itself, whose cost follows the graph's node
            # count (this model's layers grow with --gib), not the bytes switched.
            row["to_launch_call"] = row["to_launch"] - row["launch"]
            row["to_launch_total"] = (launched - commit_at) * 1e3
            row["to_end"] = (row["first_end"] - commit_at) * 1e3
        else:
            row["to_end"] = (row["first_end"] - commit_at) * 1e3
        row.update(time_lost(steps, write_start, row["first_end"], periods[-1] if periods else 0.0))
        row["gc"] = GC_PAUSES.within(commit_at, row["first_end"])
        rows.append(row)
        try:
            # Sums of ~2k bf16 products: a stale or wrong set is off by tens; bf16 rounding
            # (should cuBLAS pick another algorithm than the trainer's eager run) by < 0.5.
            torch.testing.assert_close(first.cpu(), reference, rtol=2e-2, atol=0.5)
        except AssertionError as error:
            wrong += 1
            print(f"{PREFIX} {method}: version {version}: WRONG output: {error}")
        extra_memory = max(extra_memory, free_before - torch.cuda.mem_get_info()[0])
    # Let go of the trainer's IPC memory before it exits (torch counts the references).
    sources = where = None
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    conn.send(("stop",))
    proc.join(timeout=120)
    if engine is not None:
        engine.close()

    def ms(key):
        return summarize([r[key] * 1e3 for r in rows])

    def plain(key):
        return summarize([r[key] for r in rows if key in r and not math.isnan(r[key])])

    quiet = summarize(quiet_steps)["median"]
    two_gpus = args.trainer_device != args.engine_device
    result = {
        "method": method,
        "share": share,
        "views": views if two_gpus and method in PUBLISH_METHODS else "-",
        "streams": streams if method in PUBLISH_METHODS else 1,
        "pre_copy": bool(pre_copy) if method in PUBLISH_METHODS else False,
        "layout": layout if method in PUBLISH_METHODS else "own",
        "chunk_mib": (chunk_mib if method == "pulled" or (method in PUBLISH_METHODS and share < 1.0)
                      else 0.0),
        "write_ms": ms("write"),
        "lost_ms": ms("lost"),
        "longest_ms": ms("longest"),
        # The first step on the new weights alone: tells a slow switch step from a step slowed
        # by the trainer's writes when the longest step misses.
        "first_step_ms": ms("first_step"),
        "gc_ms": ms("gc"),
        "to_end_ms": plain("to_end"),
        "quiet_ms": quiet * 1e3,
        "period_ms": summarize(periods)["median"] * 1e3,
        "extra_gib": extra_memory / GiB,
        "peer_gbps": setup["peer_gbps"],
        "probes": probes,
        "wrong": wrong,
        # pulled: per region, the chunks and copy calls a version takes.
        "pull_plan": list(engine.plan) if method == "pulled" else None,
    }
    if method in PUBLISH_METHODS:
        for key in ("in_flight", "to_launch", "to_launch_call", "to_launch_total") + PARTS:
            result[f"{key}_ms"] = plain(key)
        # Which publish was slowest to launch (version 1 is the pipelined engine's first switch
        # to its second region: the launch that uploaded that graph before the engine did).
        slowest = max(range(len(rows)), key=lambda i: rows[i].get("to_launch", -1.0))
        result["slowest_switch"] = {
            "version": slowest + 1,
            "to_launch": rows[slowest].get("to_launch", math.nan),
            "launch": rows[slowest].get("launch", math.nan),
        }
        result["write_parts"] = write_parts([r["parts"] for r in rows])
    else:
        result["pause_ms"] = ms("pause")
        result["pull_gpu_ms"] = ms("pull_gpu")
        result["first_step_ms"] = ms("first_step")
        result["tensors"] = len(params)
    return result


def write_parts(parts: list) -> dict:
    """The trainer's ``last_write`` of each publish, summarised per key: seconds (``*_s``) as
    ms under the key without ``_s``, counts and devices as they are."""
    keys = sorted({k for p in parts for k in p})
    out = {}
    for key in keys:
        values = [float(p[key]) for p in parts if key in p and not math.isnan(float(p[key]))]
        if key.endswith("_s"):
            out[key[:-2]] = summarize([v * 1e3 for v in values])
        else:
            out[key] = summarize(values)
    return out


# ---------------------------------------------------------------------------- report


def fmt(summary, key="median"):
    value = summary.get(key, math.nan) if summary else math.nan
    return "      -" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        f"{value:7.3f}"
    )


def label(r) -> str:
    """``method@share``, with ``/engine-views`` for a run through views on the engine's GPU."""
    tail = "/engine-views" if r.get("views") == "engine" else ""
    if r["method"] in PUBLISH_METHODS and r.get("streams", DEFAULT_COPY_STREAMS) != DEFAULT_COPY_STREAMS:
        tail += f"/{r['streams']}-stream"
    if r.get("pre_copy"):
        tail += "/pre-copy"
    if r["method"] in PUBLISH_METHODS and r.get("layout", "twin") != "twin":
        tail += f"/{r['layout']}"
    if r.get("chunk_mib"):
        tail += f"/{r['chunk_mib']:g}MiB"
    return f"{r['method']}@{r['share']:.2f}{tail}"


def report_parts(results, args, nbytes, alone_ms) -> None:
    """Where the writes' and pulls' time went (what the next GPU run has to look at)."""
    def med(parts, key):
        return parts[key]["median"] if key in parts else math.nan

    def gbps(ms):
        return nbytes / (ms / 1e3) / 1e9 if ms and not math.isnan(ms) else math.nan

    publish = [r for r in results if r["method"] in PUBLISH_METHODS and r.get("write_parts")]
    if publish:
        print(f"{PREFIX} the trainer's write by its parts, median ms over {args.versions} "
              "publishes (issue: queuing the copies; wait: for them; gpu: first copy to last on "
              "the writer's stream; x-dev: copies between two devices, fenced per tensor)")
    for r in publish:
        p = r["write_parts"]
        print(
            f"{PREFIX}   {label(r):28s} cuda:{med(p, 'writer'):.0f} -> set on "
            f"cuda:{med(p, 'set_device'):.0f}: check {med(p, 'check'):.3f} | acquire "
            f"{med(p, 'acquire'):.3f} | prepare {med(p, 'prepare'):.3f} | issue "
            f"{med(p, 'issue'):.3f} | wait {med(p, 'wait'):.3f} | gpu {med(p, 'gpu'):.3f} "
            f"({gbps(med(p, 'gpu')):.1f} GB/s) | pause {med(p, 'paused'):.3f} | commit "
            f"{med(p, 'commit'):.3f} | total {med(p, 'total'):.3f} | {med(p, 'copies'):.0f} "
            f"copies, x-dev {med(p, 'cross_device'):.0f}, {med(p, 'chunks'):.0f} chunk(s), "
            f"{med(p, 'lanes'):.0f} stream(s)"
            + (f" | the untimed write before it: gpu {med(p, 'pre_gpu'):.3f} "
               f"({gbps(med(p, 'pre_gpu')):.1f} GB/s)" if "pre_gpu" in p else "")
        )
    pauses = [r for r in results if r["method"] in PAUSE_METHODS]
    if pauses:
        print(f"{PREFIX} the pause-and-copy pull by its parts, median ms (queue: the engine's CPU; "
              "gpu: the pull's span on the engine's stream)")
    for r in pauses:
        print(
            f"{PREFIX}   {r['method']:12s}: queue {fmt(r['pause_ms'])} | gpu "
            f"{fmt(r['pull_gpu_ms'])} ({gbps(r['pull_gpu_ms']['median']):.1f} GB/s) | first step "
            f"{fmt(r['first_step_ms'])} (undisturbed {r['quiet_ms']:.3f}) | lost "
            f"{fmt(r['lost_ms'])} | {r['tensors']} tensors"
        )
    steps = ", ".join(f"{label(r)} {r['quiet_ms']:.3f}" for r in results)
    print(f"{PREFIX} undisturbed engine step, ms: {alone_ms:.3f} before any trainer process; "
          f"with each run's trainer process alive: {steps}")


def compared_only(r, args) -> bool:
    """A run the verdicts leave out (reported beside the others): views on the engine's GPU,
    or another stream count, pre-copy, layout or chunk than the first of ``--copy-streams``,
    ``--pre-copy``,
    ``--layout``, ``--chunk-mib``."""
    if r["method"] not in PUBLISH_METHODS:
        return False
    return (r.get("views") == "engine"
            or r.get("streams", DEFAULT_COPY_STREAMS) != args.stream_list[0]
            or bool(r.get("pre_copy", False)) != args.pre_list[0]
            or r.get("layout", "twin") != args.layout_list[0]
            or (bool(r.get("chunk_mib")) and r["chunk_mib"] != args.chunk_list[0]))


def verdict(what: str, ok, detail: str) -> None:
    word = "SKIP" if ok is None else ("PASS" if ok else "MISS")
    print(f"{PREFIX} verdict: {what}: {detail}: {word}")


def report(results, args, nbytes, alone_ms=math.nan) -> None:
    two_gpus = args.trainer_device != args.engine_device
    print(f"{PREFIX} engine time per publish (window: the step in flight when the write began "
          "→ the end of the first step on the new weights)")
    print(f"{PREFIX}   {'method':12s} {'share':>5s} {'views':>7s} | {'write ms':>8s} | "
          f"{'lost ms':>8s} {'p99':>8s} | {'longest ms':>10s} {'x max':>6s} {'1st x':>6s} | "
          f"{'commit->end ms':>14s} | {'+GiB':>5s} | wrong")
    for r in results:
        ratio = r["longest_ms"]["max"] / r["quiet_ms"]
        print(
            f"{PREFIX}   {r['method']:12s} {r['share']:5.2f} {r.get('views', '-'):>7s} | "
            f"{fmt(r['write_ms']):>8s} | "
            f"{fmt(r['lost_ms']):>8s} {fmt(r['lost_ms'], 'p99'):>8s} | "
            f"{fmt(r['longest_ms']):>10s} {ratio:6.2f} "
            f"{r['first_step_ms']['max'] / r['quiet_ms']:6.2f} | {fmt(r['to_end_ms']):>14s} | "
            f"{r['extra_gib']:5.2f} | {r['wrong']}"
        )
    print(f"{PREFIX}   undisturbed: step {results[0]['quiet_ms']:.3f} ms, period (step + loop) "
          f"{results[0]['period_ms']:.3f} ms; +GiB: device memory of the engine's GPU over the "
          "run's start (the trainer's included when it shares the GPU)")
    publish = [r for r in results if r["method"] in PUBLISH_METHODS]
    if publish:
        print(f"{PREFIX} the switch by its parts, ms, median / p99 over {args.versions} publishes "
              "(stablebuf: message, fence and remap are inside its poll)")
        keys = [("in_flight", "wait for the step in flight")] + [(p, p) for p in PARTS] + [
            ("to_launch_call", "commit -> the first launch call (after the step in flight)"),
            ("to_launch", "commit -> first launch (after the step in flight)"),
            ("to_launch_total", "commit -> first launch (with the wait)"),
            ("to_end", "commit -> end of that step"),
            ("gc", "python GC pauses inside commit -> end of that step"),
        ]
        header = " | ".join(label(r).rjust(17) for r in publish)
        print(f"{PREFIX}   {'part':52s} | {header}")
        for key, what in keys:
            cells = " | ".join(
                f"{fmt(r[f'{key}_ms'])} /{fmt(r[f'{key}_ms'], 'p99')}" for r in publish
            )
            print(f"{PREFIX}   {what:52s} | {cells}")
    for r in publish:
        slow = r.get("slowest_switch")
        if slow:
            print(f"{PREFIX}   slowest switch of {label(r)}: version {slow['version']}, commit -> "
                  f"first launch {slow['to_launch']:.3f} ms, of it the launch {slow['launch']:.3f} ms")
    print(f"{PREFIX} bandwidth share trade-off (the trainer's write against the engine's loss)")
    for r in publish:
        gbps = nbytes / (r["write_ms"]["median"] / 1e3) / 1e9
        print(f"{PREFIX}   {label(r):32s} views {r.get('views', '-')}: "
              f"write {fmt(r['write_ms'])} ms "
              f"({gbps:6.1f} GB/s) | lost {fmt(r['lost_ms'])} ms/publish | longest step "
              f"{r['longest_ms']['max'] / r['quiet_ms']:.2f}x undisturbed (max over publishes)")

    for r in publish:
        if r.get("pull_plan"):
            plan = ", ".join(f"{chunks} chunks in {calls} copy calls" for chunks, calls in
                             r["pull_plan"])
            print(f"{PREFIX}   {label(r)}: the engine's copies of a version, per region: {plan}")

    report_parts(results, args, nbytes, alone_ms)

    # ------------------------------------------------------------------ verdicts
    pipelined = [r for r in results if r["method"] == "pipelined"]
    if pipelined:
        for r in pipelined:
            med, p99 = r["to_launch_ms"]["median"], r["to_launch_ms"]["p99"]
            verdict(
                f"item 1, {label(r)}, commit -> first launch",
                med <= 1.0 and p99 <= 2.0,
                f"median {med:.3f} ms (<= 1), p99 {p99:.3f} ms (<= 2) "
                f"over {r['to_launch_ms']['n']}",
            )
    else:
        verdict("item 1, commit -> first launch", None, "pipelined not run")
    pauses = [r for r in results if r["method"] in PAUSE_METHODS]
    pause = min(pauses, key=lambda r: r["lost_ms"]["median"]) if pauses else None
    for method in PUBLISH_METHODS:
        if method == RAW:  # the floor of item 3, not a way the library offers
            continue
        # The library's way only: --views engine is the path issue 41 measured, for comparison.
        runs = [r for r in results if r["method"] == method and not compared_only(r, args)]
        if not runs or pause is None:
            continue
        best = min(runs, key=lambda r: r["lost_ms"]["median"])
        base = pause["lost_ms"]["median"]
        mine = best["lost_ms"]["median"]
        if two_gpus:
            verdict(
                f"item 2, {method} engine time lost vs pause-and-copy (two GPUs)",
                mine <= base / 5.0,
                f"{mine:.3f} ms (share {best['share']:.2f}) vs {pause['method']} {base:.3f} ms, "
                f"target <= 1/5 = {base / 5.0:.3f} ms",
            )
        else:
            verdict(
                f"item 2, {method} engine time lost vs pause-and-copy (one GPU)",
                mine <= base,
                f"{mine:.3f} ms (share {best['share']:.2f}) vs {pause['method']} {base:.3f} ms",
            )
            low = min(runs, key=lambda r: r["share"])
            ratio = low["longest_ms"]["max"] / low["quiet_ms"]  # the longest of every publish
            if method == "pulled":  # the engine copies a chunk per step: its own share
                verdict(
                    f"item 2, pulled longest step, {low['chunk_mib']:g} MiB a step (one GPU)",
                    ratio <= 1.2,
                    f"{ratio:.2f}x undisturbed (target <= 1.2x)",
                )
                continue
            verdict(
                f"item 2, {method} longest step at share {low['share']:.2f} (one GPU)",
                ratio <= 1.2 if low["share"] < 1.0 else None,
                f"{ratio:.2f}x undisturbed (target <= 1.2x; needs a --share below 1)",
            )
    if pause is None:
        verdict("item 2, engine time lost vs pause-and-copy", None, "no pause-and-copy method run")
    raw = [r for r in publish if r["method"] == RAW]
    raw_gbps = nbytes / (raw[0]["write_ms"]["median"] / 1e3) / 1e9 if raw else None
    for r in publish:
        if r["share"] < 1.0:
            continue
        gbps = nbytes / (r["write_ms"]["median"] / 1e3) / 1e9
        compared = compared_only(r, args)
        probes = r.get("probes") or {}
        if r["method"] == RAW:
            verdict(
                "item 3, the floor: a plain copy_ at a publish's moment vs the peer copy "
                "measured back to back",
                None,
                f"{gbps:.1f} GB/s vs {r['peer_gbps']:.1f} GB/s ({gbps / r['peer_gbps']:.2f}x): "
                "what the link gives a write after the trainer's training step; reported",
            )
            continue
        if two_gpus and raw_gbps is not None:
            verdict(
                f"item 3, {label(r)} write vs a plain copy_ of the same bytes at the same moment "
                "(raw-copy, share off)",
                gbps >= 0.9 * raw_gbps if not compared else None,
                f"{gbps:.1f} GB/s vs {raw_gbps:.1f} GB/s ({gbps / raw_gbps:.2f}x, target >= 0.9x)"
                + ("; reported only" if compared else ""),
            )
        for when in ("idle", "serving"):
            p = probes.get(when)
            if p:
                print(f"{PREFIX}   item 3 probe, {label(r)}, engine {when}: peer copy "
                      f"{p['peer']:.1f} GB/s | one copy into the set {p['flat']:.1f} GB/s | the "
                      f"library's write of every tensor {p['write']:.1f} GB/s | one copy in two "
                      f"halves on two streams {p.get('halves', math.nan):.1f} GB/s; the first "
                      f"of each (cold): {p.get('peer_cold', math.nan):.1f} | "
                      f"{p.get('flat_cold', math.nan):.1f} | {p.get('write_cold', math.nan):.1f}"
                      f" | {p.get('halves_cold', math.nan):.1f}")
                if "twin_range" in p:
                    print(f"{PREFIX}     diagnosis: into the set, best (first): the twin over "
                          f"the probe's range {p['twin_range']:.1f} ({p['twin_range_cold']:.1f})"
                          f" | the whole twin {p['twin_whole']:.1f} "
                          f"({p['twin_whole_cold']:.1f}) | a fresh buffer as long "
                          f"{p['fresh_whole']:.1f} ({p['fresh_whole_cold']:.1f}) | SM stores "
                          f"over the probe's range {p['sm_range']:.1f} ({p['sm_range_cold']:.1f})"
                          f" | weight-like bf16 in a fresh buffer {p['weights_like']:.1f} "
                          f"({p['weights_like_cold']:.1f}) | random bytes in the twin "
                          f"{p['twin_random']:.1f} ({p['twin_random_cold']:.1f}) GB/s")
                if "raw_spanned" in p:
                    print(f"{PREFIX}     diagnosis: the whole twin, best (first): timing events "
                          f"around it {p['raw_spanned']:.1f} ({p['raw_spanned_cold']:.1f}) | into "
                          f"the library's target {p['raw_target']:.1f} "
                          f"({p['raw_target_cold']:.1f}) | the write path without events "
                          f"{p['path_unspanned']:.1f} ({p['path_unspanned_cold']:.1f}) GB/s")
                if "after_idle" in p:
                    print(f"{PREFIX}     diagnosis: the publish's write path "
                          f"{p.get('publish', math.nan):.1f} GB/s (gpu "
                          f"{p.get('publish_gpu', math.nan):.1f}; first "
                          f"{p.get('publish_cold', math.nan):.1f}, gpu "
                          f"{p.get('publish_gpu_cold', math.nan):.1f}) | one copy into the set "
                          f"after 25 ms idle {p['after_idle']:.1f} | after training "
                          f"{p['after_train']:.1f} | after both {p['after_both']:.1f} GB/s")
        if two_gpus and "serving" in probes:
            floor = probes["serving"]["peer"]
            verdict(
                f"item 3, {label(r)} write vs peer copy, both while the engine serves",
                gbps >= 0.9 * floor if not compared else None,
                f"{gbps:.1f} GB/s (a publish's write) vs {floor:.1f} GB/s peer copy "
                f"({gbps / floor:.2f}x, target >= 0.9x)" + ("; reported only" if compared else ""),
            )
        verdict(
            f"item 3, {label(r)} write vs peer copy (NVLink floor, share off)",
            gbps >= 0.9 * r["peer_gbps"] if two_gpus and not compared and raw_gbps is None
            else None,
            f"{gbps:.1f} GB/s vs {r['peer_gbps']:.1f} GB/s peer copy "
            f"({gbps / r['peer_gbps']:.2f}x, target >= 0.9x)"
            + ("" if two_gpus else "; needs --trainer-device != --engine-device")
            + ("; views on the engine's GPU, or another stream count, layout or chunk than the "
               "first asked: reported only" if compared else "")
            + ("; measured back to back (a warm link): judged against raw-copy above"
               if raw_gbps is not None and not compared else ""),
        )
    wrong = sum(r["wrong"] for r in results)
    verdict("outputs", wrong == 0, "all correct" if wrong == 0 else f"{wrong} WRONG")


def run_sizes(args, argv) -> int:
    """``--gib A,B``: each size in its own process (regions live as long as their process),
    then the verdict that the switch does not grow with size."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--gib", "--json"):
            skip = True
            continue
        if a.startswith("--gib=") or a.startswith("--json="):
            continue
        cleaned.append(a)
    sizes = [g for g in args.gib.split(",") if g]
    found, status = {}, 0
    for gib in sizes:
        out = os.path.join(tempfile.mkdtemp(prefix="rl-sync-size-"), "results.json")
        print(f"{PREFIX} ===== --gib {gib} =====", flush=True)
        rc = subprocess.call([sys.executable, os.path.abspath(__file__), *cleaned, "--gib", gib,
                              "--json", out])
        status = status or rc
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                found[gib] = json.load(f)
    small, big = sizes[0], sizes[-1]
    for method in PUBLISH_METHODS:
        def runs(gib, method=method):
            return [r for r in found.get(gib, []) if r["method"] == method and r["share"] >= 1.0
                    and not compared_only(r, args)]

        a, b = runs(small), runs(big)
        if not a or not b:
            continue
        m_a, m_b = a[0]["to_launch_call_ms"]["median"], b[0]["to_launch_call_ms"]["median"]
        l_a, l_b = a[0]["launch_ms"]["median"], b[0]["launch_ms"]["median"]
        allowed = max(0.1, 0.25 * m_a)
        verdict(
            f"item 1, {method} commit -> the first launch call does not grow with size",
            (m_b - m_a) <= allowed if method == "pipelined" else None,
            f"{m_a:.3f} ms at {small} GiB, {m_b:.3f} ms at {big} GiB (growth {m_b - m_a:+.3f} ms, "
            f"allowed {allowed:.3f}); the launch call itself {l_a:.3f} -> {l_b:.3f} ms, as the "
            "graph's nodes grow with the layers" + ("" if method == "pipelined" else "; reported only"),
        )
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    if "," in args.gib:
        return run_sizes(args, argv)
    ctx = mp.get_context("spawn")
    edev = args.engine_device
    torch.cuda.set_device(edev)
    device = f"cuda:{edev}"
    shapes = llama_shapes(args)
    with stablebuf.region(TAG):
        params = {n: torch.empty(s, device=device, dtype=torch.bfloat16) for n, s in shapes.items()}
    fill_version(params, 0, device)
    nbytes = sum(p.numel() * 2 for p in params.values())
    print(
        f"{PREFIX} {len(params)} tensors, {nbytes / GiB:.2f} GiB bf16, engine on GPU {edev} "
        f"({torch.cuda.get_device_name(edev)}), trainer on GPU {args.trainer_device}"
        + (f" ({torch.cuda.get_device_name(args.trainer_device)})"
           if args.trainer_device != edev else "")
        + "; each write right after "
        + ("a training step" if args.write_after == "train"
           else "the engine's undisturbed steps (the trainer idle)")
    )
    x = probes(args, device)
    served = Served(params, x, TAG)
    pair = Pair(shapes, x, device) if set(TWO_GRAPHS) & set(args.method_list) else None
    # The engine's step with no trainer process (and its contexts on the GPUs) alive yet.
    alone = [timed_step(served.out, served.graph.replay) for _ in range(max(20, args.quiet_steps))]
    alone_ms = summarize([e - s for s, e, _, _ in alone])["median"] * 1e3
    two_gpus = args.trainer_device != edev
    results = []
    for method in args.method_list:
        publishing = method in PUBLISH_METHODS
        # pulled: the engine copies a chunk per step itself (--chunk-mib is its share), out of
        # the staging set the trainer trains in (the twin): no share, no other layout.
        # raw-copy: one plain copy of the twin, at full speed (no share, streams or layout).
        fixed = method in ("pulled", RAW)
        for share in (args.shares if publishing and not fixed else [1.0]):
            views_list = ["trainer"] if method == RAW else (
                args.view_list if publishing and two_gpus else ["trainer"])
            streams_list = (args.stream_list if publishing and share >= 1.0 and method != RAW
                            else [DEFAULT_COPY_STREAMS])
            chunks = (args.chunk_list if publishing and (share < 1.0 or method == "pulled")
                      else args.chunk_list[:1])
            layouts = (["twin"] if fixed
                       else args.layout_list if publishing else ["own"])
            full = publishing and share >= 1.0 and not fixed
            pre_list = args.pre_list if full else [False]
            for views, streams, pre_copy, chunk_mib, layout in itertools.product(
                views_list, streams_list, pre_list, chunks, layouts
            ):
                result = run_method(method, share, args, params, served, pair, ctx, views,
                                    streams, chunk_mib, layout, pre_copy)
                result["alone_ms"] = alone_ms
                results.append(result)
                print(
                    f"{PREFIX} {label(result):28s}: write {fmt(result['write_ms'])} ms | "
                    f"lost {fmt(result['lost_ms'])} ms/publish | longest step "
                    f"{fmt(result['longest_ms'])} ms | commit -> end of step "
                    f"{fmt(result['to_end_ms'])} ms | {result['wrong']} wrong",
                    flush=True,
                )
    report(results, args, nbytes, alone_ms)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, default=float)
    return 1 if sum(r["wrong"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
