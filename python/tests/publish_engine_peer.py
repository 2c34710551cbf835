"""The engine process of test_publish.py's tests that need the engine in another process (an
engine killed under its trainer; a trainer on GPU 0 publishing into an engine on GPU 1).

    python publish_engine_peer.py PATH DEVICE SEED,SEED,...

Builds publish_peer.py's model on DEVICE in a region, serves it with a captured graph and, as
a serving loop does, calls ``Engine.poll`` at every step boundary and reads its status: each
version it binds is checked against the CPU reference of that version's seed (a NaN-poisoned
output, replayed), and ``served N ok`` printed. Prints ``ready`` once serving, ``trainer
gone`` (and exits 0) when a trainer that was connected is gone; the status's problems go to
stderr. Exits non-zero if a check failed; runs until then or until killed.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from stablebuf.publish import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import publish_peer as peer  # noqa: E402  (the model both sides share)


def main(argv) -> int:
    path, device, seeds = argv[1], int(argv[2]), [int(s) for s in argv[3].split(",")]
    torch.cuda.set_device(device)
    tag = f"peer-engine-{device}"
    tensors = peer.build_model(tag, device, seed=0)
    engine = Engine(tag, path, tensors)
    served = peer.Served(tag, tensors, device)
    served.check(0, "initial")
    peer.say("ready")
    had_trainer = False
    while True:
        status = engine.poll()
        for problem in status.problems:
            print(f"engine: {problem}", file=sys.stderr, flush=True)
        if status.bound is not None:
            served.check(seeds[status.bound - 1], f"version {status.bound}")
            peer.say(f"served {status.bound} ok")
        if had_trainer and not status.trainer_connected:
            peer.say("trainer gone")
            return 0
        had_trainer = status.trainer_connected
        time.sleep(0.001)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
