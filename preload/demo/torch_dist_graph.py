"""torch.distributed under the preload layer: all-reduces captured in a CUDA graph over tensors the
layer allocated under a tag, replayed across pauses and resumes of that tag. One process per GPU.

    python -m torch.distributed.run --standalone --nproc_per_node=2 torch_dist_graph.py --label none --out DIR
    LD_PRELOAD=libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm \\
        python -m torch.distributed.run --standalone --nproc_per_node=2 torch_dist_graph.py --label vmm --out DIR
    python torch_dist_graph.py --compare --out DIR none vmm vmm-elide

Each rank allocates its buffers under the tag "dist" in a torch.cuda.MemPool of their own: the
input x, three all-reduce buffers, their sum, and the all-gather output. The graph, captured once:

    for i in 0, 1, 2:  b[i] = x * (i + 1) + rank;  all_reduce(b[i])      (in place, sum)
    out = b[0] + b[1] + b[2];  gathered = all_gather_into_tensor(x)      (out of place)

All values are integers below 2^24 in float32, so every sum is exact whatever NCCL's order, and
each phase is checked element for element against the sum computed on the CPU. Phases:

    before-pause        x = data 0, replay
    resumed-kept        pause keeping contents, resume, replay (x as it was: data 0)
    new-data            x = data 1, replay
    resumed-new-data    pause without contents, resume, x = data 2 (written after the resume), replay
    eager               the same steps run eagerly (no graph) on data 3

Without the layer the pauses are skipped (the functions are not there); every phase must still
give the same bytes (sha256 of out and gathered). Each rank writes DIR/dist-graph-LABEL-rankR.json
and its NCCL log (INFO, INIT and REG: whether NCCL registered the layer's memory) to
DIR/dist-graph-LABEL-rankR-nccl.log. --compare reads the ranks' files of every label and prints
one RESULT line; it exits 1 unless every phase of every rank was right in every run, the outputs
are identical across the runs, and the layer's runs really ran on the layer (vmm mode, tagged
memory, two pauses and resumes).
"""

import argparse
import ctypes
import hashlib
import json
import os
import re
import sys
import time

TAG = b"dist"
WORDS = 4 << 20  # float32 per buffer: 16 MiB, large enough for NCCL's Simple protocol
PHASES = ["before-pause", "resumed-kept", "new-data", "resumed-new-data", "eager"]
STATS_FIELDS = [
    "size", "abi_version", "mode", "live_allocations", "live_bytes", "runtime_allocs",
    "driver_allocs", "frees", "foreign_frees", "entry_points", "ipc_refusals", "oom_errors",
    "pool_mapped", "pool_cached", "pool_peak_mapped", "pool_mappings", "pool_creates",
    "pool_reuses", "pool_stitched", "pool_drains", "copies_deferred", "copies_elided",
    "copies_performed", "copies_cancelled", "bytes_elided", "tags", "tags_paused", "tagged_bytes",
    "host_bytes", "host_arena_bytes", "pauses", "resumes",
]
# NCCL's INFO lines about user-buffer registration (2.23 to 2.29 wordings).
REGISTERED = re.compile(r"IPC (?:local |graph )?regist(?:er|ered) buffer|Proxy rank \d+ register succe")
REG_FAILED = re.compile(r"failed to IPC register|Skipping registration")


def result_path(out, label, rank):
    return os.path.join(out, f"dist-graph-{label}-rank{rank}.json")


def layer():
    """The layer's C ABI from the global namespace, or None when it is not preloaded."""
    lib = ctypes.CDLL(None)
    try:
        lib.stablebuf_set_tag
    except AttributeError:
        return None
    lib.stablebuf_set_tag.argtypes = [ctypes.c_char_p]
    lib.stablebuf_pause.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.stablebuf_resume.argtypes = [ctypes.c_char_p]
    lib.stablebuf_error_string.argtypes = [ctypes.c_int]
    lib.stablebuf_error_string.restype = ctypes.c_char_p
    return lib


def layer_stats(lib):
    if lib is None:
        return None

    class Stats(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in STATS_FIELDS]

    out = Stats(size=ctypes.sizeof(Stats))
    if lib.stablebuf_stats(ctypes.byref(out)) != 0:
        return None
    return {name: getattr(out, name) for name in STATS_FIELDS}


def driver_free():
    """Free device memory of the current context as the driver sees it (libcuda's own symbol,
    not the layer's cuMemGetInfo, which adds the pool's cache)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    code = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    if code != 0:
        raise RuntimeError(f"cuMemGetInfo_v2 returned {code}")
    return free.value


def sha256(tensor):
    """sha256 of a float32 tensor's bytes (numpy's view; without numpy, of its words as text)."""
    import torch

    host = tensor.detach().cpu().contiguous()
    try:
        return hashlib.sha256(host.numpy().tobytes()).hexdigest()
    except (ImportError, RuntimeError):
        digest = hashlib.sha256()
        for chunk in host.view(-1).view(torch.int32).split(1 << 20):
            digest.update(repr(chunk.tolist()).encode())
        return "words:" + digest.hexdigest()


def registration_lines(path):
    """NCCL's registration lines in its log: (successes, failures), each a list of lines."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return None, None
    return ([l for l in text if REGISTERED.search(l)], [l for l in text if REG_FAILED.search(l)])


def worker(args):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    nccl_log = os.path.join(args.out, f"dist-graph-{args.label}-rank{rank}-nccl.log")
    # Before NCCL starts: its log says whether it registered the layer's memory.
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,REG"
    os.environ["NCCL_DEBUG_FILE"] = nccl_log
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off

    import datetime

    import torch
    import torch.distributed as dist

    report = {"label": args.label, "rank": rank, "world": world, "phases": [], "pauses": [],
              "errors": []}

    def fail(message):
        report["errors"].append(message)
        print(f"FAILED rank {rank}: {message}", flush=True)

    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    timeout = datetime.timedelta(seconds=180)
    try:
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    except TypeError:  # torch before 2.3: no device_id
        dist.init_process_group("nccl", timeout=timeout)
    lib = layer()
    report["layer_loaded"] = lib is not None

    # The buffers: under the tag, in a pool of their own (README: PyTorch).
    pool = torch.cuda.MemPool()
    if lib is not None:
        lib.stablebuf_set_tag(TAG)
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(WORDS, dtype=torch.float32, device=device)
        bufs = [torch.empty(WORDS, dtype=torch.float32, device=device) for _ in range(3)]
        out = torch.empty(WORDS, dtype=torch.float32, device=device)
        gathered = torch.empty(world * WORDS, dtype=torch.float32, device=device)
    torch.cuda.synchronize()
    if lib is not None:
        lib.stablebuf_set_tag(None)
    report["stats_after_alloc"] = layer_stats(lib)

    base = (torch.arange(WORDS, dtype=torch.int64) % 1021).to(torch.float32)

    def data(r, phase):
        return base + float(100 * r + 10 * phase)

    def expected(phase):
        total = sum(data(r, phase) for r in range(world))
        ranks = float(sum(range(world)))
        want_out = sum((i + 1) * total + ranks for i in range(3))
        want_gathered = torch.cat([data(r, phase) for r in range(world)])
        return want_out, want_gathered

    def step():
        for i, b in enumerate(bufs):
            b.copy_(x)
            b.mul_(i + 1)
            b.add_(rank)
            dist.all_reduce(b)
        out.copy_(bufs[0])
        out.add_(bufs[1])
        out.add_(bufs[2])
        dist.all_gather_into_tensor(gathered, x)

    def check(name, data_phase):
        torch.cuda.synchronize()
        got_out, got_gathered = out.cpu(), gathered.cpu()
        want_out, want_gathered = expected(data_phase)
        wrong = int((got_out != want_out).sum()) + int((got_gathered != want_gathered).sum())
        entry = {"phase": name, "data": data_phase, "right": wrong == 0, "wrong_elements": wrong,
                 "out_sha256": sha256(got_out), "gathered_sha256": sha256(got_gathered)}
        report["phases"].append(entry)
        print(f"CHECK rank {rank} {name}: {'right' if wrong == 0 else f'WRONG ({wrong} elements)'}",
              flush=True)

    def pause_resume(keep):
        torch.cuda.synchronize()
        dist.barrier(device_ids=[local])
        torch.cuda.synchronize()
        if lib is None:
            report["pauses"].append({"keep": keep, "skipped": "no layer"})
        else:
            before = driver_free()
            t0 = time.perf_counter()
            p = lib.stablebuf_pause(TAG, keep)
            t1 = time.perf_counter()
            paused = driver_free()
            r = lib.stablebuf_resume(TAG)
            t2 = time.perf_counter()
            stats = layer_stats(lib)
            entry = {"keep": keep, "pause": p, "resume": r, "released_bytes": paused - before,
                     "tagged_bytes": stats["tagged_bytes"] if stats else None,
                     "pause_ms": round((t1 - t0) * 1e3, 2), "resume_ms": round((t2 - t1) * 1e3, 2)}
            report["pauses"].append(entry)
            if p != 0 or r != 0:
                fail(f"stablebuf_pause returned {p} "
                     f"({lib.stablebuf_error_string(p).decode()}), stablebuf_resume {r}")
            print(f"PAUSE rank {rank} keep={keep}: pause {p}, resume {r}, released "
                  f"{entry['released_bytes'] / 2**20:.0f} MiB of the tag's "
                  f"{(entry['tagged_bytes'] or 0) / 2**20:.0f} MiB", flush=True)
        dist.barrier(device_ids=[local])
        torch.cuda.synchronize()

    # Eager warm-up on a side stream (NCCL connects its peers on first use, which a capture
    # cannot do), then the capture.
    x.copy_(data(rank, 0))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    torch.cuda.synchronize()

    out.fill_(float("nan"))
    graph.replay()
    check("before-pause", 0)

    pause_resume(keep=1)
    out.fill_(float("nan"))
    gathered.fill_(float("nan"))
    graph.replay()
    check("resumed-kept", 0)

    x.copy_(data(rank, 1))
    graph.replay()
    check("new-data", 1)

    pause_resume(keep=0)
    x.copy_(data(rank, 2))
    for b in bufs:
        b.fill_(float("nan"))
    out.fill_(float("nan"))
    gathered.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier(device_ids=[local])
    graph.replay()
    check("resumed-new-data", 2)

    x.copy_(data(rank, 3))
    step()
    check("eager", 3)

    torch.cuda.synchronize()
    dist.barrier(device_ids=[local])
    del graph
    report["stats_at_end"] = layer_stats(lib)
    dist.destroy_process_group()

    successes, failures = registration_lines(nccl_log)
    report["nccl_registered"] = successes
    report["nccl_registration_failed"] = failures
    if successes is None:
        print(f"NOTE rank {rank}: no NCCL log at {nccl_log}")
    else:
        print(f"NCCL rank {rank}: {len(successes)} registration lines, {len(failures)} "
              f"registration failures", flush=True)
        for line in (successes + failures)[:4]:
            print(f"    {line.strip()[:240]}")
    stats = report["stats_at_end"]
    if lib is not None and (stats is None or stats["mode"] != 2):
        fail(f"the layer is loaded but not in vmm mode (stats {stats})")
    if lib is not None and stats is not None and stats["mode"] == 2 and \
            (report["stats_after_alloc"] or {}).get("tagged_bytes", 0) == 0:
        fail("no memory was allocated under the tag (did the allocations bypass the layer?)")
    ok = not report["errors"] and all(p["right"] for p in report["phases"]) and \
        len(report["phases"]) == len(PHASES)
    report["ok"] = ok
    with open(result_path(args.out, args.label, rank), "w") as f:
        json.dump(report, f, indent=1)
    print(f"RESULT dist-graph {args.label} rank {rank}: "
          f"{sum(p['right'] for p in report['phases'])} of {len(PHASES)} phases right"
          f"{'' if ok else '; FAILED'}", flush=True)
    return 0 if ok else 1


def compare(out, labels, print_=print):
    """Checks every label's rank files; returns the exit status."""
    problems = []
    runs = {}
    for label in labels:
        ranks = []
        rank = 0
        while os.path.exists(result_path(out, label, rank)):
            with open(result_path(out, label, rank)) as f:
                ranks.append(json.load(f))
            rank += 1
        if not ranks:
            problems.append(f"{label}: no result files ({result_path(out, label, 0)})")
            continue
        if len(ranks) != ranks[0]["world"]:
            problems.append(f"{label}: {len(ranks)} rank files for world {ranks[0]['world']}")
        runs[label] = ranks
    for label, ranks in runs.items():
        for r in ranks:
            who = f"{label} rank {r['rank']}"
            if not r.get("ok"):
                problems.append(f"{who}: failed ({'; '.join(r.get('errors') or []) or 'a phase was wrong'})")
            if [p["phase"] for p in r["phases"]] != PHASES:
                problems.append(f"{who}: phases {[p['phase'] for p in r['phases']]}")
            for p in r["phases"]:
                if not p["right"]:
                    problems.append(f"{who} {p['phase']}: {p['wrong_elements']} elements wrong")
            if label == "none":
                if r.get("layer_loaded"):
                    problems.append(f"{who}: the layer was loaded in the run without it")
            else:
                stats = r.get("stats_at_end") or {}
                if stats.get("mode") != 2:
                    problems.append(f"{who}: not run under the layer in vmm mode")
                elif (r.get("stats_after_alloc") or {}).get("tagged_bytes", 0) == 0:
                    problems.append(f"{who}: nothing allocated under the tag")
                done = [p for p in r["pauses"] if p.get("pause") == 0 and p.get("resume") == 0]
                if len(done) != 2:
                    problems.append(f"{who}: {len(done)} of 2 pauses and resumes succeeded")
    # The same bytes in every run, rank by rank, phase by phase.
    differing = 0
    if runs:
        first_label = next(iter(runs))
        for label, ranks in runs.items():
            for r, ref in zip(ranks, runs[first_label]):
                for p, q in zip(r["phases"], ref["phases"]):
                    for key in ("out_sha256", "gathered_sha256"):
                        if p[key] != q[key]:
                            differing += 1
                            problems.append(f"{label} rank {r['rank']} {p['phase']}: {key} differs "
                                            f"from {first_label}")
    for problem in problems:
        print_(f"FAILED {problem}")
    released = []
    for label, ranks in runs.items():
        for r in ranks:
            for p in r["pauses"]:
                if p.get("tagged_bytes"):
                    released.append(f"{label} r{r['rank']} keep={p['keep']}: "
                                    f"{p['released_bytes'] / 2**20:.0f}/{p['tagged_bytes'] / 2**20:.0f} MiB")
                    if p["released_bytes"] < 0.9 * p["tagged_bytes"]:
                        print_(f"NOTE {label} rank {r['rank']}: a pause released only "
                               f"{p['released_bytes'] / 2**20:.0f} MiB of the tag's "
                               f"{p['tagged_bytes'] / 2**20:.0f} MiB (another holder of the pages?)")
            registered = sum(len(r.get("nccl_registered") or []) for r in ranks)
            refused = sum(len(r.get("nccl_registration_failed") or []) for r in ranks)
            print_(f"NCCL {label}: {registered} registration lines, {refused} registration failures "
                   f"(from the ranks' NCCL logs)")
    if released:
        print_("released by the pauses (driver free memory): " + ", ".join(released))
    world = max((len(r) for r in runs.values()), default=0)
    print_(f"RESULT dist-graph: {world} ranks, {len(PHASES)} phases, runs {', '.join(labels)}: "
           f"{'identical outputs, every phase right' if not problems else f'{len(problems)} problems'}"
           f" ({differing} output hashes differ)")
    return 1 if problems else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the result files and NCCL logs")
    parser.add_argument("--label", help="name of this run (none, vmm, vmm-elide)")
    parser.add_argument("--compare", action="store_true", help="compare the runs named after it")
    parser.add_argument("labels", nargs="*")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.compare:
        return compare(args.out, args.labels or ["none", "vmm", "vmm-elide"])
    if not args.label:
        parser.error("--label is required to run (or --compare)")
    if "RANK" not in os.environ:
        parser.error("run under torchrun (python -m torch.distributed.run --nproc_per_node=2 ...)")
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
