"""How long a snapshot blocks training: inmem_ft vs torch.save to local disk vs a plain clone, side by side.

    python benchmarks/snapshot_stall.py --quick --json out/stall.json [--plot out/stall.png]

Two ranks (gloo) each hold a ~100M-parameter fp32 model with Adam, as data-parallel replicas do. Each
method is timed on the same state in the same run:
  inmem_blocking_s         Snapshotter.save() with the state marked Replicated (each rank saves half)
  inmem_blocking_full_s    Snapshotter.save() of the whole state on every rank (no split)
  torch_save_s             torch.save of the whole state to local disk (page cache, no fsync)
  clone_floor_s            one plain copy of every tensor to host memory: the floor for any snapshot
On a GPU, inmem_gpu_stall_s adds the wait until the training stream may run again (the device copy).
Medians over the repeats; the reported figure of each method is the slowest rank's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import report  # benchmarks/report.py (the script's own folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))


def build_state(hidden: int, layers: int, device: torch.device):
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden))
              for _ in range(layers)]
    model = torch.nn.Sequential(*blocks).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, hidden, device=device)).sum().backward()
    opt.step()  # materialize Adam's exp_avg / exp_avg_sq
    params = sum(p.numel() for p in model.parameters())
    return model, opt, params


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(args) -> None:
    import inmem_ft

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    model, opt, params = build_state(args.hidden, args.layers, device)

    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}

    tensors = [t for t in model.state_dict().values()] + [
        v for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    results = {"params": params, "state_bytes_per_rank": nbytes, "ranks": dist.get_world_size(),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    # The floor: one plain copy of every tensor out of the training buffers (device to host on a GPU).
    results["clone_floor_s"] = slowest(timed(lambda: [t.to("cpu", copy=True) for t in tensors], args.repeats))
    if rank == 0:
        report.progress(f"plain copy: {results['clone_floor_s']:.3f} s")

    with tempfile.TemporaryDirectory(dir=args.disk_dir) as d:
        path = os.path.join(d, f"rank{rank}.pt")
        results["torch_save_s"] = slowest(timed(lambda: torch.save(state(), path), args.repeats))
    if rank == 0:
        report.progress(f"torch.save: {results['torch_save_s']:.3f} s")

    dp = dist.new_group(backend="gloo")
    for key, make, group in [("inmem_blocking_s", lambda: inmem_ft.Replicated(state()), dp),
                             ("inmem_blocking_full_s", state, None)]:
        snap = inmem_ft.Snapshotter(inmem_ft.SnapshotConfig.from_env(interval=1), dp_group=group)
        snap.save(0, make())  # first save reserves and faults in the slots, as at job start
        snap.wait()
        stalls, commits, device_stalls = [], [], []
        for step in range(1, args.repeats + 1):
            sync()
            t0 = time.perf_counter()
            snap.save(step, make())
            stalls.append(snap.metrics.last_stall_s)
            sync()  # on a GPU the training stream waits for the copy out of device memory
            device_stalls.append(time.perf_counter() - t0)
            snap.wait()
            commits.append(snap.metrics.last_commit_s)
        results[key] = slowest(statistics.median(stalls))
        if device.type == "cuda":
            results[key.replace("blocking", "gpu_stall")] = slowest(statistics.median(device_stalls))
        results[key.replace("blocking", "commit")] = slowest(statistics.median(commits))
        snap.close()
        if rank == 0:
            report.progress(f"{key}: {results[key]:.3f} s")

    results["ratio_vs_torch_save"] = results["inmem_blocking_s"] / results["torch_save_s"]
    results["ratio_vs_floor"] = results["inmem_blocking_s"] / results["clone_floor_s"]
    results["ratio_full_vs_floor"] = results["inmem_blocking_full_s"] / results["clone_floor_s"]
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["inmem_blocking_s", "inmem_blocking_full_s", "clone_floor_s", "torch_save_s"]
    labels = ["inmem_ft\n(DP split)", "inmem_ft\n(no split)", "clone\n(floor)", "torch.save\n(local disk)"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(labels, [results[k] for k in keys], color=["#2a7", "#5b9", "#999", "#c55"])
    ax.bar_label(bars, fmt="%.3f s")
    ax.set_ylabel("training blocked per snapshot (s)")
    ax.set_title(f"{results['params'] / 1e6:.0f}M params + Adam, {results['ranks']} ranks, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw a PNG bar chart here")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6, help="6 x (2048x4096 + 4096x2048) = 100.7M parameters")
    p.add_argument("--disk-dir", default=None, help="where torch.save writes (default: the temp dir)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both ranks share GPU 0)")
    report.worker_args(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, os.path.dirname(HERE))
    from inmem_ft.launcher.simulated import SimulatedCluster

    repeats = 3 if args.quick else 7
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(tmp, "run"))
        result = os.path.join(tmp, "result.json")
        budget = 8 << 30
        with SimulatedCluster(1, 2, "stallbench", budget, os.path.join(tmp, "logs"),
                              env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}) as cluster, \
                report.phase(f"2 ranks: plain copy, torch.save, inmem_ft with and without DP split, {repeats} "
                             f"repeats each"):
            attempt = cluster.run([os.path.abspath(__file__), "--worker", "--result", result, "--repeats",
                                   str(repeats), "--hidden", str(args.hidden), "--layers", str(args.layers),
                                   "--device", args.device]
                                  + (["--disk-dir", args.disk_dir] if args.disk_dir else []), timeout_s=1800,
                                  poll=report.echo_worker(cluster, "stall"))
            if not attempt.ok:
                print(cluster.rank_log(attempt.number, attempt.first_failure or 0)[-3000:], file=sys.stderr)
                return 1
        with open(result) as f:
            results = json.load(f)
    results["quick"] = args.quick
    print(f"{results['params'] / 1e6:.1f}M params + Adam, {results['state_bytes_per_rank'] / 2**30:.2f} GiB of "
          f"state per rank, {results['ranks']} ranks on {results['device']}, medians of {repeats}")
    for key in ["inmem_blocking_s", "inmem_blocking_full_s", "inmem_gpu_stall_s", "inmem_gpu_stall_full_s",
                "clone_floor_s", "torch_save_s", "inmem_commit_s", "inmem_commit_full_s"]:
        if key in results:
            print(f"  {key:<24} {results[key]:8.4f} s")
    for key in ["ratio_vs_torch_save", "ratio_vs_floor", "ratio_full_vs_floor"]:
        print(f"  {key:<24} {results[key]:8.3f}")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)  # exits with main's code; a worker's process groups are destroyed on every path (issue 23)
