"""The other process of test_publish.py (and the model both sides share).

Run as ``python publish_peer.py ROLE PATH [ARGS...]``; it prints what it did, one line at a time,
and exits 0 only if everything it checked held. Roles:

- ``trainer PATH SEED,SEED,...``: connects, and for each seed reads a line from stdin, then
  publishes that seed's weights as the next version; finally checks that publishing the last
  version again raises VersionConflict, and waits for stdin to close.
- ``twin PATH SEED,SEED,...``: as ``trainer``, but the weights go into ``Trainer.twin()``
  first and each publish is of the twin (one copy of the whole layout, timed on the GPU).
- ``die PATH SEED``: connects, writes half the tensors of a free set, prints ``ready`` and
  sleeps, to be killed mid-write.
- ``mismatch PATH``: connects expecting another shape for one tensor: must get OfferMismatch.
- ``second PATH``: connects to an engine that has a trainer: must be refused.
- ``fanout PATH,PATH SEED``: one trainer process publishing to two engines (a Trainer each).
- ``hangup PATH``: connects and closes at once, before the handshake.
"""

from __future__ import annotations

import sys
import time

import torch

import stablebuf
from stablebuf.publish import Trainer

# The model: tensor name → (shape, dtype). Mixed dtypes, so the trainer's cast is exercised.
SHAPES = {
    "layers.0.w1": ((256, 512), torch.bfloat16),
    "layers.0.w2": ((512, 128), torch.float32),
    "layers.0.b": ((128,), torch.float32),
}
BATCH = 64


def weights(seed: int):
    """Fresh random fp32 weights (CPU) for ``seed``: the trainer's "new" weights."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.05 for n, (s, _) in SHAPES.items()}


def batch(seed: int = 12345):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 256, generator=g)


def forward(t, x):
    return (x @ t["layers.0.w1"].to(x.dtype)) @ t["layers.0.w2"].to(x.dtype) + t["layers.0.b"].to(
        x.dtype
    )


def reference(seed: int):
    """The engine's output for ``seed``'s weights, in float64 on the CPU (after the cast to
    the engine's dtypes that publishing does)."""
    w = {n: v.to(SHAPES[n][1]).double() for n, v in weights(seed).items()}
    return forward(w, batch().double())


def build_model(tag: str, device: int, seed: int):
    """The engine's tensors, in region ``tag``, holding ``seed``'s weights."""
    with stablebuf.region(tag):
        tensors = {
            n: torch.empty(s, dtype=d, device=f"cuda:{device}") for n, (s, d) in SHAPES.items()
        }
    for n, v in weights(seed).items():
        tensors[n].copy_(v)
    torch.cuda.synchronize(device)
    return tensors


class Served:
    """A graph over the model: ``check(seed)`` poisons the output, replays, compares."""

    def __init__(self, tag: str, tensors, device: int) -> None:
        self.x = batch().to(f"cuda:{device}")
        self.graph = stablebuf.CUDAGraph(tags=[tag])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(tensors, self.x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.out = forward(tensors, self.x)

    def replay(self):
        self.out.fill_(float("nan"))
        self.graph.replay()
        torch.cuda.current_stream().synchronize()
        return self.out.double().cpu()

    def check(self, seed: int, what: str = "") -> None:
        torch.testing.assert_close(
            self.replay(), reference(seed), rtol=2e-3, atol=2e-3, msg=lambda m: f"{what}: {m}"
        )


def expected():
    return {n: (s, d) for n, (s, d) in SHAPES.items()}


def say(line: str) -> None:
    print(line, flush=True)


def main(argv) -> int:
    role, path = argv[1], argv[2]
    if role == "trainer":
        seeds = [int(s) for s in argv[3].split(",")]
        trainer = Trainer.connect(path, expect=expected(), check_dtypes=True)
        say("connected")
        for version, seed in enumerate(seeds, start=1):
            if not sys.stdin.readline():
                return 2
            trainer.publish(weights(seed), version=version)
            say(f"published {version} {time.monotonic()!r}")
        try:
            trainer.publish(weights(seeds[-1]), version=len(seeds))
            say("republished: no VersionConflict")
            return 3
        except stablebuf.VersionConflict as conflict:
            say(f"conflict-ok {conflict}")
        sys.stdin.read()  # until the test closes stdin
        trainer.close()
        return 0
    if role == "twin":
        seeds = [int(s) for s in argv[3].split(",")]
        trainer = Trainer.connect(path, expect=expected(), check_dtypes=True)
        trainer.gpu_timing = True
        twin = trainer.twin()
        say("connected")
        for version, seed in enumerate(seeds, start=1):
            if not sys.stdin.readline():
                return 2
            for name, value in weights(seed).items():
                twin[name].copy_(value)  # cast to the engine's dtypes, as publish would
            trainer.publish(twin, version=version)
            parts = trainer.last_write
            if parts["twin"] != 1.0 or parts["copies"] != 1.0 or not parts["gpu_s"] > 0.0:
                say(f"not one timed copy of the twin: {parts}")
                return 3
            say(f"published {version} {time.monotonic()!r}")
        sys.stdin.read()
        trainer.close()
        return 0
    if role == "die":
        trainer = Trainer.connect(path, expect=expected())
        set_id = trainer.acquire()
        tensors = trainer.tensors(set_id)
        new = weights(int(argv[3]))
        for name in list(SHAPES)[:2]:
            tensors[name].copy_(new[name])
        torch.cuda.synchronize()
        say("ready")
        time.sleep(120)
        return 4
    if role == "mismatch":
        wrong = expected()
        name = "layers.0.w2"
        wrong[name] = ((512, 129), torch.float32)
        try:
            Trainer.connect(path, expect=wrong)
        except stablebuf.OfferMismatch as mismatch:
            ok = name in str(mismatch) and "(512, 129)" in str(mismatch)
            say(f"mismatch-{'ok' if ok else 'unnamed'} {mismatch}")
            return 0 if ok else 3
        say("connected: no OfferMismatch")
        return 3
    if role == "second":
        try:
            Trainer.connect(path, expect=expected(), timeout=20)
        except stablebuf.PublishError as refused:
            ok = "already has a trainer" in str(refused)
            say(f"refused-{'ok' if ok else 'other'} {type(refused).__name__}: {refused}")
            return 0 if ok else 3
        say("connected: not refused")
        return 3
    if role == "fanout":
        # One trainer process, two engines: one Trainer per engine.
        paths, seed = argv[2].split(","), int(argv[3])
        trainers = [Trainer.connect(p, expect=expected()) for p in paths]
        say("connected")
        if not sys.stdin.readline():
            return 2
        for trainer in trainers:
            trainer.publish(weights(seed), version=1)
        say("published 1")
        sys.stdin.read()
        for trainer in trainers:
            trainer.close()
        return 0
    if role == "hangup":
        stablebuf._native.PublishChannel.connect(path).close()
        say("hung up")
        return 0
    say(f"unknown role {role}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
