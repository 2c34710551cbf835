"""Regions on two GPUs in one process: each region lives on the device that was current when
it was created, and every call acts on it there whatever device is current.

The tests make one region per device, fill them with fresh random data, and run every call
(snapshot, writing, bind, switch by copy and by remap, sleep with and without the contents,
wake, graph replays under the guard) on each region while the *other* device is current,
comparing every tensor with its CPU copy (``torch.equal``) after each step and checking that
no call moved the current device. They skip with the reason on fewer than two GPUs.
"""

from __future__ import annotations

import contextlib
import ctypes

import pytest

import stablebuf
from stablebuf import _native

MiB = 1 << 20


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module")
def torch():
    import torch as torch_module

    torch_module.cuda.init()
    return torch_module


@contextlib.contextmanager
def _current(torch, device: int):
    """``device`` is current in the block, and still is when each call in it returns."""
    with torch.cuda.device(device):
        yield
        assert torch.cuda.current_device() == device, "a stablebuf call moved the current device"


class TwoRegions:
    """One region per device and what each of its tensors must hold (CPU copies)."""

    def __init__(self, torch, prefix: str, sizes_mib=(8, 3, 16)) -> None:
        self.torch = torch
        self.tags = [f"{prefix}_{device}" for device in (0, 1)]
        self.tensors = {}
        self.expected = {}
        for device, tag in enumerate(self.tags):
            with _current(torch, device), stablebuf.region(tag):
                tensors = [torch.empty(n * MiB // 4, device="cuda") for n in sizes_mib]
            for t in tensors:
                assert t.device.index == device
                assert _native.owner(t.data_ptr()) == tag
            assert stablebuf.stats()[tag]["device"] == device
            self.tensors[tag] = tensors
            self.fill(tag)

    def device(self, tag: str) -> int:
        return self.tags.index(tag)

    def other(self, tag: str) -> int:
        return 1 - self.device(tag)

    def fill(self, tag: str) -> None:
        """Fresh random contents for every tensor of ``tag`` (written on its own device)."""
        values = [self.torch.randn(t.numel()) for t in self.tensors[tag]]
        for t, v in zip(self.tensors[tag], values):
            t.copy_(v.to(t.device))
        self.torch.cuda.synchronize(self.device(tag))
        self.expected[tag] = values

    def check(self, what: str, tags=None) -> None:
        """Every tensor of the regions ``tags`` (default: both) holds what the model says."""
        for tag in self.tags if tags is None else tags:
            self.torch.cuda.synchronize(self.device(tag))
            for i, (t, want) in enumerate(zip(self.tensors[tag], self.expected[tag])):
                assert self.torch.equal(t.cpu(), want), f"{what}: {tag} tensor {i} differs"


def test_each_region_lives_on_its_device_and_every_call_acts_there_from_the_other(torch):
    regions = TwoRegions(torch, "two_gpus")
    regions.check("after the fill")
    for tag in regions.tags:
        # Before any weight set is taken, a sleep releases the region's whole backing, and it
        # is released on the region's own device.
        device = regions.device(tag)
        mapped = stablebuf.stats()[tag]["mapped"]
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        with _current(torch, regions.other(tag)):
            report = stablebuf.sleep(tag)
        assert report[tag]["storage"] != "discarded"
        freed = torch.cuda.mem_get_info(device)[0] - free_before
        assert freed >= mapped - 2 * MiB, f"{tag}: sleeping freed {freed} of {mapped} bytes"
        assert stablebuf.stats()[tag]["asleep"]
        other_tag = regions.tags[regions.other(tag)]
        assert not stablebuf.stats()[other_tag]["asleep"]
        regions.check(f"{other_tag}: awake while {tag} sleeps", [other_tag])
        with _current(torch, regions.other(tag)):
            stablebuf.wake(tag)
        regions.check(f"{tag}: woken with its contents")

    sets = {}
    for tag in regions.tags:
        with _current(torch, regions.other(tag)):
            second = stablebuf.snapshot(tag)
            first = stablebuf.bound(tag)
        assert first is not None and second != first and second.tag == tag
        regions.check(f"{tag}: after the snapshot")
        kept_first = regions.expected[tag]
        with _current(torch, regions.other(tag)), stablebuf.writing(second):
            regions.fill(tag)  # lands in the second set
        written_second = regions.expected[tag]
        regions.expected[tag] = kept_first
        assert stablebuf.bound(tag) == first, "writing() bound the first set back"
        regions.check(f"{tag}: the first set after writing the second")
        sets[tag] = (first, second, kept_first, written_second)

    for tag in regions.tags:
        first, second, first_values, second_values = sets[tag]
        with _current(torch, regions.other(tag)):
            assert stablebuf.bind(tag, second) == first
        regions.expected[tag] = second_values
        regions.check(f"{tag}: bound to the second set")
        with _current(torch, regions.other(tag)):
            assert stablebuf.switch(tag, first, strategy="copy") == "copy"
        regions.expected[tag] = first_values
        regions.check(f"{tag}: switched to the first set by copy")
        with _current(torch, regions.other(tag)):
            assert stablebuf.switch(tag, second, strategy="remap") == "remap"
        regions.expected[tag] = second_values
        regions.check(f"{tag}: switched to the second set by remap")
        with _current(torch, regions.other(tag)):
            stablebuf.bind(tag, first)
        regions.expected[tag] = first_values
        regions.check(f"{tag}: bound back to the first set")

    for tag in regions.tags:
        with _current(torch, regions.other(tag)):
            stablebuf.sleep(tag)
        assert stablebuf.stats()[tag]["asleep"]
        other_tag = regions.tags[regions.other(tag)]
        regions.check(f"{other_tag}: awake while {tag} sleeps", [other_tag])
        with _current(torch, regions.other(tag)):
            stablebuf.wake(tag)
        regions.check(f"{tag}: woken with its contents, bound to a weight set")

    # One call over regions of both devices, from each device.
    with _current(torch, 0):
        stablebuf.sleep(regions.tags, keep=True)
    assert all(stablebuf.stats()[tag]["asleep"] for tag in regions.tags)
    with _current(torch, 1):
        stablebuf.wake(regions.tags)
    regions.check("both woken by one call")

    for tag in regions.tags:
        with _current(torch, regions.other(tag)):
            stablebuf.sleep(tag, keep=False)
            stablebuf.wake(tag)
        regions.fill(tag)  # discarded: the contents are new
        regions.check(f"{tag}: woken after a discard and refilled")
        with _current(torch, regions.other(tag)):
            third = stablebuf.snapshot(tag)
            previous = stablebuf.bind(tag, third)
        regions.check(f"{tag}: bound to a snapshot taken after the wake")
        with _current(torch, regions.other(tag)):
            stablebuf.bind(tag, previous)
        regions.check(f"{tag}: bound back")


def test_a_tag_names_one_region_on_one_device(torch):
    regions = TwoRegions(torch, "two_gpus_tag", sizes_mib=(1,))
    for tag in regions.tags:
        home, other = regions.device(tag), regions.other(tag)
        with _current(torch, other):
            pattern = f"`{tag}` lives on device {home}, not on device {other}"
            with pytest.raises(stablebuf.DeviceMismatch, match=pattern), stablebuf.region(tag):
                pass
            with pytest.raises(stablebuf.DeviceMismatch, match=pattern):
                stablebuf.pool(tag)
        with _current(torch, home), stablebuf.region(tag):
            here = torch.empty(MiB // 4, device="cuda")
            elsewhere = torch.empty(MiB // 4, device=f"cuda:{other}")
        assert _native.owner(here.data_ptr()) == tag
        assert _native.owner(elsewhere.data_ptr()) is None, "another device's tensor is not ours"

        # PyTorch's allocator asking the tag's entry point for another device's memory.
        lib = ctypes.CDLL(stablebuf.library_path())
        alloc_type = ctypes.CFUNCTYPE(
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
        )
        slot = stablebuf.tags().index(tag)
        alloc = alloc_type((_native.alloc_symbol(slot), lib))
        before = stablebuf.stats()[tag]["allocations"]
        assert alloc(2 * MiB, other, None) is None
        error = _native.take_alloc_error()
        assert isinstance(error, stablebuf.DeviceMismatch), error
        assert stablebuf.stats()[tag]["allocations"] == before
    regions.check("after the refusals")


def _capture(torch, graph, fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    # A capture stream of the current device: torch.cuda.graph's default one is made once per
    # process, on the device current at the first capture, and a capture on another device's
    # stream fails on the first kernel ("operation not permitted when stream is capturing").
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        out = fn()
    return out


def test_graphs_on_each_gpu_replay_under_the_guard_after_binds_from_the_other(torch):
    tags = ["two_gpus_graph_0", "two_gpus_graph_1"]
    fences = ["device", "last-use"]  # device 1's replays are noted on device 1's stream
    graphs, plain, outs, weights, sets = [], [], [], [], []
    for device, tag in enumerate(tags):
        with _current(torch, device):
            with stablebuf.region(tag, fence=fences[device]):
                w = torch.empty(MiB, device="cuda")
            w.copy_(torch.randn(w.numel()).to(w.device))
            torch.cuda.synchronize(device)
            guarded = stablebuf.CUDAGraph()  # no tags: the regions of its device
            out = _capture(torch, guarded, lambda w=w: w * 2 + 1)
            bare = torch.cuda.CUDAGraph()  # a plain PyTorch graph: the guard's patch
            bare_out = _capture(torch, bare, lambda w=w: w * 3 + 1)
            torch.cuda.synchronize(device)
        assert guarded.guarded_tags == tuple(
            t for t, e in stablebuf.stats().items() if e["device"] == device
        ), "a graph guards the regions of its own device"
        captured = stablebuf.graph_tags(bare) or ()
        assert tag in captured
        stats = stablebuf.stats()
        assert all(stats[t]["device"] == device for t in captured), captured
        # Replays below check this graph's own region only, whatever earlier tests left asleep.
        guarded.guard([tag])
        first_values = w.cpu()
        with _current(torch, 1 - device):
            second = stablebuf.snapshot(tag)
            first = stablebuf.bound(tag)
            with stablebuf.writing(second):
                w.copy_(torch.randn(w.numel()).to(w.device))
                second_values = w.cpu()
        graphs.append(guarded)
        plain.append(bare)
        outs.append((out, bare_out))
        weights.append((first_values, second_values))
        sets.append((first, second))

    def replay_and_check(device: int, values, what: str) -> None:
        out, bare_out = outs[device]
        out.fill_(float("nan"))
        bare_out.fill_(float("nan"))
        with _current(torch, 1 - device):  # PyTorch replays on the graph's own device
            graphs[device].replay()
            plain[device].replay()
        torch.cuda.synchronize(device)
        assert torch.equal(out.cpu(), values * 2 + 1), f"device {device}: {what}"
        assert torch.equal(bare_out.cpu(), values * 3 + 1), f"device {device}: {what} (plain)"

    for device, tag in enumerate(tags):
        first, second = sets[device]
        first_values, second_values = weights[device]
        replay_and_check(device, first_values, "on the first set")
        with _current(torch, 1 - device):
            assert stablebuf.bind(tag, second) == first
        replay_and_check(device, second_values, "after a bind made from the other device")
        with _current(torch, 1 - device):
            stablebuf.bind(tag, first)
        replay_and_check(device, first_values, "bound back")

    for device, tag in enumerate(tags):
        other = 1 - device
        with _current(torch, other):
            stablebuf.sleep(tag)
        out, bare_out = outs[device]
        out.fill_(float("nan"))
        bare_out.fill_(float("nan"))
        for graph in (graphs[device], plain[device]):
            with _current(torch, other), pytest.raises(stablebuf.Asleep, match=tag):
                graph.replay()
        torch.cuda.synchronize(device)
        assert torch.isnan(out).all() and torch.isnan(bare_out).all(), "a refused replay launched"
        # The other device's graphs use none of this region: they replay.
        replay_and_check(other, weights[other][0], f"while {tag} sleeps")
        with _current(torch, other):
            stablebuf.wake(tag)
        replay_and_check(device, weights[device][0], "after the wake")
