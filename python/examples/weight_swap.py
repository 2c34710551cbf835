"""Swap weight sets under one captured CUDA graph: stablebuf bind vs copy-in vs re-capture.

A Llama model from ``transformers`` (built from a config with random weights: nothing is
downloaded) in bf16, with ≥ 1 GiB of weights, decodes one token per step from a static KV cache;
the decode step is captured once as a CUDA graph. K weight sets are resident, and every step
uses the next one, as an RL loop or a multi-model server would. Per step, in one process:

- ``stablebuf``: ``stablebuf.bind("weights", ws[k])`` (one remap of the whole weight region,
  no copy) + replay;
- ``switch auto``: ``stablebuf.switch("weights", ws[k])`` (strategy ``"auto"``: a copy of the
  region into its own live set below the device's crossover, about 100 MiB on an H100, a remap
  above it) + replay;
- ``copy-in``: copy set k into the graph's static parameters (``torch._foreach_copy_``, what
  people do today) + replay;
- ``re-capture``: capture a new graph over set k's tensors (``torch.func.functional_call``)
  + replay;
- ``pipelined``: two copies of the model, each in a region made with ``fence="last-use"`` and
  captured as its own graph, used on alternate steps: a bind waits only for its copy's last
  replay (two steps back), so the remap runs while the GPU computes the other copy's step.
  Target: ≤ 1.03× replay only (reported, not enforced).

The same is run for a small model (``--small-layers`` layers of hidden size 512 and a
1,024-token vocabulary: about 42 MiB of bf16 weights, below the crossover) with replay only,
bind, copy-in and switch auto; ``--size`` picks ``default``, ``small`` or ``both`` (default).
At each size the switch must cost at most 1.05× the better of copy-in and bind per step, so
that small models never get slower than copy-in.

Every path's output is checked against an eager forward with the same weight set (outputs
poisoned with NaN before each replay, fresh random tokens), and the bind checks run again after
the switches (a copy switch must not change a weight set). Prints a table with ratios per size.
Exit status 1 if any output is wrong; the speed targets (≥ 1.5× faster per step than copy-in at
the default size, the switch's ≤ 1.05× at each size) are reported, not enforced.

Run: ``python python/examples/weight_swap.py`` (options: ``--help``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.func import functional_call

import stablebuf

GiB = 1 << 30
MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sets", type=int, default=3, help="weight sets resident (K)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per method")
    parser.add_argument("--recapture-steps", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--max-cache", type=int, default=512)
    parser.add_argument(
        "--size",
        choices=("both", "default", "small"),
        default="both",
        help="the model above (default), the small one (below the switch crossover), or both",
    )
    parser.add_argument(
        "--small-layers",
        type=int,
        default=8,
        help="layers of the small model (hidden 512, vocabulary 1024: 5 MiB of weights each)",
    )
    return parser.parse_args()


# The small model: every weight tensor ≤ 1 MiB, so PyTorch packs them into 2 MiB segments and
# the region's span (what a copy switch copies) stays close to the weights' size.
SMALL = dict(hidden=512, intermediate=1024, heads=8, vocab=1024)


def small_args(args: argparse.Namespace) -> argparse.Namespace:
    small = argparse.Namespace(**vars(args))
    for name, value in SMALL.items():
        setattr(small, name, value)
    small.layers = args.small_layers
    return small


def build_model(args: argparse.Namespace, tag: str = "weights", fence: str = "device"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_cache,
        attn_implementation="sdpa",
    )
    previous = torch.get_default_dtype()
    # Created directly in bf16 on the GPU, inside the region: no fp32 temporaries leave holes
    # in the region (its used span is what every snapshot and bind covers).
    torch.set_default_dtype(torch.bfloat16)
    try:
        with stablebuf.region(tag, fence=fence), torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)  # inference: weights are copied into in place
    return config, model


class Decoder:
    """One model's decode step over a static KV cache, captured once as a guarded CUDA graph.

    The static inputs and the KV cache live outside the weight region: binding another weight
    set must not swap them."""

    def __init__(self, config, model, args: argparse.Namespace, tag: str) -> None:
        from transformers import StaticCache

        self.model, self.tag, self.prompt = model, tag, args.prompt
        batch, max_cache = args.batch, args.max_cache
        self.cache = StaticCache(config=config, max_cache_len=max_cache)
        with torch.no_grad():
            model(
                input_ids=torch.randint(0, args.vocab, (batch, args.prompt), device="cuda"),
                past_key_values=self.cache,
                use_cache=True,
            )
        self.ids = torch.randint(0, args.vocab, (batch, 1), device="cuda")
        self.positions = torch.full((batch, 1), args.prompt, device="cuda", dtype=torch.long)
        self.mask = torch.zeros(batch, 1, 1, max_cache, dtype=torch.bool, device="cuda")
        self.inputs = dict(
            input_ids=self.ids,
            position_ids=self.positions,
            attention_mask=self.mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.at_position(args.prompt)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.decode()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = stablebuf.CUDAGraph(tags=[tag])
            t0 = time.perf_counter()
            with torch.cuda.graph(self.graph):
                self.logits = self.decode()
            self.capture_seconds = time.perf_counter() - t0
        # The prefill and the warm-up read the weights eagerly: a region with the "last-use"
        # fence must wait for them before its first remap.
        torch.cuda.synchronize()
        stablebuf.note_use([tag])

    def at_position(self, p: int) -> None:
        # The static cache advances its write position inside the graph; checks reset it.
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(p)
        self.positions.fill_(p)
        self.mask.zero_()
        self.mask[..., : p + 1] = True

    def decode(self, weights=None):
        if weights is None:
            return self.model(**self.inputs).logits
        return functional_call(self.model, weights, args=(), kwargs=self.inputs).logits


def random_state(model, generator: torch.Generator):
    """A new weight set: like the model's, fresh random values (never zeros)."""
    state = {}
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, device="cuda", dtype=torch.float32)
        value = 1.0 + 0.05 * noise if param.dim() == 1 else 0.02 * noise
        state[name] = value.to(param.dtype)
    return state


def timed(steps: int, step) -> float:
    """Seconds per step of ``step(i)`` over ``steps`` steps, GPU work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


class Swap:
    """One model in region ``tag`` with K resident weight sets (plain tensors for the baselines,
    stablebuf weight sets for bind and switch), its decode step captured once, the checks
    against eager, and the per-step loops of the methods every size runs."""

    def __init__(self, args: argparse.Namespace, tag: str, generator, failures: list) -> None:
        self.args, self.tag, self.generator, self.failures = args, tag, generator, failures
        self.checks = 0
        t0 = time.perf_counter()
        self.config, self.model = build_model(args, tag)
        named = list(self.model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.weight_bytes = sum(p.nbytes for p in self.params)
        self.build_seconds = time.perf_counter() - t0
        self.region_stats = stablebuf.stats()[tag]

        # K weight sets, as plain tensors (the copy-in and re-capture baselines use these) and
        # as stablebuf weight sets (one backing each of the region's whole span).
        sets = args.sets
        self.states = [{n: p.detach().clone() for n, p in named}]
        self.states += [random_state(self.model, generator) for _ in range(sets - 1)]
        t0 = time.perf_counter()
        self.weight_sets = [None] * sets
        for k in range(1, sets):
            self.weight_sets[k] = stablebuf.snapshot(tag)
            with stablebuf.writing(self.weight_sets[k]):
                torch._foreach_copy_(self.params, [self.states[k][n] for n in self.names])
        self.weight_sets[0] = stablebuf.bound(tag)
        torch.cuda.synchronize()
        self.sets_seconds = time.perf_counter() - t0
        self.sources = [[self.states[k][n] for n in self.names] for k in range(sets)]
        self.decoder = Decoder(self.config, self.model, args, tag)
        self.switch_ways: set = set()

    def check(self, method: str, k: int, run) -> None:
        """``run(k)`` must return the logits of an eager forward with weight set k."""
        d, args = self.decoder, self.args
        d.at_position(args.prompt)
        d.ids.copy_(
            torch.randint(0, args.vocab, d.ids.shape, device="cuda", generator=self.generator)
        )
        got = run(k)
        d.at_position(args.prompt)
        with torch.no_grad():
            want = d.decode(self.states[k]).float()
        got = got.float()
        bad = torch.isnan(got).any().item() or not torch.allclose(got, want, rtol=2e-2, atol=2e-2)
        diff = (got - want).abs().max().item()
        self.checks += 1
        if bad:
            self.failures.append(
                f"{self.tag}: {method}, weight set {k}: max abs diff {diff:.3g} "
                f"(nan={torch.isnan(got).any().item()})"
            )
        print(
            f"  check {method:<11} set {k}: max |graph - eager| = {diff:.3g} {'FAIL' if bad else 'ok'}"
        )

    def replay_output(self):
        self.decoder.logits.fill_(float("nan"))
        self.decoder.graph.replay()
        return self.decoder.logits.clone()

    def replay_with_bind(self, k):
        stablebuf.bind(self.tag, self.weight_sets[k])
        return self.replay_output()

    def replay_with_copy_in(self, k):
        torch._foreach_copy_(self.params, self.sources[k])
        return self.replay_output()

    def replay_with_switch(self, k):
        self.switch_ways.add(stablebuf.switch(self.tag, self.weight_sets[k], strategy="auto"))
        return self.replay_output()

    def check_all(self) -> None:
        """Every method on every weight set; then bind again, which reads each set itself: a
        switch (by copy) must have left them all as they were."""
        sets = self.args.sets
        for method, run in (
            ("stablebuf", self.replay_with_bind),
            ("switch auto", self.replay_with_switch),
            ("bind again", self.replay_with_bind),
        ):
            for k in range(sets):
                self.check(method, k, run)
        stablebuf.bind(self.tag, self.weight_sets[0])
        for k in range(sets):
            self.check("copy-in", k, self.replay_with_copy_in)
        torch._foreach_copy_(self.params, self.sources[0])

    def time_methods(self) -> dict:
        """Per-step seconds of replay only, bind + replay, bind alone, switch auto + replay and
        copy-in + replay, each loop from the prompt's position, one new set every step."""
        args, sets, d, tag = self.args, self.args.sets, self.decoder, self.tag
        ws, graph, steps = self.weight_sets, d.graph, args.steps
        out = {}
        d.at_position(args.prompt)
        out["replay"] = timed(steps, lambda i: graph.replay())
        d.at_position(args.prompt)
        timed(3, lambda i: (stablebuf.bind(tag, ws[i % sets]), graph.replay()))
        d.at_position(args.prompt)
        out["bind"] = timed(steps, lambda i: (stablebuf.bind(tag, ws[i % sets]), graph.replay()))
        out["bind_alone"] = timed(steps, lambda i: stablebuf.bind(tag, ws[i % sets]))
        d.at_position(args.prompt)
        timed(3, lambda i: (stablebuf.switch(tag, ws[i % sets]), graph.replay()))
        d.at_position(args.prompt)
        out["switch"] = timed(
            steps, lambda i: (stablebuf.switch(tag, ws[i % sets]), graph.replay())
        )
        stablebuf.bind(tag, ws[0])
        d.at_position(args.prompt)
        timed(
            3, lambda i: (torch._foreach_copy_(self.params, self.sources[i % sets]), graph.replay())
        )
        d.at_position(args.prompt)
        out["copy_in"] = timed(
            steps,
            lambda i: (torch._foreach_copy_(self.params, self.sources[i % sets]), graph.replay()),
        )
        torch._foreach_copy_(self.params, self.sources[0])
        return out

    def way(self) -> str:
        """How the timed switches went ("copy", "remap", or both if they differed)."""
        return "/".join(sorted(self.switch_ways)) or "-"

    def switch_verdict(self, label: str, t: dict) -> None:
        best = min(t["copy_in"], t["bind"])
        ratio = t["switch"] / best
        print(
            f"weight_swap: {label}: switch auto + replay vs the better of copy-in and bind, "
            f"target ≤ 1.05x: {'met' if ratio <= 1.05 else 'NOT met'} ({ratio:.3f}x; auto went "
            f"by {self.way()}, span {self.region_stats['span'] / MiB:.0f} MiB; copy-in "
            f"{t['copy_in'] * 1e6:.0f} µs, bind {t['bind'] * 1e6:.0f} µs, switch "
            f"{t['switch'] * 1e6:.0f} µs per step)"
        )


def run_default(args: argparse.Namespace, generator, failures: list, device_name: str) -> int:
    """The model of the flags: bind, switch, copy-in, re-capture and pipelined. Returns the
    number of output checks."""
    case = Swap(args, "weights", generator, failures)
    params, names, states = case.params, case.names, case.states
    weight_bytes, region_stats = case.weight_bytes, case.region_stats
    print(
        f"weight_swap on {device_name}: Llama {args.layers} layers, hidden {args.hidden}, "
        f"{sum(p.numel() for p in params) / 1e6:.0f} M parameters, "
        f"{weight_bytes / GiB:.2f} GiB of bf16 weights; region span "
        f"{region_stats['span'] / GiB:.2f} GiB in {region_stats['allocations']} segments "
        f"(built in {case.build_seconds:.1f} s)"
    )
    if weight_bytes < GiB:
        print("weight_swap: warning: less than 1 GiB of weights; the issue's target needs ≥ 1 GiB")
    print(
        f"  {args.sets} weight sets resident ({args.sets - 1} snapshots filled in "
        f"{case.sets_seconds:.2f} s); region now {stablebuf.stats()['weights']['mappings']} mapping"
    )

    decoder = case.decoder
    at_position, decode = decoder.at_position, decoder.decode
    capture_seconds = decoder.capture_seconds
    batch, sets = args.batch, args.sets

    recapture_pool = torch.cuda.graph_pool_handle()
    recaptured = []

    def recapture(k):
        fresh = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(fresh, pool=recapture_pool):
            out = decode(states[k])
        recaptured[:] = [fresh, out]  # the previous graph goes now
        fresh.replay()
        return out

    def replay_recaptured(k):
        out = recapture(k)
        return out.clone()

    case.check_all()
    for k in range(sets):
        case.check("re-capture", k, replay_recaptured)
    stablebuf.bind("weights", case.weight_sets[0])
    torch._foreach_copy_(params, case.sources[0])

    t = case.time_methods()
    at_position(args.prompt)
    with_recapture = timed(args.recapture_steps, lambda i: recapture(i % sets))
    recaptured.clear()
    with_stablebuf = t["bind"]

    # Pipelined: two copies of the model, each in its own region with the "last-use" fence
    # and its own graph. Step i replays copy i % 2; the bind for step i waits only for that
    # copy's previous replay (step i - 2), which the GPU finished while step i - 1 was queued
    # behind it, so the remap runs on the CPU while the GPU computes step i - 1.
    t0 = time.perf_counter()
    pipes = []
    for copy in range(2):
        tag = f"weights_pipelined_{copy}"
        _, pipe_model = build_model(args, tag, fence="last-use")
        pipe_params = [p for _, p in pipe_model.named_parameters()]
        pipe_sets = [stablebuf.snapshot(tag) for _ in range(sets)]
        for k, weight_set in enumerate(pipe_sets):
            with stablebuf.writing(weight_set):
                torch._foreach_copy_(pipe_params, [states[k][n] for n in names])
        torch.cuda.synchronize()  # the build's kernels wrote the region unnoted
        stablebuf.bind(tag, pipe_sets[0])  # the build's backing goes when this returns
        pipe = Decoder(case.config, pipe_model, args, tag)
        pipe.sets = pipe_sets
        pipes.append(pipe)
    print(
        f"  pipelined: 2 copies x {sets} weight sets built in {time.perf_counter() - t0:.1f} s "
        f"(fence last-use)"
    )

    def pipelined_set(i: int) -> int:
        # Each copy gets the next set at each of its steps: every bind changes the set.
        return (i // 2 + i % 2) % sets

    def pipelined_step(i: int) -> None:
        pipe = pipes[i % 2]
        stablebuf.bind(pipe.tag, pipe.sets[pipelined_set(i)])
        pipe.graph.replay()

    # Checked while pipelined: no wait between steps, outputs cloned in stream order, compared
    # afterwards with eager forwards on the same weight sets.
    pipelined_outputs = []
    for i in range(4 * sets):
        pipe = pipes[i % 2]
        pipe.at_position(args.prompt)
        pipe.logits.fill_(float("nan"))
        pipelined_step(i)
        pipelined_outputs.append((pipe, pipelined_set(i), pipe.logits.clone()))
    torch.cuda.synchronize()
    worst = 0.0
    pipelined_failed = False
    for i, (pipe, k, got) in enumerate(pipelined_outputs):
        pipe.at_position(args.prompt)
        with torch.no_grad():
            want = pipe.decode(states[k]).float()
        got = got.float()
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        if torch.isnan(got).any().item() or not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            pipelined_failed = True
            failures.append(f"pipelined step {i} (copy {i % 2}, set {k}): max abs diff {diff:.3g}")
    print(
        f"  check pipelined: {len(pipelined_outputs)} steps, max |graph - eager| = {worst:.3g} "
        f"{'FAIL' if pipelined_failed else 'ok'}"
    )
    for pipe in pipes:
        pipe.at_position(args.prompt)
    pipelined_floor = timed(args.steps, lambda i: pipes[i % 2].graph.replay())
    for pipe in pipes:
        pipe.at_position(args.prompt)
    timed(4, pipelined_step)
    for pipe in pipes:
        pipe.at_position(args.prompt)
    with_pipelined = timed(args.steps, pipelined_step)

    rows = [
        ("replay only (same weights)", t["replay"], "-"),
        ("stablebuf bind + replay", with_stablebuf, "1.00x"),
        (
            f"stablebuf switch auto ({case.way()}) + replay",
            t["switch"],
            f"{t['switch'] / with_stablebuf:.2f}x",
        ),
        (
            "stablebuf pipelined (2 regions, last-use fence)",
            with_pipelined,
            f"{with_pipelined / with_stablebuf:.2f}x",
        ),
        ("  its floor: 2 graphs alternating, no bind", pipelined_floor, "-"),
        ("copy-in + replay", t["copy_in"], f"{t['copy_in'] / with_stablebuf:.2f}x"),
        (
            "re-capture (torch.cuda.graph) + replay",
            with_recapture,
            f"{with_recapture / with_stablebuf:.2f}x",
        ),
    ]
    print()
    print(
        f"weight_swap: {weight_bytes / GiB:.2f} GiB of bf16 weights, batch {batch}, "
        f"{sets} weight sets, a new set every step, {device_name}"
    )
    print("| method | per step (µs) | vs stablebuf |")
    print("| --- | --- | --- |")
    for name, seconds, ratio in rows:
        print(f"| {name} | {seconds * 1e6:.0f} | {ratio} |")
    print(
        f"(stablebuf.bind alone: {t['bind_alone'] * 1e6:.0f} µs per swap; first capture "
        f"{capture_seconds * 1e3:.1f} ms)"
    )
    speedup = t["copy_in"] / with_stablebuf
    verdict = "met" if speedup >= 1.5 else "NOT met"
    print(f"weight_swap: target ≥ 1.5x faster per step than copy-in: {verdict} ({speedup:.2f}x)")
    hidden = with_pipelined / t["replay"]
    print(
        f"weight_swap: pipelined bind + replay vs replay only, target ≤ 1.03x: "
        f"{'met' if hidden <= 1.03 else 'NOT met'} ({hidden:.3f}x; serial bind + replay "
        f"{with_stablebuf / t['replay']:.3f}x)"
    )
    case.switch_verdict(f"default model ({weight_bytes / GiB:.2f} GiB)", t)
    return case.checks + len(pipelined_outputs)


def run_small(args: argparse.Namespace, generator, failures: list, device_name: str) -> int:
    """A model below the switch crossover: bind, switch and copy-in. Returns the number of
    output checks."""
    small = small_args(args)
    case = Swap(small, "weights_small", generator, failures)
    span = case.region_stats["span"]
    print()
    print(
        f"weight_swap (small) on {device_name}: Llama {small.layers} layers, hidden "
        f"{small.hidden}, vocabulary {small.vocab}, {case.weight_bytes / MiB:.0f} MiB of bf16 "
        f"weights; region span {span / MiB:.0f} MiB in {case.region_stats['allocations']} "
        f"segments; {small.sets} weight sets (built in "
        f"{case.build_seconds + case.sets_seconds:.1f} s)"
    )
    case.check_all()
    stablebuf.bind(case.tag, case.weight_sets[0])
    t = case.time_methods()
    best = min(t["copy_in"], t["bind"])
    rows = [
        ("replay only (same weights)", t["replay"], "-"),
        ("stablebuf bind + replay", t["bind"], f"{t['bind'] / best:.2f}x"),
        ("copy-in + replay", t["copy_in"], f"{t['copy_in'] / best:.2f}x"),
        (
            f"stablebuf switch auto ({case.way()}) + replay",
            t["switch"],
            f"{t['switch'] / best:.2f}x",
        ),
    ]
    print(
        f"weight_swap (small): {case.weight_bytes / MiB:.0f} MiB of bf16 weights, batch "
        f"{small.batch}, {small.sets} weight sets, a new set every step, {device_name}"
    )
    print("| method | per step (µs) | vs the better of copy-in and bind |")
    print("| --- | --- | --- |")
    for name, seconds, ratio in rows:
        print(f"| {name} | {seconds * 1e6:.0f} | {ratio} |")
    print(f"(stablebuf.bind alone: {t['bind_alone'] * 1e6:.0f} µs per swap)")
    case.switch_verdict(f"small model ({case.weight_bytes / MiB:.0f} MiB)", t)
    return case.checks


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("weight_swap: no CUDA device")
        return 2
    device_name = torch.cuda.get_device_name()
    generator = torch.Generator(device="cuda").manual_seed(7)
    crossover = stablebuf.crossover_bytes()  # calibrates the cost model: do it up front
    where = (
        "the same way at every size (no crossover)"
        if crossover is None
        else f"by copy below {crossover / MiB:.0f} MiB of region span and by remap above"
    )
    print(f"weight_swap: stablebuf.switch(strategy='auto') goes {where} on {device_name}")
    failures: list = []
    checks = 0
    if args.size in ("both", "default"):
        checks += run_default(args, generator, failures, device_name)
    if args.size in ("both", "small"):
        checks += run_small(args, generator, failures, device_name)
    if failures:
        print("weight_swap: WRONG OUTPUTS:\n  " + "\n  ".join(failures))
        return 1
    print(f"weight_swap: all {checks} output checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
