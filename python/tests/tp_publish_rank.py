"""One rank of test_tp_publish.py's race, started by ``torch.distributed.run``; and, run as
``tp_publish_rank.py trainer PATH DEVICE SEED,SEED,...``, the trainer process of one rank.

    python -m torch.distributed.run --nproc-per-node N --standalone tp_publish_rank.py \\
        FOLDER PLACEMENT RACE_SEED[,RACE_SEED...] [AGREE_EVERY]

PLACEMENT: ``one-gpu`` (every rank on GPU 0 of those visible) or ``gpu-per-rank`` (rank r on
GPU r). The race seeds are run one after the other, each printed as it starts; a race seed
fixes everything but the timing: the weights of each version, the steps that roll back, the
steps and ranks of the injected bind failures, and each rank's trainer pace. AGREE_EVERY: the
engines' ``agree_every`` (default: the engine's default).

Per race, every rank builds the model (publish_peer.py's) in a region on its GPU and an
``Engine(sets=3, keep_previous=True, group=...)`` over a gloo group of its own, and starts
its trainer (this file, ``trainer``) on the same GPU, told to publish the next version at
random steps: every rank at its own pace. At every step boundary each rank calls ``poll`` (at
planned steps ``rollback``) as a serving loop does, reads the status (never an exception),
replays its graph over a NaN-poisoned output and checks it against the CPU reference of the
version the status reports. Then the ranks compare: the same version, the same version bound
and the same versions refused on every rank after every boundary; a boundary refused (or a
rollback refused) on every rank exactly when an injected failure fired on some rank there;
no problem reported but those; a refused version never waiting and never bound later. At
planned steps a rank's next bind fails (injected): the version is refused on every rank, and
its set goes back to every rank's trainer.

At the end every trainer is told the rest and the ranks poll until every version is committed
on every rank and none waits, within a deadline; each trainer must have published every
version (it gives up, and fails the race, after waiting ``ACQUIRE_TIMEOUT_S`` for a set to
come back). Each rank prints ``race seed S: rank R ok: ...`` per race and exits 0.
"""

from __future__ import annotations

import datetime
import os
import random
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import stablebuf
from stablebuf._switcher import DEFAULT_AGREE_EVERY
from stablebuf.publish import Engine, PollStatus, Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import publish_peer as peer  # noqa: E402  (the shared model)

STEPS = 300
VERSIONS = 24
ROLLBACKS = 12
INJECTED_FAILURES = 3
#: The chance, per step, that a rank tells its trainer to publish the next version.
TELL_CHANCE = 0.12
#: How long a trainer waits for a set to come back before it gives up (failing the race).
ACQUIRE_TIMEOUT_S = 60.0
#: How long the ranks may take, after the race, until every version is committed and none waits.
SETTLE_TIMEOUT_S = 120.0
#: What a status may report in this race: refusals (injected failures) and empty rollbacks.
EXPECTED_PROBLEMS = (
    "was refused: this rank's bind failed",
    "was refused: another rank's",
    "no version to roll back to",
)


def say(line: str) -> None:
    print(line, flush=True)


# ------------------------------------------------------------------ the trainer process


def trainer_main(path: str, device: int, seeds: list) -> int:
    # The sets are imported, and written, on the engine's GPU: a set imported on another
    # device is refused by the engine ("the dataset is on another device").
    torch.cuda.set_device(device)
    trainer = Trainer.connect(
        path, expect=peer.expected(), check_dtypes=True, device=device, timeout=120
    )
    say(f"connected on GPU {device}")
    for version, seed in enumerate(seeds, start=1):
        if not sys.stdin.readline():
            say(f"stdin closed before version {version}")
            return 2
        try:
            trainer.publish(peer.weights(seed), version=version, timeout=ACQUIRE_TIMEOUT_S)
        except stablebuf.PublishTimeout as timeout:
            say(f"no set came back for version {version} in {ACQUIRE_TIMEOUT_S:.0f} s: {timeout}")
            return 3
        say(f"published {version}")
    say("done")
    sys.stdin.read()  # until the rank closes it
    trainer.close()
    return 0


# ------------------------------------------------------------------ one rank


class BindFailures:
    """Injected bind failures: each one armed fails this rank's next bind (a switch's or a
    rollback's), through the engine's own bind seam."""

    def __init__(self, engine: Engine) -> None:
        self.armed = 0
        self.fired = 0
        self._real = engine._bind
        engine._bind = self._bind

    def _bind(self, weight_set) -> None:
        if self.armed:
            self.armed -= 1
            self.fired += 1
            raise RuntimeError("injected bind failure")
        self._real(weight_set)


class Race:
    """One race seed on this rank (see the module's docstring)."""

    def __init__(
        self, race_seed: int, index: int, device: int, control, folder: str, agree_every: int
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.race_seed = race_seed
        plan = random.Random(race_seed)  # the same plan on every rank
        self.weight_seeds = [plan.randrange(1, 1 << 30) for _ in range(VERSIONS)]
        self.rollbacks = set(plan.sample(range(20, STEPS), ROLLBACKS))
        candidates = [s for s in range(20, STEPS * 2 // 3) if s not in self.rollbacks]
        self.injections = {
            step: plan.randrange(self.world) for step in plan.sample(candidates, INJECTED_FAILURES)
        }
        self.pace = random.Random(race_seed * 1000 + self.rank)  # this rank's trainer pace
        self.seed_of = {0: 0, **{v: s for v, s in enumerate(self.weight_seeds, start=1)}}
        self.references: dict = {}

        tag = f"tp-publish-{index}-{self.rank}"
        tensors = peer.build_model(tag, device, seed=0)
        self.path = os.path.join(folder, f"engine-{index}-{self.rank}.sock")
        self.engine = Engine(
            tag,
            self.path,
            tensors,
            sets=3,
            keep_previous=True,
            group=control,
            agree_every=agree_every,
        )
        self.served = peer.Served(tag, tensors, device)
        self.failures = BindFailures(self.engine)
        self.log_path = os.path.join(folder, f"trainer-{index}-{self.rank}.log")
        with open(self.log_path, "w") as log:
            self.trainer = subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "trainer",
                    self.path,
                    str(device),
                    ",".join(map(str, self.weight_seeds)),
                ],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        self.told = 0
        self.switched: list = []  # versions bound by a switch, in order
        self.events: list = []  # ("switch" | "rollback", version), in order
        self.refused: set = set()
        self.refused_rollbacks = 0

    def trainer_log(self) -> str:
        with open(self.log_path) as log:
            return log.read()[-2000:]

    def where(self, what: str) -> str:
        return f"race seed {self.race_seed}, rank {self.rank}, {what}"

    def tell(self) -> None:
        self.trainer.stdin.write("go\n")
        self.trainer.stdin.flush()
        self.told += 1

    def check_output(self, version: int, what: str) -> None:
        """The replay (over a NaN-poisoned output) is the reference of ``version``."""
        reference = self.references.get(version)
        if reference is None:
            reference = self.references[version] = peer.reference(self.seed_of[version])
        torch.testing.assert_close(
            self.served.replay(),
            reference,
            rtol=2e-3,
            atol=2e-3,
            msg=lambda m: f"{self.where(what)}: the output is not version {version}'s: {m}",
        )

    def boundary(self, step: int, what: str) -> PollStatus:
        """One step boundary on every rank (a rollback at planned steps), checked here and
        against the other ranks."""
        if self.injections.get(step) == self.rank:
            self.failures.armed += 1
        fired_before = self.failures.fired
        rollback = step in self.rollbacks
        status = self.engine.rollback() if rollback else self.engine.poll()
        fired = self.failures.fired > fired_before
        for problem in status.problems:
            assert any(p in problem for p in EXPECTED_PROBLEMS), (
                f"{self.where(what)}: an unexpected problem: {problem}"
            )
        refused_rollback = rollback and any("was refused" in p for p in status.problems)
        for version in status.refused:
            assert version not in self.engine.ready_versions, (
                f"{self.where(what)}: refused version {version} still waits"
            )
            self.refused.add(version)
        if status.bound is not None:
            if not rollback:
                assert status.bound not in self.refused, (
                    f"{self.where(what)}: version {status.bound} was bound after its refusal"
                )
                self.switched.append(status.bound)
            self.events.append(("rollback" if rollback else "switch", status.bound))
        self.refused_rollbacks += refused_rollback
        assert status.group_in_step, f"{self.where(what)}: out of step: {status}"
        self.check_output(status.version, f"{what}, version {status.version}")
        shared = (status.version, status.bound, status.refused, refused_rollback)
        views = [None] * self.world
        dist.all_gather_object(views, (shared, fired))
        assert len({view for view, _ in views}) == 1, (
            f"{self.where(what)}: the ranks disagree: (version, bound, refused, refused "
            f"rollback) {[view for view, _ in views]}"
        )
        failed_here = bool(status.refused) or refused_rollback
        any_fired = any(f for _, f in views)
        assert failed_here == any_fired, (
            f"{self.where(what)}: "
            + (
                "a refusal with no injected failure"
                if failed_here
                else "an injected failure fired and nothing was refused"
            )
            + f": {status}"
        )
        return status

    def run(self) -> str:
        engine = self.engine
        try:
            deadline = time.monotonic() + 120
            while not engine.accept(timeout=0.5):
                if self.trainer.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.where('start')}: the trainer did not connect (exit "
                        f"{self.trainer.poll()}); the trainer's log:\n{self.trainer_log()}"
                    )
            for step in range(STEPS):
                if self.told < VERSIONS and self.pace.random() < TELL_CHANCE:
                    self.tell()
                self.boundary(step, f"step {step}")
            while self.told < VERSIONS:
                self.tell()
            self.settle()
            return self.finish()
        finally:
            if self.trainer.stdin:
                self.trainer.stdin.close()
            try:
                self.trainer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
                self.trainer.wait()
            engine.close()

    def settle(self) -> None:
        """Polls until every version is committed on every rank and none waits; fails at once
        if a trainer gave up, and after ``SETTLE_TIMEOUT_S`` if the group never got there."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        step = STEPS
        while True:
            self.boundary(step, f"settling, boundary {step}")
            step += 1
            engine = self.engine
            quiet = engine.last_committed == VERSIONS and not engine.ready_versions
            exited = self.trainer.poll()
            states = [None] * self.world
            dist.all_gather_object(states, (quiet, exited))
            if exited not in (None, 0):
                raise AssertionError(
                    f"{self.where('settling')}: the trainer exited {exited}; its log:\n"
                    + self.trainer_log()
                )
            failed = [r for r, (_, e) in enumerate(states) if e not in (None, 0)]
            assert not failed, f"{self.where('settling')}: the trainers of ranks {failed} failed"
            if all(q for q, _ in states):
                return
            assert time.monotonic() < deadline, (
                f"{self.where('settling')}: not settled in {SETTLE_TIMEOUT_S:.0f} s: (quiet, "
                f"trainer exit) per rank {states}; here ready {engine.ready_versions}, last "
                f"committed {engine.last_committed}; the trainer's log:\n{self.trainer_log()}"
            )
            time.sleep(0.002)

    def finish(self) -> str:
        engine = self.engine
        final = engine.version
        views = [None] * self.world
        dist.all_gather_object(views, (final, self.failures.fired, len(self.switched)))
        assert len({v for v, _, _ in views}) == 1, f"{self.where('the end')}: versions {views}"
        self.check_output(final, "the end")
        # The last version was bound or refused (never dropped unsaid), and unless a rollback
        # came after it, the group ends on it.
        assert VERSIONS in self.switched or VERSIONS in self.refused, (
            f"{self.where('the end')}: version {VERSIONS} was neither bound nor refused"
        )
        if VERSIONS in self.switched:
            after = self.events[self.events.index(("switch", VERSIONS)) + 1 :]
            if not after:
                assert final == VERSIONS, f"{self.where('the end')}: ended on {final}"
        rolled_back = sum(1 for kind, _ in self.events if kind == "rollback")
        assert len(self.switched) > 5 and rolled_back > 0, (
            f"{self.where('the end')}: {len(self.switched)} switches, {rolled_back} rollbacks"
        )
        assert sum(fired for _, fired, _ in views) > 0, (
            f"{self.where('the end')}: no injected failure fired on any rank"
        )
        self.trainer.stdin.close()
        status = self.trainer.wait(timeout=60)
        log = self.trainer_log()
        assert status == 0 and "done" in log, (
            f"{self.where('the end')}: the trainer exited {status}; its log:\n{log}"
        )
        return (
            f"race seed {self.race_seed}: rank {self.rank} ok: {len(self.switched)} switches, "
            f"{rolled_back} rollbacks, {len(self.refused)} refused versions, "
            f"{self.refused_rollbacks} refused rollbacks, {self.failures.fired} injected "
            f"failures fired here, version {final} at the end"
        )


def main(argv) -> int:
    if argv[1] == "trainer":
        return trainer_main(argv[2], int(argv[3]), [int(s) for s in argv[4].split(",")])
    folder, placement = argv[1], argv[2]
    race_seeds = [int(s) for s in argv[3].split(",")]
    agree_every = int(argv[4]) if len(argv) > 4 else DEFAULT_AGREE_EVERY
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    if placement == "one-gpu":
        device = 0
    elif placement == "gpu-per-rank":
        if torch.cuda.device_count() < world:
            raise SystemExit(f"gpu-per-rank: {world} ranks, {torch.cuda.device_count()} GPUs")
        device = rank
    else:
        raise SystemExit(f"unknown placement {placement!r}: one-gpu or gpu-per-rank")
    torch.cuda.set_device(device)
    # The engines' agreement on a group of its own (the race's checks use the default one).
    control = dist.new_group(backend="gloo")
    for index, race_seed in enumerate(race_seeds):
        if rank == 0:
            say(
                f"race seed {race_seed}: {world} ranks, {placement} (GPU of rank 0: {device}), "
                f"agree_every={agree_every}"
            )
        say(Race(race_seed, index, device, control, folder, agree_every).run())
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
