"""One rank of test_tp_publish.py, started by ``torch.distributed.run``: an engine per rank
(group: gloo over every rank; ranks share the GPUs there are, round robin), each racing its
own trainer (publish_peer.py's ``trainer`` role, in a subprocess, told to publish the next
version at random steps: every rank at its own pace). At every step boundary each rank polls
(or, at planned steps, rolls back; at one planned step the last rank's bind fails), replays
its graph over a NaN-poisoned output, checks it against the CPU reference of the version it
reports, and the ranks compare (version, refused): one version on every rank after every
boundary, and a refusal on every rank or on none. Ends by polling until every version is
committed on every rank and none waits (every rank then serves the last one, or the one
before it after a late rollback), and prints ``rank R ok: ...``.

    python -m torch.distributed.run --nproc-per-node N --standalone tp_publish_rank.py \\
        DIR SEED,SEED,... RACE_SEED
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import stablebuf
from stablebuf.publish import Engine

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import publish_peer as peer  # the shared model and the trainer

STEPS = 300


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    folder, seeds, race_seed = (
        sys.argv[1],
        [int(s) for s in sys.argv[2].split(",")],
        int(sys.argv[3]),
    )
    seed_of = {0: 0, **{v: s for v, s in enumerate(seeds, start=1)}}
    shared = random.Random(race_seed)  # the same plan on every rank
    rollbacks = set(shared.sample(range(20, STEPS), 12))
    fail_at = shared.choice([s for s in range(40, STEPS) if s not in rollbacks])
    pace = random.Random(race_seed * 1000 + rank)  # this rank's own trainer pace

    tag = f"tp-publish-{rank}"
    tensors = peer.build_model(tag, device, seed=0)
    path = os.path.join(folder, f"engine-{rank}.sock")
    engine = Engine(tag, path, tensors, sets=3, keep_previous=True, group=dist.group.WORLD)
    served = peer.Served(tag, tensors, device)
    trainer = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "publish_peer.py"),
            "trainer",
            path,
            ",".join(map(str, seeds)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    told = switches = refused_count = rolled_back = 0

    def tell() -> None:
        nonlocal told
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        told += 1

    def agree(what: str, value) -> None:
        views = [None] * world
        dist.all_gather_object(views, value)
        assert len(set(views)) == 1, f"rank {rank}, {what}: the ranks disagree: {views}"

    try:
        for step in range(STEPS):
            if told < len(seeds) and pace.random() < 0.25:
                tell()
            if step == fail_at and rank == world - 1:
                real_bind = engine._bind

                def failing_bind(weight_set, real_bind=real_bind):
                    engine._bind = real_bind  # once
                    raise RuntimeError("injected bind failure")

                engine._bind = failing_bind
            before = engine.version
            refused = False
            try:
                if step in rollbacks:
                    engine.rollback()
                    rolled_back += engine.version != before
                elif engine.poll() is not None:
                    switches += 1
            except stablebuf.PublishError:
                refused = True
                refused_count += 1
            served.check(
                seed_of[engine.version], f"rank {rank}, step {step}, version {engine.version}"
            )
            agree(f"step {step}", (engine.version, refused))
        while told < len(seeds):
            tell()
        # Until every version is committed on every rank and nothing waits: then every rank
        # serves the same version (the last one, or the one before it after a late rollback).
        deadline = time.monotonic() + 120
        while True:
            engine.poll()
            states = [None] * world
            quiet = engine._versions.last == len(seeds) and not engine.ready_versions
            dist.all_gather_object(states, (engine.version, quiet))
            if all(quiet for _, quiet in states):
                break
            assert time.monotonic() < deadline, f"rank {rank}: never settled: {states}"
            time.sleep(0.002)
        agree("the end", engine.version)
        assert engine.version >= len(seeds) - 1, f"rank {rank}: ended on {engine.version}"
        served.check(seed_of[engine.version], f"rank {rank}, the end")
        assert switches > 5 and rolled_back > 0, (
            f"rank {rank}: {switches} switches, {rolled_back} rollbacks"
        )
        assert refused_count > 0, f"rank {rank}: the injected failure refused nothing"
    finally:
        if trainer.stdin:
            trainer.stdin.close()
        try:
            trainer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            trainer.kill()
        engine.close()
    print(
        f"rank {rank} ok: {switches} switches, {rolled_back} rollbacks, {refused_count} "
        f"refused boundaries, version {engine.version} at the end",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
