"""`inmem-ft launch` and the demo: an uninterrupted reference run, then the same run with failures
injected and recovered, then the timeline, the verdict and a plot."""
from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
from dataclasses import asdict
from typing import Callable

from .. import telemetry
from ..errors import InmemFTError
from ..smp import inventory
from ..agent import timelost
from .simulated import SimulatedCluster
from .supervisor import Failure, Supervisor, Timeline

# What a run writes into its work folder; a new run removes exactly these, so nothing of an earlier run
# (heartbeats, losses, logs) can leak into its timeline, and nothing else in the folder is touched.
RUN_OUTPUTS = ("agents", "loss.jsonl", "reference-loss.jsonl", "logs", "reference", "timeline.json")
PROGRESS_EVERY_S = 15.0


def clear_work_dir(work_dir: str) -> None:
    os.makedirs(work_dir, exist_ok=True)
    for pattern in RUN_OUTPUTS:
        for path in glob.glob(os.path.join(work_dir, pattern)):
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


def wipe_job(job: str, nodes: int) -> None:
    """Drop segments an earlier, interrupted run of the same job id left in /dev/shm: a launch starts a
    fresh job, and its SMPs would otherwise adopt them and restore steps this run never took."""
    for node in range(nodes):
        inventory.remove(job, node)


def reference_losses(nodes: int, ranks_per_node: int, job: str, budget: int, argv: list[str],
                     work_dir: str, say: Callable[[str], None]) -> dict[int, float]:
    """Losses of the same command run once without failures, in a job of its own."""
    log = os.path.join(work_dir, "reference-loss.jsonl")
    wipe_job(f"{job}-ref", nodes)
    say("reference run (no failures) started")
    next_note = [PROGRESS_EVERY_S]

    def progress(seconds: float) -> None:
        if seconds >= next_note[0]:
            next_note[0] = seconds + PROGRESS_EVERY_S
            say(f"reference run at step {max(telemetry.read_losses(log), default=0)} after {seconds:.0f} s")

    with SimulatedCluster(nodes, ranks_per_node, f"{job}-ref", budget, os.path.join(work_dir, "reference")) as c:
        attempt = c.run(argv, {telemetry.LOSS_LOG: log}, poll=progress)
        if not attempt.ok:
            raise InmemFTError(f"the reference run (no failures injected) failed: rank {attempt.first_failure} "
                               f"exited with {attempt.returncodes[attempt.first_failure]}; see "
                               f"{c.log_dir}/attempt1-rank{attempt.first_failure}.log")
    say(f"reference run finished in {attempt.seconds:.0f} s")
    return telemetry.read_losses(log)


def run(nodes: int, ranks_per_node: int, job: str, budget: int, argv: list[str], failures: list[Failure],
        work_dir: str, *, compare: bool = True, heartbeat_timeout_s: float = 60.0, max_restarts: int = 5,
        parity: int | None = None, group_size: int | None = None, standby: bool = True,
        say: Callable[[str], None] = lambda line: print(line, flush=True)) -> Timeline:
    """`parity` m turns erasure coding on: a lost node is rebuilt from its group's survivors. Each node runs
    `inmem-ft run`, the agent production runs (launcher/supervisor.py); `standby` is the agents' warm standbys
    (`--standbys`, one per local rank; off: every rank of a restart starts cold). `say` gets progress and each
    timeline line as it happens."""
    for f in failures:
        f.check(nodes, nodes * ranks_per_node)
    clear_work_dir(work_dir)
    reference = reference_losses(nodes, ranks_per_node, job, budget, argv, work_dir, say) if compare else None
    # A fresh per-job secret authenticates the simulated nodes' SMPs to each other.
    env = {"INMEM_FT_SECRET": os.environ.get("INMEM_FT_SECRET") or secrets.token_hex(16)}
    wipe_job(job, nodes)
    say("run with failures:\n" + Timeline.HEADER)
    timeline = Supervisor(nodes, ranks_per_node, job, budget, argv, failures, work_dir=work_dir, env=env,
                          heartbeat_timeout_s=heartbeat_timeout_s, max_restarts=max_restarts, parity=parity,
                          group_size=group_size, standby=standby, live=say).run()
    timeline.reference = reference
    return timeline


def verdict(timeline: Timeline) -> str:
    if not timeline.ok:
        return "FAILED: the job did not finish"
    last = max(timeline.losses, default=None)
    text = f"finished at step {last}, final loss {timeline.losses.get(last)!r}"
    if timeline.matches_reference is not None:
        same = "equals" if timeline.matches_reference else "DIFFERS FROM"
        text += (f"; the loss trajectory {same} the uninterrupted run's "
                 f"(final {timeline.reference.get(last)!r}), step by step")
    if timeline.missed:
        text = f"requested failure(s) never happened ({'; '.join(timeline.missed)}); " + text
    return text if timeline.passed else "FAILED: " + text


def time_lost(timeline: Timeline) -> str:
    """The table of what each failure cost, part by part, or nothing if nothing failed."""
    if not timeline.time_lost:
        return ""
    return ("time lost per failure (s), from the failure to training back at the step it had reached:\n"
            + timelost.table(timeline.time_lost))


def write_json(timeline: Timeline, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"ok": timeline.ok, "passed": timeline.passed, "matches_reference": timeline.matches_reference,
                   "events": [asdict(e) for e in timeline.events], "failures": timeline.failures,
                   "missed": timeline.missed, "time_lost": timeline.time_lost,
                   "losses": timeline.losses, "reference": timeline.reference}, f, indent=2)


def plot(timeline: Timeline, path: str, title: str) -> None:
    """Loss per step; a dashed red line at each failure that happened, a green mark at each restore with
    where it came from, and the seconds each failure cost where training caught up again."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    if timeline.reference:
        steps = sorted(timeline.reference)
        ax.plot(steps, [timeline.reference[s] for s in steps], color="#999", linewidth=4, alpha=0.6,
                label="uninterrupted run")
    steps = sorted(timeline.losses)
    ax.plot(steps, [timeline.losses[s] for s in steps], ".", color="#2a7", label="run with failures, resumed")
    lost = {split["failure"]: split["total_s"] for split in timeline.time_lost}
    for i, (step, text) in enumerate(timeline.failures):
        ax.axvline(step, color="#c33", linestyle="--")
        if lost.get(text) is not None:
            text += f"\n{lost[text]:.1f} s lost"
        ax.annotate(text, (step, 0.97 - 0.12 * i), xycoords=("data", "axes fraction"), color="#c33",
                    fontsize=8, ha="right", va="top", xytext=(-4, 0), textcoords="offset points",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    restores = [e for e in timeline.events if e.kind == "restore" and e.step]
    for i, e in enumerate(restores):
        ax.axvline(e.step, color="#27a", linestyle=":")
        source = e.text.split(" in ")[0]  # "step S from memory + peer_reconstruction"
        ax.annotate(f"restore {source}", (e.step, 0.03 + 0.07 * i), xycoords=("data", "axes fraction"),
                    color="#27a", fontsize=8, ha="left", xytext=(4, 0), textcoords="offset points",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    if timeline.missed:
        ax.text(0.5, 0.5, "requested failure(s) never happened:\n" + "\n".join(timeline.missed),
                transform=ax.transAxes, ha="center", color="#c33", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
