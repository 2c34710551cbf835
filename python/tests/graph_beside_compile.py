"""A hand-captured CUDA graph beside ``torch.compile(mode="reduce-overhead")``: does the hand
graph still replay right once the compiled function has recorded its CUDA graph trees?

Issue 38: ``python/examples/tp_decode.py`` at its default size died with an illegal address
at the first replay of its hand-captured decode graph after ``torch.compile`` had recorded.
The mechanism, which this program isolates: cuBLAS keeps one workspace per (handle, stream)
in a PyTorch cache, allocated on the stream's first matmul; a graph captured on that stream
bakes the workspace's address into its matmul kernels, but holds no reference to it. CUDA
graph trees call ``torch._C._cuda_clearCublasWorkspaces()`` around every warm-up and
recording, which frees every stream's workspace back to the caching allocator; the
``empty_cache()`` in ``torch.cuda.graph``'s entry then gives its segment back to CUDA when
nothing else lives in it. The hand graph's next replay writes through a freed pointer:
an illegal address, or (when the block was handed out again instead) another tensor
overwritten in silence.

One case per run (the CUDA context does not survive a fault); prints one
``RESULT <case>: ok|wrong|fault ...`` line and exits 0, 1 (wrong) or 3 (fault)::

    python graph_beside_compile.py [--weights plain|region] [--sequence compile|clear]
                                   [--without-fix] [--keep-tree-clear|--no-tree-clear]
                                   [--hidden H] [--ffn F] [--layers L] [--batch B]

``--weights plain``: no stablebuf at all (what PyTorch alone does); ``region``: the weights
live in a stablebuf region, so its replay guard is installed (the fix lives there).
``--sequence compile``: the compiled function warms up and records; ``clear``: the smallest
sequence, no torch.compile: ``_cuda_clearCublasWorkspaces()`` and ``empty_cache()``, which is
what a recording does to the other streams' workspaces. ``--without-fix`` turns stablebuf's
fix off (its test seam); ``--no-tree-clear`` makes the trees' workspace clear a no-op
(diagnosis: the fault goes with it).

Checks, all against fresh random data: the hand graph's output, poisoned with NaN before
each checked replay, is bit-equal to the eager forward; the compiled output is within bf16
tolerance of eager; canary tensors allocated on the capture stream after the sequence (where
a freed workspace block would be handed out again) still hold their values after the
replays.
"""

from __future__ import annotations

import argparse
import sys

EPS = 1e-6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", choices=("plain", "region"), default="region")
    parser.add_argument("--sequence", choices=("compile", "clear"), default="compile")
    parser.add_argument("--without-fix", action="store_true")
    parser.add_argument("--no-tree-clear", action="store_true")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--seed", type=int, default=20261127)
    parser.add_argument(
        "--siblings",
        action="store_true",
        help="with --weights region: then a switch by copy to a second weight set, a bind back, "
        "and sleep/wake, each followed by the compiled call and the hand graph",
    )
    return parser.parse_args()


def case_name(args: argparse.Namespace) -> str:
    parts = [args.weights, args.sequence, f"{args.layers}x{args.hidden}x{args.ffn}"]
    if args.without_fix:
        parts.append("without-fix")
    if args.no_tree_clear:
        parts.append("no-tree-clear")
    if args.siblings:
        parts.append("+siblings")
    return " ".join(parts)


def main() -> int:
    args = parse_args()
    name = case_name(args)
    import torch
    import torch.nn.functional as F

    def rms_norm(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

    class Stack(torch.nn.Module):
        """The tp_decode stack on one rank: pre-RMSNorm, up, SiLU, down, residual."""

        def __init__(self) -> None:
            super().__init__()

            def weight(*shape):
                empty = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
                return torch.nn.Parameter(empty, requires_grad=False)

            self.up = torch.nn.ParameterList(
                [weight(args.ffn, args.hidden) for _ in range(args.layers)]
            )
            self.down = torch.nn.ParameterList(
                [weight(args.hidden, args.ffn) for _ in range(args.layers)]
            )

        def forward(self, x):
            for up, down in zip(self.up, self.down):
                x = x + F.linear(F.silu(F.linear(rms_norm(x), up)), down)
            return x

    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    if args.weights == "region":
        import stablebuf
        from stablebuf import _guard

        if args.without_fix:
            _guard.OWN_CUBLAS_WORKSPACES = False
        with stablebuf.region("graph_beside_compile"):
            model = Stack().eval()
    else:
        model = Stack().eval()
    with torch.no_grad():
        for up, down in zip(model.up, model.down):
            up.copy_(torch.randn(up.shape, generator=generator, device="cuda") / args.hidden**0.5)
            down.copy_(torch.randn(down.shape, generator=generator, device="cuda") / args.ffn**0.5)
    if args.no_tree_clear:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.clear_cublass_cache = lambda: None

    x = torch.randn(args.batch, args.hidden, generator=generator, device="cuda")
    x = x.bfloat16()
    failures = []
    with torch.no_grad():
        want = model(x)
        # The hand graph, the way tp_decode.py captures it: warm-up on the capture stream
        # (cuBLAS makes that stream's workspace there), then the capture on it.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            out = model(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, want):
            failures.append("the first replay is not bit-equal to eager")

        reserved_before = torch.cuda.memory_reserved()
        if args.sequence == "compile":
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):  # warm-up, recording, first replay
                torch.compiler.cudagraph_mark_step_begin()
                got = compiled(x)
            torch.cuda.synchronize()
            bound = 4e-2 * want.float().abs() + 4e-2 * want.float().abs().max()
            if not ((got.float() - want.float()).abs() <= bound).all().item():
                failures.append("the compiled output is outside bf16 tolerance of eager")
        else:
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        reserved_after = torch.cuda.memory_reserved()

        # Where a freed workspace block would be handed out again: allocations on the
        # capture stream, filled with a value no replay writes.
        with torch.cuda.stream(stream):
            canaries = [
                torch.full((1 << 20,), 1234.5, device="cuda", dtype=torch.float32)
                for _ in range(64)
            ]
        torch.cuda.synchronize()
        try:
            for _ in range(args.replays):
                out.fill_(float("nan"))
                graph.replay()
            torch.cuda.synchronize()
        except RuntimeError as fault:  # the context is gone: say what killed it
            first = str(fault).strip().splitlines()[0][:200]
            print(f"RESULT {name}: fault at the replay after the sequence: {first}", flush=True)
            return 3
        if not torch.equal(out, want):
            failures.append("a replay after the sequence is not bit-equal to eager")
        overwritten = sum(int((c != 1234.5).any().item()) for c in canaries)
        if overwritten:
            failures.append(f"{overwritten} of 64 canary tensors overwritten by the replays")
        if args.siblings and args.weights == "region" and args.sequence == "compile":
            failures += siblings(torch, model, x, want, graph, out, compiled, generator, args)
    segments = f"reserved {reserved_before >> 20} -> {reserved_after >> 20} MiB"
    if failures:
        print(f"RESULT {name}: wrong: {'; '.join(failures)} ({segments})", flush=True)
        return 1
    print(f"RESULT {name}: ok ({segments})", flush=True)
    return 0


def siblings(torch, model, x, want_a, graph, out, compiled, generator, args) -> list:
    """Issue 38's siblings: the compiled call and the hand graph across a switch by copy to a
    second weight set, a bind back, and sleep/wake; every output against eager."""
    import stablebuf

    tag = "graph_beside_compile"
    failures = []

    def compiled_call():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x).clone()

    def close(got, want):
        bound = 4e-2 * want.float().abs() + 4e-2 * want.float().abs().max()
        return bool(((got.float() - want.float()).abs() <= bound).all().item())

    def both(what, want):
        out.fill_(float("nan"))
        graph.replay()
        got = compiled_call()
        torch.cuda.synchronize()
        if not torch.equal(out, want):
            failures.append(f"{what}: the hand graph is not bit-equal to eager")
        if not close(got, want):
            failures.append(f"{what}: the compiled call is outside bf16 tolerance of eager")

    set_a = stablebuf.bound(tag) or stablebuf.snapshot(tag)
    set_b = stablebuf.snapshot(tag)
    with stablebuf.writing(set_b):
        for up, down in zip(model.up, model.down):
            up.copy_(torch.randn(up.shape, generator=generator, device="cuda") / args.hidden**0.5)
            down.copy_(torch.randn(down.shape, generator=generator, device="cuda") / args.ffn**0.5)
    stablebuf.bind(tag, set_b)
    want_b = model(x)
    stablebuf.bind(tag, set_a)
    way = stablebuf.switch(tag, set_b, strategy="copy")
    if way != "copy":
        failures.append(f"switch(strategy='copy') went by {way}")
    both("after a switch by copy", want_b)
    stablebuf.bind(tag, set_a)
    both("after a bind back", want_a)
    stablebuf.sleep(tag)
    refused = 0
    for call in (graph.replay, compiled_call):
        try:
            call()
        except stablebuf.Asleep:
            refused += 1
    if refused != 2:
        failures.append(f"asleep: {2 - refused} of the hand replay and the compiled call ran")
    stablebuf.wake(tag)
    both("after sleep and wake", want_a)
    return failures


if __name__ == "__main__":
    sys.exit(main())
