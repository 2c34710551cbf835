"""A few deterministic training steps of a small model (an MLP classifier); run with and without the layer.

  python torch_train.py --out plain.json
  LD_PRELOAD=libstablebuf_preload.so STABLEBUF_PRELOAD_MODE=vmm python torch_train.py --out vmm.json
  python torch_train.py --compare plain.json vmm.json      # losses must be identical

Set CUBLAS_WORKSPACE_CONFIG=:4096:8 for deterministic cuBLAS (the runner does).
"""

import argparse
import ctypes
import json
import os
import sys
import time


def stats():
    """The layer's counters if it is loaded (ctypes mirror of struct stablebuf_stats)."""
    lib = ctypes.CDLL(None)
    try:
        get = lib.stablebuf_stats
    except AttributeError:
        return None
    fields = ["size", "abi_version", "mode", "live_allocations", "live_bytes", "runtime_allocs",
              "driver_allocs", "frees", "foreign_frees", "entry_points", "ipc_refusals",
              "oom_errors", "pool_mapped", "pool_cached", "pool_peak_mapped", "pool_mappings",
              "pool_creates", "pool_reuses", "pool_stitched", "pool_drains"]

    class Stats(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in fields]

    out = Stats(size=ctypes.sizeof(Stats))
    if get(ctypes.byref(out)) != 0:
        return None
    return {name: getattr(out, name) for name in fields}


def train(steps):
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda")
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.LayerNorm(2048),
        torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.LayerNorm(2048),
        torch.nn.Linear(2048, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    started = time.perf_counter()
    for _ in range(steps):
        inputs = torch.randn(256, 512, generator=generator).to(device)
        labels = torch.randint(0, 10, (256,), generator=generator).to(device)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        same = a["losses"] == b["losses"]
        print(f"losses identical: {same} ({len(a['losses'])} steps; first {a['losses'][0]:.6f}, "
              f"last {a['losses'][-1]:.6f} vs {b['losses'][-1]:.6f})")
        caught = (b.get("layer") or {}).get("runtime_allocs", 0)
        print(f"allocations served by the layer in the second run: {caught}")
        ok = same and caught > 0
        print("RESULT " + json.dumps({"script": "torch_train", "ok": ok, "identical": same,
                                      "layer_allocs": caught}))
        sys.exit(0 if ok else 1)

    losses, seconds = train(args.steps)
    result = {"losses": losses, "seconds": seconds, "layer": stats(),
              "preload": os.environ.get("LD_PRELOAD", "")}
    print(f"{len(losses)} steps in {seconds:.2f} s; loss {losses[0]:.6f} -> {losses[-1]:.6f}; "
          f"layer: {result['layer']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
