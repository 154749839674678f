"""Time lost to a killed rank: restarts started cold vs handed to warm standbys, side by side in one run.

    python benchmarks/time_lost.py [--quick] [--repeat N] [--json OUT] [--plot PNG]

The demo's job (a small GPT, DeepSpeed ZeRO-2, 2 simulated nodes x 2 ranks, a snapshot every 20 steps,
erasure-coded with m=1) runs under the supervisor of `inmem-ft launch`, and rank 3 is killed (-9) at step 110
(--quick: 60), once with every rank of the restart started cold (`--no-standby`) and once with the ranks
handed to warm standbys (the default). Each run reports the time from the kill to training back at the step it
had reached, split into detection, teardown, node replacement, process start and imports, rendezvous, setup,
restore and the steps computed again (inmem_ft/launcher/timelost.py: every figure from timestamps the run
recorded). With --repeat the modes alternate and the figures are medians. The ratio standby/cold of each part
is measured side by side; on a loaded machine only the ratios mean much.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # runs from a checkout without installing the package

from inmem_ft.launcher import scenario, timelost  # noqa: E402
from inmem_ft.launcher.supervisor import Failure  # noqa: E402

import report  # noqa: E402  benchmarks/report.py (the script's own folder is on sys.path)

MODES = ("cold", "standby")


def one_run(mode: str, kill: int, steps: int, work: str) -> dict:
    argv = ["-m", "inmem_ft.examples.deepspeed_gpt", "--zero-stage", "2", "--steps", str(steps), "--interval", "20"]
    timeline = scenario.run(2, 2, f"tl{mode}{os.getpid()}", 1 << 30, argv, [Failure("rank", kill, 3)], work,
                            compare=False, parity=1, standby=mode == "standby",
                            say=lambda line: report.say(f"  {mode}: {line}"))
    if not timeline.ok or len(timeline.time_lost) != 1:
        raise SystemExit(f"the {mode} run did not fail once and recover: see {work}")
    return timeline.time_lost[0]


def summary(splits: list[dict]) -> dict:
    """Median total and median of each part over the repeats of one mode (parts as the first run split them)."""
    parts = {}
    for p in splits[0]["parts"]:
        values = [next(q["seconds"] for q in s["parts"] if q["part"] == p["part"]) for s in splits]
        parts[p["part"]] = None if None in values else statistics.median(values)
    totals = [s["total_s"] for s in splits]
    return {"total_s": None if None in totals else statistics.median(totals), "parts": parts,
            "starts": [s["starts"] for s in splits], "steps_recomputed": [s["steps_recomputed"] for s in splits]}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    colors = plt.get_cmap("tab10").colors
    for row, mode in enumerate(MODES):
        left = 0.0
        for i, (part, seconds) in enumerate(results[mode]["parts"].items()):
            if seconds:
                ax.barh(row, seconds, left=left, color=colors[i % 10], label=part if row == 0 else None)
                left += seconds
        ax.text(left, row, f" {results[mode]['total_s'] or left:.1f} s", va="center")
    ax.set_yticks(range(len(MODES)), ["restart cold", "warm standbys"])
    ax.set_xlabel("seconds from the kill to training back at the step it had reached")
    ax.set_title(f"kill -9 rank 3 at step {results['kill_step']}, DeepSpeed ZeRO-2 GPT, 2 nodes x 2 ranks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="kill at step 60 instead of 110")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode, alternating (default: 1)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw a PNG of the split here")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    kill = 60 if args.quick else 110
    splits = report.alternating(MODES, args.repeat, lambda mode, i, work: one_run(mode, kill, kill + 10, work),
                                label=lambda mode: f"restart {mode}")
    results = {"machine": report.machine(), "kill_step": kill, "repeat": args.repeat, "runs": splits,
               **{mode: summary(splits[mode]) for mode in MODES}}
    cold, warm = results["cold"], results["standby"]
    results["ratio_standby_to_cold"] = {
        "total": warm["total_s"] / cold["total_s"] if warm["total_s"] and cold["total_s"] else None,
        **{part: (warm["parts"].get(part) / s if s and warm["parts"].get(part) is not None else None)
           for part, s in cold["parts"].items()}}
    print(f"time lost to kill -9 rank 3 at step {kill} (s; medians of {args.repeat}):")
    print(timelost.table([{**splits[mode][0], "failure": f"restart {mode}", "total_s": results[mode]["total_s"],
                           "parts": [{"part": k, "seconds": v} for k, v in results[mode]["parts"].items()]}
                          for mode in MODES]))
    ratio = results["ratio_standby_to_cold"]
    print("standby / cold: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items() if v is not None))
    print(f"ranks of each restart: cold {cold['starts']}, standby {warm['starts']}; {results['machine']}")
    report.write(results, args.json, plot, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
