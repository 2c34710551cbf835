"""GPU tests of the process-wide replay guard: torch.compile(mode="reduce-overhead") over
weights in a region (weight-set swaps without re-recording, refusals while asleep or unbound
that launch nothing and leave the CUDA graph tree usable), a plain hand-captured
torch.cuda.CUDAGraph, and a transformers Llama decoding with a compiled step. They skip (with
the reason) without torch or a CUDA device; the Llama test also without transformers.

Regions live for the whole process, so every test uses tags of its own, and each leaves its
regions awake and bound. Inputs are fresh random data and weight sets are random (never
zeros); outputs kept across a refused call are poisoned with NaN first.
"""

from __future__ import annotations

import importlib.util

import pytest

import stablebuf

pytestmark = pytest.mark.gpu

# bf16 keeps 8 bits of mantissa; a compiled graph fuses ops and rounds at other places than
# eager does, so over several layers outputs differ by about 1% of their scale.
BF16_TOLERANCE = {"rtol": 4e-2, "atol": 4e-2}


@pytest.fixture(scope="module")
def torch():
    import torch as torch_module

    torch_module.cuda.init()
    torch_module.manual_seed(20261125)
    return torch_module


def _counters(torch):
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_recorded_non_static_inputs"]


def _cudagraph_skips(torch):
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _assert_no_cudagraph_skips(torch, skips_before):
    # Compiled code that inductor did not put in a CUDA graph runs its kernels eagerly, which
    # the guard does not cover: sleeping under it would fault and end the whole test run.
    assert _cudagraph_skips(torch) == skips_before, (
        "torch.compile ran part of the model without CUDA graphs (see the 'skipping "
        "cudagraphs' log); its kernels would read the sleeping region unguarded"
    )


def _assert_matches_weight_set(torch, out, want, other, what):
    """``out`` equals ``want`` (eager, this weight set) within bf16 tolerances and is far from
    ``other`` (eager, the other weight set), so a replay on the wrong weights cannot pass."""
    out, want, other = out.float(), want.float(), other.float()
    torch.testing.assert_close(out, want, **BF16_TOLERANCE, msg=lambda m: f"{what}: {m}")
    right = ((out - want).norm() / want.norm()).item()
    wrong = ((out - other).norm() / other.norm()).item()
    assert right < 2e-2 and wrong > 0.3, (
        f"{what}: relative error {right:.3g}, to the other {wrong:.3g}"
    )


def _mlp(torch, width, layers):
    blocks = []
    for _ in range(layers):
        blocks.append(torch.nn.Linear(width, width, device="cuda", dtype=torch.bfloat16))
        blocks.append(torch.nn.GELU())
    return torch.nn.Sequential(*blocks).eval().requires_grad_(False)


def _random_mlp_state(torch, model, generator):
    # 0.06 keeps activations below unit scale through the layers (each gains about 0.9),
    # so bf16 rounding differences stay well inside the tolerances.
    return {
        name: (
            0.06 * torch.randn(v.shape, generator=generator, device="cuda", dtype=torch.float32)
        ).to(v.dtype)
        for name, v in model.state_dict().items()
    }


def test_compiled_mlp_swaps_weight_sets_without_rerecording_and_refuses_while_asleep(torch):
    tag, width, layers, batch = "compiled_mlp", 512, 8, 64
    skips_before = _cudagraph_skips(torch)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with stablebuf.region(tag):
        model = _mlp(torch, width, layers)
    stats = stablebuf.guard_stats()
    assert stats["graphs"] and stats["trees"], stats

    state_a = _random_mlp_state(torch, model, generator)
    state_b = _random_mlp_state(torch, model, generator)
    reference_a, reference_b = _mlp(torch, width, layers), _mlp(torch, width, layers)
    reference_a.load_state_dict(state_a)
    reference_b.load_state_dict(state_b)
    model.load_state_dict(state_a)
    ws_b = stablebuf.snapshot(tag)  # the first snapshot also makes the bound set: A
    ws_a = stablebuf.bound(tag)
    assert ws_a is not None and ws_a != ws_b
    with stablebuf.writing(ws_b):
        model.load_state_dict(state_b)
    assert stablebuf.bound(tag) == ws_a

    compiled = torch.compile(model, mode="reduce-overhead")

    def fresh():
        return torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)

    def call(x):
        # A new step: outputs of the previous call may be overwritten; clone what we keep.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x).clone()

    captures_before = stablebuf.guard_stats()["captures"]
    with torch.no_grad():
        # Warm-up, recording, first replay: all on weight set A.
        for step in range(3):
            x = fresh()
            _assert_matches_weight_set(
                torch, call(x), reference_a(x), reference_b(x), f"warm-up call {step}"
            )
        recorded = stablebuf.guard_stats()
        recorded_inputs = _counters(torch)
        assert recorded["captures"] > captures_before, "torch.compile recorded a CUDA graph"

        for step in range(6):
            use_b = step % 2 == 0
            stablebuf.bind(tag, ws_b if use_b else ws_a)
            x = fresh()
            want, other = (reference_b, reference_a) if use_b else (reference_a, reference_b)
            _assert_matches_weight_set(
                torch, call(x), want(x), other(x), f"swap {step} to {'B' if use_b else 'A'}"
            )
        after_swaps = stablebuf.guard_stats()
        assert after_swaps["captures"] == recorded["captures"], "a swap made torch re-record"
        assert _counters(torch) == recorded_inputs, "a swap made torch re-record"
        assert after_swaps["checked"] - recorded["checked"] >= 6, "every compiled call checked"
        assert after_swaps["refused"] == recorded["refused"]

        # Asleep: the call raises before the tree manager does anything. The previous call's
        # output, poisoned, stays untouched (nothing launched, no new generation started).
        _assert_no_cudagraph_skips(torch, skips_before)
        stablebuf.bind(tag, ws_a)
        torch.compiler.cudagraph_mark_step_begin()
        kept = compiled(fresh())
        kept.fill_(float("nan"))
        stablebuf.sleep(tag)
        try:
            before = stablebuf.guard_stats()
            torch.compiler.cudagraph_mark_step_begin()
            with pytest.raises(stablebuf.Asleep, match=tag):
                compiled(fresh())
            torch.cuda.synchronize()  # the context is healthy: no fault is pending
            assert torch.isnan(kept).all(), "a refused call launched work"
            assert stablebuf.guard_stats()["refused"] == before["refused"] + 1
            del kept
            # Other work still runs in this context.
            probe = torch.randn(256, 256, device="cuda")
            assert torch.isfinite(probe @ probe).all()
        finally:
            stablebuf.wake(tag)
        x = fresh()
        _assert_matches_weight_set(torch, call(x), reference_a(x), reference_b(x), "after wake")
        stablebuf.bind(tag, ws_b)
        x = fresh()
        _assert_matches_weight_set(torch, call(x), reference_b(x), reference_a(x), "B after wake")

        # Unbound: the same, with Unbound.
        kept_ws = stablebuf.bound(tag)
        stablebuf.unbind(tag)
        try:
            torch.compiler.cudagraph_mark_step_begin()
            with pytest.raises(stablebuf.Unbound, match=tag):
                compiled(fresh())
            torch.cuda.synchronize()
        finally:
            stablebuf.bind(tag, kept_ws)
        x = fresh()
        _assert_matches_weight_set(torch, call(x), reference_b(x), reference_a(x), "after bind")

        final = stablebuf.guard_stats()
        assert final["captures"] == recorded["captures"], "no re-recording after a refusal"
        assert _counters(torch) == recorded_inputs


def test_a_last_use_bind_waits_for_the_compiled_replay_the_guard_noted(torch):
    # A region with the "last-use" fence: a bind waits only for the uses noted on each stream.
    # The guard notes every compiled call, so a bind right after one waits for its replay
    # (about 24 large matmuls, tens of milliseconds) and that replay reads the old weights.
    tag, n, rounds = "compiled_last_use", 4096, 24

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            weight = torch.randn(n, n, device="cuda") / n**0.5
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

        def forward(self, x):
            out = x
            for _ in range(rounds):
                out = torch.tanh(out @ self.weight)
            return out

    def eager_chain(weight, x):
        out = x
        for _ in range(rounds):
            out = torch.tanh(out @ weight)
        return out

    with stablebuf.region(tag, fence="last-use"):
        model = Chain()
    first_values = model.weight.detach().clone()
    second_values = torch.randn(n, n, device="cuda") / n**0.5
    second_set = stablebuf.snapshot(tag)  # the first snapshot also makes the bound set
    first_set = stablebuf.bound(tag)
    with stablebuf.writing(second_set):
        model.weight.copy_(second_values)
    assert stablebuf.bound(tag) == first_set
    x = torch.randn(n, n, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):  # warm-up, recording, replay
            torch.compiler.cudagraph_mark_step_begin()
            compiled(x)
        torch.cuda.synchronize()

        torch.compiler.cudagraph_mark_step_begin()
        on_first = compiled(x).clone()  # queued; the clone is stream-ordered after it
        assert stablebuf.bind(tag, second_set) == first_set
        torch.compiler.cudagraph_mark_step_begin()
        on_second = compiled(x).clone()
        torch.cuda.synchronize()
        torch.testing.assert_close(on_first, eager_chain(first_values, x), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(on_second, eager_chain(second_values, x), rtol=1e-3, atol=1e-3)
    stablebuf.bind(tag, first_set)


def _warm_then_capture(torch, graph, fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = fn()
    return out


def test_a_plain_torch_graph_refuses_while_asleep_and_the_context_stays_usable(torch):
    tag, other_tag = "plain_graph", "plain_other"
    with stablebuf.region(tag):
        w1 = torch.randn(1024, 1024, device="cuda") / 32
        w2 = torch.randn(1024, 1024, device="cuda") / 32
    with stablebuf.region(other_tag):
        unrelated = torch.randn(4096, device="cuda")
    x = torch.randn(64, 1024, device="cuda")
    graph = torch.cuda.CUDAGraph()  # PyTorch's own class, not stablebuf.CUDAGraph
    out = _warm_then_capture(torch, graph, lambda: torch.relu(x @ w1) @ w2)
    captured = stablebuf.graph_tags(graph)
    assert captured is not None and {tag, other_tag} <= set(captured), captured

    x.copy_(torch.randn_like(x))
    want = torch.relu(x @ w1) @ w2
    stablebuf.sleep(tag)
    try:
        out.fill_(float("nan"))
        before = stablebuf.guard_stats()
        with pytest.raises(stablebuf.Asleep, match=tag):
            graph.replay()
        torch.cuda.synchronize()  # no illegal-address fault is pending
        assert torch.isnan(out).all(), "a refused replay launched"
        after = stablebuf.guard_stats()
        assert after["refused"] == before["refused"] + 1
        assert after["checked"] == before["checked"] + 1
        probe = torch.randn(512, 512, device="cuda")
        assert torch.isfinite(probe @ probe).all(), "the context still runs work"
    finally:
        stablebuf.wake(tag)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)

    # By default the graph guards every region that held memory (awake and bound) at capture
    # end, so sleeping an unrelated one blocks it; graph_tags narrows it to what it reads.
    reference = unrelated.clone()
    stablebuf.sleep(other_tag)
    try:
        with pytest.raises(stablebuf.Asleep, match=other_tag):
            graph.replay()
        assert stablebuf.graph_tags(graph, [tag]) == (tag,)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want)
        # A graph captured while a region sleeps does not guard it (it cannot have read it).
        later = torch.cuda.CUDAGraph()
        later_out = _warm_then_capture(torch, later, lambda: x @ w1)
        later_tags = stablebuf.graph_tags(later)
        assert tag in later_tags and other_tag not in later_tags, later_tags
        later_out.fill_(float("nan"))
        later.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(later_out, x @ w1)
    finally:
        stablebuf.wake(other_tag)
    assert torch.equal(unrelated, reference)


def test_remaps_during_a_capture_raise_capture_active_and_change_nothing(torch):
    tag = "capture_active"
    with stablebuf.region(tag):
        w = torch.randn(256, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda")
    ws_other = stablebuf.snapshot(tag)
    bound = stablebuf.bound(tag)
    reference = w.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ w
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = x @ w
        for call in (
            lambda: stablebuf.sleep(tag),
            lambda: stablebuf.wake(tag),
            lambda: stablebuf.bind(tag, ws_other),
            lambda: stablebuf.unbind(tag),
            lambda: stablebuf.snapshot(tag),
        ):
            with pytest.raises(stablebuf.CaptureActive):
                call()
    assert stablebuf.bound(tag) == bound
    assert not stablebuf.stats()[tag]["asleep"]
    stablebuf.graph_tags(graph, [tag])
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, x @ w)
    assert torch.equal(w, reference)


# --- transformers -------------------------------------------------------------------------

PROMPT, NEW_TOKENS, VOCAB = 8, 16, 1000


def _needs_transformers():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        attn_implementation="sdpa",
        # No end-of-sequence token: every generate makes exactly NEW_TOKENS tokens.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def _llama(torch, config):
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # created in bf16: no fp32 copies in the region
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def _random_llama_state(torch, model, generator):
    state = {}
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, device="cuda", dtype=torch.float32)
        value = 1.0 + 0.05 * noise if param.dim() == 1 else 0.05 * noise
        state[name] = value.to(param.dtype)
    return state


def _assert_same_greedy_tokens(torch, got, eager, reference, what):
    """``got`` (compiled decode) equals ``eager`` (eager decode with the same weights).

    bf16 logits computed by a fused graph may differ from eager ones in the last bit, which
    can swap two near-tied tokens and then change the rest of the sequence. So where the
    sequences differ, every token of ``got`` must still be eager's greedy choice given the
    tokens before it, up to a near tie (within 15% of the logits' standard deviation); with
    another weight set's tokens that fails at nearly every position.
    """
    assert got.shape == eager.shape, f"{what}: {tuple(got.shape)} vs {tuple(eager.shape)}"
    assert torch.equal(got[:, :PROMPT], eager[:, :PROMPT]), f"{what}: the prompt"
    if torch.equal(got, eager):
        return
    with torch.no_grad():
        logits = reference(got[:, :-1]).logits.float()[:, PROMPT - 1 :]
    chosen = logits.gather(-1, got[:, PROMPT:].unsqueeze(-1)).squeeze(-1)
    gap = logits.max(-1).values - chosen
    spread = logits.std(-1)
    assert (gap <= 0.15 * spread).all(), (
        f"{what}: tokens differ from eager beyond near ties\n got   {got.tolist()}\n"
        f" eager {eager.tolist()}\n gaps {(gap / spread).tolist()}"
    )


def test_llama_compiled_decode_swaps_weight_sets_and_refuses_while_asleep(torch):
    _needs_transformers()
    from transformers import LogitsProcessor, LogitsProcessorList, StaticCache

    tag = "llama_weights"
    skips_before = _cudagraph_skips(torch)
    generator = torch.Generator(device="cuda").manual_seed(3)
    config = _llama_config()
    with stablebuf.region(tag):
        model = _llama(torch, config)
    # The eager prefill of generate() reads the weights outside any graph: guard it too
    # (before the first compile, so the compiled code is traced with the hook in place).
    stablebuf.guard_module(model)

    state_a = _random_llama_state(torch, model, generator)
    state_b = _random_llama_state(torch, model, generator)
    reference_a, reference_b = _llama(torch, config), _llama(torch, config)
    reference_a.load_state_dict(state_a, strict=False)
    reference_b.load_state_dict(state_b, strict=False)
    model.load_state_dict(state_a, strict=False)
    ws_b = stablebuf.snapshot(tag)
    ws_a = stablebuf.bound(tag)
    with stablebuf.writing(ws_b):
        model.load_state_dict(state_b, strict=False)

    prompt = torch.randint(3, VOCAB, (1, PROMPT), device="cuda")
    mask = torch.ones_like(prompt)
    eager_a = reference_a.generate(
        prompt,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        disable_compile=True,
    )
    eager_b = reference_b.generate(
        prompt,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        disable_compile=True,
    )
    assert not torch.equal(eager_a, eager_b), "the two weight sets decode differently"

    # One static cache for every call: a new cache each generate() would move the cache's
    # static addresses and make the CUDA graph tree record again. generate() compiles its
    # decode step for a static cache on CUDA (CompileConfig defaults: reduce-overhead).
    cache = StaticCache(config=config, max_cache_len=PROMPT + NEW_TOKENS + 8)

    def generate(**extra):
        cache.reset()
        return model.generate(
            prompt,
            attention_mask=mask,
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            **extra,
        )

    captures_before = stablebuf.guard_stats()["captures"]
    for warm in range(2):
        _assert_same_greedy_tokens(torch, generate(), eager_a, reference_a, f"A, warm-up {warm}")
    recorded = stablebuf.guard_stats()
    recorded_inputs = _counters(torch)
    assert recorded["captures"] > captures_before, "generate() recorded a CUDA graph"

    for step, use_b in enumerate([True, False, True, False]):
        stablebuf.bind(tag, ws_b if use_b else ws_a)
        eager, reference = (eager_b, reference_b) if use_b else (eager_a, reference_a)
        _assert_same_greedy_tokens(
            torch, generate(), eager, reference, f"swap {step} to {'B' if use_b else 'A'}"
        )
    after_swaps = stablebuf.guard_stats()
    assert after_swaps["captures"] == recorded["captures"], "a swap made torch re-record"
    assert _counters(torch) == recorded_inputs, "a swap made torch re-record"
    assert after_swaps["checked"] > recorded["checked"]

    # Asleep before generate(): the guarded eager prefill raises.
    stablebuf.bind(tag, ws_a)
    stablebuf.sleep(tag)
    try:
        with pytest.raises(stablebuf.Asleep, match=tag):
            generate()
        torch.cuda.synchronize()
    finally:
        stablebuf.wake(tag)
    _assert_same_greedy_tokens(torch, generate(), eager_a, reference_a, "A after wake")

    # Asleep in the middle of generate(): the compiled decode step refuses, before the CUDA
    # graph tree does anything.
    _assert_no_cudagraph_skips(torch, skips_before)

    class SleepAfterTokens(LogitsProcessor):
        def __init__(self, tokens):
            self.length = PROMPT + tokens
            self.slept = False

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == self.length and not self.slept:
                self.slept = True
                stablebuf.sleep(tag)
            return scores

    sleeper = SleepAfterTokens(3)
    before = stablebuf.guard_stats()
    try:
        with pytest.raises(stablebuf.Asleep, match=tag):
            generate(logits_processor=LogitsProcessorList([sleeper]))
        torch.cuda.synchronize()
        assert sleeper.slept
        assert stablebuf.guard_stats()["refused"] > before["refused"]
    finally:
        stablebuf.wake(tag)
    _assert_same_greedy_tokens(torch, generate(), eager_a, reference_a, "A after mid-decode")
    stablebuf.bind(tag, ws_b)
    _assert_same_greedy_tokens(torch, generate(), eager_b, reference_b, "B after mid-decode")
    stablebuf.bind(tag, ws_a)

    final = stablebuf.guard_stats()
    assert final["captures"] == recorded["captures"], "no re-recording after refusals"
    assert _counters(torch) == recorded_inputs
