"""What the disk tier costs the trainer: step time with it off and on, before (the trainer's commit thread
wrote it) and after (the SMP's writer thread writes it from shared memory), side by side in one run.

    python benchmarks/disk_tier.py --before /path/to/checkout-with-the-trainer-side-tier --json out/disk.json \
        [--plot out/disk.png]

`--before`: a checkout of inmem_ft from before the disk tier moved into the SMP (e.g. `git worktree add
/tmp/before 5410583`); its trainers and SMPs run the `before_*` modes. Each mode is one run of the DeepSpeed
example (ZeRO-2, fp32, 1 node x 2 ranks, a snapshot every `--interval` steps, with the tier on a flush of
every snapshot); the figure is the median step time over the steps after the first `--warmup`, from rank 0's
loss log. Modes alternate within each repeat so that the machine's load hits them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import report  # noqa: E402  benchmarks/report.py (the script's own folder is on sys.path)
from inmem_ft.launcher.simulated import SimulatedCluster  # noqa: E402
from inmem_ft.telemetry import Tail  # noqa: E402

MODES = ["before_off", "before_on", "after_off", "after_on"]


def one_run(mode: str, args, tmp: str) -> dict:
    tree = args.before if mode.startswith("before") else ROOT
    disk = os.path.join(tmp, "disk")
    argv = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", str(args.steps),
            "--interval", str(args.interval), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--loss-log", os.path.join(tmp, "loss.jsonl")]
    smp_args = []
    if mode == "before_on":  # the trainers flush, from their commit thread
        argv += ["--persist-dir", disk, "--persist-every-steps", "1"]
    elif mode == "after_on":  # the SMP flushes, from its writer thread
        smp_args = ["--persist-dir", disk, "--persist-every-steps", str(args.interval)]
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": tree}
    job = f"disk{mode.replace('_', '')}{os.getpid()}"
    here = os.getcwd()
    os.chdir(tree)  # `python -m` puts the working directory first on sys.path, before PYTHONPATH
    try:
        with SimulatedCluster(1, 2, job, 1 << 30, os.path.join(tmp, "logs"), env=env, smp_args=smp_args) as cluster:
            attempt = cluster.run(argv, timeout_s=1800)
            if not attempt.ok:
                raise RuntimeError(f"{mode}: the run failed: {cluster.rank_log(attempt.number, 0)[-3000:]}")
            smp_log = open(cluster.smp_log(0)).read()
    finally:
        os.chdir(here)
    times = {r["step"]: r["time"] for r in Tail(os.path.join(tmp, "loss.jsonl")).records()}
    steps = sorted(times)[args.warmup:]
    step_s = [times[s] - times[s - 1] for s in steps if s - 1 in times]
    flushed = smp_log.count("event=flushed") if mode == "after_on" else None
    files = sum(len(f) for _, _, f in os.walk(disk)) if mode.endswith("_on") else 0
    return {"mode": mode, "step_s": statistics.median(step_s), "mean_step_s": statistics.fmean(step_s),
            "steps_timed": len(step_s), "smp_flushes": flushed, "files_on_disk": files}


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = [results[m]["step_s"] for m in MODES]
    ax.bar(MODES, values, color=["#999", "#c44", "#999", "#4a4"])
    ax.set_ylabel("median step time (s)")
    ax.set_title("trainer step time, disk tier off/on: trainer-side (before) vs SMP-side (after)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="a checkout with the trainer-side disk tier")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=6, help="steps left out of the timing")
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    runs = report.alternating(MODES, args.repeat, lambda mode, i, work: one_run(mode, args, work))
    results = {"machine": report.machine(), "args": vars(args), "runs": runs,
               **{m: {"step_s": statistics.median(r["step_s"] for r in runs[m])} for m in MODES}}
    results["before_on_over_off"] = results["before_on"]["step_s"] / results["before_off"]["step_s"]
    results["after_on_over_off"] = results["after_on"]["step_s"] / results["after_off"]["step_s"]
    print("\n".join(report.table(f"median trainer step time, s ({args.repeat} run(s) each)",
                                 [("mode", "{mode}"), ("step_s", "{step_s:.4f}"), ("mean_s", "{mean_step_s:.4f}"),
                                  ("smp flushes", "{smp_flushes}"), ("files", "{files_on_disk}")],
                                 [r for m in MODES for r in runs[m]])))
    print(f"disk tier on / off: before (trainer writes) {results['before_on_over_off']:.2f}x, after (SMP writes) "
          f"{results['after_on_over_off']:.2f}x; {results['machine']}")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
