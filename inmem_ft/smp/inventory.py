"""What this user's shared-memory namespace holds, per job and node, and removing what no SMP serves.

`inmem-ft smp status` lists the nodes' segments that no running SMP serves (a job stopped and kept for a
re-queue, or one whose SMP died with its launcher); `inmem-ft smp clean` removes them. Both work with no
SMP running: the namespace and the node locks (smp/nodelock.py) are all they need.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..errors import ForeignSegment, SMPUnavailable
from . import nodelock, paths
from .daemon import read_complete
from .segments import names_with_prefix, private_namespace, unlink


@dataclass
class NodeSegments:
    job: str
    node: int
    names: list[str] = field(default_factory=list)
    bytes: int = 0
    last_write: float = 0.0  # newest mtime of its files: the complete-step record is rewritten every step
    pid: int | None = None  # the SMP serving them; None: stale

    def complete_step(self) -> int | None:
        try:
            return read_complete(self.job, self.node)
        except ForeignSegment:
            return None

    def as_dict(self, now: float) -> dict:
        return {"job": self.job, "node": self.node, "files": len(self.names), "bytes": self.bytes,
                "age_s": round(now - self.last_write, 1), "complete_step": self.complete_step(), "pid": self.pid}


def holdings() -> list[NodeSegments]:
    """Every (job, node) with files in the namespace, sorted, each with the pid of the SMP serving it."""
    directory = private_namespace()
    if directory is None:
        return []
    found: dict[tuple[str, int], NodeSegments] = {}
    for name in os.listdir(directory):
        owner = paths.owner_of(name)
        if owner is None or name == paths.lock_name(*owner):  # the lock is bookkeeping, not a snapshot
            continue
        try:
            st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue  # removed while we looked
        group = found.setdefault(owner, NodeSegments(*owner))
        group.names.append(name)
        group.bytes += st.st_size
        group.last_write = max(group.last_write, st.st_mtime)
    for group in found.values():
        try:
            group.pid = nodelock.holder(group.job, group.node)
        except ForeignSegment:
            group.pid = None  # a planted lock file: no SMP holds it
    return [found[key] for key in sorted(found)]


def stale(job: str | None = None, older_than_s: float | None = None) -> list[NodeSegments]:
    """The nodes' segments no running SMP serves (of `job`; last written at least `older_than_s` ago)."""
    now = time.time()
    return [g for g in holdings() if g.pid is None and (job is None or g.job == job)
            and (older_than_s is None or now - g.last_write >= older_than_s)]


def stale_rows() -> list[dict]:
    """stale() as `smp status` shows it (every job's), one dict a node."""
    now = time.time()
    return [g.as_dict(now) for g in stale()]


def remove(job: str, node: int) -> tuple[int, int]:
    """Unlink every file of `job` on `node` (slots, parity, records) with no SMP involved: for a node that is
    lost, or whose SMP is gone. Refused while an SMP serves them. Returns (files, bytes) freed."""
    try:
        lock = nodelock.NodeLock.try_acquire(job, node)
    except ForeignSegment:  # a planted lock file is no SMP's lock, and removing plants is this function's job
        unlink(paths.lock_name(job, node))
        lock = nodelock.NodeLock.try_acquire(job, node)
    if lock is None:
        raise SMPUnavailable(f"an SMP (pid {nodelock.holder(job, node)}) still serves job {job} node {node}: stop "
                             f"it with `inmem-ft smp stop --job {job} --node {node} --wipe` instead")
    with lock:  # no SMP can start and adopt them half-removed
        names = [n for n in names_with_prefix(paths.segment_prefix(job, node)) if n != paths.lock_name(job, node)]
        count = size = 0
        for name in names:
            try:
                size += os.lstat(os.path.join(private_namespace(), name)).st_size
            except FileNotFoundError:
                continue
            unlink(name)
            count += 1
    return count, size
