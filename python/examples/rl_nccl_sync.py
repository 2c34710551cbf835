"""Issue 42: RL weight sync from another node over NCCL, side by side (needs 2 GPUs; GPU 0 is
the trainer's node, GPU 1 the engine's):

- paused: the anchors' mechanism (vLLM's and TRL's NCCL update, checkpoint-engine): the serving
  loop stops while each bucket is received over NCCL and copied into the live parameters;
- bucket: the same buckets received while serving, the loop paused only for each copy (a
  stronger baseline than the anchors, for reference);
- shadow: NCCL straight into the engine's spare weight set while it serves, then one bind.

    python python/examples/rl_nccl_sync.py [--gib 2] [--versions 3] [--transport net|nvlink|both]

Per mode and transport: transfer s and GB/s (trainer side), engine time lost (sum of step -
undisturbed step from the transfer's start to 5 steps after the new weights serve), the
longest step, commit -> first launch (median). Verdict lines: ``VERDICT <name>: PASS|FAIL``.
Memory: the shadow path holds 2 sets of the shard (the bound one and the one receiving); the
bucket path the live weights plus the bucket (--bucket-gib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("paused", "bucket", "shadow")  # versions 1..n, n+1..2n, 2n+1..3n
NET = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}


def engine(args) -> None:
    import torch

    import stablebuf
    from stablebuf.publish import RemoteEngine, control_store

    torch.cuda.set_device(1)
    layers, width = args.layers, int((args.gib * 2**30 / 2 / args.layers) ** 0.5)
    with stablebuf.region("w", fence="last-use"):
        ws = {f"l{i}": torch.randn(width, width, device="cuda:1", dtype=torch.bfloat16) * 0.01
              for i in range(layers)}
    store = control_store("127.0.0.1", args.port, server=True)
    # The shadow set receives in operations of the bucket's size: the same NCCL operations as
    # the bucket paths, only their destination differs (fewer, larger operations also carry
    # more per second over sockets; the library's default chunk is smaller, for the stall watch).
    eng = RemoteEngine("w", ws, store=store, prefix="ex", sets=2,
                       bucket_bytes=int(args.bucket_gib * 2**30),
                       chunk_bytes=int(args.bucket_gib * 2**30))
    eng.mode_for = lambda v: MODES[min((v - 1) // args.versions, len(MODES) - 1)]
    x = torch.randn(8, width, device="cuda:1", dtype=torch.bfloat16)
    graph = stablebuf.CUDAGraph(tags=["w"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x
        for i in range(layers):
            y = y @ ws[f"l{i}"]
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = x
        for i in range(layers):
            out = out @ ws[f"l{i}"]
    steps, launches = [], {}
    while not eng.connected:
        eng.accept(timeout=0.1)
    total = len(MODES) * args.versions
    t_end = None
    while True:
        t0 = time.monotonic()
        status = eng.poll()
        launch = time.monotonic()
        if status.version not in launches:
            launches[status.version] = launch
        graph.replay()
        torch.cuda.current_stream().synchronize()
        steps.append((t0, time.monotonic()))
        if status.version >= total and t_end is None:
            t_end = time.monotonic() + 1.0
        if t_end is not None and time.monotonic() > t_end:
            break
    print(json.dumps({"steps": steps, "launches": launches, "timeline": eng.timeline,
                      "stats": eng.transfer_stats}), flush=True)
    eng.close()


def trainer(args) -> None:
    import torch

    from stablebuf.publish import RemoteTrainer, control_store

    torch.cuda.set_device(0)
    store = control_store("127.0.0.1", args.port, server=False)
    tr = RemoteTrainer.connect(store, "ex", device=0)
    time.sleep(1.0)  # the engine's undisturbed steps
    for v in range(1, len(MODES) * args.versions + 1):
        for t in tr.tensors().values():
            t.normal_(0, 0.01)
        torch.cuda.synchronize()
        tr.send(v)
        time.sleep(0.5)
    print(json.dumps({"stats": tr.stats}), flush=True)
    tr.close()


def analyse(engine_out, trainer_out, versions):
    steps = engine_out["steps"]
    durations = [b - a for a, b in steps]
    first_ready = min(t for k, v, t in engine_out["timeline"] if k == "ready")
    undisturbed = statistics.median(b - a for a, b in steps if b < first_ready)
    rows = {}
    for i, mode in enumerate(MODES):
        vs = range(i * versions + 1, (i + 1) * versions + 1)
        lost, longest, c2l, secs, gbps = [], [], [], [], []
        for v in vs:
            start = next(t for k, vv, t in engine_out["timeline"] if k == "ready" and vv == v)
            commit = next(t for k, vv, t in engine_out["timeline"] if k == "received" and vv == v)
            launch = engine_out["launches"][str(v)]
            window = [b - a for a, b in steps if a >= start and b <= launch + 5 * undisturbed + 1e-3]
            lost.append(sum(d - undisturbed for d in window))
            longest.append(max(window) if window else 0.0)
            c2l.append(launch - commit)
            s = trainer_out["stats"][str(v)]
            secs.append(s["seconds"])
            gbps.append(s["gb_per_s"])
        rows[mode] = {"transfer_s": statistics.median(secs), "gb_per_s": statistics.median(gbps),
                      "lost_ms": 1e3 * statistics.median(lost),
                      "longest_ms": 1e3 * max(longest), "commit_to_launch_ms": 1e3 * statistics.median(c2l)}
    return undisturbed, rows


def run_pair(args, transport):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_NCCL_ENABLE_MONITORING="0")
    if transport == "net":
        env.update(NET)
    port = str(29600 + (transport == "nvlink"))
    base = [sys.executable, os.path.abspath(__file__), "--gib", str(args.gib), "--versions",
            str(args.versions), "--port", port, "--bucket-gib", str(args.bucket_gib)]
    e = subprocess.Popen(base + ["--role", "engine"], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(2)
    t = subprocess.Popen(base + ["--role", "trainer"], env=env, stdout=subprocess.PIPE, text=True)
    e_out, _ = e.communicate(timeout=900)
    t_out, _ = t.communicate(timeout=900)
    if e.returncode or t.returncode:
        raise SystemExit(f"{transport}: engine exit {e.returncode}, trainer exit {t.returncode}")
    return analyse(json.loads(e_out.strip().splitlines()[-1]),
                   json.loads(t_out.strip().splitlines()[-1]), args.versions)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="main")
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--bucket-gib", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--transport", default="both", choices=["net", "nvlink", "both"])
    args = p.parse_args()
    if args.role == "engine":
        return engine(args)
    if args.role == "trainer":
        return trainer(args)
    ok = True
    for transport in (["net", "nvlink"] if args.transport == "both" else [args.transport]):
        undisturbed, rows = run_pair(args, transport)
        print(f"\n{transport}: {args.gib} GiB shard, undisturbed step {undisturbed * 1e3:.3f} ms")
        print(f"{'mode':8} {'transfer s':>10} {'GB/s':>7} {'lost ms':>9} {'longest ms':>10} {'commit->launch ms':>17}")
        for mode, r in rows.items():
            print(f"{mode:8} {r['transfer_s']:10.3f} {r['gb_per_s']:7.2f} {r['lost_ms']:9.2f} "
                  f"{r['longest_ms']:10.2f} {r['commit_to_launch_ms']:17.3f}")
        b, p, s = rows["bucket"], rows["paused"], rows["shadow"]
        checks = {
            f"{transport} bandwidth shadow >= 0.9x bucket": s["gb_per_s"] >= 0.9 * b["gb_per_s"],
            f"{transport} lost shadow <= 1/5 paused (pause-and-copy)":
                s["lost_ms"] <= max(p["lost_ms"], 0) / 5,
            f"{transport} commit->launch median <= 1 ms": s["commit_to_launch_ms"] <= 1.0,
        }
        for name, good in checks.items():
            ok &= good
            print(f"VERDICT {name}: {'PASS' if good else 'FAIL'}")
    print(f"VERDICT all: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
