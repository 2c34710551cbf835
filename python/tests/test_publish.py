"""Weight publishing between processes (stablebuf.publish).

CPU tests (no torch, no GPU): the manifest (round trip, fingerprint, first mismatch named), the
version rule, and the native channel over real Unix sockets (messages, large manifests, closes
and typed errors).

GPU tests (skip with the reason without torch or a CUDA device): a trainer process
(tests/publish_peer.py) writes new weights straight into the engine's spare sets and the
engine's captured graph replays on them, checked against CPU references with fresh random
weights and a NaN-poisoned output; a trainer killed mid-write, an engine killed under its
trainer (no descriptor leaked), a manifest mismatch, a version published twice, a second
trainer (refused), one trainer publishing to two engines (supported: a Trainer each), a socket
closed before the handshake, and the colocated sleep → publish → wake loop. The engine's calls
never raise for what the trainer did: each test reads it from ``Engine.poll``'s status. The
tests with the engine in its own process run tests/publish_engine_peer.py. The two-GPU test
skips with its reason on fewer than two GPUs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import stablebuf
from stablebuf import _native
from stablebuf._manifest import Entry, Manifest, VersionBook, fnv1a64

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "publish_peer.py")
ENGINE_PEER = os.path.join(HERE, "publish_engine_peer.py")


# ------------------------------------------------------------------------------ CPU: manifest


def _manifest(**changes):
    entries = [
        Entry("w1", 0, (4, 8), (8, 1), "bfloat16"),
        Entry("w2", 1024, (8, 2), (1, 8), "float32"),  # transposed view
        Entry("empty", 4096, (0, 3), (3, 1), "float32"),
    ]
    args = dict(tag="weights", nbytes=2 << 20, sets=2, entries=entries)
    args.update(changes)
    return Manifest.build(**args)


def test_manifest_round_trips_and_its_fingerprint_follows_every_field():
    m = _manifest()
    again = Manifest.from_json(m.to_json())
    assert again == m and again.fingerprint == m.fingerprint
    later = Manifest.from_json(m.with_published(7).to_json())
    assert later.published == 7 and later.fingerprint == m.fingerprint
    assert m.by_name()["w2"].span == (7 * 1 + 1 * 8 + 1) * 4
    assert m.by_name()["empty"].span == 0
    changed = [
        _manifest(tag="other"),
        _manifest(entries=[Entry("w1", 0, (4, 8), (8, 1), "float16")]),
        _manifest(entries=[Entry("w1", 0, (8, 4), (4, 1), "bfloat16")]),
        _manifest(entries=[Entry("w1", 64, (4, 8), (8, 1), "bfloat16")]),
        _manifest(entries=[Entry("w1", 0, (4, 8), (1, 4), "bfloat16")]),
    ]
    prints = {c.fingerprint for c in changed} | {m.fingerprint}
    assert len(prints) == len(changed) + 1
    assert fnv1a64(b"") == 0xCBF29CE484222325


def test_malformed_or_tampered_manifests_are_value_errors():
    good = _manifest().to_json()
    for bad in [
        "not json",
        "{}",
        good.replace('"version":1', '"version":2'),
        good.replace('"w1"', '"w9"'),  # entries no longer match the fingerprint
        good.replace('"nbytes":2097152', '"nbytes":16'),  # tensors outside the set
    ]:
        with pytest.raises(ValueError):
            Manifest.from_json(bad)


def test_building_refuses_duplicates_out_of_range_and_misaligned_tensors():
    with pytest.raises(ValueError, match="twice"):
        _manifest(entries=[Entry("a", 0, (2,), (1,), "float32")] * 2)
    with pytest.raises(ValueError, match="outside"):
        _manifest(entries=[Entry("a", (2 << 20) - 4, (2,), (1,), "float32")])
    with pytest.raises(ValueError, match="aligned"):
        _manifest(entries=[Entry("a", 2, (2,), (1,), "float32")])
    with pytest.raises(ValueError, match="dtype"):
        _manifest(entries=[Entry("a", 0, (2,), (1,), "float7")])


def test_the_first_mismatch_is_named():
    m = _manifest()
    ok = {"w1": ((4, 8), "bfloat16"), "w2": ((8, 2), "float32"), "empty": ((0, 3), "float32")}
    assert m.first_mismatch(ok) is None
    missing = dict(ok, extra=((1,), "float32"))
    assert "`extra` is not in the engine" in m.first_mismatch(missing)
    fewer = {k: v for k, v in ok.items() if k != "w2"}
    assert "`w2` is not among the expected" in m.first_mismatch(fewer)
    shape = dict(ok, w2=((2, 8), "float32"))
    assert "`w2`: shape (8, 2) in the engine, (2, 8) expected" in m.first_mismatch(shape)
    dtype = dict(ok, w1=((4, 8), "float32"))
    assert "`w1`: dtype bfloat16" in m.first_mismatch(dtype)
    assert m.first_mismatch(dtype, dtypes=False) is None, "the trainer may cast"


def test_versions_must_grow():
    book = VersionBook()
    assert book.problem(1) is None
    book.advance(1)
    assert "not newer" in book.problem(1)
    assert "not newer" in book.problem(0) or "from 1" in book.problem(0)
    assert book.problem(True) is not None and book.problem("2") is not None
    assert book.problem(5) is None


# ------------------------------------------------------------------------------ CPU: channel


def _socket_path(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix="sbpub-"), f"{name}.sock")


def _pair(name: str):
    listener = _native.PublishListener(_socket_path(name))
    assert listener.accept() is None, "accepting never blocks"
    trainer = _native.PublishChannel.connect(listener.path)
    engine = None
    for _ in range(1000):
        engine = listener.accept()
        if engine is not None:
            break
        time.sleep(0.001)
    assert engine is not None
    return listener, engine, trainer


def test_publish_errors_are_stablebuf_errors():
    for cls in [
        stablebuf.PublishError,
        stablebuf.PeerClosed,
        stablebuf.OfferMismatch,
        stablebuf.VersionConflict,
        stablebuf.PublishTimeout,
    ]:
        assert issubclass(cls, stablebuf.Error)
    assert issubclass(stablebuf.PeerClosed, stablebuf.PublishError)
    assert stablebuf.publish.ManifestMismatch is stablebuf.OfferMismatch


def test_messages_and_a_large_manifest_cross_the_channel():
    listener, engine, trainer = _pair("messages")
    try:
        assert not trainer.message_waiting()
        text = "é".join(str(i) for i in range(60_000))  # several frames' worth
        sender = threading.Thread(target=engine.send_manifest, args=(text,))
        sender.start()
        assert trainer.receive_manifest() == text
        sender.join()
        engine.send("released", set=7)
        assert trainer.message_waiting()
        assert trainer.receive() == ("released", 7, 0, "")
        trainer.send("commit", set=7, version=3)
        assert engine.receive() == ("commit", 7, 3, "")
        trainer.send("reject", reason="no ≠")
        assert engine.receive() == ("reject", 0, 0, "no ≠")
        with pytest.raises(ValueError):
            trainer.send("bogus")
    finally:
        listener.close()
    assert not os.path.exists(listener.path), "closing removes the socket file"


def test_a_closed_peer_is_peer_closed_and_a_refusal_is_a_publish_error():
    listener, engine, trainer = _pair("closed")
    engine.send("reject", reason="engine `w` already has a trainer")
    with pytest.raises(stablebuf.PublishError, match="already has a trainer"):
        trainer.receive_manifest()
    engine.close()
    assert engine.closed
    with pytest.raises(stablebuf.PeerClosed):
        engine.send("released", set=1)
    assert trainer.message_waiting(), "a close is seen without blocking"
    with pytest.raises(stablebuf.PeerClosed):
        trainer.receive()
    with pytest.raises(stablebuf.PeerClosed):
        _native.PublishChannel.connect(_socket_path("nobody"))
    listener.close()


def test_channels_leak_no_descriptors():
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        listener, engine, trainer = _pair(f"leak{i}")
        trainer.close()
        engine.close()
        listener.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_dlpack_capsules_are_zero_copy_and_keep_their_memory_alive():
    torch = pytest.importorskip("torch")
    values = list(range(1, 200))
    probe = _native._DlpackProbe(values)
    assert probe.__dlpack_device__() == (1, 0)
    tensor = torch.from_dlpack(probe)
    assert tensor.dtype == torch.uint8 and tensor.shape == (len(values),)
    assert tensor.tolist() == values
    again = torch.from_dlpack(probe)
    assert again.data_ptr() == tensor.data_ptr(), "both views share the probe's bytes"
    del probe  # the tensors keep the bytes alive
    assert tensor[:3].tolist() == [1, 2, 3]
    tensor[0] = 77
    assert again[0].item() == 77
    unused = _native._DlpackProbe([5]).__dlpack__()  # never consumed: freed by its destructor
    del unused
    with pytest.raises(BufferError):
        _native._DlpackProbe([5]).__dlpack__(copy=True)


# ------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def torch():
    import torch as torch_module

    torch_module.cuda.init()
    return torch_module


@pytest.fixture(scope="module")
def peer(torch):
    sys.path.insert(0, HERE)
    import publish_peer

    return publish_peer


class Peer:
    """publish_peer.py (or ``script``) in a subprocess, talking over stdin/stdout lines."""

    def __init__(self, *args: str, script: str = PEER) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines = []
        self.problems = []  # what the engine's polls reported while waiting on this peer

    def expect(self, prefix: str, *, engine=None, timeout: float = 120.0) -> str:
        """The next stdout line, which must start with ``prefix``; polls ``engine`` meanwhile
        (its handshake and binds happen in poll)."""
        got = []

        def read():
            got.append(self.proc.stdout.readline())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while reader.is_alive() and time.monotonic() < deadline:
            if engine is not None:
                self.problems.extend(engine.poll().problems)
            time.sleep(0.001)
        reader.join(timeout=1)
        assert got and got[0], (
            f"the peer said nothing (exit {self.proc.poll()}) waiting for {prefix}"
        )
        line = got[0].strip()
        self.lines.append(line)
        assert line.startswith(prefix), f"expected `{prefix}`, the peer said `{line}`"
        return line

    def tell(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60.0) -> int:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.close()
        status = self.proc.wait(timeout=timeout)
        self.proc.stdout.close()
        return status

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.close()


def _poll_until(engine, version: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.version < version:
        assert time.monotonic() < deadline, f"version {version} was never bound"
        engine.poll()
        time.sleep(0.0005)


def _poll_until_the_trainer_is_gone(engine, timeout: float = 10.0) -> list:
    """Polls (as a serving loop does) until the engine has no trainer; returns the problems
    its statuses reported meanwhile."""
    problems: list = []
    deadline = time.monotonic() + timeout
    while True:
        status = engine.poll()
        problems.extend(status.problems)
        if not status.trainer_connected:
            return problems
        assert time.monotonic() < deadline, f"the trainer never went away: {problems}"
        time.sleep(0.001)


def _engine(peer, name: str):
    tag = f"publish-{name}"
    tensors = peer.build_model(tag, 0, seed=0)
    engine = stablebuf.publish.Engine(tag, _socket_path(name), tensors)
    served = peer.Served(tag, tensors, 0)
    served.check(0, "the engine's own weights")
    return tag, engine, served


@pytest.mark.gpu
def test_a_trainer_publishing_its_twin_is_read_by_the_graph_version_after_version(torch, peer):
    # Trainer.twin(): the weights laid out as the engine's sets, a publish is one copy of the
    # whole layout into the free set (cut once per set, only the copying GPU synchronised).
    tag, engine, served = _engine(peer, "twin")
    seeds = [int(time.time_ns() % 100_000) + i for i in range(1, 4)]
    trainer = Peer("twin", engine.path, ",".join(map(str, seeds)))
    try:
        trainer.expect("connected", engine=engine)
        for version, seed in enumerate(seeds, start=1):
            served.check(seeds[version - 2] if version > 1 else 0, f"before version {version}")
            trainer.tell()
            trainer.expect(f"published {version}", engine=None)
            _poll_until(engine, version)
            served.check(seed, f"version {version} (twin)")
        assert trainer.finish() == 0
    finally:
        if trainer.proc.poll() is None:
            trainer.kill()
        engine.close()


@pytest.mark.gpu
def test_each_published_version_is_bound_and_the_graph_replays_on_it(torch, peer):
    tag, engine, served = _engine(peer, "versions")
    seeds = [int(time.time_ns() % 100_000) + i for i in range(1, 5)]
    trainer = Peer("trainer", engine.path, ",".join(map(str, seeds)))
    try:
        trainer.expect("connected", engine=engine)
        assert engine.connected
        for version, seed in enumerate(seeds, start=1):
            served.check(seeds[version - 2] if version > 1 else 0, f"before version {version}")
            trainer.tell()
            trainer.expect(f"published {version}", engine=None)
            _poll_until(engine, version)
            assert engine.version == version
            served.check(seed, f"version {version}")
            assert stablebuf.stats()[tag]["mappings"] == 1, "one mapping after each publish"
            assert engine.bound_set is not None
        # The trainer's second commit of the last version was refused on its side.
        trainer.expect("conflict-ok")
        assert trainer.finish() == 0
        served.check(seeds[-1], "after the trainer left")
    finally:
        if trainer.proc.poll() is None:
            trainer.kill()
        engine.close()


@pytest.mark.gpu
def test_a_trainer_killed_mid_write_leaves_the_engine_serving(torch, peer):
    _tag, engine, served = _engine(peer, "killed")
    dying = Peer("die", engine.path, "777")
    try:
        dying.expect("ready", engine=engine)
        dying.kill()
        problems = _poll_until_the_trainer_is_gone(engine)
        assert len(problems) == 1 and problems[0].startswith("PeerClosed"), problems
        assert not engine.connected and engine.version == 0
        served.check(0, "the old set still serves")
        quiet = engine.poll()
        assert quiet == stablebuf.publish.PollStatus(version=0), "no trainer: nothing to do"
        # The half-written set goes back to the next trainer, which publishes whole weights.
        seed = 4242
        trainer = Peer("trainer", engine.path, str(seed))
        trainer.expect("connected", engine=engine)
        trainer.tell()
        trainer.expect("published 1")
        _poll_until(engine, 1)
        served.check(seed, "published after the kill")
        trainer.expect("conflict-ok")
        assert trainer.finish() == 0
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_manifest_mismatch_is_refused_naming_the_tensor(torch, peer):
    _tag, engine, served = _engine(peer, "mismatch")
    picky = Peer("mismatch", engine.path)
    try:
        # The trainer is refused (its side raises, naming the tensor: "mismatch-ok"); the
        # serving loop is told in poll()'s problems and serves on.
        picky.expect("mismatch-ok", engine=engine)
        assert picky.finish() == 0, picky.lines
        deadline = time.monotonic() + 10
        while not picky.problems and time.monotonic() < deadline:
            picky.problems.extend(engine.poll().problems)
            time.sleep(0.01)
        assert any("handshake failed" in p for p in picky.problems), picky.problems
        assert not engine.connected
        served.check(0, "after the refusal")
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_second_trainer_is_refused_and_the_first_keeps_publishing(torch, peer):
    _tag, engine, served = _engine(peer, "second")
    first = Peer("trainer", engine.path, "99")
    try:
        first.expect("connected", engine=engine)
        second = Peer("second", engine.path)
        second.expect("refused-ok", engine=engine)
        assert second.finish() == 0
        first.tell()
        first.expect("published 1")
        _poll_until(engine, 1)
        served.check(99, "the first trainer's weights")
        first.expect("conflict-ok")
        assert first.finish() == 0
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_socket_closed_before_the_handshake_is_peer_closed_and_changes_nothing(torch, peer):
    _tag, engine, served = _engine(peer, "hangup")
    try:
        early = Peer("hangup", engine.path)
        early.expect("hung up")
        assert early.finish() == 0
        problems: list = []
        deadline = time.monotonic() + 10
        while not problems:  # the hang-up shows in the status, not as an exception
            assert time.monotonic() < deadline, "the early close was never reported"
            status = engine.poll()
            assert not status.trainer_connected and status.version == 0
            problems.extend(status.problems)
            time.sleep(0.001)
        assert len(problems) == 1 and "handshake failed: PeerClosed" in problems[0], problems
        assert not engine.connected
        served.check(0, "after the early close")
        trainer = Peer("trainer", engine.path, "55")
        trainer.expect("connected", engine=engine)
        trainer.tell()
        trainer.expect("published 1")
        _poll_until(engine, 1)
        served.check(55, "the next trainer's weights")
        trainer.expect("conflict-ok")
        assert trainer.finish() == 0
    finally:
        engine.close()


@pytest.mark.gpu
def test_one_trainer_publishes_to_two_engines_with_a_trainer_each(torch, peer):
    engines = [_engine(peer, f"fanout{i}") for i in range(2)]
    paths = ",".join(engine.path for _, engine, _ in engines)
    fanout = Peer("fanout", paths, "66")
    try:
        deadline = time.monotonic() + 120
        while not all(engine.connected for _, engine, _ in engines):
            assert time.monotonic() < deadline, "the trainer did not connect to both engines"
            for _, engine, _ in engines:
                engine.poll()
            time.sleep(0.001)
        fanout.expect("connected")
        fanout.tell()
        fanout.expect("published 1")
        for _, engine, served in engines:
            _poll_until(engine, 1)
            served.check(66, f"engine {engine.tag}")
        assert fanout.finish() == 0
    finally:
        for _, engine, _ in engines:
            engine.close()


@pytest.mark.gpu
def test_colocated_sleep_publish_wake_serves_the_published_weights(torch, peer):
    _tag, engine, served = _engine(peer, "colocated")
    trainer = Peer("trainer", engine.path, "31,32")
    try:
        trainer.expect("connected", engine=engine)
        for version, seed in [(1, 31), (2, 32)]:
            free_awake = torch.cuda.mem_get_info()[0]
            engine.sleep()
            assert torch.cuda.mem_get_info()[0] > free_awake or version > 1
            with pytest.raises(stablebuf.Asleep):
                served.graph.replay()
            trainer.tell()
            trainer.expect(f"published {version}")
            # The commit was sent before the trainer said so; the engine binds nothing asleep.
            assert engine.wait_for_commit(version, timeout=60), f"version {version} never came"
            assert engine.ready_versions == [version] and engine.version == version - 1
            assert engine.wake() == version
            served.check(seed, f"woken onto version {version}")
        trainer.expect("conflict-ok")
        assert trainer.finish() == 0
    finally:
        engine.close()


@pytest.mark.gpu
def test_an_engine_killed_under_its_trainer_leaks_no_descriptors(torch, peer):
    def one_round(path: str, kill: bool) -> None:
        engine = Peer(path, "0", "5,6", script=ENGINE_PEER)
        try:
            engine.expect("ready")
            trainer = stablebuf.publish.Trainer.connect(path, expect=peer.expected())
            trainer.publish(peer.weights(5), version=1)
            engine.expect("served 1 ok")
            if kill:
                engine.kill()
                with pytest.raises(stablebuf.PeerClosed):
                    trainer.publish(peer.weights(6), version=2)
                    trainer.publish(peer.weights(6), version=3)  # the first may fit a free set
            trainer.close()
        finally:
            if engine.proc.poll() is None:
                engine.kill()
            else:
                engine.finish()  # closes its pipes

    one_round(_socket_path("warm"), kill=False)  # the driver opens what it keeps open
    import gc

    gc.collect()
    torch.cuda.synchronize()
    before = len(os.listdir("/proc/self/fd"))
    one_round(_socket_path("engine-killed"), kill=True)
    gc.collect()
    torch.cuda.synchronize()
    assert len(os.listdir("/proc/self/fd")) == before, "descriptors leaked"


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs (trainer on GPU 0, engine on GPU 1)")
def test_a_trainer_on_gpu0_publishes_into_an_engine_on_gpu1_over_peer_access(torch, peer):
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPU 0 cannot access GPU 1 (no peer access)")
    previous = torch.cuda.current_device()
    path = _socket_path("two-gpus")
    engine = Peer(path, "1", "8,9", script=ENGINE_PEER)
    try:
        engine.expect("ready")
        trainer = stablebuf.publish.Trainer.connect(
            path, expect=peer.expected(), device=1, access=[1, 0]
        )
        assert torch.cuda.current_device() == previous, "importing on GPU 1 moved the device"
        with torch.cuda.device(0):
            new = {n: v.to("cuda:0") for n, v in peer.weights(8).items()}
            torch.cuda.synchronize(0)
            start = time.perf_counter()
            trainer.publish(new, version=1)
            publish_s = time.perf_counter() - start
        engine.expect("served 1 ok")
        # Against a plain peer copy of the same bytes.
        targets = {
            n: torch.empty_like(v, device="cuda:1", dtype=peer.SHAPES[n][1]) for n, v in new.items()
        }
        torch.cuda.synchronize(1)
        start = time.perf_counter()
        for n, v in new.items():
            targets[n].copy_(v, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        plain_s = time.perf_counter() - start
        print(f"two GPUs: publish {publish_s * 1e3:.3f} ms, plain peer copy {plain_s * 1e3:.3f} ms")
        trainer.close()
        assert torch.cuda.current_device() == previous, "publishing moved the current device"
    finally:
        engine.kill() if engine.proc.poll() is None else None
        # The tests after this one run on the device they expect, whatever failed above.
        torch.cuda.set_device(previous)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs (engine on GPU 1, a trainer on GPU 0)")
def test_a_trainer_importing_the_sets_on_another_gpu_is_told_how_to_fix_it(torch, peer):
    """What a tensor-parallel rank's trainer left on its default device met (issue 40): the
    refusal says to import on the engine's GPU, and the engine serves on and takes the next
    trainer, which does."""
    previous = torch.cuda.current_device()
    path = _socket_path("wrong-gpu")
    engine = Peer(path, "1", "8", script=ENGINE_PEER)
    try:
        engine.expect("ready")
        with pytest.raises(stablebuf.OfferMismatch, match="on another device.*device=<the engine"):
            stablebuf.publish.Trainer.connect(path, expect=peer.expected(), device=0)
        trainer = stablebuf.publish.Trainer.connect(path, expect=peer.expected(), device=1)
        with torch.cuda.device(1):
            trainer.publish(peer.weights(8), version=1)
        engine.expect("served 1 ok")
        trainer.close()
    finally:
        engine.kill() if engine.proc.poll() is None else engine.finish()
        torch.cuda.set_device(previous)
