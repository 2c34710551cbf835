"""Failures of weight publishing (issue 41 item 4), for ``Engine``, ``PipelinedEngine`` and
``PullingEngine`` alike, each a GPU test (skipped without one) with the other side in a subprocess
(tests/publish_failure_peer.py):

- a trainer killed mid-write: the engine serves the last committed version;
- a trainer killed right after its commit: the committed version is served (it was whole);
- a trainer that closes its socket;
- an engine killed under its trainer (the trainer gets PeerClosed);

and after each, a trainer reconnects and publishes. Descriptors (/proc/self/fd), the engine
process's device memory (torch's allocated bytes, the regions' mapped bytes from
stablebuf.stats, the device's free bytes once the dead peer's context is gone) are counted
before and after: no leak.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import stablebuf

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "publish_failure_peer.py")
KINDS = ("engine", "pipelined", "pulled")
#: Device-wide free memory may move by the driver's own bookkeeping; a leaked set is MiBs more.
FREE_SLACK = 4 << 20


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def fpeer(torch):
    sys.path.insert(0, HERE)
    import publish_failure_peer

    return publish_failure_peer


def _path(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix="sb-fail-"), f"{name}.sock")


class Peer:
    """publish_failure_peer.py in a subprocess, talking over stdin/stdout lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, PEER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def expect(self, prefix: str, serving=None, timeout: float = 120.0) -> str:
        """The next line (must start with ``prefix``); serves ``serving`` meanwhile (poll and
        replay, as a serving loop does)."""
        got = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()))
        reader.daemon = True
        reader.start()
        deadline = time.monotonic() + timeout
        while reader.is_alive() and time.monotonic() < deadline:
            if serving is not None:
                serving.poll()
                serving.replay()
            time.sleep(0.001)
        reader.join(timeout=1)
        assert got and got[0], f"the peer said nothing (exit {self.proc.poll()}) for {prefix}"
        line = got[0].strip()
        assert line.startswith(prefix), f"expected `{prefix}`, the peer said `{line}`"
        return line

    def tell(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60.0) -> int:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.close()
        status = self.proc.wait(timeout=timeout)
        self.proc.stdout.close()
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.close()


def _serve_until(serving, done, timeout: float = 60.0) -> list:
    """Polls and replays until ``done(status)``; returns the problems reported meanwhile."""
    problems: list = []
    deadline = time.monotonic() + timeout
    while True:
        status = serving.poll()
        problems.extend(status.problems)
        if done(status):
            return problems
        assert time.monotonic() < deadline, f"never happened; problems: {problems}"
        serving.replay()
        time.sleep(0.001)


def _counts(torch, tags) -> dict:
    gc.collect()
    torch.cuda.synchronize()
    regions = stablebuf.stats()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "allocated": torch.cuda.memory_allocated(),
        "mapped": {t: regions[t]["mapped"] for t in tags},
        "mappings": {t: regions[t]["mappings"] for t in tags},
    }


def _free_bytes(torch) -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _assert_no_leak(torch, tags, before: dict, free_before: int) -> None:
    after = _counts(torch, tags)
    assert after == before, f"leaked: before {before}, after {after}"
    # The dead peer's context goes away asynchronously: wait for it.
    deadline = time.monotonic() + 20
    while _free_bytes(torch) < free_before - FREE_SLACK and time.monotonic() < deadline:
        time.sleep(0.2)
    free_after = _free_bytes(torch)
    assert free_after >= free_before - FREE_SLACK, (
        f"device memory: {(free_before - free_after) / 2**20:.1f} MiB less free than before"
    )


def _tags(serving) -> list:
    if serving.kind == "pulled":  # its staging region too
        return list(serving.engine.tags) + [serving.engine._staging.tag]
    return list(serving.engine.tags) if serving.kind == "pipelined" else [serving.engine.tag]


def _publish_round(serving, kind: str, path: str, seeds, first_version: int) -> None:
    """A trainer connects, publishes ``seeds`` (each served and checked), and closes."""
    trainer = Peer("trainer", kind, path, ",".join(str(s) for s in seeds))
    try:
        trainer.expect("connected", serving)
        for k, seed in enumerate(seeds):
            version = first_version + k
            trainer.tell()
            trainer.expect(f"published {version}", serving)
            _serve_until(serving, lambda s, v=version: s.version >= v)
            serving.check(seed, f"version {version}")
        assert trainer.finish() == 0
        _serve_until(serving, lambda s: not s.trainer_connected)
    finally:
        trainer.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_a_trainer_killed_mid_write_leaves_the_last_version_and_a_new_one_reconnects(
    torch, fpeer, kind
):
    path = _path(f"mid-write-{kind}")
    serving = fpeer.Serving(kind, f"fail-mid-write-{kind}", path, 0)
    try:
        _publish_round(serving, kind, path, [11], 1)  # warm: the driver opens what it keeps
        before, free_before = _counts(torch, _tags(serving)), _free_bytes(torch)
        dying = Peer("die-write", kind, path, "12")
        dying.expect("ready", serving)
        dying.kill()
        problems = _serve_until(serving, lambda s: not s.trainer_connected)
        assert any("went away" in p for p in problems), problems
        assert serving.version == 1
        serving.check(11, "after the trainer died mid-write")
        _publish_round(serving, kind, path, [13], 2)  # a trainer reconnects
        _assert_no_leak(torch, _tags(serving), before, free_before)
    finally:
        serving.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_a_trainer_killed_right_after_its_commit_leaves_that_version_served(torch, fpeer, kind):
    path = _path(f"mid-commit-{kind}")
    serving = fpeer.Serving(kind, f"fail-mid-commit-{kind}", path, 0)
    try:
        _publish_round(serving, kind, path, [21], 1)
        before, free_before = _counts(torch, _tags(serving)), _free_bytes(torch)
        dying = Peer("die-commit", kind, path, "22")
        dying.expect("committed", serving)
        dying.kill()
        _serve_until(serving, lambda s: s.version >= 2 and not s.trainer_connected)
        serving.check(22, "the version committed before the trainer died")
        _publish_round(serving, kind, path, [23], 3)
        _assert_no_leak(torch, _tags(serving), before, free_before)
    finally:
        serving.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_a_trainer_closing_its_socket_changes_nothing_and_a_new_one_reconnects(
    torch, fpeer, kind
):
    path = _path(f"closed-{kind}")
    serving = fpeer.Serving(kind, f"fail-closed-{kind}", path, 0)
    try:
        _publish_round(serving, kind, path, [31], 1)
        before, free_before = _counts(torch, _tags(serving)), _free_bytes(torch)
        _publish_round(serving, kind, path, [32, 33], 2)  # connects, publishes, closes
        serving.check(33, "after the trainer closed its socket")
        _publish_round(serving, kind, path, [34], 4)
        _assert_no_leak(torch, _tags(serving), before, free_before)
    finally:
        serving.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_killed_under_its_trainer_is_peer_closed_and_the_trainer_reconnects(
    torch, fpeer, kind
):
    import publish_peer

    def one_round(path: str, kill: bool) -> None:
        engine = Peer("engine", kind, path, "0", "41,42,43")
        try:
            engine.expect("ready")
            trainer = fpeer.connect(kind, path)
            trainer.publish(publish_peer.weights(41), version=1)
            engine.expect("served 1 ok")
            if kill:
                engine.kill()
                with pytest.raises(stablebuf.PeerClosed):
                    for version in (2, 3, 4):  # the first may find a free set and still send
                        trainer.publish(publish_peer.weights(42), version=version, timeout=10)
            trainer.close()
        finally:
            engine.kill()

    one_round(_path(f"engine-warm-{kind}"), kill=False)
    gc.collect()
    torch.cuda.synchronize()
    fds = len(os.listdir("/proc/self/fd"))
    free_before = _free_bytes(torch)
    one_round(_path(f"engine-killed-{kind}"), kill=True)
    one_round(_path(f"engine-again-{kind}"), kill=False)  # the trainer side reconnects
    gc.collect()
    torch.cuda.synchronize()
    assert len(os.listdir("/proc/self/fd")) == fds, "descriptors leaked"
    deadline = time.monotonic() + 20
    while _free_bytes(torch) < free_before - FREE_SLACK and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _free_bytes(torch) >= free_before - FREE_SLACK, "device memory leaked"
