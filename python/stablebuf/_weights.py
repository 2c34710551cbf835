"""Weight sets: several backings of one region kept resident (:func:`snapshot`), and the ways
to put one under the region's addresses: :func:`bind` (a remap), :func:`switch` (a remap or a
copy, whichever is cheaper for the region's size; :func:`crossover_bytes`), :func:`writing`,
:func:`unbind`, :func:`bound`."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from . import _guard, _native
from ._capture import refuse_during_capture
from ._devices import current_device, stream_of
from ._manual_guard import note_use
from ._native import WeightSet


def snapshot(tag: str) -> WeightSet:
    """A new weight set of region ``tag``: a second backing of its used span holding the
    region's current contents (one device allocation, one copy on the current stream of the
    region's device).

    Fill it with :func:`writing` (e.g. ``model.load_state_dict(other)``) and swap it in with
    :func:`bind`. The first snapshot also folds the region's backing into one allocation, so
    every later bind is one mapping.
    """
    refuse_during_capture("snapshot", [tag])
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.snapshot(tag, stream_of(tag))


def bind(tag: str, weights: WeightSet) -> Optional[WeightSet]:
    """Put ``weights`` under region ``tag``'s addresses and return the weight set bound before.

    Every tensor and captured graph over the region reads the new weights from then on; nothing
    is copied and nothing is re-captured. Waits for all work in flight on the region's device
    first (never unmaps under a running kernel). Raises :class:`SnapshotMismatch` for a weight
    set of another region, or when the region grew past the weight set (take a new snapshot).
    """
    refuse_during_capture("bind", [tag])
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.bind(tag, weights)


_STRATEGIES = ("auto", "copy", "remap")


def switch(tag: str, weights: WeightSet, *, strategy: str = "auto") -> str:
    """Make region ``tag`` read the contents of ``weights`` the cheaper way for its size, and
    return which way it went: ``"copy"`` or ``"remap"``.

    - ``"remap"``: exactly :func:`bind`. ``weights`` is mapped under the region's addresses
      after the region's fence (the device going idle, by default): about 0.1 ms on an H100
      whatever the size. Writes to the region's tensors then land in ``weights``.
    - ``"copy"``: the region's own *live* weight set is put under its addresses (allocated and
      bound with one remap on the first copy switch, and bound again after a remap switch),
      then ``weights``' bytes are copied into it on the current stream (of the region's
      device): no fence, a time
      proportional to the region's used span (about 0.7 ms per GiB on an H100).
    - ``"auto"`` (default): copy when the device's cost model predicts a copy of the region's
      span to be cheaper than a remap (spans below :func:`crossover_bytes`, about 100 MiB on an
      H100), remap otherwise. Small models then never switch slower than a copy-in, large ones
      get the remap.

    How a switch that returned ``"copy"`` differs from :func:`bind`:

    - ``weights`` is only read. :func:`bound` returns the region's live set, not ``weights``,
      and writes to the region's tensors (``load_state_dict``, an optimizer step) land in the
      live set, never in ``weights``; the next copy switch overwrites them. Use
      :func:`writing` or ``strategy="remap"`` to write into a weight set.
    - The copy is ordered on the current stream only, like any PyTorch copy into the
      parameters: graphs and kernels queued after it on that stream see the new weights; work
      on another stream that reads the region must wait for the current stream first.
    - Memory: one more weight set of the region's span, allocated on the first copy switch
      and kept until the region sleeps or is unbound.

    Switching to the weight set bound now does nothing and returns ``"remap"``. An unbound
    region can be switched. The first ``"auto"`` switch of a process calibrates the cost model
    (tens of milliseconds and 1 GiB of device memory meanwhile): call :func:`crossover_bytes`
    at start-up to pay that early.

    Raises ``ValueError`` for an unknown ``strategy`` (before anything else),
    :class:`CaptureActive` during a capture on the current stream, ``TypeError`` unless
    ``weights`` is a :class:`WeightSet`, :class:`SnapshotMismatch` for a weight set of another
    region or when the region grew past it, :class:`Asleep` while the region sleeps; nothing
    changes on any of them.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, not {strategy!r}")
    refuse_during_capture("switch", [tag])
    if not isinstance(weights, WeightSet):
        raise TypeError(
            "weights must be a stablebuf.WeightSet (from stablebuf.snapshot or stablebuf.bound), "
            f"not {type(weights).__name__}"
        )
    with _guard.REMAPS:  # never between another thread's check and launch
        return _native.switch(tag, weights, strategy, stream_of(tag))


def crossover_bytes(device: Optional[int] = None) -> Optional[int]:
    """The region span, in bytes, below which :func:`switch` with ``strategy="auto"`` copies
    and above which it remaps, on CUDA device ``device`` (default: the current one); ``None``
    if one way always wins there.

    It comes from the device's cost model, calibrated on first use in the process (timed
    remaps and device-to-device copies: tens of milliseconds and 1 GiB of device memory for
    the duration), then kept, per device. About 100 MiB on an H100. Raises
    :class:`CaptureActive` during a capture on the current stream (calibrating would break it).
    """
    refuse_during_capture("crossover_bytes")
    return _native.crossover_bytes(current_device() if device is None else int(device))


def bound(tag: str) -> Optional[WeightSet]:
    """The weight set under region ``tag`` now (``None`` before the first snapshot or wake).
    After a :func:`switch` that copied, it is the region's own live set, which the next copy
    switch overwrites: take a :func:`snapshot` to keep its contents."""
    return _native.bound(tag)


def unbind(tag: str) -> None:
    """Unmap region ``tag``'s weight set (keep :func:`bound` first to bind it back). Graphs
    guarded by the tag raise :class:`Unbound` until the next :func:`bind`."""
    refuse_during_capture("unbind", [tag])
    with _guard.REMAPS:
        _native.unbind(tag)


@contextlib.contextmanager
def writing(weights: WeightSet) -> Iterator[WeightSet]:
    """Bind ``weights`` for the block, then bind back what was bound before.

    Writes to the region's tensors inside the block (``model.load_state_dict(sd_b)``,
    ``param.copy_(...)``) land in ``weights``::

        ws_b = stablebuf.snapshot("weights")
        with stablebuf.writing(ws_b):
            model.load_state_dict(state_b)
    """
    previous = bind(weights.tag, weights)
    try:
        yield weights
    finally:
        # The writes were eager: a "last-use" region's bind must wait for them.
        note_use([weights.tag])
        if previous is not None:
            bind(weights.tag, previous)
