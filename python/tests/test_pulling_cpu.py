"""CPU tests (no torch, no GPU) of the pulling engine's state machine: a committed version is
copied into the idle region a chunk per poll on the current stream (before the next step), only
once that region's last replay is done; the switch comes with the last chunk; the staging set
goes back to the trainer once, and only once the copies out of it are done; a commit while it is
read drops the trainer and changes nothing. And the byte copies' plan: exactly the tensors'
bytes, never a gap, in chunks of at most the size asked."""

from __future__ import annotations

import random
import socket

import pytest

from stablebuf._manifest import VersionBook
from stablebuf._pipelined import (
    _COMMITTED,
    _FREE,
    _SERVING,
    PipelinedEngine,
    _Port,
    is_pulling,
    remove_stale_staging,
    staging_path,
)
from stablebuf._pulling import PullingEngine
from stablebuf._share import plan_byte_copies


class _Event:
    def __init__(self, done=True):
        self.done, self.recorded = done, 0

    def query(self):
        return self.done

    def record(self, stream=None):
        self.recorded += 1


class _Piece:
    """A stand-in destination of one copy: records the copies made into it, with the stream."""

    def __init__(self, name, log, torch):
        self.name, self.log, self.torch = name, log, torch

    def copy_(self, source, non_blocking=False):
        self.log.append((self.name, source, self.torch.cuda.stream_now))


class _Channel:
    def __init__(self):
        self.inbox, self.sent, self.closed = [], [], False

    def message_waiting(self):
        return bool(self.inbox)

    def receive(self):
        return self.inbox.pop(0)

    def send(self, kind, set=0, version=0, reason=""):  # noqa: A002 - the extension's name
        self.sent.append((kind, set))

    def close(self):
        self.closed = True


class _Listener:
    path = "/nowhere"

    def accept(self):
        return None

    def close(self):
        pass


class _Set:
    def __init__(self, set_id):
        self.id = set_id


class _Cuda:
    """The stream the copies go on: the current one, where the next replay follows them."""

    stream_now = "stream"

    def current_stream(self, device=None):
        return self.stream_now


class _Torch:
    def __init__(self):
        self.cuda = _Cuda()


def _port(tag, set_id, state, channel=None):
    port = object.__new__(_Port)
    port.tag, port.set, port.manifest = tag, _Set(set_id), None
    port.listener, port.channel, port.state, port.version = _Listener(), channel, state, 0
    return port


def _engine(chunks=2):
    """Two regions (a current, b idle), ``chunks`` chunks of one copy each into either, the
    staging set 3 with a trainer connected."""
    log = []
    engine = object.__new__(PullingEngine)
    engine._torch, engine.device, engine.tags = _Torch(), 0, ("a", "b")
    engine._ports = [_port("a", 1, _SERVING), _port("b", 2, _SERVING)]
    engine._staging = _port("a.staging", 3, _FREE, _Channel())
    engine._events = [_Event(), _Event()]
    engine.current, engine._versions, engine._closed = 0, VersionBook(), False
    engine._unreported, engine._pending, engine.switches = [], None, []
    engine._copies = [
        [[(_Piece(f"{r}.{k}", log, engine._torch), f"src.{k}")] for k in range(chunks)]
        for r in ("a", "b")
    ]
    engine._pull, engine._reading, engine.chunks_pulled = None, False, 0
    engine._read_done = _Event(False)
    return engine, log


def test_a_commit_is_copied_a_chunk_per_poll_and_switched_with_the_last():
    engine, log = _engine()
    engine._staging.channel.inbox.append(("commit", 3, 1, ""))
    status = engine.poll()
    assert status.bound is None and engine.current == 0
    assert log == [("b.0", "src.0", "stream")]  # into the idle region only, in line
    assert engine._staging.state == _SERVING  # being read: not the trainer's
    status = engine.poll()
    assert status.bound == 1 and engine.current == 1 and engine.version == 1
    assert log[-1] == ("b.1", "src.1", "stream") and len(log) == 2
    assert engine._read_done.recorded == 1 and engine.chunks_pulled == 2
    # The staging set goes back only once the copies out of it are done on the GPU, and once.
    engine.poll()
    assert engine._staging.channel.sent == [] and engine._staging.state == _SERVING
    engine._read_done.done = True
    engine.poll()
    engine.poll()
    assert engine._staging.channel.sent == [("released", 3)] and engine._staging.state == _FREE
    # The next version goes into the region left, a.
    engine._staging.channel.inbox.append(("commit", 3, 2, ""))
    engine.poll()
    assert log[-1][0] == "a.0"


def test_a_model_with_nothing_to_copy_switches_all_the_same():
    engine, log = _engine(chunks=0)
    engine._staging.channel.inbox.append(("commit", 3, 1, ""))
    status = engine.poll()
    assert log == [] and status.bound == 1 and engine.version == 1
    assert engine._read_done.recorded == 1


def test_the_pull_waits_for_the_idle_regions_last_replay():
    engine, log = _engine()
    engine._events[1].done = False
    engine._staging.channel.inbox.append(("commit", 3, 1, ""))
    engine.poll()
    assert log == [] and engine._staging.state == _COMMITTED
    engine._events[1].done = True
    engine.poll()
    assert log == [("b.0", "src.0", "stream")]


def test_a_commit_while_the_staging_set_is_read_drops_the_trainer_and_the_pull_goes_on():
    engine, log = _engine()
    channel = engine._staging.channel
    channel.inbox.append(("commit", 3, 1, ""))
    engine.poll()
    channel.inbox.append(("commit", 3, 2, ""))
    status = engine.poll()
    assert channel.closed and engine._staging.channel is None
    assert any("may not write now" in p for p in status.problems)
    assert status.bound == 1 and engine.version == 1 and len(log) == 2


def test_a_version_not_newer_goes_back_at_once_and_nothing_is_copied():
    engine, log = _engine()
    engine._versions.advance(5)
    engine._staging.channel.inbox.append(("commit", 3, 5, ""))
    status = engine.poll()
    assert log == [] and engine._staging.state == _FREE
    assert engine._staging.channel.sent == [("released", 3)]
    assert any("VersionConflict" in p for p in status.problems)


def _bytes_copied(chunks):
    """destination byte -> source byte, over every copy of ``chunks``."""
    moved = {}
    for chunk in chunks:
        for dst, src, n in chunk:
            for i in range(n):
                assert moved.setdefault(dst + i, src + i) == src + i
    return moved


def test_byte_copies_merge_side_by_side_tensors_and_never_copy_a_gap():
    # Three tensors side by side in both places (one run), then one after a gap of 8 bytes.
    pieces = [(1000, 0, 16), (1016, 16, 16), (1032, 32, 8), (1048, 48, 4)]
    chunks = plan_byte_copies(pieces, 1 << 20)
    assert chunks == [[(1000, 0, 40), (1048, 48, 4)]]
    assert set(_bytes_copied(chunks)) == set(range(1000, 1040)) | set(range(1048, 1052))


def test_byte_copies_are_cut_into_chunks_of_at_most_the_size_asked():
    rng = random.Random(41)
    for _ in range(200):
        pieces, dst, src = [], rng.randrange(0, 64), rng.randrange(0, 64)
        for _ in range(rng.randrange(0, 8)):
            n = rng.randrange(0, 40)
            pieces.append((dst, src, n))
            gap = rng.choice((0, 0, rng.randrange(1, 9)))
            dst, src = dst + n + gap, src + n + rng.choice((gap, gap, gap + 3))
        chunk_bytes = rng.randrange(1, 50)
        rng.shuffle(pieces)
        chunks = plan_byte_copies(pieces, chunk_bytes)
        want = _bytes_copied([[p] for p in pieces])
        assert _bytes_copied(chunks) == want
        sizes = [sum(n for _, _, n in chunk) for chunk in chunks]
        assert all(0 < size <= chunk_bytes for size in sizes)
        assert all(size == chunk_bytes for size in sizes[:-1])
        runs = sum(len(chunk) for chunk in chunks) - (len(chunks) - 1)
        assert runs <= max(1, sum(1 for p in pieces if p[2] > 0))


def test_byte_copies_refuse_a_chunk_of_nothing():
    with pytest.raises(ValueError):
        plan_byte_copies([(0, 0, 4)], 0)


def test_a_stale_staging_socket_goes_and_nothing_else_does(tmp_path):
    """A PullingEngine killed at ``path`` leaves ``path.s``: a PipelinedEngine started there
    removes it (else its trainer would connect to the dead staging socket); any other file
    stays, and a PullingEngine keeps its own."""
    path = str(tmp_path / "engine")
    left = socket.socket(socket.AF_UNIX)
    left.bind(staging_path(path))
    left.close()  # the socket file stays, as after a kill
    assert is_pulling(path)
    assert remove_stale_staging(path) and not is_pulling(path)
    assert not remove_stale_staging(path)  # nothing there: nothing to do
    with open(staging_path(path), "w") as f:
        f.write("not a socket")
    assert not remove_stale_staging(path) and is_pulling(path)
    assert PipelinedEngine._exports_staging is False and PullingEngine._exports_staging is True
