"""The Snapshotter a DCP writer or reader of a job uses in this process: one per job, kept across saves so
that its slot mappings and layout plan are reused (a writer is made per dcp.save call)."""
from __future__ import annotations

from ..capture.snapshotter import Snapshotter
from ..config import SnapshotConfig

_open: dict[str, Snapshotter] = {}


def snapshotter(job: str | None, config: SnapshotConfig | None, given: Snapshotter | None) -> Snapshotter:
    """`given` if any, else this process's Snapshotter of the job (`config`, or one from the environment with
    `job`), created on first use (collective: every rank must get here)."""
    if given is not None:
        return given
    config = config or SnapshotConfig.from_env(**({"job": job} if job else {}))
    snap = _open.get(config.job)
    if snap is None:
        snap = _open[config.job] = Snapshotter(config)
    return snap


def step_of(checkpoint_id) -> int | None:
    """A DCP checkpoint_id as a step (an int, or a string of one); None if it is not one."""
    if isinstance(checkpoint_id, bool):
        return None
    if isinstance(checkpoint_id, int):
        return checkpoint_id if checkpoint_id >= 0 else None
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return int(checkpoint_id)
    return None


def close(job: str | None = None) -> None:
    """Close this process's Snapshotters made by the writers and readers (of `job`, default all): waits for
    the last commit. Collective, like Snapshotter.close."""
    for name in [job] if job else sorted(_open):
        snap = _open.pop(name, None)
        if snap is not None:
            snap.close()
