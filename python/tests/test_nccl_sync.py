"""GPU tests of issue 42 (cross-node weight sync over NCCL into the shadow set): the race at
2 and 4 ranks and the dead-trainer test, each a ``torch.distributed.run`` of
``nccl_sync_rank.py`` with a GPU per rank, over NCCL's network transport
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: sockets over loopback) unless
STABLEBUF_NCCL_TRANSPORT=nvlink. Skipped without the GPUs.

Time limits: ``NCCL_SYNC_TIMEOUT`` (s, the race; 900) and ``NCCL_SYNC_KILL_TIMEOUT`` (s, the
dead-trainer run; 300, about four times a passing run's 40-75 s). On a limit the ranks' and
trainers' stacks are dumped into their logs (SIGUSR1, see nccl_sync_rank.py) before the run is
killed, and the failure carries every log of the run's folder. ``NCCL_SYNC_LOG_DIR``: make each
run's folder there and keep it (else a temporary one, kept only when the run failed)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import stablebuf

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "nccl_sync_rank.py")
TIMEOUT_S = int(os.environ.get("NCCL_SYNC_TIMEOUT", "900"))
KILL_TIMEOUT_S = int(os.environ.get("NCCL_SYNC_KILL_TIMEOUT", "300"))
LOG_DIR = os.environ.get("NCCL_SYNC_LOG_DIR") or None
SEEDS = os.environ.get("STABLEBUF_TP_RACE_SEEDS", "").strip() or str(
    random.SystemRandom().randrange(1, 1 << 31))


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _signal_run(folder: str, sig: int) -> list:
    """Sends ``sig`` to every process of the run still alive, as listed in ``FOLDER/pids``
    (each rank and trainer adds itself) and checked to be this test's script. torchrun starts
    each rank in a session of its own, so killing torchrun's process group leaves the ranks
    (and their trainers) running: they must be signalled one by one."""
    signalled = []
    try:
        with open(os.path.join(folder, "pids")) as f:
            entries = [line.split(" ", 1) for line in f.read().splitlines() if " " in line]
    except OSError:
        return signalled
    for pid, who in entries:
        try:
            with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
                if b"nccl_sync_rank.py" not in f.read():
                    continue
            os.kill(int(pid), sig)
            signalled.append(f"{pid} ({who})")
        except (OSError, ValueError):
            continue
    return signalled


STDOUT, STDERR = "torchrun.stdout", "torchrun.stderr"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _logs(folder: str, tail: int = 4000) -> str:
    out = ""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name not in (STDOUT, STDERR):
            with open(path, errors="replace") as f:
                out += f"\n--- {name}\n{f.read()[-tail:]}"
    return out


def _run(mode: str, ranks: int, timeout: int) -> str:
    if LOG_DIR is not None:
        os.makedirs(LOG_DIR, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"sbnc-{mode}{ranks}-", dir=LOG_DIR)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_NCCL_ENABLE_MONITORING="0")
    if os.environ.get("STABLEBUF_NCCL_TRANSPORT", "net") == "net":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
    site = os.path.dirname(os.path.dirname(os.path.abspath(stablebuf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--standalone", RANK, mode, folder, SEEDS]
    start = time.monotonic()
    # Into the folder, not pipes: whatever kills this test, the folder has everything so far.
    with open(os.path.join(folder, STDOUT), "w") as out_f, \
            open(os.path.join(folder, STDERR), "w") as err_f:
        proc = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=err_f, text=True,
                                start_new_session=True)
    timed_out, signalled = False, []
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        signalled = _signal_run(folder, signal.SIGUSR1)  # every thread's stack into its log
        time.sleep(3.0)  # the dumps land in the logs
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - start
    left = _signal_run(folder, signal.SIGKILL)  # nothing of this run outlives it
    out, err = _read(os.path.join(folder, STDOUT)), _read(os.path.join(folder, STDERR))
    failed = timed_out or proc.returncode != 0
    logs = _logs(folder)  # before the folder goes, whatever happened
    if LOG_DIR is None and not failed:
        shutil.rmtree(folder, ignore_errors=True)
    detail = (f"{mode} at {ranks} ranks, seeds {SEEDS}: "
              + (f"no end in {timeout} s (stacks dumped by {signalled})" if timed_out
                 else f"exit {proc.returncode} after {seconds:.1f} s")
              + (f"; killed, still running after it: {left}" if left else "")
              + f"; folder {folder}{' (kept)' if failed or LOG_DIR else ''}"
              + f"\n--- stdout\n{out[-6000:]}\n--- stderr\n{err[-8000:]}{logs[-24000:]}")
    if timed_out:
        pytest.fail(detail)
    assert proc.returncode == 0, detail
    print(f"{mode} at {ranks} ranks: {seconds:.1f} s")
    print("\n".join(l for l in out.splitlines() if "race seed" in l or "KILL rank" in l))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_race_over_nccl_every_step_from_one_version(ranks):
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    out = _run("race", ranks, TIMEOUT_S)
    for seed in SEEDS.split(","):
        for rank in range(ranks):
            assert f"race seed {seed}: rank {rank} ok:" in out


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_dead_trainer_never_takes_the_engine_down(ranks):
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    out = _run("kill", ranks, KILL_TIMEOUT_S)
    for rank in range(ranks):
        assert f"KILL rank {rank}: PASS" in out
