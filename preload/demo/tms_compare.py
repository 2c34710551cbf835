"""stablebuf's preload layer against torch_memory_saver (its preload mode), side by side.

  python tms_compare.py --lib libstablebuf_preload.so --tms-site /tmp/site [--sizes 1,8]

Each tool needs its own LD_PRELOAD, so each runs in a worker process of its own; this driver
starts them and prints one table. Per size (GiB of weights, contents kept): pause and resume
times of the first cycle and of the later ones, and the device memory a pause gives back
(measured through libcuda's own handle, not through either tool's hooks).

- stablebuf: the first pause of a size pins the host arena (~0.5 s/GiB, once); later cycles
  reuse it. Both are reported.
- torch_memory_saver 0.0.10, default: pins a fresh host copy at every pause.
- torch_memory_saver with retain_cpu_backup=True: keeps its host copy between cycles (its best
  case).
Target (issue 12): stablebuf's pause+resume ≥ 10× faster than torch_memory_saver's (default).
"""

import argparse
import ctypes
import glob
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30


# ---- worker -------------------------------------------------------------------------------

class Driver:
    """Device free memory from libcuda itself (its handle's lookup bypasses LD_PRELOAD)."""

    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2

    def free(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        assert self.cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
        return free.value


def fill(torch, tensors):
    for i, t in enumerate(tensors):
        words = t.view(torch.int32)
        torch.arange(words.numel(), out=words)
        words.add_(i * 7919)


def verify(torch, tensors):
    for i, t in enumerate(tensors):
        words = t.view(torch.int32)
        expected = torch.arange(words.numel(), dtype=torch.int32, device=t.device) + i * 7919
        if not torch.equal(words, expected):
            return False
        del expected
    return True


def worker(args):
    import torch

    driver = Driver()
    torch.zeros(1, device="cuda")  # create the context before timing anything
    if args.tool == "stablebuf":
        lib = ctypes.CDLL(None)
        lib.stablebuf_set_tag.argtypes = [ctypes.c_char_p]
        lib.stablebuf_pause.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.stablebuf_resume.argtypes = [ctypes.c_char_p]

        def allocate(tag, gib):
            pool = torch.cuda.MemPool()
            assert lib.stablebuf_set_tag(tag.encode()) == 0
            with torch.cuda.use_mem_pool(pool):
                tensors = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(gib)]
            assert lib.stablebuf_set_tag(None) == 0
            return tensors, pool

        def pause(tag):
            code = lib.stablebuf_pause(tag.encode(), 1)
            assert code == 0, f"stablebuf_pause returned {code}"

        def resume(tag):
            code = lib.stablebuf_resume(tag.encode())
            assert code == 0, f"stablebuf_resume returned {code}"
    else:
        from torch_memory_saver import torch_memory_saver as tms

        if args.retain:
            tms.retain_cpu_backup = True

        def allocate(tag, gib):
            with tms.region(tag=tag, enable_cpu_backup=True):
                tensors = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(gib)]
            return tensors, None

        def pause(tag):
            tms.pause(tag)

        def resume(tag):
            tms.resume(tag)

    for gib in args.sizes:
        tag = f"weights{gib}"
        tensors, pool = allocate(tag, gib)
        fill(torch, tensors)
        torch.cuda.synchronize()
        cycles = []
        ok = True
        for _ in range(args.cycles):
            torch.cuda.synchronize()
            before = driver.free()
            t0 = time.perf_counter()
            pause(tag)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            freed = driver.free() - before
            t2 = time.perf_counter()
            resume(tag)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            ok = ok and verify(torch, tensors)
            cycles.append({"pause_s": t1 - t0, "resume_s": t3 - t2, "freed": freed})
        print("RESULT " + json.dumps({"tool": args.label, "gib": gib, "cycles": cycles,
                                      "verified": ok}), flush=True)
        del tensors, pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- driver -------------------------------------------------------------------------------

def find_tms_library(site):
    for pattern in ("torch_memory_saver_hook_mode_preload_cu13*.so",
                    "torch_memory_saver_hook_mode_preload_cu12*.so",
                    "torch_memory_saver_hook_mode_preload*.so"):
        found = sorted(glob.glob(os.path.join(site, pattern)))
        if found:
            return found[0]
    return None


def find_cudart_dir():
    """Where this Python's libcudart.so.13 lives: torch_memory_saver's preload library needs it
    on the loader's path (its link-time dependency; stablebuf's library has none)."""
    for entry in sys.path:
        for pattern in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.13",
                        "nvidia/*/lib/libcudart.so.13"):
            found = glob.glob(os.path.join(entry, pattern))
            if found:
                return os.path.dirname(found[0])
    for directory in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        if os.path.exists(os.path.join(directory, "libcudart.so.13")):
            return directory
    return None


def run_worker(label, env_extra, extra_args, args):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(env_extra)
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--label", label,
               "--sizes", ",".join(map(str, args.sizes)), "--cycles", str(args.cycles)] + extra_args
    print(f"--- {label}: {' '.join(f'{k}={v}' for k, v in env_extra.items())}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    results = []
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            results.append(json.loads(line[len("RESULT "):]))
    print(f"    exit {proc.returncode} in {time.perf_counter() - started:.1f} s", flush=True)
    if proc.returncode != 0 or len(results) != len(args.sizes):
        print(f"    worker {label} failed; its output:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    if args.out:
        with open(os.path.join(args.out, f"tms_compare_{label}.log"), "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return results, proc.returncode == 0


def summarize(cycles):
    first = cycles[0]
    rest = cycles[1:] or cycles
    mean = lambda key: sum(c[key] for c in rest) / len(rest)  # noqa: E731
    return {
        "first_pause": first["pause_s"], "first_resume": first["resume_s"],
        "pause": mean("pause_s"), "resume": mean("resume_s"),
        "freed": min(c["freed"] for c in cycles),
    }


def driver(args):
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    ok = True
    results = []
    found, worked = run_worker(
        "stablebuf", {"LD_PRELOAD": os.path.abspath(args.lib), "STABLEBUF_PRELOAD_MODE": "vmm"},
        ["--tool", "stablebuf"], args)
    results += found
    ok &= worked
    tms_library = find_tms_library(args.tms_site) if args.tms_site else None
    if tms_library is None:
        print(f"torch_memory_saver's preload library not found under {args.tms_site!r}: "
              "only stablebuf was measured")
        ok = False
    else:
        cudart = find_cudart_dir()
        env = {"LD_PRELOAD": tms_library,
               "PYTHONPATH": args.tms_site + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if cudart:
            env["LD_LIBRARY_PATH"] = cudart + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
        for label, extra in (("tms", []), ("tms-retain", ["--retain"])):
            found, worked = run_worker(label, env, ["--tool", "tms"] + extra, args)
            results += found
            ok &= worked

    print()
    print("| GiB | tool | pause, 1st (s) | resume, 1st (s) | pause, later (s) | resume, later (s) "
          "| device memory freed (GiB) | contents kept |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    table = {}
    for r in results:
        s = summarize(r["cycles"])
        table[(r["tool"], r["gib"])] = s
        # Free memory moves by a few MiB for reasons of its own (driver bookkeeping): allow 64 MiB.
        ok &= r["verified"] and s["freed"] >= r["gib"] * GIB - 64 * 1024 * 1024
        print(f"| {r['gib']} | {r['tool']} | {s['first_pause']:.3f} | {s['first_resume']:.3f} | "
              f"{s['pause']:.3f} | {s['resume']:.3f} | {s['freed'] / GIB:.2f} | "
              f"{'yes' if r['verified'] else 'NO'} |")
    print()
    for gib in args.sizes:
        ours = table.get(("stablebuf", gib))
        for other in ("tms", "tms-retain"):
            theirs = table.get((other, gib))
            if not ours or not theirs:
                continue
            for label, key_pause, key_resume in (("later cycles", "pause", "resume"),
                                                 ("first cycle", "first_pause", "first_resume")):
                a = ours[key_pause] + ours[key_resume]
                b = theirs[key_pause] + theirs[key_resume]
                print(f"{gib} GiB, {label}: stablebuf pause+resume {a:.3f} s vs {other} {b:.3f} s: "
                      f"{b / a:.1f}x")
        ours, theirs = table.get(("stablebuf", gib)), table.get(("tms", gib))
        if ours and theirs:
            speedup = (theirs["pause"] + theirs["resume"]) / (ours["pause"] + ours["resume"])
            print(f"TARGET {gib} GiB pause+resume >= 10x torch_memory_saver (arena pinned once): "
                  f"{speedup:.1f}x {'met' if speedup >= 10 else 'NOT met'}")
    print("RESULT " + json.dumps({"script": "tms_compare", "ok": bool(ok)}))
    return 0 if ok else 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", help="libstablebuf_preload.so")
    parser.add_argument("--tms-site", help="where the torch_memory_saver wheel is unpacked")
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--tool", choices=["stablebuf", "tms"])
    parser.add_argument("--label")
    parser.add_argument("--retain", action="store_true")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.worker:
        worker(args)
        return 0
    if not args.lib:
        parser.error("--lib is required")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
