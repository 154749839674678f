"""Time lost to a killed rank under the shipped launch script: `inmem-ft run` (torch's agent with inmem_ft's)
vs plain `torchrun --max-restarts`, side by side.

    python benchmarks/agent_time_lost.py [--repeat N] [--steps S] [--json OUT]

One node, 2 ranks of the plain PyTorch example (a snapshot every 3 steps), launched by
launch_scripts/torchrun_inmem.sh with INMEM_FT_AGENT=inmem and =torchrun; rank 1 kills itself (-9) after step
7. Both are measured alike from the loss log: from the first record of step 7 to its record again after the
restart (the ranks resume from step 6, so that includes one step computed again). Runs with `inmem-ft run` also
give the agent's own split (its time_lost.json). With --repeat the modes alternate and the figures are medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # runs from a checkout without installing the package

from inmem_ft.launcher.ports import free_port  # noqa: E402
from inmem_ft.smp.segments import names_with_prefix, unlink  # noqa: E402

import report  # noqa: E402  benchmarks/report.py

MODES = ("torchrun", "inmem")
DIE_AT = 7
SCRIPT = os.path.join(ROOT, "inmem_ft", "launch_scripts", "torchrun_inmem.sh")


def one_run(mode: str, steps: int, work: str) -> dict:
    job = f"b{uuid.uuid4().hex[:10]}"
    os.makedirs(work, exist_ok=True)
    loss_log = os.path.join(work, "loss.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_"))}
    env.update({"PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), "PYTHONPATH": ROOT,
                "OMP_NUM_THREADS": "1", "INMEM_FT_JOB": job, "INMEM_FT_MEMORY_BUDGET": "64MiB", "NNODES": "1",
                "NODE_RANK": "0", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()), "INMEM_FT_AGENT": mode,
                "INMEM_FT_WIPE_ON_EXIT": "1", "PYTHON": sys.executable})
    argv = ["-m", "inmem_ft.examples.plain_pytorch", "--steps", str(steps), "--interval", "3", "--die-at",
            str(DIE_AT), "--die-rank", "1", "--loss-log", loss_log]
    try:
        proc = subprocess.run(["bash", SCRIPT, *argv], env=env, cwd=work, capture_output=True, text=True,
                              timeout=600)
    finally:
        for seg in names_with_prefix(f"inmemft.{job}."):
            unlink(seg)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    times = [rec["time"] for rec in map(json.loads, open(loss_log)) if rec["step"] == DIE_AT]
    if len(times) != 2:
        raise SystemExit(f"the {mode} run did not run step {DIE_AT} twice: see {loss_log}")
    out = {"loss_log_s": times[1] - times[0]}
    split_file = os.path.join(os.environ["INMEM_FT_RUNTIME_DIR"], job, "agent-node0", "time_lost.json")
    if mode == "inmem":
        with open(split_file) as f:
            [split] = json.load(f)
        out["agent_split"] = {"total_s": split["total_s"], **{p["part"]: p["seconds"] for p in split["parts"]}}
    return out


def plot(results: dict, path: str) -> None:
    """Each run's seconds per launcher, and the agent's split (medians) as one stacked bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (runs, split) = plt.subplots(1, 2, figsize=(10, 3), gridspec_kw={"width_ratios": [1, 2]})
    for row, mode in enumerate(results["runs"]):
        seconds = [r["loss_log_s"] for r in results["runs"][mode]]
        runs.plot(seconds, [row] * len(seconds), "o", alpha=0.7)
        runs.plot([results["median_loss_log_s"][mode]], [row], "k|", markersize=20)
    runs.set_yticks(range(len(results["runs"])), list(results["runs"]))
    runs.set_xlabel("s from step 7 to step 7 again")
    colors, left = plt.get_cmap("tab10").colors, 0.0
    parts = {k: v for k, v in results["median_agent_split"].items() if k != "total_s"}
    for i, (part, seconds) in enumerate(parts.items()):
        split.barh(0, seconds, left=left, color=colors[i % 10], label=part)
        left += seconds
    split.set_yticks([])
    split.set_xlabel("inmem-ft run's split of the time lost (medians, s)")
    split.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs per mode, alternating (default: 3)")
    p.add_argument("--steps", type=int, default=12, help="steps of each run (default: 12)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    runs = report.alternating(MODES, args.repeat, lambda mode, i, work: one_run(mode, args.steps, work),
                              label=lambda mode: f"{mode}, kill -9 rank 1 after step {DIE_AT}")
    results = {"repeat": args.repeat, "runs": runs,
               "median_loss_log_s": {m: statistics.median(r["loss_log_s"] for r in runs[m]) for m in MODES}}
    splits = [r["agent_split"] for r in runs["inmem"]]
    results["median_agent_split"] = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    print(f"seconds from step {DIE_AT} in the loss log to step {DIE_AT} again (medians of {args.repeat}):")
    for mode in MODES:
        print(f"  {mode:<9} {results['median_loss_log_s'][mode]:.2f}")
    print("inmem-ft run's own split (medians): " + ", ".join(f"{k} {v:.3f}"
                                                           for k, v in results["median_agent_split"].items()))
    print(report.machine())
    report.write(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
