"""Shared fixtures: the GPU tests skip, with the reason, where torch or a CUDA device is missing."""

from __future__ import annotations

import importlib.util
import os

import pytest

import stablebuf

_SOURCE_TREE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stablebuf"
)
if os.path.dirname(os.path.abspath(stablebuf.__file__)) == _SOURCE_TREE and not any(
    name.startswith("_native") and name.endswith(".so") for name in os.listdir(_SOURCE_TREE)
):
    raise pytest.UsageError(
        "imported stablebuf from the source tree, which has no built extension: build and "
        "install the wheel (python/build-wheel.sh, then pip install --target DIR) and run pytest "
        "from the repository root with PYTHONPATH=DIR"
    )


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not stablebuf.driver_present():
        return "no CUDA driver"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()


@pytest.fixture(autouse=True)
def _current_cuda_device_kept():
    """Put PyTorch's current CUDA device back after each test, so that a test that switches
    devices (the two-GPU ones) cannot move the tests after it to another GPU. Before torch has
    initialised CUDA the current device is device 0; the fixture does not initialise it."""
    if GPU_SKIP_REASON is not None:
        yield
        return
    import torch

    before = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    yield
    if torch.cuda.is_initialized() and torch.cuda.current_device() != before:
        torch.cuda.set_device(before)


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {GPU_SKIP_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch with a CUDA device")
