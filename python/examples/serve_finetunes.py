"""N fine-tunes served behind one captured decode graph: one bind per request.

A Llama-shaped model (bf16, RMSNorm, rotary attention over a static KV cache, SwiGLU MLP; random
weights, nothing downloaded) lives in ``stablebuf.region("finetunes")``. N fine-tunes of it (the
base weights plus a fine-tune's own deltas, merged) are resident as weight sets. The prefill and
the decode step are captured once as CUDA graphs, greedy sampling included, so a whole request
is one prefill replay and one decode replay per new token, with no other work per token. A stream of
requests, each for a random fine-tune (a prompt, 32+ new tokens, greedy), is served five ways in
one process, over the same requests:

- ``single fine-tune``: every request on fine-tune 0, no bind: the floor;
- ``stablebuf``: ``stablebuf.bind("finetunes", ws[k])`` (one remap) per request, same graphs;
- ``copy-in (device)``: one static model; the fine-tune is copied into its parameters from
  device memory per request (``torch._foreach_copy_``), same graphs;
- ``copy-in (pinned host)``: the same, from pinned host memory (where fine-tunes that do not
  fit beside each other on the GPU would be);
- ``one instance per fine-tune``: N models, each with its own KV cache and graphs;
- ``re-capture``: a new capture per request over the fine-tune's tensors
  (``torch.func.functional_call``).

Every request's tokens are compared with an eager run of the same model with its fine-tune
bound (no graphs); any difference fails the run (exit 1). Prints requests/s, tokens/s and
per-token latency side by side, a memory table (how many fine-tunes fit each way on this GPU)
and verdict lines for the targets (per-token latency ≤ 1.05× the single fine-tune; ≥ 2× the
requests/s of copy-in), which are reported, not enforced.

Run: ``python python/examples/serve_finetunes.py`` (options: ``--help``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.func import functional_call

import stablebuf

GiB = 1 << 30
TAG = "finetunes"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--finetunes", type=int, default=4, help="fine-tunes resident (N)")
    parser.add_argument("--requests", type=int, default=24, help="timed requests per method")
    parser.add_argument("--recapture-requests", type=int, default=6)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=20261125)
    return parser.parse_args()


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Block(torch.nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        h = shape.hidden
        self.heads, self.head_dim = shape.heads, shape.head_dim
        self.attn_norm = torch.nn.RMSNorm(h, eps=1e-5)
        self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
        self.out = torch.nn.Linear(h, h, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(h, eps=1e-5)
        self.gate_up = torch.nn.Linear(h, 2 * shape.intermediate, bias=False)
        self.down = torch.nn.Linear(shape.intermediate, h, bias=False)

    def forward(self, x, positions, keys, values, mask, cos, sin):
        batch, tokens, hidden = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, tokens, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, tokens, head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, hidden))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Llama(torch.nn.Module):
    """Llama-shaped decoder; the KV cache is passed in (one per server), not owned."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = torch.nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = torch.nn.RMSNorm(shape.hidden, eps=1e-5)
        self.head = torch.nn.Linear(shape.hidden, shape.vocab, bias=False)
        inverse = 1.0 / (10000 ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
        angles = torch.outer(torch.arange(shape.context).float(), inverse)
        self.register_buffer("cos_table", angles.cos().float(), persistent=False)
        self.register_buffer("sin_table", angles.sin().float(), persistent=False)

    def forward(self, ids, positions, keys, values, mask):
        cos = self.cos_table.index_select(0, positions)
        sin = self.sin_table.index_select(0, positions)
        x = self.embed(ids)
        for layer, block in enumerate(self.blocks):
            x = block(x, positions, keys[layer], values[layer], mask, cos, sin)
        return self.head(self.norm(x))


def build(shape: Shape, tag: Optional[str] = None) -> Llama:
    """A model made directly in bf16 on the GPU (inside region ``tag`` when given)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        if tag is None:
            with torch.device("cuda"):
                model = Llama(shape)
        else:
            with stablebuf.region(tag), torch.device("cuda"):
                model = Llama(shape)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def finetune_states(model: Llama, count: int, generator: torch.Generator):
    """``count`` fine-tunes: the base weights plus deltas of their own (never zeros)."""
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = []
    for _ in range(count):
        state = {}
        for name, value in base.items():
            noise = torch.randn(value.shape, generator=generator, device="cuda")
            scale = 0.1 if value.dim() == 1 else 0.5 * value.float().std().item()
            state[name] = (value.float() + scale * noise).to(value.dtype)
        states.append(state)
    return states


class Server:
    """One model's greedy generation: a static KV cache and static inputs, the prefill and the
    decode step (sampling included) captured as graphs. ``weights`` (a state dict) makes the
    graphs read those tensors instead of the model's parameters (re-capture)."""

    def __init__(self, model: Llama, shape: Shape, args, tags=None, weights=None) -> None:
        self.model, self.weights, self.tags = model, weights, tags
        self.prompt_len, self.new_tokens = args.prompt, args.new_tokens
        batch, context = args.batch, shape.context
        cache_shape = (shape.layers, batch, shape.heads, context, shape.head_dim)
        self.keys = torch.zeros(cache_shape, device="cuda", dtype=torch.bfloat16)
        self.values = torch.zeros(cache_shape, device="cuda", dtype=torch.bfloat16)
        self.prompt = torch.zeros(batch, args.prompt, device="cuda", dtype=torch.long)
        self.prefill_positions = torch.arange(args.prompt, device="cuda")
        columns = torch.arange(context, device="cuda")
        self.prefill_mask = (columns[None, :] <= self.prefill_positions[:, None])[None, None]
        self.columns = columns
        self.ids = torch.zeros(batch, 1, device="cuda", dtype=torch.long)
        self.position = torch.zeros(1, device="cuda", dtype=torch.long)
        self.decode_mask = torch.zeros(1, 1, 1, context, device="cuda", dtype=torch.bool)
        self.tokens = torch.zeros(batch, args.new_tokens, device="cuda", dtype=torch.long)
        self.prefill_graph = self.decode_graph = None

    def _logits(self, ids, positions, mask):
        args = (ids, positions, self.keys, self.values, mask)
        if self.weights is None:
            return self.model(*args)
        return functional_call(self.model, self.weights, args)

    def _prefill(self) -> None:
        logits = self._logits(self.prompt, self.prefill_positions, self.prefill_mask)
        token = logits[:, -1].argmax(-1)
        self.ids.copy_(token.unsqueeze(1))
        self.tokens[:, 0].copy_(token)
        self.position.fill_(self.prompt_len)
        self.decode_mask.copy_((self.columns <= self.position).view(self.decode_mask.shape))

    def _decode(self) -> None:
        logits = self._logits(self.ids, self.position, self.decode_mask)
        token = logits[:, -1].argmax(-1, keepdim=True)
        self.ids.copy_(token)
        self.tokens.index_copy_(1, self.position - (self.prompt_len - 1), token)
        self.position.add_(1)
        self.decode_mask.copy_((self.columns <= self.position).view(self.decode_mask.shape))

    def capture(self, warm_up: bool = True) -> float:
        """Warm up (the first time: cuBLAS and the allocator need an eager run), then capture
        the prefill and the decode step; returns the seconds taken."""
        start = time.perf_counter()
        with torch.no_grad():
            if warm_up:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._prefill()
                        self._decode()
                torch.cuda.current_stream().wait_stream(side)
            self.prefill_graph = self._new_graph()
            with torch.cuda.graph(self.prefill_graph):
                self._prefill()
            self.decode_graph = self._new_graph()
            with torch.cuda.graph(self.decode_graph):
                self._decode()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def _new_graph(self):
        if self.tags:
            return stablebuf.CUDAGraph(tags=self.tags)
        return torch.cuda.CUDAGraph()

    def generate(self, prompt: torch.Tensor) -> torch.Tensor:
        """Greedy tokens for ``prompt`` by the graphs (a view of the static token buffer)."""
        self.prompt.copy_(prompt)
        self.prefill_graph.replay()
        for _ in range(self.new_tokens - 1):
            self.decode_graph.replay()
        return self.tokens

    def generate_eager(self, prompt: torch.Tensor) -> torch.Tensor:
        """The same, without graphs: the reference."""
        self.prompt.copy_(prompt)
        with torch.no_grad():
            self._prefill()
            for _ in range(self.new_tokens - 1):
                self._decode()
        return self.tokens.clone()


@dataclass
class Result:
    name: str
    seconds: float
    requests: int
    new_tokens: int
    wrong: int

    @property
    def per_token_us(self) -> float:
        return self.seconds / (self.requests * self.new_tokens) * 1e6

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def serve(
    name: str,
    requests: List[tuple],
    handle: Callable[[int, torch.Tensor], torch.Tensor],
    references: Dict[tuple, torch.Tensor],
    new_tokens: int,
    warmup: int = 2,
) -> Result:
    """Serves ``requests`` (index, fine-tune, prompt) with ``handle``; checks every answer."""
    for index, finetune, prompt in requests[:warmup]:
        handle(finetune, prompt)
    torch.cuda.synchronize()
    answers = []
    start = time.perf_counter()
    for index, finetune, prompt in requests:
        answers.append((index, finetune, handle(finetune, prompt).clone()))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    wrong = 0
    for index, finetune, tokens in answers:
        if not torch.equal(tokens, references[(index, finetune)]):
            wrong += 1
    print(f"  {name}: {len(requests)} requests served, {wrong} with tokens unlike eager")
    return Result(name, seconds, len(requests), new_tokens, wrong)


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("serve_finetunes: no CUDA device")
        return 2
    if args.new_tokens < 2 or args.finetunes < 2:
        print("serve_finetunes: needs --new-tokens >= 2 and --finetunes >= 2")
        return 2
    device_name = torch.cuda.get_device_name()
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    torch.manual_seed(args.seed)
    shape = Shape(
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        heads=args.heads,
        context=args.prompt + args.new_tokens,
    )
    n = args.finetunes

    t0 = time.perf_counter()
    model = build(shape, TAG)
    params = [p for _, p in model.named_parameters()]
    names = [name for name, _ in model.named_parameters()]
    weight_bytes = sum(p.nbytes for p in params)
    states = finetune_states(model, n, generator)
    weight_sets = [stablebuf.snapshot(TAG) for _ in range(n)]
    for weight_set, state in zip(weight_sets, states):
        with stablebuf.writing(weight_set):
            torch._foreach_copy_(params, [state[name] for name in names])
    torch.cuda.synchronize()
    stablebuf.bind(TAG, weight_sets[0])  # the build's own backing goes
    print(
        f"serve_finetunes on {device_name}: Llama-shaped, {args.layers} layers, hidden "
        f"{args.hidden}, {sum(p.numel() for p in params) / 1e9:.2f} B parameters, "
        f"{weight_bytes / GiB:.2f} GiB of bf16 weights per fine-tune, {n} fine-tunes resident "
        f"as weight sets (built in {time.perf_counter() - t0:.1f} s)"
    )
    if weight_bytes < GiB:
        print("serve_finetunes: warning: under 1 GiB of weights; the targets need >= 1 GiB")

    rng = random.Random(args.seed)
    requests = []
    for index in range(args.requests):
        prompt = torch.randint(
            0, args.vocab, (args.batch, args.prompt), device="cuda", generator=generator
        )
        requests.append((index, rng.randrange(n), prompt))

    server = Server(model, shape, args, tags=[TAG])
    capture_seconds = server.capture()

    # References: eager runs of the region's model with the request's fine-tune bound (and
    # with fine-tune 0, for the single-fine-tune floor).
    references: Dict[tuple, torch.Tensor] = {}
    for index, finetune, prompt in requests:
        for k in {finetune, 0}:
            stablebuf.bind(TAG, weight_sets[k])
            references[(index, k)] = server.generate_eager(prompt)
    distinct = len({tuple(t.flatten().tolist()) for t in references.values()})
    print(f"  {len(references)} eager references, {distinct} distinct token sequences")

    results = []
    stablebuf.bind(TAG, weight_sets[0])
    single_requests = [(index, 0, prompt) for index, _, prompt in requests]
    results.append(
        serve("single fine-tune (floor)", single_requests, lambda k, p: server.generate(p),
              references, args.new_tokens)
    )

    def with_bind(k, prompt):
        stablebuf.bind(TAG, weight_sets[k])
        return server.generate(prompt)

    results.append(serve("stablebuf bind", requests, with_bind, references, args.new_tokens))

    # Copy-in: one static model outside any region, the fine-tune copied into its parameters.
    static_model = build(shape)
    static_params = [p for _, p in static_model.named_parameters()]
    static_server = Server(static_model, shape, args)
    static_server.capture()
    device_sources = [[state[name] for name in names] for state in states]

    def copy_from_device(k, prompt):
        torch._foreach_copy_(static_params, device_sources[k])
        return static_server.generate(prompt)

    results.append(
        serve("copy-in (device)", requests, copy_from_device, references, args.new_tokens)
    )
    host_sources = [[t.to("cpu").pin_memory() for t in source] for source in device_sources]

    def copy_from_host(k, prompt):
        torch._foreach_copy_(static_params, host_sources[k], non_blocking=True)
        return static_server.generate(prompt)

    results.append(
        serve("copy-in (pinned host)", requests, copy_from_host, references, args.new_tokens)
    )
    del host_sources

    # One instance per fine-tune: N models, N caches, N pairs of graphs.
    before = torch.cuda.memory_allocated()
    instances = []
    for state in states:
        instance = build(shape)
        torch._foreach_copy_(
            [p for _, p in instance.named_parameters()], [state[name] for name in names]
        )
        instance_server = Server(instance, shape, args)
        instance_server.capture()
        instances.append(instance_server)
    per_instance = (torch.cuda.memory_allocated() - before) / n
    results.append(
        serve(
            "one instance per fine-tune",
            requests,
            lambda k, prompt: instances[k].generate(prompt),
            references,
            args.new_tokens,
        )
    )
    del instances

    # Re-capture: new graphs per request over the fine-tune's own tensors.
    recapture_server = Server(static_model, shape, args, weights=states[0])
    recapture_server.capture()

    def recapture(k, prompt):
        recapture_server.weights = states[k]
        recapture_server.capture(warm_up=False)
        return recapture_server.generate(prompt)

    results.append(
        serve(
            "re-capture per request",
            requests[: args.recapture_requests],
            recapture,
            references,
            args.new_tokens,
            warmup=1,
        )
    )

    floor, swapped = results[0], results[1]
    print()
    print(
        f"serve_finetunes: {n} fine-tunes x {weight_bytes / GiB:.2f} GiB bf16, batch "
        f"{args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, greedy, "
        f"{device_name}"
    )
    print("| method | requests/s | tokens/s | per-token latency (µs) | vs stablebuf (requests/s) |")
    print("| --- | --- | --- | --- | --- |")
    for result in results:
        print(
            f"| {result.name} | {result.requests_per_s:.1f} | "
            f"{result.requests_per_s * result.new_tokens * args.batch:.0f} | "
            f"{result.per_token_us:.1f} | "
            f"{swapped.requests_per_s / result.requests_per_s:.2f}x |"
        )
    print(f"(first capture of prefill + decode: {capture_seconds * 1e3:.1f} ms)")

    # Memory: what N fine-tunes cost on the GPU each way, and how many fit beside one server.
    total = torch.cuda.get_device_properties(0).total_memory
    server_bytes = (server.keys.nbytes + server.values.nbytes)
    rows = [
        ("stablebuf weight sets", n * weight_bytes, weight_bytes, server_bytes),
        ("copy-in (device)", (n + 1) * weight_bytes, weight_bytes, weight_bytes + server_bytes),
        ("copy-in (pinned host)", weight_bytes, 0, weight_bytes + server_bytes),
        ("one instance per fine-tune", n * per_instance, per_instance, 0),
        ("re-capture", (n + 1) * weight_bytes, weight_bytes, weight_bytes + server_bytes),
    ]
    print()
    print(f"| method | GPU bytes for {n} fine-tunes | per extra fine-tune | fine-tunes that fit in {total / GiB:.0f} GiB |")
    print("| --- | --- | --- | --- |")
    for name, used, per, fixed in rows:
        fits = "limited by host memory" if per == 0 else str(int((0.9 * total - fixed) // per))
        print(f"| {name} | {used / GiB:.1f} GiB | {per / GiB:.2f} GiB | {fits} |")

    latency = swapped.per_token_us / floor.per_token_us
    print(
        f"serve_finetunes: target per-token latency <= 1.05x the single fine-tune: "
        f"{'met' if latency <= 1.05 else 'NOT met'} ({latency:.3f}x)"
    )
    device_copy, host_copy = results[2], results[3]
    for copy in (device_copy, host_copy):
        speedup = swapped.requests_per_s / copy.requests_per_s
        print(
            f"serve_finetunes: target >= 2x the requests/s of {copy.name}: "
            f"{'met' if speedup >= 2.0 else 'NOT met'} ({speedup:.2f}x)"
        )
    print(
        "serve_finetunes: bound: a device copy of W bytes costs about 2W/bandwidth, a decode "
        f"step about W/bandwidth, so with {args.new_tokens} tokens per request no swap can beat "
        f"copy-in from device memory by more than about 1 + 2/{args.new_tokens} = "
        f"{1 + 2 / args.new_tokens:.2f}x; the 2x holds where the fine-tunes cannot all sit on "
        "the GPU as copy sources (pinned host)"
    )
    wrong = sum(result.wrong for result in results)
    if wrong:
        print(f"serve_finetunes: WRONG TOKENS in {wrong} requests")
        return 1
    checked = sum(result.requests for result in results)
    print(f"serve_finetunes: all {checked} requests gave the eager tokens of their fine-tune")
    return 0


if __name__ == "__main__":
    sys.exit(main())
