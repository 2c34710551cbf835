"""GPU test of tensor-parallel weight publishing (``stablebuf.publish.Engine(group=...)``):
2 and 4 ranks under ``torch.distributed.run`` with a gloo group, each engine racing its own
trainer process; a version is bound on every rank at the same step boundary or on none, a
failed bind on one rank leaves every rank on its version, and rollbacks are one bind on every
rank (``tp_publish_rank.py`` says what each rank checks). Runs on one GPU (the ranks share
it) or several."""

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

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "tp_publish_rank.py")


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_engines_switch_on_every_rank_or_on_none(ranks):
    seeds = [random.randrange(1, 1 << 30) for _ in range(24)]
    race_seed = random.randrange(1 << 30)
    folder = tempfile.mkdtemp(prefix="sbtp-")  # short: a Unix socket path has 107 bytes
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    site = os.path.dirname(os.path.dirname(os.path.abspath(stablebuf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--standalone",
        RANK,
        folder,
        ",".join(map(str, seeds)),
        str(race_seed),
    ]
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"race seed {race_seed}: did not finish in 300 s\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    detail = f"race seed {race_seed}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}"
    assert process.returncode == 0, detail
    for rank in range(ranks):
        assert f"rank {rank} ok:" in stdout, detail
