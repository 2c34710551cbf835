"""Does NCCL keep the old pages of the layer's memory across a tag's pause and resume, when one
process drives two GPUs, and does the layer now keep NCCL's registrations current?
(preload/README.md, "NCCL registrations" and Limits; the CHANGELOG's known problem, issue 39.)

    LD_PRELOAD=libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm python nccl_register_pause.py --out DIR
    python nccl_register_pause.py --out DIR          (the baseline, without the layer)

One process, two GPUs, libnccl through ctypes (the library PyTorch loaded, else found as
stablebuf finds it), one communicator per device from ncclCommInitAll, and an out-of-place sum
all-reduce of 32 MiB per device, issued eagerly in one group. NCCL registers a user buffer for a
ring all-reduce only when both buffers were registered (ncclCommRegister), the all-reduce is out
of place, the protocol is Simple and every peer is reached by direct P2P; so this sets
NCCL_ALGO=Ring and NCCL_PROTO=Simple unless they are set, and NCCL_NVLS_ENABLE=0. NCCL's log
(INFO, INIT and REG, in DIR/nccl-register-LABEL.log) says what NCCL did with each buffer.

ncclCommRegister, ncclCommDeregister and ncclCommDestroy are called as a program linked with
libnccl calls them: through the global scope (ctypes.CDLL(None)), where the preloaded layer's
hooks come first. (ctypes.CDLL("libnccl.so.2").ncclCommRegister would be dlsym on libnccl's own
handle, which no LD_PRELOAD library can interpose.)

  control     buffers from ncclMemAlloc (NCCL's own cuMem memory), registered, all-reduced: does
              NCCL register user buffers on this machine at all?
  A           the layer's buffers (torch tensors allocated under the tag "nccl"), registered once,
              all-reduced (A0); the tag paused (contents kept) and resumed; new data written,
              the receive buffers poisoned with NaN, all-reduced again (A1). Under vmm the layer
              deregisters the buffers before the pause and registers them again after the
              resume, behind the caller's handles: A1 must be right.
  B           the manual sequence: deregistered before the pause and registered again after the
              resume (B0 before, B1 after), on the same buffers.
  C           graphs: the all-reduce captured in one CUDA graph per GPU (one NCCL group over two
              capturing streams, as nccl-tests -G does), replayed (C0); the tag paused and
              resumed; new data, replayed again (C1). Not registered with ncclCommRegister;
              NCCL's own graph registration is what NCCL_GRAPH_REGISTER says (the layer sets it
              to 0 under vmm unless it is set). C1 must be right.

Each all-reduce is checked element for element against the sum (integers in float32: exact), and
under the layer each pause must release all of the tag's memory (driver free memory).
The verdict, one line:
  REGISTRATION-CLAIM: handled by the layer (...)                    NCCL registered the layer's
      buffers, the layer renewed the registrations around the pause, and A1 was right
  REGISTRATION-CLAIM: confirmed (stale pages after resume)          NCCL registered the layer's
      buffer and A1 was wrong: NCCL kept using the pages it registered
  REGISTRATION-CLAIM: refuted (...)                                 NCCL did not register the
      layer's memory, or did and A1 was right without the layer renewing anything
  REGISTRATION-CLAIM: untested (...)                                NCCL registered nothing here,
      not even its own memory (no direct P2P between the GPUs, an NCCL without the path, ...)
and a GRAPH-CASE line for C. Without the layer the pauses are skipped and no verdict is drawn
(the baseline must be right).
Exit status 0 when every all-reduce was right and every pause released the tag's memory, 1
otherwise (a confirmed claim included), 2 when the test could not run (fewer than two GPUs, no
libnccl).
"""

import argparse
import ctypes
import glob
import importlib.util
import json
import os
import re
import sys

TAG = b"nccl"
WORDS = 8 << 20  # float32 per buffer: 32 MiB
NCCL_FLOAT32 = 7
NCCL_SUM = 0
# NCCL's INFO lines (2.23 to 2.29 wordings): a user buffer registered with a peer, reused, or not.
REGISTERED = re.compile(r"IPC (?:local |graph )?regist(?:er|ered) buffer (0x[0-9a-fA-F]+)")
PROXY_REGISTERED = re.compile(r"Proxy rank \d+ register succe")
REUSED = re.compile(r"IPC (?:local )?reuse buffer (0x[0-9a-fA-F]+)")
FAILED = re.compile(r"failed to IPC register userbuff (0x[0-9a-fA-F]+)")
SKIPPED = re.compile(r"Skipping registration")
TRANSPORT = re.compile(r"via (P2P/\S+|SHM\S*|NET\S*)")
P2P_TYPE = re.compile(r"isAllDirectP2p (\d)")
STATS_FIELDS = [
    "size", "abi_version", "mode", "live_allocations", "live_bytes", "runtime_allocs",
    "driver_allocs", "frees", "foreign_frees", "entry_points", "ipc_refusals", "oom_errors",
    "pool_mapped", "pool_cached", "pool_peak_mapped", "pool_mappings", "pool_creates",
    "pool_reuses", "pool_stitched", "pool_drains", "copies_deferred", "copies_elided",
    "copies_performed", "copies_cancelled", "bytes_elided", "tags", "tags_paused", "tagged_bytes",
    "host_bytes", "host_arena_bytes", "pauses", "resumes", "last_pause_ns", "last_resume_ns",
    # abi_version 2: the layer's NCCL registrations of tagged memory.
    "nccl_registrations", "nccl_suspended", "nccl_reregistrations", "nccl_failures",
]
MIB = 1 << 20
# A pause must release at least the tag's bytes less this (the driver's free memory moves a
# little on its own).
RELEASE_SLACK = 4 * MIB
CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed


# ---- what NCCL's log says (pure functions, tested without a GPU) -----------------------------

def registration(text):
    """What a stretch of NCCL's log says about user-buffer registration."""
    lines = text.splitlines()
    return {
        "registered": sorted({int(m.group(1), 16) for l in lines for m in [REGISTERED.search(l)] if m}),
        "proxy_registered": sum(1 for l in lines if PROXY_REGISTERED.search(l)),
        "reused": sorted({int(m.group(1), 16) for l in lines for m in [REUSED.search(l)] if m}),
        "failed": sorted({int(m.group(1), 16) for l in lines for m in [FAILED.search(l)] if m}),
        "skipped": sum(1 for l in lines if SKIPPED.search(l)),
        "lines": [l.strip() for l in lines if REGISTERED.search(l) or REUSED.search(l)
                  or FAILED.search(l) or SKIPPED.search(l) or PROXY_REGISTERED.search(l)],
    }


def did_register(found):
    return bool(found["registered"] or found["proxy_registered"])


def machine_facts(text):
    """The transports NCCL chose and whether it sees direct P2P between every pair."""
    transports = sorted({m.group(1) for m in TRANSPORT.finditer(text)})
    p2p = P2P_TYPE.search(text)
    return {"transports": transports, "all_direct_p2p": p2p.group(1) if p2p else "?"}


def verdict(layer_vmm, control, a0, a1_right, a1_wrong_elements, facts, a0_right=True,
            a0_wrong_elements=0, renewed=None, released=None):
    """The REGISTRATION-CLAIM line, or None without the layer (the baseline). `renewed`: the
    layer's count of registrations made again after resumes (None: a layer without the count);
    `released`: (bytes the first pause released, the tag's bytes), or None."""
    if not layer_vmm:
        return None
    where = (f"transports {', '.join(facts['transports']) or '?'}, "
             f"isAllDirectP2p {facts['all_direct_p2p']}")
    if did_register(a0):
        if not a0_right:
            # NCCL maps each registered segment's physical allocation from offset 0 (p2p.cc,
            # p2pProxyRegister); a mapping of the layer's that starts inside its allocation
            # gives NCCL other bytes than the program's.
            return ("REGISTRATION-CLAIM: confirmed, worse than stated (NCCL registered the "
                    "layer's buffers and the all-reduce was wrong already before any pause, in "
                    f"{a0_wrong_elements} elements; after the pause and resume: "
                    f"{'right' if a1_right else f'wrong in {a1_wrong_elements} elements'})")
        if not a1_right:
            renewal = (f"; the layer had registered them again {renewed} times, yet the result "
                       "was wrong" if renewed else "")
            return ("REGISTRATION-CLAIM: confirmed (stale pages after resume: NCCL registered the "
                    f"layer's buffers with its peer and kept their old pages; the all-reduce after "
                    f"the pause and resume was wrong in {a1_wrong_elements} elements{renewal})")
        if renewed:
            freed = ("" if released is None else
                     f"; the pause released {released[0] / MIB:.0f} of the tag's "
                     f"{released[1] / MIB:.0f} MiB")
            return ("REGISTRATION-CLAIM: handled by the layer (NCCL registered the layer's "
                    "buffers; the layer deregistered them before the pause and registered them "
                    f"again after the resume, {renewed} registrations renewed; the all-reduce "
                    f"after the resume was right{freed})")
        return ("REGISTRATION-CLAIM: refuted (NCCL registered the layer's buffers, yet the "
                "all-reduce after the pause and resume was right)")
    tail = "" if a1_right else (f"; but the all-reduce after the pause and resume was WRONG in "
                                f"{a1_wrong_elements} elements without any registration")
    why = a0["lines"][0] if a0["lines"] else "no registration attempt in NCCL's log"
    if did_register(control):
        return ("REGISTRATION-CLAIM: refuted (NCCL registers its own cuMem memory on this machine "
                f"but did not register the layer's: {why}; it copied through its own buffers{tail})")
    return ("REGISTRATION-CLAIM: untested (NCCL registered neither its own memory nor the layer's "
            f"here: {where}; {why}{tail})")


def release_problems(pauses):
    """Pauses (of the layer) that released less than the tag's bytes: NCCL, or something else,
    still holds the old pages."""
    return [p for p in pauses if "released" in p and p["released"] < p["tagged"] - RELEASE_SLACK]


def graph_case_line(graph_register, found, c0_right, c1_right):
    """The GRAPH-CASE line: what NCCL did with the captured all-reduce's buffers, and whether
    the replays were right (None: the case did not run)."""
    def state(right):
        return "not run" if right is None else ("right" if right else "WRONG")
    return (f"GRAPH-CASE: NCCL_GRAPH_REGISTER={graph_register}; NCCL registered "
            f"{len(found['registered'])} buffers while capturing (proxy: "
            f"{found['proxy_registered']}); replay before the pause {state(c0_right)}, after the "
            f"pause and resume {state(c1_right)}")


# ---- libraries -----------------------------------------------------------------------------

def nccl_candidates():
    """Where libnccl may be: the one already in the process (PyTorch's), then as stablebuf looks."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "libnccl" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    if os.environ.get("STABLEBUF_NCCL_LIBRARY"):
        named = os.environ["STABLEBUF_NCCL_LIBRARY"]
        found += glob.glob(os.path.join(named, "libnccl.so*")) if os.path.isdir(named) else [named]
    found += ["libnccl.so.2", "libnccl.so"]
    for name, sub in (("nvidia.nccl", "lib"), ("nvidia", os.path.join("cu13", "lib")),
                      ("nvidia", os.path.join("cu12", "lib"))):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            found += [os.path.join(root, sub, n) for n in ("libnccl.so.2", "libnccl.so")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found.append(os.path.join(home, "lib64", "libnccl.so.2"))
    return found


def load_nccl():
    tried = []
    for candidate in nccl_candidates():
        try:
            lib = ctypes.CDLL(candidate)
            lib.ncclCommRegister  # noqa: B018 (needs 2.19 or later)
        except (OSError, AttributeError) as error:
            tried.append(f"{candidate}: {error}")
            continue
        P = ctypes.POINTER
        lib.ncclGetVersion.argtypes = [P(ctypes.c_int)]
        lib.ncclCommInitAll.argtypes = [P(ctypes.c_void_p), ctypes.c_int, P(ctypes.c_int)]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        lib.ncclCommRegister.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                         P(ctypes.c_void_p)]
        lib.ncclCommDeregister.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclMemAlloc.argtypes = [P(ctypes.c_void_p), ctypes.c_size_t]
        lib.ncclMemFree.argtypes = [ctypes.c_void_p]
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        return lib, candidate
    return None, tried


def through_global_scope(lib):
    """ncclCommRegister, ncclCommDeregister and ncclCommDestroy as a program linked with libnccl
    reaches them: the first definition in the global scope (the preloaded layer's hooks, which
    call libnccl's). Returns the names taken from there."""
    everything = ctypes.CDLL(None)
    P = ctypes.POINTER
    prototypes = {
        "ncclCommRegister": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, P(ctypes.c_void_p)],
        "ncclCommDeregister": [ctypes.c_void_p, ctypes.c_void_p],
        "ncclCommDestroy": [ctypes.c_void_p],
    }
    taken = []
    for name, argtypes in prototypes.items():
        try:
            function = getattr(everything, name)
        except AttributeError:
            continue
        function.argtypes = argtypes
        function.restype = ctypes.c_int
        setattr(lib, name, function)
        taken.append(name)
    return taken


def cuda_runtime():
    """The CUDA runtime PyTorch loaded (for the graph case), with the graph functions' types."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libcudart.so") and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    P = ctypes.POINTER
    for candidate in paths + [None]:
        try:
            rt = ctypes.CDLL(candidate)
            rt.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
            rt.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, P(ctypes.c_void_p)]
            rt.cudaGraphInstantiateWithFlags.argtypes = [P(ctypes.c_void_p), ctypes.c_void_p,
                                                         ctypes.c_ulonglong]
            rt.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            rt.cudaGraphExecDestroy.argtypes = [ctypes.c_void_p]
            rt.cudaGraphDestroy.argtypes = [ctypes.c_void_p]
            rt.cudaGetErrorString.argtypes = [ctypes.c_int]
            rt.cudaGetErrorString.restype = ctypes.c_char_p
        except (OSError, AttributeError):
            continue
        return rt, candidate or "the global scope"
    return None, None


def layer():
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
    class Stats(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in STATS_FIELDS]

    out = Stats(size=ctypes.sizeof(Stats))
    if lib is None or lib.stablebuf_stats(ctypes.byref(out)) != 0:
        return None
    return {name: getattr(out, name) for name in STATS_FIELDS}


class DeviceBuffer:
    """A raw device pointer as a torch tensor (__cuda_array_interface__; no copy, no ownership)."""

    def __init__(self, pointer, words):
        self.__cuda_array_interface__ = {
            "shape": (words,), "typestr": "<f4", "data": (pointer, False), "version": 2,
            "strides": None,
        }


# ---- the test ------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for NCCL's log and the JSON report")
    parser.add_argument("--label", help="name of this run (default: vmm under the layer, else none)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lib = layer()
    label = args.label or ("none" if lib is None else "layer")
    log_path = os.path.abspath(os.path.join(args.out, f"nccl-register-{label}.log"))
    # Before NCCL starts.
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,REG"
    os.environ["NCCL_DEBUG_FILE"] = log_path
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ.setdefault("NCCL_PROTO", "Simple")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    import torch

    if torch.cuda.device_count() < 2:
        print(f"SKIPPED: {torch.cuda.device_count()} GPU(s) visible; this test needs two")
        return 2
    for d in range(2):
        torch.cuda.init()
        with torch.cuda.device(d):
            torch.zeros(1, device=f"cuda:{d}")  # contexts made, torch's libraries loaded
    nccl, where = load_nccl()
    if nccl is None:
        print("FAILED: libnccl (2.19 or later) not found; tried:\n    " + "\n    ".join(where))
        return 2
    version = ctypes.c_int()
    nccl.ncclGetVersion(ctypes.byref(version))
    stats = layer_stats(lib)
    layer_vmm = stats is not None and stats["mode"] == 2
    if lib is None:
        layer_text = "none"
    elif layer_vmm:
        layer_text = "vmm"
    else:
        layer_text = f"loaded, mode {stats['mode'] if stats else '?'} (not vmm)"
    # The layer's hooks come first in the global scope; without the layer the global scope
    # holds libnccl's own functions only if PyTorch loaded it globally (else the handle's stay).
    interposed = through_global_scope(nccl) if lib is not None else []
    renewing = layer_vmm and bool(stats) and stats.get("abi_version", 1) >= 2
    graph_register = os.environ.get("NCCL_GRAPH_REGISTER", "(unset: NCCL's default, 1)")
    print(f"libnccl {version.value} from {where}; layer: {layer_text}; "
          f"NCCL_ALGO={os.environ['NCCL_ALGO']} NCCL_PROTO={os.environ['NCCL_PROTO']} "
          f"NCCL_CUMEM_ENABLE={os.environ.get('NCCL_CUMEM_ENABLE', '(default)')} "
          f"NCCL_LOCAL_REGISTER={os.environ.get('NCCL_LOCAL_REGISTER', '(default)')} "
          f"NCCL_GRAPH_REGISTER={graph_register} "
          f"STABLEBUF_PRELOAD_NCCL_REGISTER={os.environ.get('STABLEBUF_PRELOAD_NCCL_REGISTER', '(default)')}; "
          f"through the global scope: {', '.join(interposed) or 'nothing'}", flush=True)

    def check(code, what):
        if code != 0:
            raise RuntimeError(f"{what} returned {code}: {nccl.ncclGetErrorString(code).decode()}")

    devices = [0, 1]
    comms = (ctypes.c_void_p * 2)()
    check(nccl.ncclCommInitAll(comms, 2, (ctypes.c_int * 2)(*devices)), "ncclCommInitAll")
    streams = [torch.cuda.Stream(device=d) for d in devices]
    log_offset = [0]

    def log_since():
        """NCCL's log written since the last call (NCCL line-buffers its file)."""
        try:
            with open(log_path, "rb") as f:
                f.seek(log_offset[0])
                raw = f.read()
        except OSError:
            return ""
        log_offset[0] += len(raw)
        return raw.decode("utf-8", errors="replace")

    base = (torch.arange(WORDS, dtype=torch.int64) % 1021).to(torch.float32)

    def data(d, phase):
        return base + float(100 * d + 10 * phase)

    def expected(phase):
        return sum(data(d, phase) for d in devices)

    def all_reduce(sends, recvs):
        for d in devices:
            torch.cuda.synchronize(d)
        check(nccl.ncclGroupStart(), "ncclGroupStart")
        for d in devices:
            check(nccl.ncclAllReduce(sends[d].data_ptr(), recvs[d].data_ptr(), WORDS, NCCL_FLOAT32,
                                     NCCL_SUM, comms[d], streams[d].cuda_stream), "ncclAllReduce")
        check(nccl.ncclGroupEnd(), "ncclGroupEnd")
        for s in streams:
            s.synchronize()

    results = {}

    def run_phase(name, sends, recvs, phase, op=None):
        for d in devices:
            sends[d].copy_(data(d, phase))
            recvs[d].fill_(float("nan"))
        if op is None:
            all_reduce(sends, recvs)
        else:
            op()
        want = expected(phase)
        wrong = sum(int((recvs[d].cpu() != want).sum()) for d in devices)
        found = registration(log_since())
        results[name] = {"right": wrong == 0, "wrong_elements": wrong, "nccl": found}
        print(f"CHECK {name}: {'right' if wrong == 0 else f'WRONG ({wrong} elements)'}; NCCL "
              f"registered {len(found['registered'])} buffers (proxy: {found['proxy_registered']}), "
              f"reused {len(found['reused'])}, failed {len(found['failed'])}", flush=True)
        for line in found["lines"][:4]:
            print(f"    {line[:240]}")
        return found

    def register(buffers):
        handles = []
        for d in devices:
            for t in buffers[d]:
                handle = ctypes.c_void_p()
                check(nccl.ncclCommRegister(comms[d], t.data_ptr(), WORDS * 4, ctypes.byref(handle)),
                      "ncclCommRegister")
                handles.append((d, handle))
        return handles

    def deregister(handles):
        for d, handle in handles:
            check(nccl.ncclCommDeregister(comms[d], handle), "ncclCommDeregister")

    def free_bytes():
        """Free device memory of both GPUs, as the driver sees it (libcuda's own symbol)."""
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
        total = 0
        for d in devices:
            with torch.cuda.device(d):
                torch.cuda.synchronize(d)
                free, size = ctypes.c_size_t(), ctypes.c_size_t()
                check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(size)), "cuMemGetInfo_v2")
                total += free.value
        return total

    pauses = []

    def pause_resume(name):
        if not layer_vmm:
            pauses.append({"name": name, "skipped": "no layer in vmm mode"})
            return
        before = free_bytes()
        p = lib.stablebuf_pause(TAG, 1)
        released = free_bytes() - before
        r = lib.stablebuf_resume(TAG)
        tagged = (layer_stats(lib) or {}).get("tagged_bytes", 0)
        now = layer_stats(lib) or {}
        entry = {"name": name, "pause": p, "resume": r, "released": released, "tagged": tagged,
                 "nccl_reregistrations": now.get("nccl_reregistrations"),
                 "nccl_failures": now.get("nccl_failures"),
                 "nccl_registrations": now.get("nccl_registrations")}
        pauses.append(entry)
        print(f"PAUSE {name}: pause {p}, resume {r}; the pause released {released / 2**20:.0f} MiB of "
              f"the tag's {tagged / 2**20:.0f} MiB"
              + (f"; layer: {entry['nccl_registrations']} NCCL registrations kept, "
                 f"{entry['nccl_reregistrations']} made again so far, {entry['nccl_failures']} failures"
                 if renewing else ""), flush=True)
        if p != 0 or r != 0:
            raise RuntimeError(f"stablebuf_pause {p} ({lib.stablebuf_error_string(p).decode()}), "
                               f"stablebuf_resume {r}")

    rt, rt_where = cuda_runtime()
    graph = {"found": registration(""), "c0": None, "c1": None, "skipped": None}

    def check_rt(code, what):
        if code != 0:
            raise RuntimeError(f"{what} returned {code}: {rt.cudaGetErrorString(code).decode()}")

    def graph_case(sends, recvs):
        """C: one graph per GPU holding its part of the all-reduce, replayed before and after a
        pause and resume."""
        if rt is None:
            graph["skipped"] = "no CUDA runtime with the graph functions found"
            print(f"SKIPPED graph case: {graph['skipped']}", flush=True)
            return
        for d in devices:
            torch.cuda.synchronize(d)
        log_since()
        graphs, execs, began = [], [], []
        try:
            for d in devices:
                with torch.cuda.device(d):
                    check_rt(rt.cudaStreamBeginCapture(streams[d].cuda_stream, CAPTURE_RELAXED),
                             "cudaStreamBeginCapture")
                began.append(d)
            check(nccl.ncclGroupStart(), "ncclGroupStart")
            for d in devices:
                check(nccl.ncclAllReduce(sends[d].data_ptr(), recvs[d].data_ptr(), WORDS,
                                         NCCL_FLOAT32, NCCL_SUM, comms[d], streams[d].cuda_stream),
                      "ncclAllReduce (capturing)")
            check(nccl.ncclGroupEnd(), "ncclGroupEnd (capturing)")
        finally:
            ended = []
            for d in began:
                with torch.cuda.device(d):
                    g = ctypes.c_void_p()
                    ended.append((d, rt.cudaStreamEndCapture(streams[d].cuda_stream, ctypes.byref(g))))
                    graphs.append((d, g))
        for d, code in ended:
            check_rt(code, f"cudaStreamEndCapture on GPU {d}")
        graph["found"] = registration(log_since())
        try:
            for d, g in graphs:
                with torch.cuda.device(d):
                    e = ctypes.c_void_p()
                    check_rt(rt.cudaGraphInstantiateWithFlags(ctypes.byref(e), g, 0),
                             "cudaGraphInstantiateWithFlags")
                    execs.append((d, e))

            def replay():
                for d in devices:
                    torch.cuda.synchronize(d)
                for d, e in execs:
                    with torch.cuda.device(d):
                        check_rt(rt.cudaGraphLaunch(e, streams[d].cuda_stream), "cudaGraphLaunch")
                for stream in streams:
                    stream.synchronize()

            run_phase("C0 captured in a graph, replayed before the pause", sends, recvs, 4, replay)
            graph["c0"] = results["C0 captured in a graph, replayed before the pause"]["right"]
            pause_resume("C (graph)")
            run_phase("C1 graph replayed after the pause and resume", sends, recvs, 5, replay)
            graph["c1"] = results["C1 graph replayed after the pause and resume"]["right"]
        finally:
            for d, e in execs:
                with torch.cuda.device(d):
                    rt.cudaGraphExecDestroy(e)
            for d, g in graphs:
                with torch.cuda.device(d):
                    rt.cudaGraphDestroy(g)

    facts = {"transports": [], "all_direct_p2p": "?"}
    try:
        # Control: NCCL's own memory.
        control_ptrs = []
        control = {}
        for d in devices:
            with torch.cuda.device(d):
                pair = []
                for _ in range(2):
                    p = ctypes.c_void_p()
                    check(nccl.ncclMemAlloc(ctypes.byref(p), WORDS * 4), "ncclMemAlloc")
                    control_ptrs.append(p.value)
                    pair.append(torch.as_tensor(DeviceBuffer(p.value, WORDS), device=f"cuda:{d}"))
                control[d] = pair
        log_since()
        handles = register({d: control[d] for d in devices})
        control_found = run_phase("control", {d: control[d][0] for d in devices},
                                  {d: control[d][1] for d in devices}, 0)
        deregister(handles)
        for d in devices:
            torch.cuda.synchronize(d)
        del control
        for p in control_ptrs:
            check(nccl.ncclMemFree(p), "ncclMemFree")

        # The layer's memory: torch tensors allocated under the tag, a pool per device.
        pools, sends, recvs = {}, {}, {}
        if lib is not None:
            lib.stablebuf_set_tag(TAG)
        for d in devices:
            with torch.cuda.device(d):
                pools[d] = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pools[d]):
                    sends[d] = torch.empty(WORDS, dtype=torch.float32, device=f"cuda:{d}")
                    recvs[d] = torch.empty(WORDS, dtype=torch.float32, device=f"cuda:{d}")
        if lib is not None:
            lib.stablebuf_set_tag(None)
        if layer_vmm and not (layer_stats(lib) or {}).get("tagged_bytes"):
            raise RuntimeError("nothing was allocated under the tag (the layer did not serve torch)")
        print(f"buffers: send {[hex(sends[d].data_ptr()) for d in devices]}, "
              f"recv {[hex(recvs[d].data_ptr()) for d in devices]}", flush=True)

        # A: registered once, across a pause and resume.
        handles = register({d: (sends[d], recvs[d]) for d in devices})
        a0 = run_phase("A0 registered, before the pause", sends, recvs, 0)
        pause_resume("A (registered)")
        run_phase("A1 registered, after the pause and resume", sends, recvs, 1)

        # B: deregistered before the pause, registered again after the resume.
        deregister(handles)
        handles = register({d: (sends[d], recvs[d]) for d in devices})
        run_phase("B0 registered again", sends, recvs, 2)
        deregister(handles)
        pause_resume("B (deregistered first)")
        handles = register({d: (sends[d], recvs[d]) for d in devices})
        run_phase("B1 registered after the resume", sends, recvs, 3)
        deregister(handles)

        # C: captured in a graph per GPU, replayed across a pause and resume. Its own failure
        # (a capture NCCL or the runtime refuses) fails the run but not the verdict on A.
        try:
            graph_case(sends, recvs)
        except Exception as error:
            print(f"FAILED: graph case: {type(error).__name__}: {error}", flush=True)
            results["C error"] = {"right": False, "wrong_elements": -1, "message": str(error)}
    except Exception as error:  # report what ran, then fail
        print(f"FAILED: {type(error).__name__}: {error}", flush=True)
        results["error"] = {"right": False, "wrong_elements": -1, "message": str(error)}
        control_found = results.get("control", {}).get("nccl", registration(""))
        a0 = results.get("A0 registered, before the pause", {}).get("nccl", registration(""))
    finally:
        try:
            for d in devices:
                torch.cuda.synchronize(d)
            for d in devices:
                nccl.ncclCommDestroy(comms[d])
        except Exception as error:  # a broken context: the verdict still comes out
            print(f"NOTE: cleanup failed: {type(error).__name__}: {error}", flush=True)
        try:
            with open(log_path, errors="replace") as f:
                facts = machine_facts(f.read())
        except OSError:
            pass

    missing = {"right": False, "wrong_elements": -1}
    a0_result = results.get("A0 registered, before the pause", missing)
    a1 = results.get("A1 registered, after the pause and resume", missing)
    pause_a = next((p for p in pauses if p["name"] == "A (registered)" and "released" in p), None)
    renewed = pause_a.get("nccl_reregistrations") if (pause_a and renewing) else None
    released = (pause_a["released"], pause_a["tagged"]) if pause_a else None
    line = verdict(layer_vmm, control_found, a0, a1["right"], a1["wrong_elements"], facts,
                   a0_result["right"], a0_result["wrong_elements"], renewed=renewed,
                   released=released)
    if line is not None and "error" in results:
        ran = ", ".join(name for name in results if name != "error") or "nothing"
        line = (f"REGISTRATION-CLAIM: untested (the test stopped: {results['error']['message']}; "
                f"ran: {ran})")
    print(f"NCCL transports: {', '.join(facts['transports']) or '?'}; isAllDirectP2p "
          f"{facts['all_direct_p2p']}")
    all_right = all(r["right"] for r in results.values())
    short = release_problems(pauses)
    for p in short:
        print(f"CHECK pause {p['name']}: FAILED: released only {p['released'] / MIB:.0f} of the "
              f"tag's {p['tagged'] / MIB:.0f} MiB (something still holds the old pages)")
    print(graph_case_line(graph_register, graph["found"], graph["c0"], graph["c1"])
          + (f" ({graph['skipped']})" if graph["skipped"] else f"; runtime: {rt_where}"))
    if renewing:
        end = layer_stats(lib) or {}
        print(f"LAYER-NCCL: {end.get('nccl_registrations')} registrations kept at the end, "
              f"{end.get('nccl_suspended')} suspended, {end.get('nccl_reregistrations')} made again "
              f"after resumes, {end.get('nccl_failures')} failures")
    if line is None:
        print(f"BASELINE (no layer in vmm mode): every all-reduce {'right' if all_right else 'NOT right'}; "
              f"no verdict is drawn without the layer")
    else:
        print(line)
    with open(os.path.join(args.out, f"nccl-register-{label}.json"), "w") as f:
        json.dump({"label": label, "nccl_version": version.value, "library": where,
                   "results": results, "pauses": pauses, "facts": facts, "verdict": line,
                   "graph": {"nccl_graph_register": graph_register, "c0": graph["c0"],
                             "c1": graph["c1"], "skipped": graph["skipped"],
                             "registered": graph["found"]["registered"]},
                   "interposed": interposed}, f, indent=1)
    print(f"RESULT nccl-register {label}: {sum(r['right'] for r in results.values())} of "
          f"{len(results)} all-reduces right"
          + (f", {len(short)} pauses released too little" if short else "")
          + (f"; {line.split(' (')[0]}" if line else ""))
    return 0 if all_right and not short else 1


if __name__ == "__main__":
    sys.exit(main())
