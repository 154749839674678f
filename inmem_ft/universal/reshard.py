"""Resharding on restore: a job back on another parallel layout builds each rank's state from the snapshots
its old layout left in memory, read through the job-wide catalog: the local SMP's shared memory first, then
other nodes, then parity for a lost node (a disk tier's steps are slots again once an SMP adopted them). Where
memory holds no complete step of the old layout any more (more nodes of a group lost than its parity rebuilds:
a second loss before the first snapshot after a shrink is protected), the SMPs' disk tier files are read instead,
with one line saying so. Only the pieces a rank holds travel, one at a time.

Framework-free. This module finds the old layout's newest step that every old rank holds (the same one on
every new rank), reads any piece of any global tensor, and decides what each new rank takes of the old
ranks' own state. Adapters translate: which pieces their framework's rank holds, and how they go into a
live engine (integrations/deepspeed/reshard.py).

The rule for per-rank state (RNG streams, an adapter's extras such as a data-loader position): a new rank
takes the state of the old rank at the same coordinates (tp, pp, dp, ...). A coordinate beyond the old
layout's size is taken modulo that size: with DP 2 -> 4, new DP ranks 2 and 3 take the state of old DP
ranks 0 and 1, so their RNG streams repeat those ranks' until the job reseeds (dropout masks, say, match
theirs). Job-wide state (the step, the data position, the scheduler, optimizer hyperparameters) is old rank
0's, which every old rank holds alike.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from ..capture import sentinel
from ..errors import STOP_EXIT, InmemFTError, SnapshotLost, StepIncomplete
from ..smp.client import SMPClient
from ..snapshot import catalog
from ..snapshot.annotate import OPTIMIZER_STATE
from ..snapshot.topology import Topology, layout_key
from .diskslots import DiskSlots
from .source import MemorySource

log = logging.getLogger("inmem_ft.capture")
NO_STEP = -1


class NothingToResume(SnapshotLost):
    """Memory holds no complete step any more (more nodes lost than parity rebuilds) and the disk tier has none
    either: a restart cannot help, so the rank exits with STOP_EXIT."""

    exit_code = STOP_EXIT


@dataclass
class Resharding:
    """One new rank's view of the old layout's snapshot: read pieces through `source`."""

    source: MemorySource
    old: Topology
    """Old rank 0's layout record (sizes, position, optimizer groups)."""
    new: Topology
    per_rank: int
    """The old rank whose own state (RNG, extras) this rank takes."""
    seconds: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.source.step

    def job_state(self, *path: str):
        """Old rank 0's state at `path` (see MemorySource.state): what every old rank holds alike."""
        return self.source.state(0, *path)

    def rank_state(self, *path: str):
        """The state at `path` of the old rank this rank takes its own state from."""
        return self.source.state(self.per_rank, *path)

    def optimizer_keys(self) -> dict[str, dict[str, str]]:
        """Parameter name -> {kind: key} of its optimizer state in the snapshot (fp32_param, exp_avg, ...)."""
        out: dict[str, dict[str, str]] = {}
        for key in self.source.fragments.by_key:
            if key.startswith(OPTIMIZER_STATE):
                kind, name = key[len(OPTIMIZER_STATE):].split(".", 1)
                out.setdefault(name, {})[kind] = key
        return out

    @property
    def losses(self) -> list[float]:
        """The losses recorded by the snapshot of the old rank this rank takes its own state from: what the
        check after the restore learns its bound from (capture/sentinel.py)."""
        return sentinel.recorded_in(self.source.manifests[self.per_rank])

    @property
    def bytes_read(self) -> dict:
        return dict(self.source.fragments.bytes_read)

    def describe(self) -> dict:
        """For the restore log line: from/to layouts, and bytes read by where they came from (memory, parity,
        disk)."""
        return {"from": self.old.layout(), "to": self.new.layout(),
                **{f"bytes_{where}": n for where, n in sorted(self.bytes_read.items())}}

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class FromMemory:
    """How a restore opens another layout's newest snapshots to reshard them into `layout` (the Opener of
    capture/resume.py): from the slots the SMPs hold, through this rank's SMP."""

    socket_path: str
    layout: Topology
    node: int | None
    agree_min: Callable

    @classmethod
    def of(cls, snap, layout: Topology) -> FromMemory:
        """For the restore of Snapshotter `snap`, on its job's SMPs and agreement group."""
        return cls(snap.config.socket_path, layout, snap.config.node, snap.agree_min)

    def alone(self) -> Resharding:
        return open_newest(self.socket_path, self.layout, self.node)

    def together(self) -> Resharding:
        return open_memory(self.socket_path, self.layout, self.agree_min, self.node)


def open_memory(socket_path: str, new: Topology, agree_min, node: int | None = None) -> Resharding:
    """Collective over the new job (`agree_min(values) -> the smallest of every rank's, elementwise`): the old
    layout's newest step every old rank holds, the same on every new rank. `node`: this rank's node, whose
    copies it reads first. Raises on every rank when some rank cannot open it.

    Every rank opens the step its own listing names before the ranks agree, so one round settles both the
    step and that every rank could open it; only ranks whose listings differ (a node unreachable from some
    SMPs) take a second, to open the oldest step any rank named."""
    t0 = time.perf_counter()
    listing, mine, error = None, None, None
    try:
        listing = _listing(socket_path)
        mine = _open(socket_path, listing, new, node)
    except Exception as e:  # every rank must take part in the agreement below, whatever went wrong
        error = e
    reopen = functools.partial(_open, socket_path, listing, new, node)
    if isinstance(error, StepIncomplete):  # more nodes lost than parity rebuilds: the disk tier's newest, if any
        error, reopen = None, functools.partial(_open_disk, socket_path, new)
        try:
            mine = reopen()
            log.warning("restore event=memory_lost: %s; step %d is loaded from the disk tier (%s)",
                        _what_was_lost(listing), mine.step, mine.source.client.where)
        except Exception as e:
            error = e if not isinstance(e, InmemFTError) else NothingToResume(
                f"{_what_was_lost(listing)}, and the disk tier has no step to resume from either ({e}); restart "
                f"the job from a checkpoint of your own, or from scratch (INMEM_FT_START_FRESH=1)")
    step = mine.step if mine is not None else NO_STEP
    low, high = agree_min([step, -step])
    high = -high
    if low != NO_STEP and low != high:
        if mine is not None and mine.step != low:
            mine.close()
            mine = None
            try:
                mine = reopen(step=low)
            except Exception as e:
                error = e
        low = agree_min(low if mine is not None else NO_STEP)
    if low == NO_STEP:
        if mine is not None:
            mine.close()
        raise error or InmemFTError("another rank of the job could not open the old layout's snapshots (its log "
                                    "says why); nothing was changed")
    mine.seconds["open"] = round(time.perf_counter() - t0, 4)
    return mine


def _open_disk(socket_path: str, new: Topology, step: int | None = None) -> Resharding:
    """The old layout's newest step every old rank flushed to the SMPs' disk tier (or `step`), opened for this
    rank: what a restore falls back to when memory lost more nodes than parity rebuilds. Every node's folder
    of the tier is read: a tier on a file system the nodes share."""
    client = SMPClient(socket_path)
    try:
        disk = client.call("status").get("disk")
    finally:
        client.close()
    if not disk:
        raise InmemFTError("the SMPs run without a disk tier (no --persist-dir)")
    slots = DiskSlots(os.path.dirname(disk["dir"]))
    try:
        key, step = _newest_old(slots.catalog(), new, step)
    except BaseException:
        slots.close()
        raise
    return _resharding(MemorySource(slots, step, accept=lambda e: layout_key(e["manifest"].get("topology", {})) == key),
                       new)


def _what_was_lost(listing: dict | None) -> str:
    nodes = sorted(u["node"] for u in (listing or {}).get("unreachable", []))
    if not nodes:
        return "memory holds no step of the old layout for every rank"
    return (f"the snapshots in memory of node(s) {nodes} are lost (unreachable, and more nodes are gone than the "
            f"erasure coding rebuilds)")


def open_newest(socket_path: str, new: Topology, node: int | None = None) -> Resharding:
    """This rank's open of the old layout's newest step every old rank holds, agreeing with no one: for a
    restore that settles, in the agreement it holds anyway, that every rank opened the same step
    (FromMemory.alone, for Snapshotter.resume); open_memory otherwise."""
    t0 = time.perf_counter()
    rs = _open(socket_path, _listing(socket_path), new, node)
    rs.seconds["open"] = round(time.perf_counter() - t0, 4)
    return rs


def _open(socket_path: str, listing: dict, new: Topology, node: int | None, step: int | None = None) -> Resharding:
    """The old layout's newest step every old rank holds in `listing` (or `step`), opened for this rank."""
    key, step = _newest_old(listing, new, step)
    return _resharding(MemorySource(socket_path, step, node=node, listing=listing,
                                    accept=lambda e: layout_key(e["manifest"].get("topology", {})) == key), new)


def _resharding(source: MemorySource, new: Topology) -> Resharding:
    try:
        per_rank = per_rank_source(source, new)
    except BaseException:
        source.close()
        raise
    return Resharding(source, Topology.from_json(source.topology), new, per_rank)


def _listing(socket_path: str) -> dict:
    client = SMPClient(socket_path)
    try:
        return client.catalog()
    finally:
        client.close()


def _newest_old(listing: dict, new: Topology, step: int | None = None) -> tuple[tuple, int]:
    """(layout key, step) of the newest step every rank of some other layout holds (or of `step`)."""
    groups: dict[tuple, list] = {}
    for e in listing["entries"]:
        key = layout_key(e["manifest"].get("topology", {}))
        if key != new.layout_key():
            groups.setdefault(key, []).append(e)
    best, why = None, []
    for key, entries in groups.items():
        try:
            held = catalog.complete_step(entries, step)
        except StepIncomplete as e:
            why.append(str(e))
            continue
        if best is None or held > best[1]:
            best = (key, held)
    if best is None:
        lost = "; ".join(f"node {u['node']}: {u['error']}" for u in listing["unreachable"])
        raise StepIncomplete(f"no step of another layout is held for all its ranks, so there is nothing to reshard "
                             f"from ({'; '.join(why) or 'no snapshots of another layout'}"
                             f"{f'; unreachable: {lost}' if lost else ''}); bring back the nodes that hold them, "
                             f"or wipe the SMPs (inmem-ft smp stop --wipe) to restore from the disk tier")
    return best


def per_rank_source(source: MemorySource, new: Topology) -> int:
    """The old rank whose own state a new rank at `new.coords` takes (the module's rule)."""
    old = Topology.from_json(source.topology)
    sizes = {"tp": old.tp, "pp": old.pp, "dp": old.dp, "ep": old.ep, "vpp": old.vpp}
    want = {axis: c % sizes.get(axis, 1) for axis, c in new.coords.items()}
    for rank in sorted(source.manifests):
        coords = source.topology_of(rank).get("coords", {})
        if all(coords.get(axis, 0) == c for axis, c in want.items()):
            return rank
    raise InmemFTError(f"no rank of the old layout ({old.layout()}) sits at coordinates {want}, where the new rank "
                       f"at {new.coords} takes its RNG and extras from: the snapshot's topology records are "
                       f"inconsistent")
