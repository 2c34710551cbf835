"""GPU tests of stablebuf.hf.StableCache and the KvCache bindings (issue 45): they skip without
torch, transformers or a CUDA device.

  * StableCache's generate() output equals StaticCache's token for token on a small random
    Llama (eager, then torch.compile(mode="reduce-overhead") through generate's own compile).
  * A masked SDPA over max_len on a partly-grown cache (rows mapped only as far as the tokens
    go, the rest the read-only zero granule) equals the same SDPA on a dense copy, and faults
    nowhere (the next synchronize would raise).
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def torch():
    import torch as torch_module

    return torch_module


@pytest.fixture(scope="module")
def llama(torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def _cache_kw(model) -> str:
    """transformers 5.x names the argument `cache` (`past_key_values` deprecated)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _generate(model, cache, inputs, new_tokens, compile_):
    kwargs = {_cache_kw(model): cache}
    if not compile_:
        kwargs["disable_compile"] = True
    return model.generate(
        inputs, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, **kwargs
    )


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "reduce-overhead"])
@pytest.mark.parametrize("follow", [False, True], ids=["whole-rows", "follow"])
def test_stable_cache_generates_what_static_cache_does(torch, llama, compile_, follow):
    from transformers import StaticCache

    from stablebuf.hf import StableCache

    torch.manual_seed(1)
    inputs = torch.randint(0, llama.config.vocab_size, (2, 17), device="cuda")
    new, max_len = 24, 64
    static = StaticCache(config=llama.config, max_cache_len=max_len)
    expected = _generate(llama, static, inputs, new, compile_)
    stable = StableCache(config=llama.config, max_cache_len=max_len, follow=follow)
    extra = {"logits_processor": [stable.grower()]} if follow else {}
    kwargs = {_cache_kw(llama): stable, **extra}
    if not compile_:
        kwargs["disable_compile"] = True
    got = llama.generate(inputs, max_new_tokens=new, do_sample=False, min_new_tokens=new, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
    stats = stable.memory_stats()
    assert stats["sequences"] == 2
    if follow:
        # 64 tokens of 2 x 32 bf16 = 8 KiB: one granule per (sequence, layer, K/V).
        assert stats["physical_granules"] == 2 * 3 * 2


def test_stable_cache_keeps_its_addresses_across_reset(torch, llama):
    from stablebuf.hf import StableCache

    cache = StableCache(config=llama.config, max_cache_len=32)
    inputs = torch.randint(0, llama.config.vocab_size, (1, 5), device="cuda")
    llama(inputs, **{_cache_kw(llama): cache}, use_cache=True)
    before = [layer.keys.data_ptr() for layer in cache.layers]
    cache.reset()
    torch.cuda.synchronize()
    assert [layer.keys.data_ptr() for layer in cache.layers] == before
    assert cache.memory_stats()["sequences"] == 0
    assert int(cache.layers[0].keys.abs().sum()) == 0  # reads the zero granule, no fault


def test_masked_sdpa_over_a_partly_grown_cache(torch):
    import torch.nn.functional as F

    from stablebuf import _native
    from stablebuf.hf import kv_tensors, lengths_tensor

    layers, batch, max_len, kv_heads, head_dim = 2, 4, 20000, 2, 64  # 8,192 tokens per granule
    kv = _native.KvCache(torch.cuda.current_device(), layers, batch, max_len, kv_heads, head_dim)
    lengths = [1, 9000, 0, 17]  # slot 2 empty: all zeros; slot 1 spans two granules of three
    g = torch.Generator(device="cuda").manual_seed(3)
    for seq, n in enumerate(lengths):
        if n:
            kv.grow(seq, n)
    kv.publish_lengths()
    assert lengths_tensor(kv).tolist() == lengths
    for layer in range(layers):
        keys, values = kv_tensors(kv, layer)
        assert keys.shape == (batch, max_len, kv_heads, head_dim)
        for seq, n in enumerate(lengths):
            if n:
                keys[seq, :n].copy_(torch.randn(n, kv_heads, head_dim, generator=g, device="cuda"))
                values[seq, :n].copy_(torch.randn(n, kv_heads, head_dim, generator=g, device="cuda"))
        q = torch.randn(batch, kv_heads * 2, 1, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(max_len, device="cuda")
        lens = torch.tensor(lengths, device="cuda")
        mask = ((pos[None] < lens[:, None]) | (pos[None] == 0))[:, None, None, :]
        k = keys.permute(0, 2, 1, 3)
        v = values.permute(0, 2, 1, 3)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        dense = F.scaled_dot_product_attention(
            q, k.contiguous(), v.contiguous(), attn_mask=mask, enable_gqa=True
        )
        torch.cuda.synchronize()  # a fault in the strided read would raise here
        torch.testing.assert_close(got, dense, atol=1e-2, rtol=1e-2)
        # Past each length the rows read zeros.
        assert int(keys[1, 9000:].abs().sum()) == 0
        assert int(keys[2].abs().sum()) == 0
        # The reference on the valid tokens only.
        for seq, n in enumerate(lengths):
            m = max(n, 1)
            ref = F.scaled_dot_product_attention(
                q[seq : seq + 1].float(),
                k[seq : seq + 1, :, :m].float().repeat_interleave(2, 1),
                v[seq : seq + 1, :, :m].float().repeat_interleave(2, 1),
            )
            torch.testing.assert_close(got[seq : seq + 1].float(), ref, atol=2e-2, rtol=2e-2)
    stats = kv.stats()
    assert stats["physical_granules"] == layers * 2 * (1 + 2 + 1)
    kv.release(1)
    torch.cuda.synchronize()
    keys, _ = kv_tensors(kv, 0)
    assert int(keys[1].abs().sum()) == 0


def test_sleep_and_wake_keep_the_views(torch):
    from stablebuf import _native
    from stablebuf.hf import kv_tensors

    kv = _native.KvCache(torch.cuda.current_device(), 1, 2, 1000, 2, 64)
    kv.grow(0, 10)
    keys, _ = kv_tensors(kv, 0)
    keys[0, :10].fill_(1.5)
    torch.cuda.synchronize()
    assert kv.sleep(keep=True) > 0
    assert int(keys[0].abs().sum()) == 0  # asleep: zeros, same address
    assert kv.wake() > 0
    assert float(keys[0, :10].float().mean()) == 1.5


def _behind_cache(torch, layers, batch, kv_heads, head_dim):
    """A cache of 8,192 tokens a granule (head_dim 64, 2 KV heads) with fresh random rows:
    row 0 fills its granule exactly, row 1 holds 100 tokens, row 2 stays empty. Returns it,
    its views, and the CPU reference: per layer, per row, the sum of K and V over every
    token."""
    from stablebuf import _native
    from stablebuf.hf import kv_tensors

    kv = _native.KvCache(torch.cuda.current_device(), layers, batch, 20000, kv_heads, head_dim)
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    lengths = {0: 8192, 1: 100}
    for seq, n in lengths.items():
        kv.grow(seq, n)
    views = [kv_tensors(kv, layer) for layer in range(layers)]
    for keys, values in views:
        for seq, n in lengths.items():
            keys[seq, :n].copy_(torch.randn(n, kv_heads, head_dim, generator=g, device="cuda"))
            values[seq, :n].copy_(torch.randn(n, kv_heads, head_dim, generator=g, device="cuda"))
    torch.cuda.synchronize()
    before = torch.stack([(k.float().sum((1, 2, 3)) + v.float().sum((1, 2, 3))).cpu() for k, v in views])
    return kv, views, before


def test_change_behind_remaps_each_layer_only_after_the_replay_is_done_with_it(torch):
    """`change_behind` while a captured step runs: every layer's read sleeps first, so a remap
    made before that layer's mark would change what the replay in flight reads. The replay
    must see the rows as they were, the next one as they are now, and nothing faults."""
    import stablebuf

    layers, batch, kv_heads, head_dim = 3, 3, 2, 64
    kv, views, before = _behind_cache(torch, layers, batch, kv_heads, head_dim)
    with pytest.raises(stablebuf.Error, match="never marked"):
        kv.change_behind([(0, 1)], [])
    out = torch.empty(layers, batch, device="cuda")

    def step():
        for layer, (keys, values) in enumerate(views):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the host remaps meanwhile, if it does not wait
            out[layer] = keys.float().sum((1, 2, 3)) + values.float().sum((1, 2, 3))
            kv.mark_layer_done(layer, torch.cuda.current_stream().cuda_stream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()

    out.fill_(float("nan"))
    graph.replay()
    # Row 0 opens its second granule, row 1 ends: both while the replay still runs.
    assert kv.change_behind([(0, 8193)], [1]) is True
    torch.cuda.synchronize()  # a fault would raise here
    torch.testing.assert_close(out.cpu(), before, atol=0.5, rtol=1e-3)
    assert kv.lengths()[:2] == [8193, 0]
    stats = kv.stats()
    assert stats["physical_granules"] == layers * 2 * 2  # row 0's two granules; row 1's freed
    # The replay after it reads the new state: row 1 zeros, row 0 as before (its new granule
    # is zeroed), and row 0's token 8192 is writable.
    for keys, values in views:
        keys[0, 8192].fill_(2.0)
    after = before.clone()
    after[:, 1] = 0
    after[:, 0] += 2.0 * kv_heads * head_dim
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), after, atol=0.5, rtol=1e-3)
    # Row 1's granules are free: the last layer's retiring (zeroed, still mapped) until the
    # next fenced operation. Nothing to change is no change.
    assert stats["free_granules"] == 2 * layers
    graph.replay()
    assert kv.change_behind([(0, 8194)], []) is False
    torch.cuda.synchronize()
    # An admission (a fenced grow) unmaps the retiring granules first, then takes them all.
    kv.grow(2, 5)
    assert kv.stats()["free_granules"] == 0
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), after, atol=0.5, rtol=1e-3)


@pytest.mark.parametrize("gated", ["last", "all"])
def test_gated_layers_are_remapped_while_the_next_replay_runs_up_to_their_gates(torch, gated):
    """The last layer gated (`gate_layer`), or every layer: `change_behind` returns before
    remapping them, the next replay is launched at once and runs up to each gate while the
    cache's worker remaps layer after layer behind the replay in flight. Both replays must
    read the rows as they should (the first as they were, the second as they are now), nothing
    faults, and new granules are zeroed and writable, also those taken zeroed from the free
    list (released behind a step, unmapped since) where a plain release left dirty ones."""
    layers, batch, kv_heads, head_dim = 3, 3, 2, 64
    kv, views, before = _behind_cache(torch, layers, batch, kv_heads, head_dim)
    first, second = torch.empty(layers, batch, device="cuda"), torch.empty(layers, batch, device="cuda")

    def step(out):
        stream = torch.cuda.current_stream().cuda_stream
        for layer, (keys, values) in enumerate(views):
            if gated == "all" or layer == layers - 1:
                kv.gate_layer(layer, stream)
            torch.cuda._sleep(20_000_000)  # ~10 ms: the worker remaps meanwhile, if it does not wait
            out[layer] = keys.float().sum((1, 2, 3)) + values.float().sum((1, 2, 3))
            kv.mark_layer_done(layer, stream)

    graphs = []
    for out in (first, second):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(out)
        graphs.append(graph)
    torch.cuda.synchronize()

    first.fill_(float("nan"))
    second.fill_(float("nan"))
    graphs[0].replay()
    assert kv.change_behind([(0, 8193)], [1]) is True
    graphs[1].replay()  # at once: it waits at the last layer's gate if the remap still runs
    torch.cuda.synchronize()  # a fault would raise here
    after = before.clone()
    after[:, 1] = 0
    torch.testing.assert_close(first.cpu(), before, atol=0.5, rtol=1e-3)
    torch.testing.assert_close(second.cpu(), after, atol=0.5, rtol=1e-3)
    assert kv.lengths()[:2] == [8193, 0]
    # The last layer's new granule of row 0 is mapped, zeroed and writable.
    for keys, values in views:
        keys[0, 8192].fill_(2.0)
    after[:, 0] += 2.0 * kv_heads * head_dim
    second.fill_(float("nan"))
    graphs[1].replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(second.cpu(), after, atol=0.5, rtol=1e-3)
    # A fenced operation takes the remap back first; everything freed is free.
    kv.grow(2, 5)
    assert kv.stats()["physical_granules"] == layers * 2 * 3
    # Row 2 written, then released behind a step: its granules retire, zeroed.
    for keys, values in views:
        keys[2, :5].fill_(3.0)
        values[2, :5].fill_(3.0)
    graphs[0].replay()
    assert kv.change_behind([], [2]) is True
    graphs[1].replay()
    torch.cuda.synchronize()
    # A plain release of row 0 settles them into the free list (zeroed) beside row 0's own
    # granules (their old tokens kept: dirty).
    kv.release(0)
    assert kv.stats()["free_granules"] == layers * 2 * 3
    # Row 1 opens a granule behind a step: gated layers take zeroed ones as they are, the
    # others zero theirs. Every row reads zeros in the next replay.
    graphs[0].replay()
    assert kv.change_behind([(1, 5)], []) is True
    second.fill_(float("nan"))
    graphs[1].replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(second.cpu(), torch.zeros_like(before), atol=0, rtol=0)
    assert kv.lengths()[:3] == [0, 5, 0]
