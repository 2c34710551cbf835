"""Region tags and where their work runs: the ``tags`` argument, the CUDA device each region
lives on, the current device, and PyTorch's current stream on a region's device.

The bottom of the package's own modules (it imports only the extension): the replay guard, the
region calls, the graph classes and the publish protocol all stand on it. Nothing here imports
torch; the helpers look for a torch already imported, except :func:`cuda_torch`, which the
calls that need PyTorch use to import it.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Union

from . import _native
from ._native import Error, UnknownTag

Tags = Union[str, Iterable[str]]

# The device of each tag's region: a region never moves, so what the extension said is kept.
_TAG_DEVICES: Dict[str, int] = {}


def as_tags(tags: Tags) -> List[str]:
    """``"w"`` or ``["w", "kv"]`` as a list of tags."""
    if isinstance(tags, str):
        return [tags]
    names = list(tags)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"tags must be strings, got {type(name).__name__}: {name!r}")
    return names


def remember_device(tag: str, device: int) -> None:
    """Record that region ``tag`` was created on ``device`` (saves asking the extension)."""
    _TAG_DEVICES[tag] = device


def device_of(tag: str) -> int:
    """The CUDA device region ``tag`` lives on; :class:`UnknownTag` if there is no region."""
    device = _TAG_DEVICES.get(tag)
    if device is None:
        device = _TAG_DEVICES[tag] = _native.region_device(tag)
    return device


def devices_of(tags: Iterable[str]) -> List[int]:
    """The devices of the regions ``tags``, each once. Unknown tags are skipped: the call that
    follows names them in its :class:`UnknownTag`."""
    devices: List[int] = []
    for tag in tags:
        try:
            device = device_of(tag)
        except UnknownTag:
            continue
        if device not in devices:
            devices.append(device)
    return devices


def tags_on(device: int) -> List[str]:
    """The tags whose regions live on ``device``, in creation order."""
    return [tag for tag in _native.tags() if device_of(tag) == device]


def cuda_torch() -> "Any":
    """``torch``, imported, with a CUDA device it can see (the PyTorch glue's entry point)."""
    try:
        import torch
    except ImportError as missing:  # pragma: no cover - depends on the environment
        raise ImportError("stablebuf's PyTorch glue needs torch (pip install torch)") from missing
    if not torch.cuda.is_available():
        raise Error("stablebuf regions need a CUDA device, and torch sees none")
    return torch


def stream_of(tag: str) -> int:
    """PyTorch's current CUDA stream handle on the device of region ``tag``, whatever device is
    current (0, the legacy default stream, where torch has not initialised CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.current_stream(device_of(tag)).cuda_stream)


def streams_of(tags: Iterable[str]) -> Dict[int, int]:
    """``{device: PyTorch's current CUDA stream handle there}`` for the devices of the regions
    ``tags``: each region's copies and fences go on its own device's stream. Empty where torch
    has not initialised CUDA (the extension then uses each device's legacy default stream)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {
        device: int(torch.cuda.current_stream(device).cuda_stream) for device in devices_of(tags)
    }


def current_device() -> int:
    """PyTorch's current CUDA device (0 where torch is not imported or sees no CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.current_device())
