"""DCP checkpoint stall and restore: inmem_ft.dcp vs stock torch.distributed.checkpoint, side by side.

    python benchmarks/dcp_save.py --quick --json out/dcp.json [--plot out/dcp.png]

An FSDP2 (fully_shard) MLP trained with AdamW on 2 ranks (gloo, CPU); default 6 x (2048x4096 + 4096x2048)
Linear layers = 100.7M parameters (--quick: a small one). In the same run, on the same state, alternating:
  inmem_blocking_s      dcp.async_save(state, storage_writer=InmemStorageWriter(...)): how long the call holds
                        training (the writer is the stager: the copy into the SMP slot)
  inmem_commit_s        until its future completes (checksums, commit, job-wide agreement)
  fs_async_blocking_s   dcp.async_save with FileSystemWriter and torch's DefaultStager (pinned memory only
                        with CUDA; on CPU it stages into plain memory)
  fs_save_s             dcp.save with FileSystemWriter
  restore_step_s        dcp.load from InmemStorageReader + set_state_dict + the first training step
  fs_load_step_s        dcp.load from FileSystemReader (page cache warm) + set_state_dict + the first step
Medians over the repeats; each figure is the slowest rank's. Restores run in the training processes (warm),
not in fresh ones after a crash; the cold-page-cache disk load is not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import report  # benchmarks/report.py (the script's own folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = ("inmem_blocking_s", "inmem_commit_s", "fs_async_blocking_s", "fs_save_s", "restore_step_s",
        "fs_load_step_s")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from inmem_ft import SnapshotConfig, Snapshotter
    from inmem_ft.dcp import InmemStorageReader, InmemStorageWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    h = args.hidden
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(h, 2 * h, bias=False), torch.nn.Linear(2 * h, h, bias=False)]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, h)

    def train_step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    def state():
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optimizer": optim_sd}

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    train_step()
    snap = Snapshotter(SnapshotConfig.from_env(interval=1))
    pg = dist.new_group(backend="gloo")
    runs = {k: [] for k in KEYS}
    step, disk = 0, args.disk_dir
    for i in range(args.repeats):
        step += 1
        train_step()
        t0 = time.perf_counter()
        upload = dcp.async_save(state(), storage_writer=InmemStorageWriter(step=step, snapshotter=snap),
                                process_group=pg)
        t1 = time.perf_counter()
        upload.result()
        runs["inmem_blocking_s"].append(slowest(t1 - t0))
        runs["inmem_commit_s"].append(slowest(time.perf_counter() - t1))
        train_step()
        where = os.path.join(disk, f"async{i}")
        t0 = time.perf_counter()
        upload = dcp.async_save(state(), storage_writer=FileSystemWriter(where), process_group=pg)
        t1 = time.perf_counter()
        upload.result()
        runs["fs_async_blocking_s"].append(slowest(t1 - t0))
        where = os.path.join(disk, f"save{i}")
        t0 = time.perf_counter()
        dcp.save(state(), storage_writer=FileSystemWriter(where))
        runs["fs_save_s"].append(slowest(time.perf_counter() - t0))
        if rank == 0:
            report.progress(f"repeat {i + 1}/{args.repeats} saved")
    for i in range(args.repeats):
        for key, reader in (("restore_step_s", lambda: InmemStorageReader(snapshotter=snap)),
                            ("fs_load_step_s", lambda: FileSystemReader(os.path.join(disk, f"save{args.repeats - 1}")))):
            dist.barrier()
            t0 = time.perf_counter()
            loaded = state()
            dcp.load(loaded, storage_reader=reader())
            set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
            train_step()
            runs[key].append(slowest(time.perf_counter() - t0))
    snap.close()
    dist.destroy_process_group(pg)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(args.result, "w") as f:
            json.dump({"params": params, "ranks": dist.get_world_size(), "repeats": args.repeats,
                       "runs": runs, **{k: statistics.median(v) for k, v in runs.items()}}, f)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(KEYS), [results[k] for k in KEYS])
    ax.set_xlabel("seconds (median, slowest rank)")
    ax.set_title(f"DCP on {results['params'] / 1e6:.1f}M params, {results['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a small model, 2 repeats")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="draw a PNG bar chart here")
    p.add_argument("--hidden", type=int, default=None, help="default 2048 (--quick: 256)")
    p.add_argument("--layers", type=int, default=6)
    report.worker_args(p)
    p.add_argument("--disk-dir", default=None, help="where FileSystemWriter writes (default: the temp dir)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, os.path.dirname(HERE))
    from inmem_ft.launcher.simulated import SimulatedCluster

    repeats = 2 if args.quick else 5
    hidden = args.hidden or (256 if args.quick else 2048)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(tmp, "run"))
        result, disk = os.path.join(tmp, "result.json"), args.disk_dir or os.path.join(tmp, "disk")
        with SimulatedCluster(1, 2, "dcpbench", 8 << 30, os.path.join(tmp, "logs"),
                              env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}) as cluster, \
                report.phase(f"2 ranks: inmem_ft.dcp vs FileSystemWriter/Reader, {repeats} repeats"):
            attempt = cluster.run([os.path.abspath(__file__), "--worker", "--result", result, "--repeats",
                                   str(repeats), "--hidden", str(hidden), "--layers", str(args.layers),
                                   "--disk-dir", disk], timeout_s=1800, poll=report.echo_worker(cluster, "dcp"))
            if not attempt.ok:
                print(cluster.rank_log(attempt.number, attempt.first_failure or 0)[-3000:], file=sys.stderr)
                return 1
        with open(result) as f:
            results = json.load(f)
        if not args.disk_dir:
            shutil.rmtree(disk, ignore_errors=True)
    results["quick"] = args.quick
    results["ratio_blocking_vs_fs_async"] = results["inmem_blocking_s"] / results["fs_async_blocking_s"]
    results["ratio_blocking_vs_fs_save"] = results["inmem_blocking_s"] / results["fs_save_s"]
    results["ratio_restore_vs_fs_load"] = results["restore_step_s"] / results["fs_load_step_s"]
    print(f"{results['params'] / 1e6:.1f}M params + Adam, {results['ranks']} ranks, medians of {repeats}")
    for key in KEYS:
        print(f"  {key:<24} {results[key]:8.4f} s")
    for key in ("ratio_blocking_vs_fs_async", "ratio_blocking_vs_fs_save", "ratio_restore_vs_fs_load"):
        print(f"  {key:<28} {results[key]:8.3f}")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
