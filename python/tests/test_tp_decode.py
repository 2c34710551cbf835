"""GPU test of ``python/examples/tp_decode.py``: tensor-parallel decode over stablebuf regions
on 2 and 4 GPUs of one host.

Each case runs the example, at ``--small`` (64 MiB of weights per rank at 2 ranks) or at its
default size (2 GiB of weights over the ranks, where issue 38's fault showed: a hand-captured
graph beside ``torch.compile``'s graph trees), under ``torch.distributed.run`` (torchrun: one
process per GPU, NCCL) in its own process group, with a timeout (``TP_DECODE_TIMEOUT``
seconds, 300 by default) after which every process of the run is killed, and asserts exit 0
and the example's final line ``tp_decode: N ranks, all outputs correct``. The example checks
that the captured decode step, all-reduces inside, replays bit-equal to eager on every weight
set it binds, that the guarded replay refuses while the weights sleep, and more (its
docstring). A case skips, with the reason, where fewer than N CUDA GPUs are visible.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import stablebuf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join("python", "examples", "tp_decode.py")
TIMEOUT_S = int(os.environ.get("TP_DECODE_TIMEOUT", "300"))


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ranks", "size"),
    [
        pytest.param(
            n, size, marks=pytest.mark.skipif(_gpu_count() < n, reason=f"needs {n} CUDA GPUs")
        )
        for n, size in ((1, "default"), (2, "small"), (2, "default"), (4, "small"), (4, "default"))
    ],
)
def test_tp_decode_example_swaps_weight_sets_under_a_graph_with_all_reduces(ranks, size):
    env = dict(os.environ)
    # The ranks import the stablebuf this test imported (PYTHONPATH passed through, with its
    # folder first), never the source folder python/stablebuf, which has no extension.
    site = os.path.dirname(os.path.dirname(os.path.abspath(stablebuf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--standalone",
        EXAMPLE,
        *(["--small"] if size == "small" else []),
    ]
    # A session of its own, so that a hung run's ranks (torchrun's children) are killed too.
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"tp_decode on {ranks} GPUs did not finish in {TIMEOUT_S} s (killed)\n"
            f"--- stdout\n{_tail(stdout)}\n--- stderr\n{_tail(stderr)}"
        )
    print(stdout)  # the example's tables, shown with pytest -s or on failure
    finals = [line for line in stdout.splitlines() if line.startswith(f"tp_decode: {ranks} ranks,")]
    detail = f"--- stdout\n{_tail(stdout)}\n--- stderr\n{_tail(stderr)}"
    assert process.returncode == 0, f"tp_decode exited {process.returncode}\n{detail}"
    assert finals, f"tp_decode printed no final line\n{detail}"
    assert finals[-1] == f"tp_decode: {ranks} ranks, all outputs correct", detail
