"""Does NCCL keep the old pages of the layer's memory across a tag's pause and resume, when one
process drives two GPUs? (preload/README.md, Limits; the CHANGELOG's known problem, until now
read from NCCL's source only.)

    LD_PRELOAD=libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm python nccl_register_pause.py --out DIR
    python nccl_register_pause.py --out DIR          (the baseline, without the layer)

One process, two GPUs, libnccl through ctypes (the library PyTorch loaded, else found as
stablebuf finds it), one communicator per device from ncclCommInitAll, and an out-of-place sum
all-reduce of 32 MiB per device, issued eagerly in one group. NCCL registers a user buffer for a
ring all-reduce only when both buffers were registered (ncclCommRegister), the all-reduce is out
of place, the protocol is Simple and every peer is reached by direct P2P; so this sets
NCCL_ALGO=Ring and NCCL_PROTO=Simple unless they are set, and NCCL_NVLS_ENABLE=0. NCCL's log
(INFO, INIT and REG, in DIR/nccl-register-LABEL.log) says what NCCL did with each buffer.

  control     buffers from ncclMemAlloc (NCCL's own cuMem memory), registered, all-reduced: does
              NCCL register user buffers on this machine at all?
  A           the layer's buffers (torch tensors allocated under the tag "nccl"), registered once,
              all-reduced (A0); the tag paused (contents kept) and resumed; new data written,
              the receive buffers poisoned with NaN, all-reduced again (A1).
  B           the workaround: deregistered before the pause and registered again after the
              resume (B0 before, B1 after), on the same buffers.

Each all-reduce is checked element for element against the sum (integers in float32: exact).
The verdict, one line:
  REGISTRATION-CLAIM: confirmed (stale pages after resume)          NCCL registered the layer's
      buffer and A1 was wrong: NCCL kept using the pages it registered
  REGISTRATION-CLAIM: refuted (...)                                 NCCL did not register the
      layer's memory, or did and A1 was right anyway
  REGISTRATION-CLAIM: untested (...)                                NCCL registered nothing here,
      not even its own memory (no direct P2P between the GPUs, an NCCL without the path, ...)
Without the layer the pauses are skipped and no verdict is drawn (the baseline must be right).
Exit status 0 when every all-reduce was right, 1 when one was wrong (a confirmed claim included),
2 when the test could not run (fewer than two GPUs, no libnccl).
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
]


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
            a0_wrong_elements=0):
    """The REGISTRATION-CLAIM line, or None without the layer (the baseline)."""
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
            return ("REGISTRATION-CLAIM: confirmed (stale pages after resume: NCCL registered the "
                    f"layer's buffers with its peer and kept their old pages; the all-reduce after "
                    f"the pause and resume was wrong in {a1_wrong_elements} elements)")
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
    print(f"libnccl {version.value} from {where}; layer: {layer_text}; "
          f"NCCL_ALGO={os.environ['NCCL_ALGO']} NCCL_PROTO={os.environ['NCCL_PROTO']} "
          f"NCCL_CUMEM_ENABLE={os.environ.get('NCCL_CUMEM_ENABLE', '(default)')} "
          f"NCCL_LOCAL_REGISTER={os.environ.get('NCCL_LOCAL_REGISTER', '(default)')}", flush=True)

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

    def run_phase(name, sends, recvs, phase):
        for d in devices:
            sends[d].copy_(data(d, phase))
            recvs[d].fill_(float("nan"))
        all_reduce(sends, recvs)
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
        pauses.append({"name": name, "pause": p, "resume": r, "released": released, "tagged": tagged})
        print(f"PAUSE {name}: pause {p}, resume {r}; the pause released {released / 2**20:.0f} MiB of "
              f"the tag's {tagged / 2**20:.0f} MiB", flush=True)
        if p != 0 or r != 0:
            raise RuntimeError(f"stablebuf_pause {p} ({lib.stablebuf_error_string(p).decode()}), "
                               f"stablebuf_resume {r}")

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
    line = verdict(layer_vmm, control_found, a0, a1["right"], a1["wrong_elements"], facts,
                   a0_result["right"], a0_result["wrong_elements"])
    if line is not None and "error" in results:
        ran = ", ".join(name for name in results if name != "error") or "nothing"
        line = (f"REGISTRATION-CLAIM: untested (the test stopped: {results['error']['message']}; "
                f"ran: {ran})")
    print(f"NCCL transports: {', '.join(facts['transports']) or '?'}; isAllDirectP2p "
          f"{facts['all_direct_p2p']}")
    all_right = all(r["right"] for r in results.values())
    if line is None:
        print(f"BASELINE (no layer in vmm mode): every all-reduce {'right' if all_right else 'NOT right'}; "
              f"no verdict is drawn without the layer")
    else:
        print(line)
    with open(os.path.join(args.out, f"nccl-register-{label}.json"), "w") as f:
        json.dump({"label": label, "nccl_version": version.value, "library": where,
                   "results": results, "pauses": pauses, "facts": facts, "verdict": line}, f, indent=1)
    print(f"RESULT nccl-register {label}: {sum(r['right'] for r in results.values())} of "
          f"{len(results)} all-reduces right" + (f"; {line.split(' (')[0]}" if line else ""))
    return 0 if all_right else 1


if __name__ == "__main__":
    sys.exit(main())
