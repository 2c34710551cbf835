"""Sleep and wake: a region's device memory released (its bytes kept in pinned host memory, or
discarded) and backed again at the same addresses, and the pinned host arena behind it."""

from __future__ import annotations

from typing import Any, Dict, Optional

from . import _guard, _native
from ._capture import refuse_during_capture
from ._devices import Tags, as_tags, current_device, streams_of
from ._regions import warn_free_errors


def sleep(tags: Tags, keep: bool = True) -> Dict[str, Dict[str, Any]]:
    """Release the device memory of the regions ``tags``, keeping their addresses.

    With ``keep=True`` the bytes are copied to pinned host memory first, and :func:`wake` puts
    them back; with ``keep=False`` they are discarded (KV caches, activations). The pinned host
    arena is allocated once and reused: call :func:`reserve_host` up front, otherwise the first
    sleep pins it (about 0.5 s per GiB) and that cost shows in the first sleep.

    Waits for all work in flight on the region's device before unmapping; copies run on the
    current stream of the region's device (whatever device is current). Sleeping an asleep
    region does nothing. All or nothing: an unbound region refuses the call (:class:`Unbound`)
    before any region sleeps, and if one region fails while sleeping, the others this call put
    to sleep are woken again. Returns ``{tag: {"bytes", "seconds", "gb_per_s", "storage"}}``.
    """
    names = as_tags(tags)
    refuse_during_capture("sleep", names)
    try:
        with _guard.REMAPS:  # never between another thread's check and launch
            return _native.sleep(names, keep, streams_of(names))
    finally:
        warn_free_errors()


def wake(tags: Tags) -> Dict[str, Dict[str, Any]]:
    """Back the regions ``tags`` with device memory again (one allocation and one mapping per
    region) and restore their bytes; tensors and graphs over them are valid again.

    Waking an awake region does nothing. On :class:`OutOfMemory` the failing region (and those
    after it) stays asleep with its host copy: free memory and call ``wake`` again.
    """
    names = as_tags(tags)
    refuse_during_capture("wake", names)
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.wake(names, streams_of(names))


def reserve_host(nbytes: int) -> int:
    """Pin ``nbytes`` of host memory for sleeping regions now, once, and return the pinned
    capacity. Pinning is the slow part of a sleep (about 0.5 s per GiB); without this call the
    first ``sleep(keep=True)`` pins what it needs. One arena serves the regions of every
    device (it is pinned portable)."""
    return _native.reserve_host(int(nbytes), current_device())


def host_arena() -> Optional[Dict[str, Any]]:
    """``{"capacity", "free", "pin_seconds", "pins"}`` of the pinned host arena, or ``None``
    before anything was pinned."""
    return _native.host_arena()
