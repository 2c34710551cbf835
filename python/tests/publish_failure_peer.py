"""The other process of test_publish_failures.py: a trainer (of an ``Engine``, KIND ``engine``,
or of a ``PipelinedEngine``, KIND ``pipelined``) or an engine, over publish_peer.py's model.

    python publish_failure_peer.py ROLE KIND PATH [ARGS...]

- ``trainer KIND PATH SEED,...``: connects, prints ``connected``; per seed reads a stdin line
  and publishes it as the next version (``published N``); closes when stdin closes.
- ``die-write KIND PATH SEED``: writes part of a free set, prints ``ready``, sleeps (killed).
- ``die-commit KIND PATH SEED``: writes a whole free set, commits version 1, prints
  ``committed`` and kills itself (SIGKILL) at once.
- ``engine KIND PATH DEVICE SEED,...``: serves (poll and replay at every step), checks each
  version it switches to against its seed's CPU reference and prints ``served N ok``; prints
  ``ready`` once serving; runs until killed.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import stablebuf
from stablebuf._pipelined import PipelinedEngine, PipelinedTrainer
from stablebuf._pulling import PullingEngine
from stablebuf.publish import Engine, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import publish_peer as peer  # noqa: E402


def connect(kind: str, path: str):
    if kind in ("pipelined", "pulled"):  # connect() finds a pulling engine
        return PipelinedTrainer.connect(path, expect=peer.expected())
    return Trainer.connect(path, expect=peer.expected())


def acquire(kind: str, trainer):
    """(tensors of a free set, commit(version))."""
    if kind in ("pipelined", "pulled"):
        region, set_id = trainer.acquire()
        return trainer.tensors(region, set_id), lambda v: trainer.commit(region, set_id, v)
    set_id = trainer.acquire()
    return trainer.tensors(set_id), lambda v: trainer.commit(set_id, v)


class Serving:
    """An engine of either kind over publish_peer.py's model on ``device``, with ``check``."""

    def __init__(self, kind: str, name: str, path: str, device: int) -> None:
        self.kind = kind
        if kind in ("pipelined", "pulled"):
            tags = (f"{name}-a", f"{name}-b")
            self.tensors, self.served = [], []
            for tag in tags:
                with stablebuf.region(tag, fence="last-use"):
                    tensors = {
                        n: torch.empty(s, dtype=d, device=f"cuda:{device}")
                        for n, (s, d) in peer.SHAPES.items()
                    }
                for n, v in peer.weights(0).items():
                    tensors[n].copy_(v)
                self.tensors.append(tensors)
                self.served.append(peer.Served(tag, tensors, device))
            torch.cuda.synchronize(device)  # the eager warm-ups were not noted
            kind_of = PullingEngine if kind == "pulled" else PipelinedEngine
            self.engine = kind_of(tags, path, self.tensors, lambda i: self.served[i].graph)
            if self.engine.uploaded != (True, True):
                raise AssertionError(f"the engine's graphs were not uploaded: {self.engine.uploaded}")
        else:
            tag = name
            self.tensors = peer.build_model(tag, device, seed=0)
            self.served = [peer.Served(tag, self.tensors, device)]
            self.engine = Engine(tag, path, self.tensors)

    def poll(self):
        return self.engine.poll()

    def replay(self):
        if self.kind in ("pipelined", "pulled"):
            served = self.served[self.engine.current]
            served.out.fill_(float("nan"))
            self.engine.step()
            torch.cuda.current_stream().synchronize()
            return served.out.double().cpu()
        return self.served[0].replay()

    def check(self, seed: int, what: str = "") -> None:
        torch.testing.assert_close(
            self.replay(), peer.reference(seed), rtol=2e-3, atol=2e-3, msg=lambda m: f"{what}: {m}"
        )

    @property
    def version(self) -> int:
        return self.engine.version

    def close(self) -> None:
        self.engine.close()


def main(argv) -> int:
    role, kind, path = argv[1], argv[2], argv[3]
    if role == "trainer":
        seeds = [int(s) for s in argv[4].split(",")]
        trainer = connect(kind, path)
        peer.say("connected")
        for version, seed in enumerate(seeds, start=trainer.version + 1):
            if not sys.stdin.readline():
                return 2
            trainer.publish(peer.weights(seed), version=version)
            peer.say(f"published {version}")
        sys.stdin.read()
        trainer.close()
        return 0
    if role in ("die-write", "die-commit"):
        trainer = connect(kind, path)
        tensors, commit = acquire(kind, trainer)
        new = peer.weights(int(argv[4]))
        names = list(peer.SHAPES)
        for name in names if role == "die-commit" else names[:2]:
            tensors[name].copy_(new[name])
        torch.cuda.synchronize()
        if role == "die-write":
            peer.say("ready")
            time.sleep(120)
            return 4
        commit(trainer.version + 1)
        peer.say("committed")
        os.kill(os.getpid(), signal.SIGKILL)
        return 5
    if role == "engine":
        device, seeds = int(argv[4]), [int(s) for s in argv[5].split(",")]
        torch.cuda.set_device(device)
        serving = Serving(kind, f"failure-peer-{kind}-{device}", path, device)
        serving.check(0, "initial")
        peer.say("ready")
        while True:
            status = serving.poll()
            for problem in status.problems:
                print(f"engine: {problem}", file=sys.stderr, flush=True)
            if status.bound is not None:
                serving.check(seeds[status.bound - 1], f"version {status.bound}")
                peer.say(f"served {status.bound} ok")
            else:
                serving.replay()
            time.sleep(0.001)
    peer.say(f"unknown role {role}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
