"""Megatron checkpoint stall: inmem_ft's snapshot vs Megatron's own torch_dist save, sync and async.

    python benchmarks/megatron_save.py --quick --json out/megatron.json [--plot out/megatron.png]

One GPT (Megatron-Core 0.19.2's pretrain loop, inmem_ft/examples/megatron_gpt.py; on CPU through the test
shim) on 2 ranks at TP=2, in one run. At each of `repeats` save points of the same training run, on the
same state, in this order (so that our copy overlaps the next forward/backward, as in production):
  torch_dist_sync_s        save_checkpoint_and_time(...) with the torch_dist format, --async-save off
  torch_dist_async_s       the same with --async-save (mcore strategy, a forked worker per save): the call
  torch_dist_async_total_s ... plus the wait until Megatron finalizes it
  inmem_blocking_s         Megatron's non-persistent save call, which --inmem-ft routes to the adapter
                           (Megatron's functions build the tensor-aware state dict; our manager starts the
                           copy; patch.snapshot_without_save_checkpoint) plus the training thread's time
                           in Snapshotter.fence/wait until the next save point (the fence before the next
                           optimizer step; Megatron's finalize of the async request)
  inmem_snapshotter_s      ... of which inmem_ft's own part (Snapshotter.save plus those waits); the rest is
                           Megatron building the state dict
Then, in a fresh launch (the same SMP): restore_s (the snapshot back from memory and loaded by Megatron,
by phase: agreement, checksums, Megatron's load) and the first training iteration after it
(first_step_after_restore_s: the copy-out of the optimizer state Megatron kept as views of the slots runs
behind its forward/backward, and its optimizer step waits for what is left); in another fresh launch, without
--inmem-ft: disk_load_s (Megatron's load_checkpoint of the torch_dist checkpoint under --load, barrier to
barrier; page cache, no fsync) and its first iteration. The headline, restore_then_step_vs_disk, is restart to
first step done: restore + first iteration against disk load + first iteration. In a last launch that loads
nothing, first_step_cold_s, for reference: a new process's first iteration (a load's first iteration differs
from it by what the load leaves it, such as Adam's moments already there or work still behind it).
Every figure is the slowest rank's: the saves' medians over the repeats, the loads' over three fresh launches of
each kind, alternating (restore, disk, nothing loaded).
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
ROOT = os.path.dirname(HERE)
KEYS = ("inmem_blocking_s", "torch_dist_sync_s", "torch_dist_async_s", "torch_dist_async_total_s")
BREAKDOWN = ("inmem_snapshotter_s",)


# ---------------------------------------------------------------------------------------------------------
# Worker side (one rank process, under SimulatedCluster)
# ---------------------------------------------------------------------------------------------------------

def worker(phase: str, out: str, ckpt: str, megatron_argv: list[str]) -> None:
    sys.path.insert(0, ROOT)
    from inmem_ft.examples import megatron_gpt as example

    args, cfg, handle, _ = example.prepare(megatron_argv)
    # validate_args allows --async-save only with the persistent worker, a process spawned without the CPU
    # shim that hangs here; a forked worker per save (Megatron's other mcore caller) runs on CPU.
    args.use_persistent_ckpt_worker = False
    import torch.distributed as dist
    from megatron.training import training
    from megatron.training.async_utils import maybe_finalize_async_save

    rows = []
    if phase == "save":
        from inmem_ft.capture import Snapshotter

        stock = training.save_checkpoint_and_time
        # The training thread's time in Snapshotter.fence/wait outside the save calls, charged to the last
        # save, until the last iteration is logged (pretrain's end then waits for the last commit).
        waits = {"s": 0.0, "depth": 0, "on": False}

        def charged(method):
            def timed_wait(self, *a, **kw):
                waits["depth"] += 1
                t0 = time.perf_counter()
                try:
                    return method(self, *a, **kw)
                finally:
                    waits["depth"] -= 1
                    if waits["depth"] == 0 and waits["on"]:
                        waits["s"] += time.perf_counter() - t0
            return timed_wait

        Snapshotter.fence, Snapshotter.wait = charged(Snapshotter.fence), charged(Snapshotter.wait)
        log = training.training_log

        def training_log(*a, **kw):
            if a[3] == args.train_iters:  # iteration
                waits["on"] = False
            return log(*a, **kw)

        training.training_log = training_log

        def timed(*a, **kw):
            dist.barrier()  # the ranks start together: no rank's time includes waiting for another to arrive
            t0 = time.perf_counter()
            stock(*a, **kw)
            return time.perf_counter() - t0

        def save_and_time(iteration, model, optimizer, scheduler, flops, context, non_persistent_ckpt=False,
                          train_data_iterator=None):
            if not non_persistent_ckpt:
                return stock(iteration, model, optimizer, scheduler, flops, context, False, train_data_iterator)
            waits["on"] = False
            if rows:
                rows[-1]["inmem_after_s"] = waits["s"]
            row = {"iteration": iteration}
            saved = (args.save, args.async_save)
            for mode, is_async in (("sync", False), ("async", True)):
                args.save, args.async_save = os.path.join(ckpt, mode), is_async
                row[f"torch_dist_{mode}_s"] = timed(iteration, model, optimizer, scheduler, flops, context,
                                                   False, train_data_iterator)
                if is_async:
                    t0 = time.perf_counter()
                    maybe_finalize_async_save(blocking=True)
                    row["torch_dist_async_total_s"] = row["torch_dist_async_s"] + time.perf_counter() - t0
            args.save, args.async_save = saved
            row["inmem_call_s"] = timed(iteration, model, optimizer, scheduler, flops, context, True,
                                        train_data_iterator)
            row["stall_at_call_s"] = handle.snap.metrics.last_stall_s
            rows.append(row)
            waits["s"], waits["on"] = 0.0, True

        training.save_checkpoint_and_time = save_and_time
        example.run(cfg)
        handle.wait()
        rows[-1]["inmem_after_s"] = waits["s"]
        for row in rows:
            row["inmem_blocking_s"] = row["inmem_call_s"] + row["inmem_after_s"]
            row["inmem_snapshotter_s"] = row["stall_at_call_s"] + row["inmem_after_s"]
        result = {"rows": rows, "bytes": handle.snap.metrics.last_bytes}
    elif phase == "load":
        result = {}
        training.train = first_step(training.train, args, result)
        example.run(cfg)
        result["restore_s"] = handle.restored.seconds if handle.restored else None
        result["restore_phases"] = handle.restored.phases if handle.restored else {}
        if result["restore_s"] is not None:
            result["restore_then_step_s"] = result["restore_s"] + result["first_step_s"]
    elif phase == "cold":  # a launch that loads nothing: the first iteration either restart pays anyway
        result = {}
        training.train = first_step(training.train, args, result)
        example.run(cfg)
    else:  # "disk": a restart that loads the torch_dist checkpoint (--load), timed as Megatron runs it
        stock = training.load_checkpoint

        def timed_load(*a, **kw):
            dist.barrier()
            t0 = time.perf_counter()
            out = stock(*a, **kw)
            dist.barrier()
            result["disk_load_s"] = time.perf_counter() - t0
            return out

        result = {}
        training.load_checkpoint = timed_load
        training.train = first_step(training.train, args, result)
        example.run(cfg)
        result["disk_then_step_s"] = result["disk_load_s"] + result["first_step_s"]
    if handle is not None:
        handle.close()
    with open(f"{out}.rank{dist.get_rank() if dist.is_initialized() else 0}.json", "w") as f:
        json.dump(result, f)


def first_step(train, args, result: dict):
    """Megatron's train() cut to the one iteration after the load, timed into result["first_step_s"]: the
    restore's work behind the first forward/backward (the copy-out of the optimizer state Megatron kept as
    views of the slots) and the optimizer step's wait for it at the fence are in it, as a user feels them."""
    def timed(*a, **kw):
        import torch.distributed as dist

        args.train_iters = args.iteration + 1
        dist.barrier()
        t0 = time.perf_counter()
        out = train(*a, **kw)
        result["first_step_s"] = time.perf_counter() - t0
        return out
    return timed


# ---------------------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------------------

def model_argv(opts, phase: str, ckpt: str) -> list[str]:
    iters = opts.warmup + opts.repeats * opts.interval + 1  # + 1: an optimizer step (and its fence) after each
    inmem = ["--inmem-ft", "--inmem-ft-interval", str(opts.interval), "--inmem-ft-job", opts.job]
    return ["--tensor-model-parallel-size", "2", "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
            "--num-attention-heads", "8", "--seq-length", "128", "--max-position-embeddings", "128",
            "--vocab-size", "1024", "--train-iters", str(iters), "--save-interval", "1000000",
            "--ckpt-assume-constant-structure",  # both kinds of save reuse their plan across saves
            "--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore",
            *(["--load", os.path.join(ckpt, "sync")] if phase == "disk" else [] if phase == "cold" else inmem)]


# The restore's phases (RestoreInfo.phases and the adapter's) under the names an operator asks about.
RESTORE_PHASES = [("agreement", ("list", "agree", "pull")),
                  ("checksums (of the slot where it lies)", ("verify", "copy_verify")),
                  ("data-parallel shares", ("replicated",)), ("unpack", ("unpack",)),
                  ("Megatron's load_checkpoint of it (reads the slot)", ("megatron_load",))]
SETUP = ("snapshotter", "layout")  # before restore_s starts
LOAD_REPEATS = 3  # fresh launches of each kind of load, alternating; the figures are their medians
# Per kind of launch: the worker's figure -> the result's name for its median.
LOAD_KEYS = {"load": {"restore_s": "restore_s", "restore_then_step_s": "restore_then_step_s",
                      "first_step_s": "first_step_after_restore_s"},
             "disk": {"disk_load_s": "disk_load_s", "disk_then_step_s": "disk_then_step_s",
                      "first_step_s": "first_step_after_disk_load_s"},
             "cold": {"first_step_s": "first_step_cold_s"}}


def phase_groups(phases: dict) -> dict:
    return {label: round(sum(phases.get(p, 0.0) for p in names), 4) for label, names in RESTORE_PHASES}


def slowest(per_rank: list[dict], key: str):
    values = [r[key] for r in per_rank if r.get(key) is not None]
    return max(values) if values else None


def orchestrate(opts) -> dict:
    from inmem_ft.launcher.simulated import SimulatedCluster

    work = tempfile.mkdtemp(prefix="inmem_ft-megatron-bench-")
    os.environ["INMEM_FT_RUNTIME_DIR"] = os.path.join(work, "run")
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    results = {"model": {"layers": opts.layers, "hidden": opts.hidden, "tp": 2, "ranks": 2}, "repeats": opts.repeats}
    try:
        with SimulatedCluster(1, 2, opts.job, opts.budget, os.path.join(work, "logs")) as cluster:
            # Each load in a fresh launch of its own: in one process the second would find Megatron's code
            # paths warm and its optimizer state allocated (init_state_fn skips a non-empty state).
            runs = {"load": [], "disk": [], "cold": []}  # per fresh launch: the slowest rank's figures
            for phase in ("save", *("load", "disk", "cold") * LOAD_REPEATS):
                ckpt = os.path.join(work, "ckpt")
                argv = [os.path.abspath(__file__), "--worker", phase, os.path.join(work, phase), ckpt,
                        *model_argv(opts, phase, ckpt)]
                attempt = cluster.run(argv, timeout_s=1800)
                if not attempt.ok:
                    sys.exit(f"the {phase} phase failed:\n{cluster.rank_log(attempt.number, attempt.first_failure)[-4000:]}")
                per_rank = []
                for rank in range(2):
                    with open(os.path.join(work, f"{phase}.rank{rank}.json")) as f:
                        per_rank.append(json.load(f))
                if phase == "save":
                    rows = list(zip(*(r["rows"] for r in per_rank)))[1:]  # the first is the warm-up save
                    for key in KEYS + BREAKDOWN:
                        results[key] = statistics.median(max(row[key] for row in ranks) for ranks in rows)
                    results["bytes_per_rank"] = max(r["bytes"] for r in per_rank)
                    continue
                run = {key: slowest(per_rank, key) for key in LOAD_KEYS[phase]}
                ranks = [r for r in per_rank if r.get("restore_s") is not None]
                if ranks:  # the slowest rank's phases, so that they add up to its restore_s
                    worst = max(ranks, key=lambda r: r["restore_s"])
                    run["restore_phases"] = phase_groups(worst["restore_phases"])
                    run["setup_s"] = {k: worst["restore_phases"].get(k) for k in SETUP}
                runs[phase].append(run)
            for phase, got in runs.items():
                for key, name in LOAD_KEYS[phase].items():
                    values = [run[key] for run in got if run.get(key) is not None]
                    results[name] = statistics.median(values) if values else None
                    results[name.removesuffix("_s") + "_runs"] = values
            mine = sorted([run for run in runs["load"] if run.get("restore_s") is not None], key=lambda r: r["restore_s"])
            if mine:  # the breakdown of the run whose restore was the median one
                results["restore_phases"] = mine[(len(mine) - 1) // 2]["restore_phases"]
                results["setup_s"] = mine[(len(mine) - 1) // 2]["setup_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["blocked_vs_sync"] = results["inmem_blocking_s"] / results["torch_dist_sync_s"]
    results["restore_vs_disk_load"] = results["restore_s"] / results["disk_load_s"]
    results["restore_then_step_vs_disk"] = results["restore_then_step_s"] / results["disk_then_step_s"]
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = ["inmem_ft", "torch_dist sync", "torch_dist async\n(call)", "torch_dist async\n(until written,\nnot blocking)"]
    values = [results[k] for k in KEYS]
    a.bar(names, values, color=["#2a7", "#c55", "#d98", "#eb9"])
    a.set_ylabel("training blocked per save (s)")
    a.set_title(f"Megatron GPT, {results['model']['layers']}x{results['model']['hidden']}, TP=2")
    for i, v in enumerate(values):
        a.annotate(f"{v:.3f}", (i, v), ha="center", va="bottom", fontsize=8)
    a.tick_params(axis="x", labelsize=8)
    names = ["inmem_ft restore\n(memory)", "Megatron load\n(torch_dist, disk)"]
    theirs = results.get("restore_phases", {}).get(RESTORE_PHASES[-1][0], 0.0)
    b.bar(names, [results["restore_s"] - theirs, results["disk_load_s"]], color=["#2a7", "#c55"])
    b.bar(names[:1], [theirs], bottom=[results["restore_s"] - theirs], color="#9db",
          label="of which Megatron's load_checkpoint of it")
    b.legend(fontsize=8, loc="upper left")
    b.set_ylabel("seconds")
    b.set_title("restore after a restart")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer repeats")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    opts = p.parse_args()
    opts.layers = opts.layers or (4 if opts.quick else 6)
    opts.hidden = opts.hidden or (256 if opts.quick else 512)
    opts.repeats = opts.repeats or (3 if opts.quick else 5)
    opts.warmup, opts.interval = 2, 2  # the save at iteration 2 warms up and is dropped
    opts.budget, opts.job = 4 << 30, f"mbench{os.getpid()}"
    results = orchestrate(opts)
    print(f"{'':28}{'seconds':>10}")
    for key in (*KEYS, *BREAKDOWN, "restore_s", "disk_load_s", "first_step_after_restore_s",
                "first_step_after_disk_load_s", "first_step_cold_s", "restore_then_step_s", "disk_then_step_s"):
        print(f"{key:28}{results[key]:>10.4f}")
    print(f"restart to first step done, restore + first step / torch_dist load + first step: "
          f"{results['restore_then_step_vs_disk']:.3f}")
    print(f"inmem blocked / torch_dist sync save: {results['blocked_vs_sync']:.3f}")
    print(f"restore from memory / torch_dist load from disk: {results['restore_vs_disk_load']:.3f}")
    print("restore_s of the slowest rank, by phase:")
    for label, seconds in results.get("restore_phases", {}).items():
        print(f"  {label:<58}{seconds:>8.4f}")
    print("  (after it, in the first step: the copy-out of the optimizer's kept views, behind the first "
          "forward/backward, and the optimizer step's wait for it)")
    setup = ", ".join(f"{k} {v:.4f} s" for k, v in results.get("setup_s", {}).items())
    print(f"  (before it, not in restore_s: {setup}: connecting to the SMP and creating the snapshot's gloo group, "
          f"which every run with --inmem-ft pays)")
    report.write(results, opts.json, plot, opts.plot)


if __name__ == "__main__":
    main()
