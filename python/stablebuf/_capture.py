"""No remap or copy of region memory during a CUDA graph capture: :class:`CaptureActive` and
the check that raises it."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from ._devices import devices_of
from ._native import Error


class CaptureActive(Error):
    """A call that unmaps, maps or copies region memory (``sleep``, ``wake``, ``bind``,
    ``switch``, ``unbind``, ``snapshot``, ``crossover_bytes``, which may calibrate) came while
    a CUDA graph capture is under way on the current stream (of the current device, or of the
    device of a region the call acts on); nothing was changed."""


CaptureActive.__module__ = "stablebuf"


def refuse_during_capture(call: str, tags: Sequence[str] = ()) -> None:
    """Raise :class:`CaptureActive` if the current stream, or the current stream of a device
    the regions ``tags`` live on, is capturing a CUDA graph: a remap or a copy now would be
    captured into (or break) the graph being recorded."""
    torch = sys.modules.get("torch")
    if torch is None:
        return  # without torch nothing can be capturing through PyTorch
    try:
        if not torch.cuda.is_initialized():
            return
        capturing = bool(torch.cuda.is_current_stream_capturing())
        capturing = capturing or _capturing_on_other_devices(torch, tags)
    except Exception:  # noqa: BLE001 - a torch without CUDA: no capture can be under way
        return
    if capturing:
        raise CaptureActive(
            f"stablebuf.{call}() was called while a CUDA graph capture is under way on the "
            "current stream; nothing was changed: call it before the capture begins or after "
            "it ends"
        )


def _capturing_on_other_devices(torch: Any, tags: Sequence[str]) -> bool:
    """Whether PyTorch's current stream is capturing on a device of the regions ``tags`` other
    than the current device (the regions' copies and fences run on those streams)."""
    here = torch.cuda.current_device()
    for device in devices_of(tags):
        if device != here:
            with torch.cuda.device(device):
                if torch.cuda.is_current_stream_capturing():
                    return True
    return False
