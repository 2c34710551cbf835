"""GPU tests of issue 42 (cross-node weight sync over NCCL into the shadow set): the race at
2 and 4 ranks and the dead-trainer test, each a ``torch.distributed.run`` of
``nccl_sync_rank.py`` with a GPU per rank, over NCCL's network transport
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: sockets over loopback) unless
STABLEBUF_NCCL_TRANSPORT=nvlink. Skipped without the GPUs."""

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
RANK = os.path.join(HERE, "nccl_sync_rank.py")
TIMEOUT_S = int(os.environ.get("NCCL_SYNC_TIMEOUT", "900"))
SEEDS = os.environ.get("STABLEBUF_TP_RACE_SEEDS", "").strip() or str(
    random.SystemRandom().randrange(1, 1 << 31))


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(mode: str, ranks: int) -> str:
    folder = tempfile.mkdtemp(prefix="sbnc-")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_NCCL_ENABLE_MONITORING="0")
    if os.environ.get("STABLEBUF_NCCL_TRANSPORT", "net") == "net":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
    site = os.path.dirname(os.path.dirname(os.path.abspath(stablebuf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--standalone", RANK, mode, folder, SEEDS]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{mode} at {ranks} ranks: no end in {TIMEOUT_S} s\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        logs = ""
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            with open(os.path.join(folder, name), errors="replace") as f:
                logs += f"\n--- {name}\n{f.read()[-1500:]}"
        shutil.rmtree(folder, ignore_errors=True)
    detail = f"seeds {SEEDS}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}{logs[-6000:]}"
    assert proc.returncode == 0, detail
    print("\n".join(l for l in out.splitlines() if l.startswith(("race seed", "KILL"))))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_race_over_nccl_every_step_from_one_version(ranks):
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    out = _run("race", ranks)
    for seed in SEEDS.split(","):
        for rank in range(ranks):
            assert f"race seed {seed}: rank {rank} ok:" in out


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_dead_trainer_never_takes_the_engine_down(ranks):
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    out = _run("kill", ranks)
    for rank in range(ranks):
        assert f"KILL rank {rank}: PASS" in out
