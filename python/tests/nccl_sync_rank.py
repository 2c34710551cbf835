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

A passing kill run takes about 40-75 s: torchrun and the ranks' start (~10 s), then mostly
the start of four trainer processes one after the other on rank 0 (python, torch, CUDA, the
NCCL pair over sockets: ~5-10 s each), at most STALL_S for the stall (less where NCCL reports
the dead peer at once), the rest well under a second per phase (deadlines: ``PHASES``).

Diagnosis: every line any process prints is stamped (wall clock, seconds since start, who)
and flushed; each engine rank also writes its lines to ``FOLDER/rank-R.log``, each trainer to
its own log there, and every process appends ``PID ROLE`` to ``FOLDER/pids``. Each kill phase
has a deadline (``PHASES``); a rank past it raises, in lockstep on every rank,
``PhaseTimeout`` naming what was awaited, and the run ends with ``KILL rank R: FAIL``. A step
that blocks past its phase's deadline + ``STUCK_GRACE_S`` gets every thread's Python stack
dumped (faulthandler) into the rank's log, again after each such interval; ``SIGUSR1`` dumps
any of these processes' stacks at once (test_nccl_sync.py sends it on its own timeout).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import faulthandler
import gc
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
# How _describe_socket names a TCP socket ncclCommAbort left behind (CLOSE state, unbound).
NCCL_ABORT_SOCKET = "socket AF_INET SOCK_STREAM ('0.0.0.0', 0) (not in /proc/net)"
#: Deadlines (s) of the kill run's phases; a passing run needs a small part of each (a
#: trainer's start ~5-10 s, the stall STALL_S, the others under a second).
PHASES = {
    "join": 90.0,  # a new trainer process connected (python + torch + CUDA + NCCL pair)
    "bind": 30.0,  # a published version bound on every rank
    "mid": 30.0,  # the dying trainer sent its first range
    "stall": STALL_S + 10.0,  # rank 0 reported the dead trainer (the test's bound: +2 s)
    "leave": 30.0,  # the trainers closed and the engines saw them leave
    "exit": 60.0,  # a trainer process ended after its stdin closed
    "teardown": 120.0,  # engine.close, barrier, destroy_process_group
}
#: Past a phase's deadline + this, a blocked step gets every thread's stack dumped.
STUCK_GRACE_S = 15.0
#: The gloo/NCCL groups' own timeout (a rank that never comes to a collective).
GROUP_TIMEOUT_S = float(os.environ.get("NCCL_SYNC_GROUP_TIMEOUT", "120"))
#: A trainer process ends on its own after this long (an orphan never lingers).
TRAINER_MAX_S = 1800.0

T0 = time.monotonic()
_who = f"pid {os.getpid()}"
_log = None  # this engine rank's log file in the run folder


def say(line: str) -> None:
    """Prints ``line`` stamped (wall clock, seconds since this process started, who), flushed,
    and writes it to this rank's log too."""
    text = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:7.2f}s {_who}] {line}"
    print(text, flush=True)
    if _log is not None:
        _log.write(text + "\n")
        _log.flush()


def start_diagnosis(folder: str, who: str, log=None) -> None:
    """Stamps this process's lines with ``who``, writes them to ``log`` as well, dumps every
    thread's stack on SIGUSR1 and on a crash (to ``log``, else stderr), and lists the process
    in ``FOLDER/pids`` (for test_nccl_sync.py's SIGUSR1 on its timeout)."""
    global _who, _log
    _who, _log = who, log
    out = log if log is not None else sys.stderr
    faulthandler.enable(file=out, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    try:
        with open(os.path.join(folder, "pids"), "a") as f:
            f.write(f"{os.getpid()} {who}\n")
    except OSError:  # not in a run folder (a trainer started by hand)
        pass


class PhaseTimeout(RuntimeError):
    """A kill phase's deadline passed on some rank (raised on every rank at the same step)."""


def shard_seed(seed: int, rank: int) -> int:
    return seed * 7 + rank  # every rank's shard differs


MID = "MID-TRANSFER"  # the dying trainer's line once its first range is enqueued


def trainer_main(host, port, prefix, device, seeds, die=False) -> int:
    # Stdout is this trainer's log in the run folder (spawn); the folder is its directory.
    folder = os.path.dirname(os.path.realpath(f"/proc/self/fd/{sys.stdout.fileno()}"))
    start_diagnosis(folder, f"trainer {prefix} gpu{device}")
    # An orphan (its engine rank gone without closing stdin) never lingers.
    faulthandler.dump_traceback_later(TRAINER_MAX_S, exit=True, file=sys.stdout)
    say(f"start: store 127.0.0.1:{port}, versions {[v for v, _ in seeds]}, die={die}")
    torch.cuda.set_device(device)
    store = control_store(host, port, server=False, timeout=120)
    say("store connected; joining (manifest, epoch, NCCL pair warm-up; deadline 120 s)")
    trainer = RemoteTrainer.connect(store, prefix, device=device, expect=peer.expected(),
                                    check_dtypes=True, timeout=120)
    say(f"connected epoch {trainer.epoch} on GPU {device}")
    for version, seed in seeds:
        line = sys.stdin.readline()
        if not line:
            say("stdin closed before being told to publish: exit 2")
            return 2
        if die and version == seeds[-1][0]:
            for name, v in peer.weights(seed).items():
                trainer.tensors()[name].copy_(v)
            torch.cuda.synchronize()
            say(f"sending version {version}, first range only")
            trainer.send(version, stop_after=1)
            say(MID)
            sys.stdin.read()  # SIGKILLed here; or its engine rank is gone: stdin closes
            os._exit(3)
        say(f"publishing version {version} (deadline 120 s)")
        trainer.publish(peer.weights(seed), version=version, timeout=120)
        say(f"published {version} {trainer.stats[version]['gb_per_s']:.2f} GB/s")
    say("done; waiting for stdin to close")
    sys.stdin.read()
    start = time.monotonic()
    trainer.close()
    say(f"closed in {time.monotonic() - start:.2f} s")
    return 0


def probe_main(host, port, prefix, device) -> int:
    """A bare pair's trainer side: join ``PairGroup`` rank 0, broadcast once, abort (what
    ``RemoteTrainer.close`` does to its pair) and exit. No engine, no weights."""
    from stablebuf._nccl_sync import PairGroup

    torch.cuda.set_device(device)
    store = control_store(host, port, server=False, timeout=60)
    pair = PairGroup(store, prefix, 0, device)
    pair.broadcast(torch.ones(1 << 16, device=f"cuda:{device}")).wait()
    torch.cuda.synchronize(device)
    store.wait([f"{prefix}received"])  # the engine side has it: leave as a trainer does
    pair.abort()
    return 0


def bare_pair_cycles(store, prefix, device, peer_device, cycles=3):
    """The engine's join-and-leave with nothing of stablebuf's around it: per cycle a child
    process joins a bare ``PairGroup`` (a two-rank ``ProcessGroupNCCL``) with this one,
    broadcasts once, aborts and exits, and this side aborts its end as the engine does when
    a trainer leaves. Returns the descriptors opened between consecutive cycles, by kind,
    one ``Counter`` per interval (what NCCL and torch keep per pair that joined and left)."""
    from stablebuf._nccl_sync import PairGroup

    snapshots = []
    for cycle in range(cycles):
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "probe", "127.0.0.1", str(store.port),
             f"{prefix}/{cycle}/", str(peer_device)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            pair = PairGroup(store, f"{prefix}/{cycle}/", 1, device)
            got = torch.zeros(1 << 16, device=f"cuda:{device}")
            pair.broadcast(got).wait()
            torch.cuda.synchronize(device)
            store.set(f"{prefix}/{cycle}/received", "1")
            child.wait(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        pair.abort()
        del pair
        gc.collect()
        snapshots.append(fd_targets())
    return [collections.Counter(b) - collections.Counter(a) for a, b in zip(snapshots, snapshots[1:])]


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
    with log:  # the child has its own descriptor
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
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


#: What each call of :func:`counts` found open (``readlink`` of every descriptor): a growth is
#: reported by kind (socket, anon_inode:[eventfd], /dev/nvidia-uvm, ...), not only counted.
FD_TARGETS = []


def _socket_table():
    """inode -> what the socket is (tcp/udp local -> remote state, a unix socket's path, a
    netlink or packet socket's protocol)."""
    table = {}
    for kind in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
        with contextlib.suppress(OSError):
            with open(f"/proc/net/{kind}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, remote, state, inode = parts[1], parts[2], parts[3], parts[9]
                    port = lambda a: int(a.split(":")[1], 16)  # noqa: E731
                    table[inode] = f"{kind} :{port(local)} -> :{port(remote)} st{state}"
    with contextlib.suppress(OSError):
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                parts = line.split()
                table[parts[6]] = "unix " + (parts[7] if len(parts) > 7 else "(unnamed)")
    # netlink: sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode; packet: ... Inode last.
    for kind, proto_col in (("netlink", 1), ("packet", 3)):
        with contextlib.suppress(OSError):
            with open(f"/proc/net/{kind}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    table[parts[-1]] = f"{kind} proto {parts[proto_col]}"
    return table


def _describe_socket(fd: str) -> str:
    """What the kernel says of a socket no /proc/net table lists: family, type, addresses
    (through a duplicate of the descriptor, closed at once; the original stays open)."""
    import socket

    try:
        with socket.socket(fileno=os.dup(int(fd))) as s:
            what = f"socket {s.family.name} {s.type.name}"
            with contextlib.suppress(OSError):
                what += f" {s.getsockname()!r}"
            with contextlib.suppress(OSError):
                what += f" -> {s.getpeername()!r}"
            return what + " (not in /proc/net)"
    except (OSError, ValueError) as error:
        return f"socket (not in /proc/net; {type(error).__name__})"


def fd_targets():
    found = []
    sockets = _socket_table()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                found.append(sockets.get(target[8:-1]) or _describe_socket(fd))
            else:
                found.append(target.split(":[")[0] + ":[]" if ":[" in target else target)
    return found


def counts(device):
    torch.cuda.synchronize(device)
    # Cyclic garbage is not a leak: collect it first (and say what that closed, to tell a
    # communicator kept alive by a reference cycle from one NCCL did not release).
    open_before = len(os.listdir("/proc/self/fd"))
    gc.collect()
    FD_TARGETS.append(fd_targets())
    fds = len(os.listdir("/proc/self/fd"))
    if fds != open_before:
        say(f"gc.collect() closed {open_before - fds} descriptors")
    mib = nvidia_smi_mib(os.getpid())
    if mib is None:
        free, total = torch.cuda.mem_get_info(device)
        mib = (total - free) / 2**20  # the device's (other processes idle meanwhile)
    return fds, mib


def wait_exit(proc, seconds, what, failures) -> None:
    """Waits up to ``seconds`` for a trainer process to end; past that, dumps its stacks
    (SIGUSR1 into its log), kills it and records a failure naming ``what``."""
    start = time.monotonic()
    try:
        code = proc.wait(timeout=seconds)
        say(f"{what}: exited {code} after {time.monotonic() - start:.2f} s")
    except subprocess.TimeoutExpired:
        failures.append(f"{what}: still running after {seconds:.0f} s (killed; stacks in "
                        f"{os.path.basename(proc.log_path)})")
        say(failures[-1])
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        proc.wait()


def kill_main(folder, device, agree_every, store) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    control = dist.new_group(backend="gloo", timeout=timeout)
    tp_nccl = dist.new_group(backend="nccl", timeout=timeout)
    tag = f"nccl-kill-{rank}"
    tensors = build(tag, device)
    engine = RemoteEngine(tag, tensors, store=store, prefix=f"kill/tp{rank}", sets=2,
                          group=control, agree_every=agree_every, chunk_bytes=CHUNK,
                          stall_timeout=STALL_S)
    served = peer.Served(tag, tensors, device)
    gpu = (device + 1) % torch.cuda.device_count()
    seeds = {v: shard_seed(1000 + v, rank) for v in range(1, 5)}
    refs = {0: peer.reference(0), **{v: peer.reference(s) for v, s in seeds.items()}}
    say(f"engine up on GPU {device} (stall_timeout {STALL_S:g} s, agree_every {agree_every}); "
        f"trainers on GPU {gpu}")
    failures = []
    engine_grew, bare_grew = None, None
    state = {"steps": 0, "killed_at": None, "dropped_at": None}
    spawned = []
    detect = None
    base_counts = None
    after = []

    def start_trainer(name, versions, die=False):
        proc = spawn(folder, name, store, f"kill/tp{rank}", gpu,
                     [(v, seeds[v]) for v in versions], die=die)
        spawned.append(proc)
        say(f"spawned trainer {name} pid {proc.pid} for versions {versions}"
            + (" (dies mid-transfer)" if die else ""))
        return proc

    def step(done_here=True, broken=None):
        """One boundary on every rank (lockstep: the ranks gather after it); returns whether
        ``done_here`` holds on every rank. Raises PhaseTimeout on every rank if ``broken``
        (a rank's deadline passed) is set on any."""
        status = engine.poll()
        got = served.replay()
        if not torch.allclose(got.double(), refs[status.version], rtol=2e-3, atol=2e-3):
            failures.append(f"step {state['steps']}: output is not version {status.version}'s")
        one = torch.ones(1, device=f"cuda:{device}")
        dist.all_reduce(one, group=tp_nccl)  # the engines' own NCCL group goes on
        if int(one.item()) != world:
            failures.append("the TP all-reduce went wrong")
        views = [None] * world
        dist.all_gather_object(views, (status.version, bool(done_here), broken), group=control)
        if len({v for v, _, _ in views}) != 1:
            failures.append(f"step {state['steps']}: ranks serve versions {views}")
        for p in status.problems:
            say(f"step {state['steps']}: problem: {p}")
            if "PeerClosed" in p and state["dropped_at"] is None:
                state["dropped_at"] = time.monotonic()
        if status.bound is not None:
            say(f"step {state['steps']}: bound version {status.bound}")
        state["steps"] += 1
        reasons = [b for _, _, b in views if b]
        if reasons:
            raise PhaseTimeout("; ".join(reasons))
        return all(d for _, d, _ in views)

    def serve_until(cond, phase, what):
        """Steps in lockstep on every rank until ``cond`` holds on every rank; a rank past the
        phase's deadline makes every rank raise PhaseTimeout naming ``what``."""
        seconds = PHASES[phase]
        start, first = time.monotonic(), state["steps"]
        say(f"phase '{what}': begin (deadline {seconds:g} s)")
        faulthandler.dump_traceback_later(seconds + STUCK_GRACE_S, repeat=True, file=_log)
        try:
            while True:
                here = bool(cond())
                broken = None
                if not here and time.monotonic() - start > seconds:
                    broken = f"rank {rank}: no '{what}' within {seconds:g} s"
                if step(here, broken):
                    break
        finally:
            faulthandler.cancel_dump_traceback_later()
        say(f"phase '{what}': done in {time.monotonic() - start:.2f} s, "
            f"{state['steps'] - first} steps")

    def tell(proc, what):
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            say(f"told {os.path.basename(proc.log_path)}: {what}")
        except (BrokenPipeError, OSError, ValueError) as gone:
            failures.append(f"telling {os.path.basename(proc.log_path)} ({what}) failed: "
                            f"{gone!r}; it exited {proc.poll()}")
            say(failures[-1])

    def barrier(what):
        start = time.monotonic()
        dist.barrier(group=control)
        say(f"barrier '{what}' passed in {time.monotonic() - start:.2f} s")

    def log_says(proc, line):
        with open(proc.log_path, errors="replace") as f:
            return line in f.read()

    try:
        trainer = start_trainer(f"kill-{rank}.log", [1, 2], die=(rank == 0))
        serve_until(lambda: engine.connected, "join", "first trainer joined")
        tell(trainer, "publish version 1")
        serve_until(lambda: engine.version == 1, "bind", "version 1 bound")
        tell(trainer, "version 2 (rank 0's trainer dies mid-transfer)")
        serve_until(lambda: rank != 0 or log_says(trainer, MID), "mid", "trainer mid-transfer")
        if rank == 0:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait()
            state["killed_at"] = time.monotonic()
            say(f"SIGKILLed trainer pid {trainer.pid} mid-transfer")
        serve_until(lambda: rank != 0 or state["dropped_at"] is not None, "stall",
                    "stall reported")
        if rank == 0 and state["dropped_at"] and state["killed_at"]:
            detect = state["dropped_at"] - state["killed_at"]
            say(f"stall reported {detect:.2f} s after the SIGKILL (bound {STALL_S + 2.0:g} s)")
        barrier("after the drop")
        base_counts = counts(device)
        say(f"counts after the drop: {base_counts}")
        # Rank 0: a new trainer joins and publishes version 2 (the others have it): bound
        # everywhere.
        if rank == 0:
            fresh = start_trainer("kill-0-new.log", [2])
        serve_until(lambda: rank != 0 or engine.connected, "join", "the new trainer joined")
        if rank == 0:
            tell(fresh, "publish version 2")
        serve_until(lambda: engine.version == 2, "bind", "version 2 bound after the rejoin")
        if rank == 0:
            fresh.stdin.close()
            wait_exit(fresh, PHASES["exit"], "rank 0's new trainer", failures)
        elif trainer.poll() is None:
            trainer.stdin.close()
            wait_exit(trainer, PHASES["exit"], f"rank {rank}'s first trainer", failures)
        serve_until(lambda: not engine.connected, "leave", "the trainers left")
        barrier("after the rejoin")
        after.append(counts(device))
        say(f"counts after the rejoin: {after[-1]}")
        # Two more rejoin cycles on every rank (fresh trainers everywhere): the leak's slope.
        for cycle, version in ((2, 3), (3, 4)):
            fresh = start_trainer(f"kill-{rank}-cycle{cycle}.log", [version])
            serve_until(lambda: engine.connected, "join", f"cycle {cycle} joined")
            tell(fresh, f"publish version {version}")
            serve_until(lambda: engine.version == version, "bind",
                        f"cycle {cycle}: version {version} bound")
            fresh.stdin.close()
            wait_exit(fresh, PHASES["exit"], f"cycle {cycle}'s trainer", failures)
            serve_until(lambda: not engine.connected, "leave", f"cycle {cycle} left")
            barrier(f"after cycle {cycle}")
            after.append(counts(device))
            say(f"counts after cycle {cycle}: {after[-1]}")
        # The engine's growth first (the bare cycles below open descriptors of their own).
        engine_grew = collections.Counter(FD_TARGETS[-1]) - collections.Counter(FD_TARGETS[-len(after)])
        barrier("before the bare pairs")
        start = time.monotonic()
        intervals = bare_pair_cycles(store, f"kill/bare{rank}", device, gpu)
        # What the engine may keep: NCCL's worst join/leave alone, once per engine cycle. The
        # sockets ncclCommAbort leaves (TCP, CLOSE state, so in no /proc/net table) vary from
        # abort to abort (1-3 per pair over the runs so far, 2 and 2 in one bare run beside an
        # engine cycle that kept 3): three bare cycles can miss NCCL's worst, so that kind, and
        # only that kind, gets one more per cycle. Any other kind, or more, still fails.
        bare_grew = collections.Counter()
        for kind in set().union(*intervals):
            slack = 1 if kind == NCCL_ABORT_SOCKET else 0
            bare_grew[kind] = (max(c[kind] for c in intervals) + slack) * (len(after) - 1)
        say(f"bare pairs (3 join/abort cycles of a PairGroup alone, {time.monotonic() - start:.1f} s): "
            f"descriptors opened per cycle: {[dict(c) or 'none' for c in intervals]}; allowed the "
            f"engine over its {len(after) - 1} cycles: {dict(bare_grew) or 'none'}")
        barrier("after the bare pairs")
    except PhaseTimeout as late:
        failures.insert(0, f"PhaseTimeout: {late}")
        say(f"phase deadline passed: {late}")
    except Exception as error:  # noqa: BLE001 - reported in the verdict, then re-raised
        failures.insert(0, f"{type(error).__name__}: {error}")
        say(f"kill run raised {type(error).__name__}: {error}")
        raise
    finally:
        for proc in spawned:
            if proc.poll() is None:
                say(f"killing trainer {os.path.basename(proc.log_path)} pid {proc.pid}, "
                    "still running at the end")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)  # its stacks into its log
                time.sleep(0.5)
                proc.kill()
                proc.wait()
        ok, fd_growth, mib_growth, beyond = False, None, None, None
        if len(after) >= 2:
            fd_growth = after[-1][0] - after[0][0]
            mib_growth = round(after[-1][1] - after[0][1], 1)
            # What the engine kept beyond what a bare pair of NCCL's keeps per join/leave
            # (its leaked sockets are NCCL's own: see the bare pairs' line), when measured.
            if engine_grew is not None and bare_grew is not None:
                beyond = sum((engine_grew - bare_grew).values())
                leaked = beyond
            else:
                leaked = fd_growth
            ok = not failures and leaked <= LEAK_FDS and mib_growth <= LEAK_MIB
            if rank == 0:
                ok = ok and detect is not None and detect <= STALL_S + 2.0
        if len(FD_TARGETS) >= 2:
            grew = collections.Counter(FD_TARGETS[-1]) - collections.Counter(FD_TARGETS[-len(after)])
            say(f"descriptors opened between the first and the last count after a cycle: "
                f"{dict(grew) or 'none'}; torch reserved {torch.cuda.memory_reserved(device) / 2**20:.0f} MiB")
        say(f"KILL rank {rank}: {'PASS' if ok else 'FAIL'} detect_s={detect} (bound "
            f"{STALL_S + 2.0:.1f} s, rank 0 only) steps={state['steps']} counts "
            f"base={base_counts} after_cycles={after} fd_growth={fd_growth} "
            f"mib_growth={mib_growth} beyond_bare_pairs={beyond} failures={failures[:5]}")
        marks = [(k, v, round(t - T0, 2)) for k, v, t in engine.timeline]
        say(f"engine timeline (event, version or epoch, s since start): {marks}")
        start = time.monotonic()
        engine.close()
        say(f"engine closed in {time.monotonic() - start:.2f} s")
    return 0 if ok else 1


def main(argv) -> int:
    if argv[1] == "probe":
        return probe_main(argv[2], int(argv[3]), argv[4], int(argv[5]))
    if argv[1] == "trainer":
        seeds = [tuple(int(x) for x in p.split(":")) for p in argv[6].split(",")]
        return trainer_main(argv[2], int(argv[3]), argv[4], int(argv[5]), seeds,
                            die=len(argv) > 7 and argv[7] == "die")
    mode, folder = argv[1], argv[2]
    race_seeds = [int(s) for s in argv[3].split(",")]
    agree_every = int(argv[4]) if len(argv) > 4 else 8
    env_rank = os.environ.get("RANK", "?")  # torchrun's, before the group exists
    log = open(os.path.join(folder, f"rank-{env_rank}.log"), "a")
    start_diagnosis(folder, f"rank {env_rank}", log)
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    say(f"{mode}: start (pid {os.getpid()}, torch {torch.__version__}, NCCL {nccl}); "
        "init_process_group (gloo)")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.device_count() < max(world, 2):
        raise SystemExit(f"{world} ranks need {max(world, 2)} GPUs")
    device = rank
    torch.cuda.set_device(device)
    store = control_store("127.0.0.1", 0, server=True, timeout=120)
    say(f"rank {rank} of {world} on GPU {device}; control store on port {store.port}")
    if mode == "kill":
        code = kill_main(folder, device, agree_every, store)
        faulthandler.dump_traceback_later(PHASES["teardown"] + STUCK_GRACE_S, repeat=True,
                                          file=log)
        start = time.monotonic()
        dist.barrier()
        say(f"teardown: final barrier passed in {time.monotonic() - start:.2f} s")
        start = time.monotonic()
        dist.destroy_process_group()
        say(f"teardown: destroy_process_group in {time.monotonic() - start:.2f} s; exit {code}")
        faulthandler.cancel_dump_traceback_later()
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
