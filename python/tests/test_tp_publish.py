"""GPU test of tensor-parallel weight publishing (``stablebuf.publish.Engine(group=...)``): the
race of ``tp_publish_rank.py`` (commits raced against steps, injected bind failures,
rollbacks; every step's output on every rank from exactly one version, and every set back
with its trainer) at 2 and 4 ranks under ``torch.distributed.run``, with every rank on one GPU
and with a GPU per rank (skipped, with the reason, where fewer GPUs are visible).

Each case runs the race seeds in ``STABLEBUF_TP_RACE_SEEDS`` (comma-separated, to repeat a
run) or else 3 fresh ones; they are in the test's id, and the ranks print each as it starts.
The engines agree every ``STABLEBUF_TP_AGREE_EVERY`` boundaries (default: the engine's
default, ``DEFAULT_AGREE_EVERY``; 1 agrees at every boundary).
A case that does not finish in ``TP_PUBLISH_TIMEOUT`` seconds (600 by default) is killed with
all its processes and fails.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

import stablebuf
from stablebuf._switcher import DEFAULT_AGREE_EVERY

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "tp_publish_rank.py")
TIMEOUT_S = int(os.environ.get("TP_PUBLISH_TIMEOUT", "600"))
AGREE_EVERY = int(os.environ.get("STABLEBUF_TP_AGREE_EVERY", "") or DEFAULT_AGREE_EVERY)


def _race_seeds() -> list:
    chosen = os.environ.get("STABLEBUF_TP_RACE_SEEDS", "").strip()
    if chosen:
        return [int(s) for s in chosen.split(",") if s.strip()]
    fresh = random.SystemRandom()
    return [fresh.randrange(1, 1 << 31) for _ in range(3)]


RACE_SEEDS = _race_seeds()
SEEDS_ID = f"agree-every-{AGREE_EVERY}-race-seeds-" + "-".join(map(str, RACE_SEEDS))


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cases():
    for ranks in (2, 4):
        yield pytest.param(ranks, "one-gpu", id=f"{ranks}-ranks-one-gpu-{SEEDS_ID}")
        yield pytest.param(
            ranks,
            "gpu-per-rank",
            id=f"{ranks}-ranks-gpu-per-rank-{SEEDS_ID}",
            marks=pytest.mark.skipif(
                _gpu_count() < ranks, reason=f"needs {ranks} GPUs (a GPU per rank)"
            ),
        )


@pytest.mark.gpu
@pytest.mark.parametrize(("ranks", "placement"), list(_cases()))
def test_tensor_parallel_engines_switch_on_every_rank_or_on_none(ranks, placement):
    folder = tempfile.mkdtemp(prefix="sbtp-")  # short: a Unix socket path has 107 bytes
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    site = os.path.dirname(os.path.dirname(os.path.abspath(stablebuf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    seeds = ",".join(map(str, RACE_SEEDS))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--standalone",
        RANK,
        folder,
        placement,
        seeds,
        str(AGREE_EVERY),
    ]
    print(
        f"race seeds {seeds} (STABLEBUF_TP_RACE_SEEDS={seeds} repeats them), "
        f"agree_every={AGREE_EVERY}"
    )
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a hung run's ranks and trainers are killed too
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"race seeds {seeds}: did not finish in {TIMEOUT_S} s\n{stdout[-3000:]}\n"
            f"{stderr[-3000:]}"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    detail = f"race seeds {seeds}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}"
    assert process.returncode == 0, detail
    for race_seed in RACE_SEEDS:
        for rank in range(ranks):
            assert f"race seed {race_seed}: rank {rank} ok:" in stdout, detail
    print("\n".join(line for line in stdout.splitlines() if line.startswith("race seed")))
