"""Continuous batching over a KV cache on stable addresses (issue 45, item 3).

A Llama-shaped model from transformers with random weights serves requests of random prompt
and output lengths that arrive and leave. Side by side, in one run:

  stable   stablebuf.KvCache views, max_batch B: decode steps replay ONE CUDA graph; between
           replays the host grows the rows that crossed into a new granule and releases the
           rows of finished requests.
  static   transformers StaticCache at the same B and max_len (its per-layer tensors, early
           initialised), the same graph.
  dynamic  eager, no graph: per layer K/V tensors that follow the longest running sequence by
           torch.cat each step (what DynamicCache does; DynamicCache itself writes one column
           for the whole batch, which continuous batching of rows at different positions cannot
           use, so its growth policy is reproduced here on [B, T, kv_heads, head_dim] tensors).
  budget   stablebuf.KvCache with 4 B slots, admitting requests while the cache's projected
           memory stays within the memory of the StaticCache of B sequences.

All share one decode step (own attention over the Llama modules' weights, SDPA with a
length mask over max_len, GQA): the caches differ only in where K/V live. Prints tokens/s,
step time, peak device memory, sequences served at the budget, and one verdict line per target:

  step time <= 1.03 x StaticCache at the same batch (median decode step, stable vs static)
  cache memory <= the tokens' bytes + one granule per (sequence, layer, K/V) (every step)
  no step slower than 1.1 x the median because of a map (steps that mapped a granule)
  at the memory of a StaticCache of B sequences, >= 2 B sequences served at once when the
  mean length <= max_len / 3

    python python/examples/kv_serve.py [--max-batch 16] [--max-len 4096] [--requests 256]
"""

from __future__ import annotations

import argparse
import time
from statistics import median
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import stablebuf._native as native
from stablebuf import _kv_logic as logic
from stablebuf.hf import kv_tensors

try:
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
except ImportError as error:  # pragma: no cover
    raise SystemExit(f"kv_serve needs transformers: {error}")


def build_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.heads * args.head_dim,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_len,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    return model


class Step:
    """The decode step over K/V buffers `kv[layer] = (K, V)` of `[rows, max_len, kv_heads, D]`
    (token-major; rows >= batch: row `batch` may be the scratch row free slots write to)."""

    def __init__(self, model, kv: List[Tuple[torch.Tensor, torch.Tensor]], batch: int, max_len: int):
        self.m = model
        self.kv = kv
        self.batch = batch
        cfg = model.config
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dev = "cuda"
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.widx = torch.arange(batch, dtype=torch.long, device=dev)  # row each slot writes
        self.arange = torch.arange(max_len, device=dev)
        self.host_lengths = torch.zeros(batch, dtype=torch.int32, pin_memory=True)
        self.host_widx = torch.arange(batch, dtype=torch.long).pin_memory()

    def __call__(self) -> torch.Tensor:
        m, b = self.m, self.batch
        pos = (self.lengths.long() - 1).clamp(min=0)
        x = m.model.embed_tokens(self.tokens[:, None])
        cos, sin = m.model.rotary_emb(x, pos[:, None])
        mask = (self.arange[None, :] < self.lengths[:, None]) | (self.arange[None, :] == 0)
        mask = mask[:, None, None, :]
        for i, layer in enumerate(m.model.layers):
            h = layer.input_layernorm(x)
            a = layer.self_attn
            q = a.q_proj(h).view(b, 1, self.nh, self.d).transpose(1, 2)
            k = a.k_proj(h).view(b, 1, self.nkv, self.d).transpose(1, 2)
            v = a.v_proj(h).view(b, 1, self.nkv, self.d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = self.kv[i]
            keys.index_put_((self.widx, pos), k[:, :, 0, :])
            values.index_put_((self.widx, pos), v[:, :, 0, :])
            kk = keys[:b].permute(0, 2, 1, 3)
            vv = values[:b].permute(0, 2, 1, 3)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, 1, self.nh * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = m.lm_head(m.model.norm(x))[:, 0]
        nxt = logits.argmax(-1)
        self.tokens.copy_(nxt)
        return nxt

    def prefill(self, slot: int, prompt: torch.Tensor) -> None:
        """Eager prefill of one request into row `slot` (its rows must hold len(prompt))."""
        m = self.m
        n = prompt.numel()
        pos = torch.arange(n, device="cuda")[None]
        x = m.model.embed_tokens(prompt[None])
        cos, sin = m.model.rotary_emb(x, pos)
        for i, layer in enumerate(m.model.layers):
            h = layer.input_layernorm(x)
            a = layer.self_attn
            q = a.q_proj(h).view(1, n, self.nh, self.d).transpose(1, 2)
            k = a.k_proj(h).view(1, n, self.nkv, self.d).transpose(1, 2)
            v = a.v_proj(h).view(1, n, self.nkv, self.d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = self.kv[i]
            keys[slot, :n].copy_(k[0].transpose(0, 1))
            values[slot, :n].copy_(v[0].transpose(0, 1))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, n, self.nh * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = m.lm_head(m.model.norm(x[:, -1:]))[0, 0]
        self.tokens[slot] = logits.argmax(-1)

    def publish(self, lengths: List[int], widx: List[int]) -> None:
        self.host_lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
        self.host_widx.copy_(torch.tensor(widx, dtype=torch.long))
        self.lengths.copy_(self.host_lengths, non_blocking=True)
        self.widx.copy_(self.host_widx, non_blocking=True)


def capture(step: Step) -> Callable[[], None]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


class Backend:
    """Where K/V live and what the host does around each step."""

    name = ""
    slots = 0

    def kv(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def admit(self, slot: int, tokens: int) -> None:
        pass

    def grow(self, grown: List[Tuple[int, int]]) -> bool:
        return False

    def release(self, slot: int) -> None:
        pass

    def scratch_row(self) -> Optional[int]:
        return None

    def cache_bytes(self) -> int:
        return 0

    def before_step(self, step: Step, lengths: List[int]) -> None:
        pass


class Stable(Backend):
    def __init__(self, cfg, slots: int, max_len: int):
        self.name = "stable"
        self.slots = slots
        layers, nkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        # One more row than slots: free slots write their (masked, unused) token there.
        self.cache = native.KvCache(torch.cuda.current_device(), layers, slots + 1, max_len, nkv, d)
        self.cache.grow(slots, 1)
        self.tpg = self.cache.tokens_per_granule
        self.backed: Dict[int, int] = {}
        self.views = [kv_tensors(self.cache, i) for i in range(layers)]

    def kv(self):
        return self.views

    def scratch_row(self):
        return self.slots

    def admit(self, slot, tokens):
        self.cache.grow(slot, tokens)
        self.backed[slot] = -(-tokens // self.tpg)

    def grow(self, grown):
        mapped = False
        for slot, length in grown:
            need = -(-length // self.tpg)
            if need > self.backed.get(slot, 0):
                mapped = True
                self.backed[slot] = need
        self.cache.grow_many(grown)
        return mapped

    def release(self, slot):
        self.cache.release(slot)
        self.backed.pop(slot, None)

    def cache_bytes(self):
        return int(self.cache.stats()["bytes"])


class Static(Backend):
    def __init__(self, model, slots: int, max_len: int):
        self.name = "static"
        self.slots = slots
        cfg = model.config
        cache = StaticCache(config=cfg, max_cache_len=max_len)
        cache.early_initialization(slots, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, torch.device("cuda"))
        self.cache = cache
        self.views = [(layer.keys.permute(0, 2, 1, 3), layer.values.permute(0, 2, 1, 3)) for layer in cache.layers]
        self.bytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.views)

    def kv(self):
        return self.views

    def cache_bytes(self):
        return self.bytes


class Dynamic(Backend):
    """Eager; K/V follow the longest running sequence (torch.cat of new columns per step)."""

    def __init__(self, cfg, slots: int):
        self.name = "dynamic"
        self.slots = slots
        self.layers, self.nkv, self.d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.views = [self._empty(1) for _ in range(self.layers)]
        self.lengths: Dict[int, int] = {}

    def _empty(self, t):
        z = torch.zeros(self.slots, t, self.nkv, self.d, dtype=torch.bfloat16, device="cuda")
        return z, torch.zeros_like(z)

    def kv(self):
        return self.views

    def _fit(self, need: int) -> None:
        have = self.views[0][0].shape[1]
        if need > have:
            extra = need - have
            self.views[:] = [
                (torch.cat([k, self._empty(extra)[0]], 1), torch.cat([v, self._empty(extra)[1]], 1))
                for k, v in self.views
            ]
        elif need < have:
            self.views[:] = [(k[:, :need].clone(), v[:, :need].clone()) for k, v in self.views]

    def admit(self, slot, tokens):
        self.lengths[slot] = tokens
        self._fit(max(self.lengths.values()))

    def grow(self, grown):
        for slot, length in grown:
            self.lengths[slot] = length
        self._fit(max(self.lengths.values(), default=1))
        return False

    def release(self, slot):
        self.lengths.pop(slot, None)

    def cache_bytes(self):
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.views)


def serve(model, backend: Backend, requests, args, budget: Optional[int] = None, graph: bool = True) -> dict:
    cfg = model.config
    max_len = args.max_len
    token_bytes = cfg.num_key_value_heads * cfg.head_dim * 2
    rows = backend.kv()
    step = Step(model, rows, backend.slots, max_len)
    if backend.scratch_row() is not None:
        step.publish([0] * backend.slots, [backend.scratch_row()] * backend.slots)
    replay = capture(step) if graph else step
    sched = logic.Scheduler(backend.slots, list(requests))
    gen = torch.Generator().manual_seed(args.seed)
    projected: Dict[int, int] = {}
    step_times: List[float] = []
    mapped_flags: List[bool] = []
    bound_ok = True
    peak_cache = 0
    generated = 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()

    def accept(request, slot):
        if budget is None:
            return True
        held = sum(projected.values())
        return logic.fits(held, request.total, budget, cfg.num_hidden_layers, token_bytes)

    while not sched.idle and sched.step < args.max_steps:
        for slot, request in sched.admit(accept):
            projected[slot] = 2 * cfg.num_hidden_layers * logic.granules_for(request.total, token_bytes) * logic.GRANULE
            backend.admit(slot, request.prompt)
            prompt = torch.randint(0, cfg.vocab_size, (request.prompt,), generator=gen).cuda()
            if isinstance(backend, Dynamic):
                step.kv = backend.kv()
            step.prefill(slot, prompt)
        if not sched.slots:
            sched.finish([])
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        grown, finished = sched.advance()
        mapped = backend.grow(grown)
        lengths = sched.lengths()
        scratch = backend.scratch_row()
        widx = [s if (lengths[s] > 0 or scratch is None) else scratch for s in range(backend.slots)]
        step.publish(lengths, widx)
        if isinstance(backend, Dynamic):
            step.kv = backend.kv()
            step.arange = torch.arange(backend.kv()[0][0].shape[1], device="cuda")
        replay()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        mapped_flags.append(mapped)
        generated += len(grown)
        cache = backend.cache_bytes()
        peak_cache = max(peak_cache, cache)
        if isinstance(backend, Stable):
            s = backend.cache.stats()
            data = s["physical_granules"] * s["granule"]
            bound = logic.memory_bound(lengths, cfg.num_hidden_layers, token_bytes)
            # The scratch row's granules are fixed overhead like the zero granule: not counted.
            scratch_bytes = 2 * cfg.num_hidden_layers * s["granule"]
            bound_ok &= data - scratch_bytes <= bound
        for slot in finished:
            backend.release(slot)
            projected.pop(slot, None)
        sched.finish(finished)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    mid, spike = logic.map_spike(step_times, mapped_flags)
    return {
        "name": backend.name,
        "slots": backend.slots,
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "median_step_ms": mid * 1e3,
        "p99_step_ms": (sorted(step_times)[int(0.99 * (len(step_times) - 1))] * 1e3) if step_times else 0.0,
        "map_spike_ms": None if spike is None else spike * 1e3,
        "map_steps": sum(mapped_flags),
        "steps": len(step_times),
        "served": len(sched.done),
        "peak_running": sched.peak_running,
        "peak_torch_bytes": torch.cuda.max_memory_allocated(),
        "peak_cache_bytes": peak_cache,
        "bound_ok": bound_ok,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--mean-len", type=int, default=0, help="mean prompt+output tokens (default max_len/4)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--budget-slots", type=int, default=4, help="KvCache slots per StaticCache slot at the budget")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--skip-dynamic", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_serve needs a CUDA GPU")
    b, max_len = args.max_batch, args.max_len
    mean = args.mean_len or max_len // 4
    model = build_model(args)
    cfg = model.config
    token_bytes = cfg.num_key_value_heads * cfg.head_dim * 2
    mean_out = max(1, mean // 2)
    requests = logic.make_requests(args.requests, max_len, mean, arrivals_per_step=b / mean_out, seed=args.seed)
    budget = logic.static_bytes(cfg.num_hidden_layers, b, max_len, token_bytes)
    budget_requests = logic.make_requests(
        args.requests, max_len, mean, arrivals_per_step=args.budget_slots * b / mean_out, seed=args.seed + 1
    )

    runs = []
    with torch.inference_mode():
        runs.append(serve(model, Static(model, b, max_len), requests, args))
        torch.cuda.empty_cache()
        runs.append(serve(model, Stable(cfg, b, max_len), requests, args))
        if not args.skip_dynamic:
            runs.append(serve(model, Dynamic(cfg, b), requests, args, graph=False))
        torch.cuda.empty_cache()
        runs.append(
            serve(model, Stable(cfg, args.budget_slots * b, max_len), budget_requests, args, budget=budget)
        )
        runs[-1]["name"] = "stable@budget"

    print(f"model: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV x "
          f"{cfg.head_dim}, bf16; max_batch {b}, max_len {max_len}, mean length {mean}; "
          f"budget = StaticCache({b}) = {budget / 2**30:.2f} GiB; device {torch.cuda.get_device_name()}")
    head = f"{'cache':14} {'slots':>5} {'tok/s':>9} {'step ms':>8} {'p99 ms':>8} {'map ms':>8} {'served':>6} {'peak run':>8} {'torch GiB':>9} {'cache GiB':>9}"
    print(head)
    for r in runs:
        spike = "-" if r["map_spike_ms"] is None else f"{r['map_spike_ms']:.3f}"
        print(f"{r['name']:14} {r['slots']:5d} {r['tokens_per_s']:9.0f} {r['median_step_ms']:8.3f} {r['p99_step_ms']:8.3f} "
              f"{spike:>8} {r['served']:6d} {r['peak_running']:8d} {r['peak_torch_bytes'] / 2**30:9.2f} {r['peak_cache_bytes'] / 2**30:9.2f}")

    static, stable, at_budget = runs[0], runs[1], runs[-1]
    ratio = stable["median_step_ms"] / static["median_step_ms"] if static["median_step_ms"] else float("inf")
    print(logic.verdict("step time <= 1.03 x StaticCache", ratio <= 1.03,
                        f"stable {stable['median_step_ms']:.3f} ms / static {static['median_step_ms']:.3f} ms = {ratio:.3f}"))
    print(logic.verdict("cache memory <= tokens + 1 granule per (seq, layer, K/V)", stable["bound_ok"] and at_budget["bound_ok"],
                        "checked after every step of both stable runs (zero, lengths and scratch granules apart)"))
    spike = stable["map_spike_ms"]
    print(logic.verdict("no map step > 1.1 x median", None if spike is None else spike <= 1.1 * stable["median_step_ms"],
                        "no step mapped" if spike is None else
                        f"slowest of {stable['map_steps']} mapping steps {spike:.3f} ms, median {stable['median_step_ms']:.3f} ms"))
    print(logic.verdict(f">= 2 x {b} sequences at StaticCache({b})'s memory", at_budget["peak_running"] >= 2 * b,
                        f"{at_budget['peak_running']} running at once (mean length {mean} <= max_len/3 = {max_len // 3}), "
                        f"peak cache {at_budget['peak_cache_bytes'] / 2**30:.2f} GiB of {budget / 2**30:.2f}"))


if __name__ == "__main__":
    main()
