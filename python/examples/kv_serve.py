"""Continuous batching over a KV cache on stable addresses (issue 45, item 3).

A Llama-shaped model from transformers with random weights serves requests of random prompt
and output lengths that arrive and leave. Side by side, in one run:

  static   transformers StaticCache at B slots and max_len (its per-layer tensors, early
           initialised, [B, kv_heads, max_len, head_dim] contiguous), one CUDA graph per step.
  stable   stablebuf.KvCache views at B slots ([B, max_len, kv_heads, head_dim] token-major
           rows, seen by attention as a permuted [B, kv_heads, max_len, head_dim]), the same
           graph plus one event-record node per layer (the cache's mark that the step is done
           with the layer). While a replay runs, the host waits for each layer's mark and then
           maps that layer's granule for the rows whose next token opens one, and unmaps the
           rows of requests that just finished (`KvCache.change_behind`): the map calls
           overlap the replay's later layers. The later layers' marks leave only the step's
           tail, so the step waits at a gate before each of its last --gates layers (default
           half of them; a wait node in the graph) and the cache's worker remaps those layers
           once the step in flight is done with each, while the next step runs the layers
           before the first gate (--maps behind: every layer remapped behind the step by the
           host; --maps between: all of it between replays). While a step that changes
           nothing runs, the host zeroes one free granule ahead for the gated layers
           (`KvCache.zero_ahead`), so a row opening a granule there takes one as it is; those
           steps count as mapping steps.
  budget   stablebuf.KvCache with 4 B slots, admitting a request while the granules of every
           admitted sequence at its full length fit the memory of StaticCache(B).
  dynamic  (--dynamic) eager, no graph: per layer K/V tensors that follow the longest running
           sequence by torch.cat each step (DynamicCache's growth policy; DynamicCache itself
           writes one column for the whole batch, which rows at different positions cannot
           use). Its per-step copy of the whole cache is that policy's cost: no verdict uses it.

All share one decode step (own attention over the Llama modules' weights, SDPA with a length
mask over max_len; GQA as a batch of kv_heads groups of heads/kv_heads queries by default, or
`enable_gqa` with --attention gqa): the caches differ only in where K/V live. Before serving,
an attention probe times SDPA alone on the two layouts (plain torch memory) for every kernel
that accepts them and says which kernel torch picks for each.

What is timed (each decode step):
  step ms  device time of the step's graph replay (CUDA events around replay; nothing else):
           the verdict "step time <= 1.03 x StaticCache" compares these medians.
  wall ms  host wall time of the whole step: scheduler, publishing lengths and write rows,
           replay, the maps and releases behind it, synchronize. Reported, and
           compared to StaticCache's too; the map-step verdict uses it (a map costs host time).
  host us  the host part of it before the replay is launched.
  tok/s    decoded tokens / the summed wall time of the decode steps (prefill excluded);
  run s    the backend's whole run, eager prefills included.

Verdicts (the issue's targets):
  step time <= 1.03 x StaticCache at the same batch (median step ms; also median wall ms)
  cache memory <= the tokens' bytes + one granule per (sequence, layer, K/V) (every step)
  no step slower than 1.1 x the median because of a map (wall ms): a step the map touched
           (it mapped, or ran under a gate the step before closed) is charged where the map
           was on its path: it mapped before its replay, its maps behind outlasted the replay,
           or the replay itself ran over 1.1 x the median replay (a gate's wait, or an unmap
           slowing the GPU). The slowest touched step and the steps no map touched (for
           static too) are printed beside it: the host's own noise at the 1.1 x level.
  at the memory of a StaticCache of B sequences, >= 2 B sequences served at once when the
  mean length <= max_len / 3 (and the data mapped stays within that memory)

Sizes: --size quick (default: B 8, max_len 4096, 4 layers, 48 requests; about a minute on one
H100) or --size issue (the issue's table: B 16, max_len 4096, 8 layers, 256 requests; several
minutes); any flag below overrides the size's value.

    python -u python/examples/kv_serve.py                   # quick
    python -u python/examples/kv_serve.py --size issue      # the issue's table
"""

from __future__ import annotations

import argparse
import contextlib
import time

if __name__ == "__main__":
    print("kv_serve: importing torch and transformers", flush=True)
from statistics import median
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import stablebuf._native as native
from stablebuf import _kv_logic as logic
from stablebuf.hf import kv_tensors

try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
except ImportError as error:  # pragma: no cover
    raise SystemExit(f"kv_serve needs transformers: {error}")

_START = time.perf_counter()


def log(message: str) -> None:
    """One line now (flushed), with the seconds since the start."""
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", flush=True)


# ---- attention ------------------------------------------------------------------------------

_SDPA_NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def sdpa_context(name: str):
    """`auto`: torch's choice; else only that SDPA backend (for the capture and the probe)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]
    return sdpa_kernel([backend])


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Decode attention of `q [B, heads, 1, D]` over `keys`/`values [B, kv_heads, L, D]` (any
    strides) under `mask [B, 1, 1, L]`; returns `[B, 1, heads * D]`.

    grouped: query head h reads KV head h // (heads / kv_heads) (transformers' repeat_kv), so
    the heads sharing a KV head are that head's queries: `[B, kv_heads, heads / kv_heads, D]`,
    no K/V copies and no `enable_gqa` (which some SDPA kernels refuse, falling back to math,
    which copies K/V heads / kv_heads times). Else `enable_gqa=True`."""
    b, nh, _, d = q.shape
    nkv = keys.shape[1]
    if grouped:
        o = F.scaled_dot_product_attention(q.reshape(b, nkv, nh // nkv, d), keys, values, attn_mask=mask)
        return o.reshape(b, 1, nh * d)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(b, 1, nh * d)


def sdpa_pick(q, keys, values, mask, grouped: bool) -> str:
    """The SDPA kernel torch picks for these inputs (`torch._fused_sdp_choice`), or `?`."""
    b, nh, _, d = q.shape
    if grouped:
        q = q.reshape(b, keys.shape[1], nh // keys.shape[1], d)
    try:
        code = torch._fused_sdp_choice(q, keys, values, mask, 0.0, False, enable_gqa=not grouped)
    except Exception:  # noqa: BLE001 - a private op: report, never fail
        return "?"
    return _SDPA_NAMES.get(int(code), str(int(code)))


def gpu_ms(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def attention_probe(cfg, batch: int, max_len: int, grouped: bool) -> Dict[str, str]:
    """SDPA alone over one layer's K/V in StaticCache's layout and in the KvCache's (plain
    torch memory of the same shape and strides, all of it real: no zero granule), for every
    kernel that accepts them. Returns torch's pick per layout."""
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, nh, 1, d, device=dev, dtype=bf16, generator=gen)
    lengths = torch.randint(1, max_len + 1, (batch,), device=dev, generator=gen)
    ar = torch.arange(max_len, device=dev)
    mask = ((ar[None, :] < lengths[:, None]) | (ar[None, :] == 0))[:, None, None, :]
    static_k = torch.randn(batch, nkv, max_len, d, device=dev, dtype=bf16, generator=gen)
    static_v = torch.randn(batch, nkv, max_len, d, device=dev, dtype=bf16, generator=gen)
    row = logic.row_stride(max_len, nkv * d * 2) // 2  # the KvCache's row stride, in elements
    layouts = {"static": (static_k, static_v)}
    token_major = []
    for src in (static_k, static_v):
        t = torch.empty_strided((batch, max_len, nkv, d), (row, nkv * d, d, 1), device=dev, dtype=bf16)
        t.copy_(src.permute(0, 2, 1, 3))
        token_major.append(t.permute(0, 2, 1, 3))
    layouts["stable"] = tuple(token_major)
    reference = attend(q, static_k, static_v, mask, grouped=False).float()
    picks = {}
    for name, (k, v) in layouts.items():
        picks[name] = sdpa_pick(q, k, v, mask, grouped)
        cells = []
        for kernel in ("auto", "flash", "efficient", "cudnn", "math"):
            try:
                with sdpa_context(kernel):
                    err = (attend(q, k, v, mask, grouped).float() - reference).abs().max().item()
                    ms = gpu_ms(lambda: attend(q, k, v, mask, grouped))
                cells.append(f"{kernel} {ms:.3f} ms (err {err:.0e})")
            except RuntimeError:
                cells.append(f"{kernel} -")
        strides = tuple(k.stride())
        log(f"attention probe {name:6} K {list(k.shape)} strides {strides}: torch picks {picks[name]}; " + ", ".join(cells))
    return picks


# ---- the model and its decode step ------------------------------------------------------------


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
    # Built on the GPU: random initialisation of ~0.5 G parameters on the host takes seconds.
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    return model.to(dtype=torch.bfloat16).eval()


class Step:
    """The decode step over K/V buffers `kv[layer] = (K, V)` of `[rows, max_len, kv_heads, D]`
    (token-major; rows >= batch: row `batch` may be the scratch row free slots write to)."""

    def __init__(self, model, kv: List[Tuple[torch.Tensor, torch.Tensor]], batch: int, max_len: int, grouped: bool,
                 layer_done: Optional[Callable[[int], None]] = None,
                 layer_start: Optional[Callable[[int], None]] = None):
        self.m = model
        # Called after each layer's attention (also while captured): the backend marks there
        # that the step is done with the layer's K and V.
        self.layer_done = layer_done
        # Called before each layer's K and V are written (also while captured): the backend
        # may make the step wait there for a remap behind the previous step (its gate).
        self.layer_start = layer_start
        self.kv = kv
        self.batch = batch
        self.grouped = grouped
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
            if self.layer_start is not None:
                self.layer_start(i)
            keys.index_put_((self.widx, pos), k[:, :, 0, :])
            values.index_put_((self.widx, pos), v[:, :, 0, :])
            kk = keys[:b].permute(0, 2, 1, 3)
            vv = values[:b].permute(0, 2, 1, 3)
            x = x + a.o_proj(attend(q, kk, vv, mask, self.grouped))
            if self.layer_done is not None:
                self.layer_done(i)
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


# ---- where K/V live ---------------------------------------------------------------------------


class Backend:
    """Where K/V live and what the host does around each step."""

    name = ""
    slots = 0

    def kv(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def admit(self, slot: int, tokens: int) -> None:
        pass

    def grow(self, grown: List[Tuple[int, int]]) -> bool:
        """Before the step that writes each `(slot, length)`'s token `length - 1`; True when
        it mapped memory."""
        return False

    def layer_done(self) -> Optional[Callable[[int], None]]:
        """What the step calls after each layer's attention (None: nothing)."""
        return None

    def layer_start(self) -> Optional[Callable[[int], None]]:
        """What the step calls before each layer's K and V are written (None: nothing)."""
        return None

    def behind(self, upcoming: List[Tuple[int, int]], finished: List[int]) -> bool:
        """While the step just launched runs: make room for the next step's `(slot, length)`
        and give back the finished slots; True when it mapped memory. Slots it released need
        no `release` after the step."""
        return False

    def release(self, slot: int) -> None:
        pass

    def scratch_row(self) -> Optional[int]:
        return None

    def cache_bytes(self) -> int:
        return 0


class Stable(Backend):
    def __init__(self, cfg, slots: int, max_len: int, maps: str = "behind", warm: int = 1, gates: int = 1):
        self.name = "stable"
        self.slots = slots
        self.maps = maps
        self.gates = gates
        layers, nkv, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.layers = layers
        # One more row than slots: free slots write their (masked, unused) token there.
        self.cache = native.KvCache(torch.cuda.current_device(), layers, slots + 1, max_len, nkv, d)
        self.cache.grow(slots, 1)
        # A server's start: one granule per layer's K and V made ahead, in the free list, so
        # the first row that opens a granule takes it there instead of from cuMemCreate (the
        # memory a release keeps does the same for every later one).
        if warm:
            self.cache.grow(0, self.cache.tokens_per_granule * warm)
            self.cache.release(0)
        self.token_bytes = self.cache.token_bytes
        self.granule = self.cache.granule
        self.backed: Dict[int, int] = {}  # granules mapped per row (ahead_tokens is 0)
        # Zeroed free granules as of the last zero_ahead (a change behind may take some).
        # A server's start makes the gated layers' first ones, as `warm` does: later steps
        # that change nothing keep them topped up (Stable.idle).
        self.ready = self.cache.zero_ahead(self._zeroed_wanted()) if maps == "gated" else 0
        self.views = [kv_tensors(self.cache, i) for i in range(layers)]

    def _granules(self, tokens: int) -> int:
        return logic.granules_for(tokens, self.token_bytes, self.granule)

    def kv(self):
        return self.views

    def scratch_row(self):
        return self.slots

    def admit(self, slot, tokens):
        self.cache.grow(slot, tokens)
        self.backed[slot] = self._granules(tokens)

    def grow(self, grown):
        # Only the rows whose new token opens a granule: the others are mapped already, and a
        # call per step for every row would be host work StaticCache does not do.
        opening = [(slot, length) for slot, length in grown if self._granules(length) > self.backed.get(slot, 0)]
        if not opening:
            return False
        self.cache.grow_many(opening)
        for slot, length in opening:
            self.backed[slot] = self._granules(length)
        return True

    def layer_done(self):
        if self.maps == "between":
            return None
        cache = self.cache
        return lambda layer: cache.mark_layer_done(layer, torch.cuda.current_stream().cuda_stream)

    def layer_start(self):
        # The last layer's mark leaves only the step's tail to remap behind: gated, its remap
        # runs on the cache's worker while the next step runs the layers before it.
        if self.maps != "gated":
            return None
        cache, first_gated = self.cache, self.layers - self.gates

        def gate(layer):
            if layer >= first_gated:
                cache.gate_layer(layer, torch.cuda.current_stream().cuda_stream)
        return gate

    def behind(self, upcoming, finished):
        # Layer by layer, once the step in flight is done with the layer (its mark): the map
        # calls overlap the step's later layers instead of adding to the time between steps.
        if self.maps == "between":
            return False
        opening = [(slot, length) for slot, length in upcoming if self._granules(length) > self.backed.get(slot, 0)]
        gone = [slot for slot in finished if slot in self.backed]
        if not opening and not gone:
            return False
        mapped = self.cache.change_behind(opening, gone)
        if opening:
            self.ready = 0  # it may have taken zeroed granules: ask again when idle
        for slot, length in opening:
            self.backed[slot] = self._granules(length)
        for slot in gone:
            del self.backed[slot]
        return mapped

    def _zeroed_wanted(self) -> int:
        # Two rows opening a granule in every gated layer, K and V.
        return 2 * 2 * self.gates

    def idle(self) -> bool:
        # While a step that changes nothing runs: zeroed granules ready for the gated layers
        # (two rows opening a granule in each, K and V), so an opening step takes them as they
        # are instead of zeroing fresh ones on its path. One per step: 0.15-0.4 ms of host
        # time (new memory, its own mapping, the fill, the unmap), inside the step's wait.
        # Whether it zeroed any (map work: the step counts as one that mapped).
        if self.maps != "gated":
            return False
        want = self._zeroed_wanted()
        if self.ready >= want:
            return False
        self.ready = self.cache.zero_ahead(want, 1)
        return True

    def release(self, slot):
        if slot in self.backed:  # not released behind the step already
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
    """Eager; K/V follow the longest running sequence (torch.cat of new columns per step, as
    DynamicCache: a copy of the whole cache per step, its growth policy's cost)."""

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
            zk, zv = self._empty(need - have)
            self.views[:] = [(torch.cat([k, zk], 1), torch.cat([v, zv], 1)) for k, v in self.views]
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


# ---- serving ----------------------------------------------------------------------------------


def _p99(xs: List[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))] if xs else 0.0


def serve(model, backend: Backend, requests, args, name: str, budget: Optional[int] = None, graph: bool = True) -> dict:
    cfg = model.config
    max_len = args.max_len
    layers = cfg.num_hidden_layers
    token_bytes = cfg.num_key_value_heads * cfg.head_dim * 2
    plan = logic.simulate(backend.slots, requests, layers, token_bytes, budget=budget, max_steps=args.max_steps)
    log(f"{name}: start, {backend.slots} slots, {len(requests)} requests, {plan.steps} decode steps "
        f"({plan.map_steps} of them map), up to {plan.peak_running} running")
    began = time.perf_counter()
    rows = backend.kv()
    step = Step(model, rows, backend.slots, max_len, grouped=args.attention == "grouped",
                layer_done=backend.layer_done(), layer_start=backend.layer_start())
    if backend.scratch_row() is not None:
        step.publish([0] * backend.slots, [backend.scratch_row()] * backend.slots)
    if graph:
        with sdpa_context(args.sdpa):
            replay = capture(step)
    else:
        def replay():
            with sdpa_context(args.sdpa):
                step()
    sched = logic.Scheduler(backend.slots, list(requests))
    admission = logic.Admission(budget, layers, token_bytes)
    gen = torch.Generator().manual_seed(args.seed)
    device_s: List[float] = []
    wall_s: List[float] = []
    host_s: List[float] = []
    mapped_flags: List[bool] = []
    # Per mapping step: wall, the maps behind the replay, launch -> their end, step index,
    # mapped before the replay, mapped behind it, rows opening a granule next, rows finished,
    # the change's parts, whether the replay was done before the maps behind it were, and
    # the replay's device time.
    map_log: List[tuple] = []
    # Per step: whether a map can have made it slow (logic.map_on_path, judged at the end
    # against the median replay).
    map_before: List[bool] = []
    map_outlasted: List[bool] = []
    # Steps that run under gates the step before closed (its gated layers' remap handed to
    # the cache's worker): a late remap shows as a wait in their replay.
    under_gate: List[bool] = []
    gated = isinstance(backend, Stable) and backend.maps == "gated"
    handed = False
    tpg = getattr(getattr(backend, "cache", None), "tokens_per_granule", 0) or 1
    bound_ok = True
    peak_cache = 0
    peak_data = 0
    generated = 0
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = last_report = time.perf_counter()

    while not sched.idle and sched.step < args.max_steps:
        for slot, request in sched.admit(admission):
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
        t1 = time.perf_counter()
        before.record()
        replay()
        after.record()
        upcoming = [(slot, length + 1) for slot, length in grown if slot not in finished]
        tb = time.perf_counter()
        behind = backend.behind(upcoming, finished)
        # Nothing to change: granules zeroed ahead instead (map work too).
        zeroed = not behind and isinstance(backend, Stable) and backend.idle()
        tb2 = time.perf_counter()
        # Still running when the maps behind it ended: the synchronize below waits on the
        # replay, not on the map.
        outlasted = bool(behind or zeroed) and after.query()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        device_s.append(before.elapsed_time(after) / 1e3)
        if mapped or behind or zeroed:
            parts = backend.cache.last_change_times() if behind and isinstance(backend, Stable) else {}
            map_log.append((t2 - t0, tb2 - tb, tb2 - t1, len(wall_s), mapped, "zero ahead" if zeroed else behind,
                            sum(1 for _, n in upcoming if n % tpg == 1), len(finished), parts,
                            outlasted, device_s[-1]))
        map_before.append(bool(mapped))
        map_outlasted.append(outlasted)
        under_gate.append(handed)
        handed = gated and bool(behind)
        mapped = mapped or behind or zeroed
        host_s.append(t1 - t0)
        wall_s.append(t2 - t0)
        mapped_flags.append(mapped)
        generated += len(grown)
        peak_cache = max(peak_cache, backend.cache_bytes())
        if isinstance(backend, Stable):
            s = backend.cache.stats()
            # The scratch row's granules are fixed overhead like the zero granule: not counted.
            data = s["physical_granules"] * s["granule"] - 2 * layers * s["granule"]
            peak_data = max(peak_data, data)
            bound_ok &= data <= logic.memory_bound(lengths, layers, token_bytes)
        for slot in finished:
            backend.release(slot)
            admission.release(slot)
        sched.finish(finished)
        if t2 - last_report > 10.0:
            last_report = t2
            log(f"{name}: step {len(wall_s)}/{plan.steps}, served {len(sched.done)}/{len(requests)}, "
                f"running {len(sched.slots)}")
    torch.cuda.synchronize()
    run = time.perf_counter() - start
    mid_wall, spike = logic.map_spike(wall_s, mapped_flags)
    mid_device = median(device_s) if device_s else 0.0
    touched = [m or g for m, g in zip(mapped_flags, under_gate)]
    on_path = [t and logic.map_on_path(b, o, d, mid_device)
               for t, b, o, d in zip(touched, map_before, map_outlasted, device_s)]
    _, charged_spike = logic.map_spike(wall_s, on_path)
    gate_over, gate_steps = logic.over(wall_s, [g and not m for m, g in zip(mapped_flags, under_gate)])
    # The host's own noise: steps no map touched that still took over 1.1 x the median.
    quiet_over, quiet_steps = logic.over(wall_s, [not t for t in touched])
    if map_log:
        walls = sorted(m[0] for m in map_log)
        log(f"{name}: {len(map_log)} mapping steps: wall median {median(walls) * 1e3:.3f} ms, "
            f"p90 {walls[int(0.9 * (len(walls) - 1))] * 1e3:.3f}, max {walls[-1] * 1e3:.3f} (all steps' median "
            f"{mid_wall * 1e3:.3f}); over 1.1 x median: {sum(w > 1.1 * mid_wall for w in walls)}, of them "
            f"with the map on the path (before the replay, outlasting it, or a replay over 1.1 x its median): "
            f"{sum(w > 1.1 * mid_wall for w, p in zip(wall_s, on_path) if p)} of {sum(on_path)}; steps that "
            f"no map touched over 1.1 x median: {quiet_over} of {quiet_steps}; steps under a gate the step "
            f"before closed (mapping nothing themselves): {gate_over} of {gate_steps} over 1.1 x median")
        with_parts = [m[8] for m in map_log if m[8]]
        if with_parts:
            log(f"{name}:   median parts of {len(with_parts)} changes behind (us): " + ", ".join(
                f"{k} {median(p[k] for p in with_parts):.0f}" for k in with_parts[0] if k != "inline_layers"))
        for m in sorted(map_log, key=lambda m: m[0], reverse=True)[:5]:
            log(f"{name}:   step {m[3]}: wall {m[0] * 1e3:.3f} ms, maps behind {m[1] * 1e3:.3f} ms "
                f"(ended {m[2] * 1e3:.3f} ms after launch), mapped before {m[4]}, behind {m[5]}, "
                f"opening {m[6]}, finished {m[7]}, replay {m[10] * 1e3:.3f} ms "
                f"({'done before' if m[9] else 'still running when'} the maps behind ended)")
            if m[8]:
                # The host's parts of those maps (us): what a slow step waited on.
                log(f"{name}:     parts (us): " + ", ".join(
                    f"{k} {v:.0f}" if k != "inline_layers" else f"{k} {v}" for k, v in m[8].items()))
    gate_only = sorted((i for i, (m, g) in enumerate(zip(mapped_flags, under_gate)) if g and not m),
                       key=lambda i: wall_s[i], reverse=True)[:3]
    for i in gate_only:
        log(f"{name}:   under a gate: step {i}: wall {wall_s[i] * 1e3:.3f} ms, replay {device_s[i] * 1e3:.3f} ms "
            f"(median replay {mid_device * 1e3:.3f})")
    result = {
        "name": name,
        "slots": backend.slots,
        "tokens_per_s": generated / sum(wall_s) if wall_s else 0.0,
        "median_step_ms": median(device_s) * 1e3 if device_s else 0.0,
        "p99_step_ms": _p99(device_s) * 1e3,
        "median_wall_ms": mid_wall * 1e3,
        "p99_wall_ms": _p99(wall_s) * 1e3,
        "median_host_us": median(host_s) * 1e6 if host_s else 0.0,
        "map_spike_ms": None if spike is None else spike * 1e3,
        "charged_spike_ms": None if charged_spike is None else charged_spike * 1e3,
        "charged_steps": sum(on_path),
        "touched_spike_ms": None if not any(touched) else max(w for w, t in zip(wall_s, touched) if t) * 1e3,
        "gate_over": gate_over,
        "gate_steps": gate_steps,
        "quiet_over": quiet_over,
        "quiet_steps": quiet_steps,
        "map_steps": sum(mapped_flags),
        "steps": len(wall_s),
        "served": len(sched.done),
        "requests": len(requests),
        "peak_running": sched.peak_running,
        "peak_torch_bytes": torch.cuda.max_memory_allocated(),
        "peak_cache_bytes": peak_cache,
        "peak_data_bytes": peak_data,
        "bound_ok": bound_ok,
        "run_s": run,
    }
    log(f"{name}: done in {time.perf_counter() - began:.1f} s ({len(wall_s)} steps, served {len(sched.done)}, "
        f"step {result['median_step_ms']:.3f} ms device, {result['median_wall_ms']:.3f} ms wall)")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(logic.SIZES), default="quick",
                   help="max_batch/max_len/requests/layers preset (flags below override it)")
    p.add_argument("--max-batch", type=int)
    p.add_argument("--max-len", type=int)
    p.add_argument("--requests", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--mean-len", type=int, default=0, help="mean prompt+output tokens (default max_len/4)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--budget-slots", type=int, default=4, help="KvCache slots per StaticCache slot at the budget")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--attention", choices=("grouped", "gqa"), default="grouped",
                   help="decode attention: GQA as kv_heads groups of queries (default) or SDPA's enable_gqa")
    p.add_argument("--sdpa", choices=("auto", "flash", "efficient", "cudnn", "math"), default="auto",
                   help="SDPA kernel of the decode step, for every backend (default: torch's choice)")
    p.add_argument("--maps", choices=("gated", "behind", "between"), default="gated",
                   help="where the stable cache maps: behind the step in flight, layer by layer after each "
                        "layer's mark, the last layer by the cache's worker behind that layer's gate while "
                        "the next step runs the layers before it (gated, default); behind the step, the last "
                        "layer too (behind); or between steps")
    p.add_argument("--gates", type=int, default=None,
                   help="with --maps gated: how many of the last layers are gated (default half the layers); "
                        "the worker remaps them while the next step runs the layers before the first gate, "
                        "so the host's share is the layers before them. One gate leaves the host the layers "
                        "up to the step's last quarter (its remaps can outlast the step); every layer gated "
                        "makes the next step wait at its first gate for the worker")
    p.add_argument("--dynamic", action="store_true", help="also run the eager torch.cat (DynamicCache-like) backend")
    p.add_argument("--skip-dynamic", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--skip-probe", action="store_true", help="no attention probe")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for key, value in logic.SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.gates is None:
        args.gates = max(1, args.layers // 2)
    if not 1 <= args.gates <= args.layers:
        p.error(f"--gates {args.gates}: between 1 and the {args.layers} layers")
    if not torch.cuda.is_available():
        raise SystemExit("kv_serve needs a CUDA GPU")
    b, max_len = args.max_batch, args.max_len
    mean = args.mean_len or max_len // 4
    grouped = args.attention == "grouped"
    token_bytes = args.kv_heads * args.head_dim * 2
    log(f"kv_serve --size {args.size}: {args.layers} layers, {args.heads} heads / {args.kv_heads} KV x {args.head_dim}, "
        f"bf16; max_batch {b}, max_len {max_len}, mean length {mean}, {args.requests} requests; attention "
        f"{args.attention}, SDPA {args.sdpa}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name()}")
    budget = logic.static_bytes(args.layers, b, max_len, token_bytes)
    requests, budget_requests = logic.workload(args.requests, b, max_len, mean, args.budget_slots, seed=args.seed)
    built = time.perf_counter()
    model = build_model(args)
    cfg = model.config
    log(f"model built in {time.perf_counter() - built:.1f} s; budget = StaticCache({b}) = {budget / 2**30:.2f} GiB")

    runs = []
    with torch.inference_mode():
        picks = {} if args.skip_probe else attention_probe(cfg, b, max_len, grouped)
        runs.append(serve(model, Static(model, b, max_len), requests, args, "static"))
        torch.cuda.empty_cache()
        runs.append(serve(model, Stable(cfg, b, max_len, args.maps, gates=args.gates), requests, args, "stable"))
        torch.cuda.empty_cache()
        if args.dynamic:
            runs.append(serve(model, Dynamic(cfg, b), requests, args, "dynamic", graph=False))
            torch.cuda.empty_cache()
        runs.append(serve(model, Stable(cfg, args.budget_slots * b, max_len, args.maps, gates=args.gates), budget_requests, args,
                          "stable@budget",
                          budget=budget))

    head = (f"{'cache':14} {'slots':>5} {'tok/s':>8} {'step ms':>8} {'p99':>7} {'wall ms':>8} {'p99':>7} {'host us':>8} "
            f"{'map ms':>7} {'served':>6} {'peak run':>8} {'run s':>6} {'torch GiB':>9} {'cache GiB':>9}")
    print(head, flush=True)
    for r in runs:
        spike = "-" if r["map_spike_ms"] is None else f"{r['map_spike_ms']:.3f}"
        print(f"{r['name']:14} {r['slots']:5d} {r['tokens_per_s']:8.0f} {r['median_step_ms']:8.3f} {r['p99_step_ms']:7.3f} "
              f"{r['median_wall_ms']:8.3f} {r['p99_wall_ms']:7.3f} {r['median_host_us']:8.1f} {spike:>7} "
              f"{r['served']:6d} {r['peak_running']:8d} {r['run_s']:6.1f} {r['peak_torch_bytes'] / 2**30:9.2f} "
              f"{r['peak_cache_bytes'] / 2**30:9.2f}")
    print("step ms: device time of the graph replay alone (CUDA events; dynamic: the eager step). wall ms: the whole "
          "step on the host: scheduler, grow, publish, replay, synchronize. host us: its part before the replay. "
          "tok/s: decoded tokens / summed wall ms. run s: whole run, prefills included.", flush=True)

    static, stable, at_budget = runs[0], runs[1], runs[-1]
    if picks and len(set(picks.values())) > 1:
        print(f"note: torch picks SDPA {picks['static']} for StaticCache's layout and {picks['stable']} for the "
              f"KvCache's: the step-time ratio includes that kernel difference (the probe above times each; "
              f"--sdpa <kernel> runs both on one kernel)")

    def ratio(key: str) -> float:
        return stable[key] / static[key] if static[key] else float("inf")

    r_dev, r_wall = ratio("median_step_ms"), ratio("median_wall_ms")
    print(logic.verdict("step time <= 1.03 x StaticCache (graph replay, device)", r_dev <= 1.03,
                        f"stable {stable['median_step_ms']:.3f} ms / static {static['median_step_ms']:.3f} ms = {r_dev:.3f}"))
    print(logic.verdict("whole step <= 1.03 x StaticCache (host + device, wall)", r_wall <= 1.03,
                        f"stable {stable['median_wall_ms']:.3f} ms / static {static['median_wall_ms']:.3f} ms = {r_wall:.3f}"))
    print(logic.verdict("cache memory <= tokens + 1 granule per (seq, layer, K/V)", stable["bound_ok"] and at_budget["bound_ok"],
                        "checked after every step of both stable runs (zero, lengths and scratch granules apart)"))
    # The words: no step slower than 1.1 x the median *because of a map*. A step a map
    # touched (it mapped, or it ran under a gate the step before closed) is charged where the
    # map was on its path (logic.map_on_path); the slowest touched step of all and the steps
    # no map touched show the host's own noise beside it.
    touched, charged = stable["touched_spike_ms"], stable["charged_spike_ms"]
    mid = stable["median_wall_ms"]
    noise = (f"steps no map touched over 1.1 x their median: stable {stable['quiet_over']} of "
             f"{stable['quiet_steps']}, static {static['quiet_over']} of {static['quiet_steps']}")
    if touched is None:
        detail = "no step mapped"
    else:
        worst = ("none had the map on its path" if charged is None else
                 f"slowest of the {stable['charged_steps']} with the map on their path {charged:.3f} ms "
                 f"({charged / mid:.2f} x)")
        detail = (f"{stable['map_steps']} mapping steps and {stable['gate_steps']} more under a gate: {worst}; "
                  f"slowest of them all {touched:.3f} ms ({touched / mid:.2f} x), median {mid:.3f} ms; {noise}")
    print(logic.verdict("no step > 1.1 x median because of a map (wall)",
                        None if touched is None else (charged is None or charged <= 1.1 * mid), detail))
    within = at_budget["peak_data_bytes"] <= budget
    at_least = at_budget["peak_running"] >= 2 * b
    print(logic.verdict(f">= 2 x {b} sequences at StaticCache({b})'s memory",
                        None if mean > max_len // 3 else (at_least and within),
                        f"{at_budget['peak_running']} running at once (mean length {mean}, max_len/3 = {max_len // 3}), "
                        f"peak data mapped {at_budget['peak_data_bytes'] / 2**30:.2f} GiB of {budget / 2**30:.2f} "
                        f"(held with free list, zero, lengths and scratch granules: "
                        f"{at_budget['peak_cache_bytes'] / 2**30:.2f} GiB)"))
    log("done")


if __name__ == "__main__":
    main()
