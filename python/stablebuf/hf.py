"""Hugging Face transformers glue for the KV cache on stable addresses (issue 45).

`StableCache` is a `transformers.Cache` built like `StaticCache` (same constructor, same
`update`, same `[batch, kv_heads, max_cache_len, head_dim]` tensors per layer, fixed
addresses marked static for `torch.compile(mode="reduce-overhead")`), whose K and V tensors
are views of a `stablebuf.KvCache`: the addresses never change, the memory under them is
mapped as the sequences grow. Unmapped tokens read zeros (one shared read-only granule), so
an attention that reads all `max_cache_len` positions under a mask (SDPA, eager) faults
nowhere and computes what it computes over StaticCache's zeros.

Which transformers:
  * 4.56 and later (5.x included): `Cache` is a list of per-layer objects, `StaticCache`'s are
    `StaticLayer`s that allocate lazily in `lazy_initialization` and write with
    `index_copy_` in `update` (5.x: at `cumulative_length`, a device tensor; 4.56-4.57: at
    `cache_kwargs["cache_position"]`). `_StableLayer` subclasses the installed `StaticLayer`
    and replaces only the allocation (views of the KvCache), `reset` (releases the memory
    instead of writing zeros into read-only granules) and what cannot keep addresses
    (`reorder_cache`, offloading); `update` and the rest are inherited, so the writes and the
    masks are StaticCache's own.
  * Earlier (4.4x-4.55, `StaticCache.key_cache` lists): not supported, `StableCache` raises
    with the version it found (the per-layer API is what `generate` compiles against now).

Growing. The tokens written must be mapped before the write (a write into the read-only zero
granule faults on the GPU). Eager calls of `update` grow every row to the tokens written so
far. A compiled decode step runs no Python, so:
  * `follow=False` (default): the first eager `update` (the prefill) maps every row of the
    batch to `max_cache_len`: memory as StaticCache's, any `generate` works.
  * `follow=True`: rows are mapped as far as the tokens go (+ `ahead_tokens`); for compiled
    decode pass `logits_processor=[cache.grower()]` to `generate` (it runs eagerly between
    steps and grows to the next step's length from `input_ids.shape[1]`, no device sync), or
    call `cache.grow_to(length)` before each step yourself.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from . import _native
from ._kv_logic import grow_target

try:
    import transformers
    from transformers import cache_utils as _cu
except ImportError as error:  # pragma: no cover - import guard
    raise ImportError("stablebuf.hf needs transformers (pip install transformers)") from error

_StaticLayer = getattr(_cu, "StaticLayer", None)
_Cache = _cu.Cache

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return bool(compiler.is_compiling())
    return bool(torch._dynamo.is_compiling())


def _layer_types(config: Any) -> List[str]:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    get = getattr(_cu, "get_layer_types_and_kwargs", None)
    if get is not None:
        try:
            types, _ = get(text)
            return list(types)
        except (AttributeError, TypeError):
            pass
    types = getattr(text, "layer_types", None)
    if types is not None:
        return list(types)
    return ["full_attention"] * int(text.num_hidden_layers)


def kv_tensors(kv: "_native.KvCache", layer: int):
    """Layer `layer`'s K and V as tensors `[max_batch, max_len, kv_heads, head_dim]` (token-major
    rows, fixed addresses) over the KvCache's memory."""
    keys = torch.from_dlpack(kv.buffer(layer, "k"))
    values = torch.from_dlpack(kv.buffer(layer, "v"))
    return keys, values


def lengths_tensor(kv: "_native.KvCache") -> torch.Tensor:
    """The KvCache's device lengths (`int32 [max_batch]`, as last `publish_lengths`)."""
    return torch.from_dlpack(kv.lengths_buffer())


if _StaticLayer is not None:

    class _StableLayer(_StaticLayer):  # type: ignore[misc, valid-type]
        """A `StaticLayer` whose keys and values are views of the owner's KvCache."""

        def __init__(self, max_cache_len: int, owner: "StableCache", index: int, **kwargs):
            super().__init__(max_cache_len=max_cache_len, **kwargs)
            self._owner = owner
            self._index = index

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.batch_size, self.num_heads = key_states.shape[:2]
            self.k_head_dim = key_states.shape[-1]
            self.v_head_dim = value_states.shape[-1]
            keys, values = self._owner._views(self._index, key_states, value_states)
            batch = self.batch_size
            # [B, L, H, D] token-major -> StaticLayer's [B, H, L, D] (a permuted view: same memory).
            self.keys = keys[:batch].permute(0, 2, 1, 3)
            self.values = values[:batch].permute(0, 2, 1, 3)
            if isinstance(getattr(self, "cumulative_length", None), torch.Tensor):
                self.cumulative_length = self.cumulative_length.to(self.device)
            if not _compiling():
                torch._dynamo.mark_static_address(self.keys)
                torch._dynamo.mark_static_address(self.values)
                if isinstance(getattr(self, "cumulative_length", None), torch.Tensor):
                    torch._dynamo.mark_static_address(self.cumulative_length)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if not _compiling():
                self._owner._before_write(self._index, key_states.shape[0], key_states.shape[-2], kwargs, args)
            return super().update(key_states, value_states, *args, **kwargs)

        def reset(self) -> None:
            # StaticLayer.reset writes zeros over max_len: into read-only granules that faults.
            # Releasing maps the zero granule back, which reads the same zeros.
            self._owner._release_all(self._index)
            if isinstance(getattr(self, "cumulative_length", None), torch.Tensor):
                self.cumulative_length.zero_()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            raise NotImplementedError(
                "StableCache keeps fixed addresses: beam search's reorder (index_select into new "
                "tensors) is not supported; use StaticCache or greedy/sampling"
            )

        def offload(self):
            raise NotImplementedError("StableCache does not offload layers; use KvCache.sleep()")

        def prefetch(self):
            raise NotImplementedError("StableCache does not offload layers; use KvCache.wake()")

else:  # pragma: no cover - transformers < 4.56
    _StableLayer = None  # type: ignore[assignment, misc]


class StableCache(_Cache):
    """A `StaticCache` whose K/V live in a `stablebuf.KvCache` (see the module docs).

    Args:
        config: the model's config (its text config's layers; every layer full attention).
        max_cache_len: tokens per sequence (the KvCache's `max_len`).
        max_batch_size: sequence slots (default: the batch of the first update).
        follow: map memory as the tokens go (see the module docs) instead of whole rows.
        ahead_tokens: with `follow`, tokens mapped past the ones written.
        kv: an existing `stablebuf.KvCache` to use (its layout must match).
    """

    def __init__(
        self,
        config: Any,
        max_cache_len: int,
        max_batch_size: Optional[int] = None,
        follow: bool = False,
        ahead_tokens: int = 0,
        kv: Optional["_native.KvCache"] = None,
        offloading: bool = False,
        **kwargs: Any,
    ):
        if _StableLayer is None:
            raise NotImplementedError(
                f"StableCache needs transformers >= 4.56 (per-layer StaticLayer); found "
                f"{transformers.__version__}"
            )
        if offloading:
            raise NotImplementedError("StableCache does not offload; use KvCache.sleep()")
        types = _layer_types(config)
        unsupported = sorted({t for t in types if t != "full_attention"})
        if unsupported:
            raise NotImplementedError(
                f"StableCache holds full-attention layers only; this config has {unsupported}"
            )
        # Not `self.max_cache_len` / `self.max_batch_size`: transformers 5.x makes those
        # read-only properties of Cache (answered by the layers).
        self._max_len = int(max_cache_len)
        self._max_batch = max_batch_size
        self.follow = bool(follow)
        self.ahead_tokens = int(ahead_tokens)
        self.kv = kv
        self._host_len = 0  # tokens written so far (eager updates and grow_to)
        self._batch = 0
        layers = [_StableLayer(max_cache_len=self._max_len, owner=self, index=i) for i in range(len(types))]
        super().__init__(layers=layers)

    # ---- the KvCache -------------------------------------------------------------------

    def _views(self, index: int, key_states: torch.Tensor, value_states: torch.Tensor):
        batch, heads = key_states.shape[:2]
        head_dim = key_states.shape[-1]
        if value_states.shape[-1] != head_dim:
            raise NotImplementedError("StableCache needs K and V of one head_dim")
        if key_states.dtype not in _DTYPES:
            raise TypeError(f"StableCache holds bfloat16, float16 or float32, not {key_states.dtype}")
        if key_states.device.type != "cuda":
            raise ValueError(f"StableCache lives on a CUDA device, not {key_states.device}")
        if self.kv is None:
            max_batch = max(batch, self._max_batch or batch)
            self.kv = _native.KvCache(
                key_states.device.index if key_states.device.index is not None else torch.cuda.current_device(),
                len(self.layers),
                max_batch,
                self._max_len,
                heads,
                head_dim,
                dtype=_DTYPES[key_states.dtype],
                ahead_tokens=self.ahead_tokens if self.follow else 0,
            )
        kv = self.kv
        expect = (kv.kv_heads, kv.head_dim, kv.dtype, kv.max_len)
        found = (heads, head_dim, _DTYPES[key_states.dtype], self._max_len)
        if expect != found:
            raise ValueError(f"layer {index}: (kv_heads, head_dim, dtype, max_len) {found}, KvCache {expect}")
        if batch > kv.max_batch:
            raise ValueError(f"batch {batch} > the KvCache's max_batch {kv.max_batch}")
        self._batch = max(self._batch, batch)
        return kv_tensors(kv, index)

    def _before_write(self, index: int, batch: int, tokens: int, kwargs: dict, args: tuple) -> None:
        """Eager update of layer `index`: grows every row of the batch to hold the tokens about
        to be written (layer 0 grows all layers at once)."""
        if index != 0:
            return
        start = self._host_len
        position = _cache_position(kwargs, args)
        if position is not None and position.numel() > 0 and position.device.type == "cpu":
            start = int(position.min())
        self._host_len = start + tokens
        self._grow_rows(batch, self._host_len)

    def _grow_rows(self, batch: int, length: int) -> None:
        kv = self.kv
        if kv is None:
            return
        target = grow_target(length, 0, kv.max_len) if self.follow else kv.max_len
        kv.grow_many([(seq, target) for seq in range(batch)])

    def _release_all(self, index: int) -> None:
        if index != 0 or self.kv is None:
            return
        for seq in range(self.kv.max_batch):
            self.kv.release(seq)
        self._host_len = 0

    # ---- growing between compiled steps -------------------------------------------------

    def grow_to(self, length: int, batch: Optional[int] = None) -> None:
        """Maps every row of the batch for `length` tokens (call before a compiled step that
        writes token `length - 1`)."""
        self._host_len = max(self._host_len, int(length))
        self._grow_rows(batch or self._batch, int(length))

    def grower(self):
        """A logits processor for `generate(logits_processor=[...])` that grows the rows to the
        next step's length before each compiled decode step (reads only `input_ids.shape`)."""
        cache = self

        class _Grow:
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                cache.grow_to(int(input_ids.shape[-1]) + 1, int(input_ids.shape[0]))
                return scores

        return _Grow()

    def memory_stats(self) -> dict:
        """The KvCache's stats (empty before the first update)."""
        return dict(self.kv.stats()) if self.kv is not None else {}

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("StableCache keeps fixed addresses: no beam search")


def _cache_position(kwargs: dict, args: tuple) -> Optional[torch.Tensor]:
    """transformers 4.56-4.57 pass `cache_kwargs={"cache_position": ...}`; 5.x nothing."""
    cache_kwargs = kwargs.get("cache_kwargs")
    if cache_kwargs is None and args and isinstance(args[0], dict):
        cache_kwargs = args[0]
    if isinstance(cache_kwargs, dict):
        position = cache_kwargs.get("cache_position")
        if isinstance(position, torch.Tensor):
            return position
    return None
