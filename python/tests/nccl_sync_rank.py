"""One engine rank of test_nccl_sync.py (issue 42), started by ``torch.distributed.run`` with
a GPU per rank; and, as ``nccl_sync_rank.py trainer HOST PORT PREFIX DEVICE SEEDS [die]``, the
remote trainer of one rank's shard (on another GPU: rank r's trainer uses GPU (r+1) % N).

    python -m torch.distributed.run --nproc-per-node N --standalone nccl_sync_rank.py \\
        race|kill FOLDER RACE_SEED[,...] [AGREE_EVERY]

``race``: tp_publish_rank.py's race (commits raced against steps, injected bind failures,
rollbacks; every step's output on every rank checked against the version its status reports,
and the ranks compared after every boundary), with each rank's weights arriving over NCCL
from its remote trainer into a spare set. Prints ``race seed S: rank R ok: ...``.

``kill``: every rank gets version 1; rank 0's trainer is SIGKILLed mid-transfer of version 2
while the others' finish. Rank 0 must report the stall within STALL_S + 2 s, serve every step
meanwhile (outputs checked, an NCCL all-reduce on the engines' own TP group every step), then
three new trainers in turn join rank 0 and publish versions 2..4 (the others' trainers
too), each bound on every rank at once. Descriptors and device memory of the engine process
are counted after the drop and after each cycle. Prints ``KILL rank R: PASS|FAIL ...``.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import stablebuf
from stablebuf.publish import RemoteEngine, RemoteTrainer, control_store

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import publish_peer as peer  # noqa: E402
import tp_publish_rank as base  # noqa: E402

CHUNK = 64 << 10  # several receive operations per version (the model is ~0.7 MB)
STALL_S = 3.0
LEAK_FDS = 0
LEAK_MIB = 8.0


def say(line: str) -> None:
    print(line, flush=True)


def shard_seed(seed: int, rank: int) -> int:
    return seed * 7 + rank  # every rank's shard differs


def trainer_main(host, port, prefix, device, seeds, die=False) -> int:
    torch.cuda.set_device(device)
    store = control_store(host, port, server=False, timeout=120)
    trainer = RemoteTrainer.connect(store, prefix, device=device, expect=peer.expected(),
                                    check_dtypes=True, timeout=120)
    say(f"connected epoch {trainer.epoch} on GPU {device}")
    for version, seed in seeds:
        if not sys.stdin.readline():
            return 2
        if die and version == seeds[-1][0]:
            for name, v in peer.weights(seed).items():
                trainer.tensors()[name].copy_(v)
            torch.cuda.synchronize()
            trainer.send(version, stop_after=1)
            say("mid")
            time.sleep(3600)
        trainer.publish(peer.weights(seed), version=version, timeout=120)
        say(f"published {version} {trainer.stats[version]['gb_per_s']:.2f} GB/s")
    say("done")
    sys.stdin.read()
    trainer.close()
    return 0


def build(tag, device):
    with stablebuf.region(tag, fence="last-use"):
        tensors = {n: torch.empty(s, dtype=d, device=f"cuda:{device}")
                   for n, (s, d) in peer.SHAPES.items()}
    for n, v in peer.weights(0).items():
        tensors[n].copy_(v)
    torch.cuda.synchronize(device)
    return tensors


def spawn(folder, name, store, prefix, device, seeds, die=False):
    log_path = os.path.join(folder, name)
    log = open(log_path, "w")
    args = [sys.executable, os.path.abspath(__file__), "trainer", "127.0.0.1", str(store.port),
            prefix, str(device), ",".join(f"{v}:{s}" for v, s in seeds)] + (["die"] if die else [])
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    proc.log_path = log_path
    return proc


class NcclRace(base.Race):
    """tp_publish_rank.Race with a RemoteEngine and a remote trainer per rank."""

    def __init__(self, race_seed, index, device, control, folder, agree_every, store):
        import random

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.race_seed = race_seed
        plan = random.Random(race_seed)
        self.weight_seeds = [plan.randrange(1, 1 << 30) for _ in range(base.VERSIONS)]
        self.rollbacks = set(plan.sample(range(20, base.STEPS), base.ROLLBACKS))
        candidates = [s for s in range(20, base.STEPS * 2 // 3) if s not in self.rollbacks]
        self.injections = {s: plan.randrange(self.world)
                           for s in plan.sample(candidates, base.INJECTED_FAILURES)}
        self.pace = random.Random(race_seed * 1000 + self.rank)
        mine = [shard_seed(s, self.rank) for s in self.weight_seeds]
        self.seed_of = {0: 0, **{v: s for v, s in enumerate(mine, start=1)}}
        self.references = {}
        tag = f"nccl-race-{index}-{self.rank}"
        tensors = build(tag, device)
        prefix = f"race{index}/tp{self.rank}"
        self.engine = RemoteEngine(tag, tensors, store=store, prefix=prefix, sets=3,
                                   keep_previous=True, group=control, agree_every=agree_every,
                                   chunk_bytes=CHUNK, stall_timeout=60.0)
        self.served = peer.Served(tag, tensors, device)
        self.failures = base.BindFailures(self.engine)
        trainer_gpu = (device + 1) % torch.cuda.device_count()
        self.trainer = spawn(folder, f"trainer-{index}-{self.rank}.log", store, prefix,
                             trainer_gpu, list(enumerate(mine, start=1)))
        self.log_path = self.trainer.log_path
        self.told = 0
        self.switched, self.events, self.refused = [], [], set()
        self.refused_rollbacks = 0


def nvidia_smi_mib(pid):
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except Exception:  # noqa: BLE001
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def counts(device):
    torch.cuda.synchronize(device)
    fds = len(os.listdir("/proc/self/fd"))
    mib = nvidia_smi_mib(os.getpid())
    if mib is None:
        free, total = torch.cuda.mem_get_info(device)
        mib = (total - free) / 2**20  # the device's (other processes idle meanwhile)
    return fds, mib


def kill_main(folder, device, agree_every, store) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")
    tp_nccl = dist.new_group(backend="nccl")
    tag = f"nccl-kill-{rank}"
    tensors = build(tag, device)
    engine = RemoteEngine(tag, tensors, store=store, prefix=f"kill/tp{rank}", sets=2,
                          group=control, agree_every=agree_every, chunk_bytes=CHUNK,
                          stall_timeout=STALL_S)
    served = peer.Served(tag, tensors, device)
    gpu = (device + 1) % torch.cuda.device_count()
    seeds = {v: shard_seed(1000 + v, rank) for v in range(1, 5)}
    refs = {0: peer.reference(0), **{v: peer.reference(s) for v, s in seeds.items()}}
    trainer = spawn(folder, f"kill-{rank}.log", store, f"kill/tp{rank}", gpu,
                    [(1, seeds[1]), (2, seeds[2])], die=(rank == 0))
    failures = []
    state = {"steps": 0, "killed_at": None, "dropped_at": None}

    def step(done_here=True):
        """One boundary on every rank (lockstep: the ranks gather after it); returns whether
        ``done_here`` holds on every rank."""
        status = engine.poll()
        got = served.replay()
        if not torch.allclose(got.double(), refs[status.version], rtol=2e-3, atol=2e-3):
            failures.append(f"step {state['steps']}: output is not version {status.version}'s")
        one = torch.ones(1, device=f"cuda:{device}")
        dist.all_reduce(one, group=tp_nccl)  # the engines' own NCCL group goes on
        if int(one.item()) != world:
            failures.append("the TP all-reduce went wrong")
        views = [None] * world
        dist.all_gather_object(views, (status.version, bool(done_here)), group=control)
        if len({v for v, _ in views}) != 1:
            failures.append(f"step {state['steps']}: ranks serve versions {views}")
        for p in status.problems:
            if "PeerClosed" in p and state["dropped_at"] is None:
                state["dropped_at"] = time.monotonic()
        state["steps"] += 1
        return all(d for _, d in views)

    def serve_until(cond, seconds, what):
        """Steps in lockstep on every rank until ``cond`` holds on every rank (a rank's
        time-out counts as its ``cond`` holding, and is a failure)."""
        deadline = time.monotonic() + seconds
        while True:
            here = cond()
            if not here and time.monotonic() > deadline:
                failures.append(f"timed out: {what}")
                here = True
            if step(here):
                return

    def tell(proc):
        proc.stdin.write("go\n")
        proc.stdin.flush()

    serve_until(lambda: engine.connected, 120, "first trainer joined")
    tell(trainer)
    serve_until(lambda: engine.version == 1, 120, "version 1 bound")
    tell(trainer)  # version 2: rank 0's trainer dies mid-transfer
    serve_until(lambda: rank != 0 or "mid" in open(trainer.log_path).read(), 60,
                "trainer mid-transfer")
    if rank == 0:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        state["killed_at"] = time.monotonic()
    serve_until(lambda: rank != 0 or state["dropped_at"] is not None, STALL_S + 30,
                "stall reported")
    dist.barrier(group=control)
    detect = None
    if rank == 0 and state["dropped_at"] and state["killed_at"]:
        detect = state["dropped_at"] - state["killed_at"]
    base_counts = counts(device)
    after = []
    # Rank 0: a new trainer joins and publishes version 2 (the others have it): bound everywhere.
    if rank == 0:
        fresh = spawn(folder, "kill-0-new.log", store, "kill/tp0", gpu, [(2, seeds[2])])
    serve_until(lambda: rank != 0 or engine.connected, 120, "the new trainer joined")
    if rank == 0:
        tell(fresh)
    serve_until(lambda: engine.version == 2, 120, "version 2 bound after the rejoin")
    if rank == 0:
        fresh.stdin.close()
        fresh.wait(timeout=60)
    elif trainer.poll() is None:
        trainer.stdin.close()
        trainer.wait(timeout=60)
    serve_until(lambda: not engine.connected, 60, "the trainers left")
    dist.barrier(group=control)
    after.append(counts(device))
    # Two more rejoin cycles on every rank (fresh trainers everywhere): the leak's slope.
    for cycle, version in ((2, 3), (3, 4)):
        fresh = spawn(folder, f"kill-{rank}-cycle{cycle}.log", store, f"kill/tp{rank}", gpu,
                      [(version, seeds[version])])
        serve_until(lambda: engine.connected, 120, f"cycle {cycle} joined")
        tell(fresh)
        serve_until(lambda: engine.version == version, 120, f"cycle {cycle}: version bound")
        fresh.stdin.close()
        fresh.wait(timeout=60)
        serve_until(lambda: not engine.connected, 30, f"cycle {cycle} left")
        dist.barrier(group=control)
        after.append(counts(device))
    fd_growth = after[-1][0] - after[0][0]
    mib_growth = after[-1][1] - after[0][1]
    ok = not failures and fd_growth <= LEAK_FDS and mib_growth <= LEAK_MIB
    if rank == 0:
        ok = ok and detect is not None and detect <= STALL_S + 2.0
    say(f"KILL rank {rank}: {'PASS' if ok else 'FAIL'} detect_s={detect} (bound "
        f"{STALL_S + 2.0:.1f} s, rank 0 only) steps={state['steps']} counts base={base_counts} "
        f"after_cycles={after} fd_growth={fd_growth} mib_growth={mib_growth:.1f} "
        f"failures={failures[:5]}")
    engine.close()
    return 0 if ok else 1


def main(argv) -> int:
    if argv[1] == "trainer":
        seeds = [tuple(int(x) for x in p.split(":")) for p in argv[6].split(",")]
        return trainer_main(argv[2], int(argv[3]), argv[4], int(argv[5]), seeds,
                            die=len(argv) > 7 and argv[7] == "die")
    mode, folder = argv[1], argv[2]
    race_seeds = [int(s) for s in argv[3].split(",")]
    agree_every = int(argv[4]) if len(argv) > 4 else 8
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.device_count() < max(world, 2):
        raise SystemExit(f"{world} ranks need {max(world, 2)} GPUs")
    device = rank
    torch.cuda.set_device(device)
    store = control_store("127.0.0.1", 0, server=True, timeout=120)
    if mode == "kill":
        code = kill_main(folder, device, agree_every, store)
        dist.barrier()
        dist.destroy_process_group()
        return code
    control = dist.new_group(backend="gloo")
    for index, race_seed in enumerate(race_seeds):
        if rank == 0:
            say(f"race seed {race_seed}: {world} ranks over NCCL, agree_every={agree_every}")
        say(NcclRace(race_seed, index, device, control, folder, agree_every, store).run())
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
