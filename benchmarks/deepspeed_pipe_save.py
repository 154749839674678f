"""DeepSpeed pipeline checkpoint stall: inmem_ft's snapshot vs the stock engine's save_checkpoint, on the same
PipelineEngine at PP2 x DP2, in one run.

    python benchmarks/deepspeed_pipe_save.py --quick --json out/pipe.json [--plot out/pipe.png]

A PipelineModule of `--layers` x (hidden x 2*hidden + 2*hidden x hidden) Linear layers (6 x 2048: 100.7M
parameters, as benchmarks/deepspeed_save.py's model) in fp32 with AdamW, ZeRO-1, trained by DeepSpeed's pipeline
engine on 4 ranks (2 simulated nodes of 2; gloo, CPU, DS_ACCELERATOR=cpu), 2 stages x 2 data-parallel replicas.
On the same engine, alternating:
  inmem_blocking_s    how long training waits for one snapshot: the handle.snapshot() call plus the wait, at the
                      next train_batch()'s fence before its optimizer step, for the copy that ran behind that
                      batch's forward/backward
  torch_engine_s      engine.save_checkpoint(local dir) with DeepSpeed's default TorchCheckpointEngine (one file
                      per layer, one model-states file per stage, the ZeRO-1 optimizer partitions)
  ratio_vs_torch_engine   inmem_blocking_s / torch_engine_s (goal <= 0.02)
Medians over the repeats; every figure is the slowest rank's. Local disk = the page cache (no fsync).
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
from deepspeed_save import MICRO_BATCH, ds_config, load_adapter, setup_worker, slowest

HERE = os.path.dirname(os.path.abspath(__file__))
NODES, RANKS_PER_NODE, STAGES = 2, 2, 2
ROWS = [("inmem_blocking_s", "inmem_ft: training blocked (snapshot call + wait at the next step's fence)"),
        ("inmem_save_call_s", "  of which: handle.snapshot() call"),
        ("torch_engine_s", "DeepSpeed TorchCheckpointEngine save_checkpoint"),
        ("inmem_commit_s", "inmem_ft commit behind training (copy, checksums, agreement)"),
        ("step_s", "train_batch() time, no snapshots"),
        ("ratio_vs_torch_engine", "inmem_blocking_s / torch_engine_s (goal <= 0.02)")]


# ---------------------------------------------------------------------------------------------------------
# Worker side (one rank process)
# ---------------------------------------------------------------------------------------------------------

def build_engine(args):
    import torch
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(torch.nn.Linear, *dims) for _ in range(args.layers)
             for dims in ((args.hidden, 2 * args.hidden), (2 * args.hidden, args.hidden))]
    torch.manual_seed(0)
    model = PipelineModule(specs, num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(1, interval=10**9))
    return engine


def batches(hidden: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(MICRO_BATCH, hidden, generator=g), torch.randn(MICRO_BATCH, hidden, generator=g)


def train_batch(engine, data) -> float:
    t0 = time.perf_counter()
    engine.train_batch(data)
    return time.perf_counter() - t0


def worker(args) -> None:
    setup_worker()
    import torch.distributed as dist

    adapter, why = load_adapter()
    if adapter is None:
        raise SystemExit(why)
    engine = build_engine(args)
    rank = dist.get_rank()
    data = batches(args.hidden, engine.grid.data_parallel_id)
    mine = sum(p.numel() for p in engine.module.parameters())  # this stage's: its replicas hold the same
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, (engine.stage_id, mine))
    res = {"params": sum(dict(stages).values()), "ranks": dist.get_world_size(), "pp": STAGES,
           "dp": dist.get_world_size() // STAGES, "zero_stage": 1}
    handle = adapter.install(engine)
    assert handle is not None and handle.restored is None, "install() restored or returned None"
    for _ in range(args.warmup):
        train_batch(engine, data)
    res["step_s"] = slowest(statistics.median(train_batch(engine, data) for _ in range(args.base_steps)))
    handle.snapshot()  # the first one reserves and faults in the SMP's slots, as at job start
    train_batch(engine, data)
    handle.wait()
    disk = os.path.join(args.disk_dir, "pipe")
    stalls, calls, commits, saves = [], [], [], []
    metrics = handle.snap.metrics
    for i in range(args.repeats):
        if rank == 0:
            report.progress(f"repeat {i + 1}/{args.repeats}")
        dist.barrier()
        t0 = time.perf_counter()
        handle.snapshot()
        call = time.perf_counter() - t0
        at_call = metrics.stalls_s[-1]
        train_batch(engine, data)  # its fence, before the optimizer step, waits for what is left of the copy
        stalls.append(call + metrics.stalls_s[-1] - at_call)
        calls.append(call)
        handle.wait()
        commits.append(metrics.last_commit_s)
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(disk, tag=f"r{i}")  # the handle hands the user's own saves to DeepSpeed's engine
        saves.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(disk, f"r{i}"), ignore_errors=True)
    res["inmem_blocking_s"] = slowest(statistics.median(stalls))
    res["inmem_save_call_s"] = slowest(statistics.median(calls))
    res["inmem_commit_s"] = slowest(statistics.median(commits))
    res["torch_engine_s"] = slowest(statistics.median(saves))
    res["ratio_vs_torch_engine"] = res["inmem_blocking_s"] / res["torch_engine_s"]
    handle.close()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------

def fmt(v, key: str) -> str:
    if v is None:
        return "missing"
    return f"{v:.3f}" if key.startswith("ratio") else f"{v:.3f} s"


def print_table(results: dict) -> None:
    print(f"{results['params'] / 1e6:.1f}M params fp32 + AdamW, ZeRO-1, PP{results['pp']} x DP{results['dp']} "
          f"({results['ranks']} ranks, gloo, CPU), medians of {results['repeats']}, slowest rank"
          + (" [--quick]" if results["quick"] else ""))
    for key, label in ROWS:
        print(f"  {key:<24} {label:<76} {fmt(results.get(key), key):>10}")


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["inmem_blocking_s", "torch_engine_s"]
    labels = ["inmem_ft\nsnapshot (blocking)", "DeepSpeed\nsave_checkpoint"]
    fig, ax = plt.subplots(figsize=(5, 4))
    vals = [results.get(k) for k in keys]
    bars = ax.bar(range(len(keys)), [v or 0 for v in vals], 0.6, color=["#2a7", "#c55"], edgecolor="black",
                  linewidth=0.5)
    ax.bar_label(bars, labels=[fmt(v, k) for v, k in zip(vals, keys)], fontsize=8, padding=2)
    ax.set_xticks(range(len(keys)), labels)
    ax.set_ylabel("seconds training is blocked")
    ratio = results.get("ratio_vs_torch_engine")
    ax.set_title(f"DeepSpeed pipeline PP{results['pp']} x DP{results['dp']}, {results['params'] / 1e6:.0f}M params, "
                 f"CPU" + (f"\nratio {ratio:.3f}" if ratio is not None else ""), fontsize=9)
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw a PNG bar chart here")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6, help="6 x (2048x4096 + 4096x2048) = 100.7M parameters")
    p.add_argument("--disk-dir", default=None, help="where DeepSpeed's engine writes (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    for a in ("--repeats", "--warmup", "--base-steps"):
        p.add_argument(a, type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, os.path.dirname(HERE))
    from inmem_ft.launcher.simulated import SimulatedCluster

    counts = {"repeats": 3 if args.quick else 5, "warmup": 1 if args.quick else 2, "base_steps": 3 if args.quick else 5}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("INMEM_FT_RUNTIME_DIR", os.path.join(tmp, "run"))
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE), "DS_ACCELERATOR": "cpu"}
        result = os.path.join(tmp, "pipe.json")
        argv = [os.path.abspath(__file__), "--worker", "--result", result, "--hidden", str(args.hidden),
                "--layers", str(args.layers), "--disk-dir", args.disk_dir or os.path.join(tmp, "disk")]
        argv += [x for k, v in counts.items() for x in ("--" + k.replace("_", "-"), str(v))]
        with SimulatedCluster(NODES, RANKS_PER_NODE, f"dspipebench-{os.getpid()}", 4 << 30,
                              os.path.join(tmp, "logs"), env=env) as cluster:
            with report.phase(f"PP{STAGES} x DP{NODES * RANKS_PER_NODE // STAGES}: inmem_ft snapshots and DeepSpeed's "
                              f"save_checkpoint, alternating"):
                attempt = cluster.run(argv, timeout_s=1800, poll=report.echo_worker(cluster, "pipeline"))
            if not attempt.ok:
                print(cluster.rank_log(attempt.number, attempt.first_failure or 0)[-4000:], file=sys.stderr)
                return 1
        with open(result) as f:
            results = {"quick": args.quick, "repeats": counts["repeats"], **json.load(f)}
    results["wall_s"] = time.monotonic() - t_start
    print_table(results)
    print(f"  total wall time {results['wall_s']:.0f} s")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
