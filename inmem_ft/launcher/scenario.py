"""`inmem-ft launch` and the demo: an uninterrupted reference run, then the same run with failures
injected and recovered, then the timeline, the verdict and a plot."""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict

from .. import telemetry
from .simulated import SimulatedCluster
from .supervisor import Failure, Supervisor, Timeline


def reference_losses(nodes: int, ranks_per_node: int, job: str, budget: int, argv: list[str],
                     work_dir: str) -> dict[int, float]:
    """Losses of the same command run once without failures, in a job of its own."""
    log = os.path.join(work_dir, "reference-loss.jsonl")
    with SimulatedCluster(nodes, ranks_per_node, f"{job}-ref", budget, os.path.join(work_dir, "reference")) as c:
        attempt = c.run(argv, {telemetry.LOSS_LOG: log})
        if not attempt.ok:
            raise RuntimeError(f"the reference run failed; see {c.log_dir}")
    return telemetry.read_losses(log)


def run(nodes: int, ranks_per_node: int, job: str, budget: int, argv: list[str], failures: list[Failure],
        work_dir: str, *, compare: bool = True, heartbeat_timeout_s: float = 60.0, max_restarts: int = 5,
        parity: int | None = None, group_size: int | None = None) -> Timeline:
    """`parity` m turns erasure coding on: a lost node is rebuilt from its group's survivors."""
    os.makedirs(work_dir, exist_ok=True)
    reference = reference_losses(nodes, ranks_per_node, job, budget, argv, work_dir) if compare else None
    # A fresh per-job secret authenticates the simulated nodes' SMPs to each other.
    env = {"INMEM_FT_SECRET": os.environ.get("INMEM_FT_SECRET") or secrets.token_hex(16)}
    cluster = SimulatedCluster(nodes, ranks_per_node, job, budget, os.path.join(work_dir, "logs"), env,
                               parity=parity, group_size=group_size)
    with cluster:
        timeline = Supervisor(cluster, argv, failures, heartbeat_timeout_s=heartbeat_timeout_s,
                              max_restarts=max_restarts, work_dir=work_dir).run()
    timeline.reference = reference
    return timeline


def verdict(timeline: Timeline) -> str:
    if not timeline.ok:
        return "the job did not finish"
    last = max(timeline.losses, default=None)
    text = f"finished at step {last}, final loss {timeline.losses.get(last)!r}"
    if timeline.matches_reference is not None:
        same = "equals" if timeline.matches_reference else "DIFFERS FROM"
        text += (f"; the loss trajectory {same} the uninterrupted run's "
                 f"(final {timeline.reference.get(last)!r}), step by step")
    return text


def write_json(timeline: Timeline, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"ok": timeline.ok, "matches_reference": timeline.matches_reference,
                   "events": [asdict(e) for e in timeline.events], "failures": timeline.failures,
                   "losses": timeline.losses, "reference": timeline.reference}, f, indent=2)


def plot(timeline: Timeline, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    if timeline.reference:
        steps = sorted(timeline.reference)
        ax.plot(steps, [timeline.reference[s] for s in steps], color="#999", linewidth=4, alpha=0.6,
                label="uninterrupted run")
    steps = sorted(timeline.losses)
    ax.plot(steps, [timeline.losses[s] for s in steps], ".", color="#2a7", label="run with failures, resumed")
    for i, (step, text) in enumerate(timeline.failures):
        ax.axvline(step, color="#c33", linestyle="--")
        ax.annotate(text, (step, 0.97 - 0.07 * i), xycoords=("data", "axes fraction"), color="#c33",
                    fontsize=8, ha="right", rotation=0, xytext=(-4, 0), textcoords="offset points")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
