"""CPU tests (no torch, no GPU) of stablebuf.upload_graph: what it leaves alone and what it
hands the extension."""

from __future__ import annotations

import pytest

import stablebuf
from stablebuf import _upload


class _NotAGraph:
    pass


class _Unready:
    def raw_cuda_graph_exec(self):
        raise RuntimeError("You cannot access the raw cudaGraphExec_t instance until instantiate()")


class _Ready:
    def raw_cuda_graph_exec(self):
        return 0xABC0


class _Stream:
    cuda_stream = 0x5150


class _Cuda:
    def current_device(self):
        return 3

    def current_stream(self, device):
        assert device == 3
        return _Stream()


class _Torch:
    cuda = _Cuda()


def test_objects_without_an_executable_are_left_alone():
    assert stablebuf.upload_graph(_NotAGraph()) is False
    assert stablebuf.upload_graph(_Unready()) is False


def test_an_instantiated_graph_goes_to_the_extension_with_its_device_and_stream(monkeypatch):
    calls = []
    monkeypatch.setattr(_upload, "cuda_torch", lambda: _Torch())
    monkeypatch.setattr(_upload._native, "upload_graph", lambda *a: calls.append(a))
    assert stablebuf.upload_graph(_Ready()) is True
    assert calls == [(3, 0xABC0, 0x5150)]
    stream = _Stream()
    stream.cuda_stream = 0x77
    assert stablebuf.upload_graph(_Ready(), stream) is True
    assert calls[-1] == (3, 0xABC0, 0x77)


def test_a_driver_failure_is_raised(monkeypatch):
    def refuse(*_):
        raise stablebuf.Error("cuGraphUpload failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(_upload, "cuda_torch", lambda: _Torch())
    monkeypatch.setattr(_upload._native, "upload_graph", refuse)
    with pytest.raises(stablebuf.Error, match="cuGraphUpload"):
        stablebuf.upload_graph(_Ready())
