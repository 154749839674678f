"""What a restart gets, as one value: the state restored in place (from which tier, at which step), the
newest snapshots of another layout to reshard from, or nothing to resume.

`Snapshotter.resume` returns a `Resume`; each adapter (DeepSpeed, Megatron, DCP, the plain Snapshotter API)
only translates it into its framework. This module also owns what every adapter reports of a restore: the
one `Restored` record, the tier names and the one restore log line

    restore rank=R step=S source=TIER [from=OLD to=NEW ]seconds=T[ bytes=N] [phase_s=T ...] [bytes_WHERE=N ...]

(`agent/timelost.py` reads it; operators grep it), and when a reshard opens what (an `Opener`, which
universal/reshard.py implements: capture sits below it).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .. import events
from ..deprecation import Tier
from ..errors import LayoutChanged

log = logging.getLogger("inmem_ft.capture")

# Tiers the SMPs name a slot's source by (smp/daemon.py, cluster/slotreads.py): memory, peer_memory,
# peer_reconstruction, disk (a slot adopted from the disk tier). The adapters add these:
MEMORY_RESHARDED = "memory_resharded"  # built from another layout's snapshots
DISK = "disk"  # the framework's own checkpoint (Megatron's --load) was newer than any snapshot
DCP_PREFIX = "dcp-"  # a DCP load through InmemStorageReader: dcp-memory, dcp-parity


@dataclass
class RestoreInfo:
    """The Snapshotter's record of the step the job resumed from (Snapshotter.last_restore)."""

    step: int
    source: str
    seconds: float
    bytes: int
    path: str | None = None
    """A file that holds the restored snapshot (its shared-memory slot), for loaders that want a path."""
    phases: dict = field(default_factory=dict)
    """Seconds per phase: list, agree, copy_verify, replicated, unpack (adapters add their own)."""
    losses: list = field(default_factory=list)
    """The losses this rank's snapshot recorded of the steps before it, oldest first (capture/sentinel.py)."""

    @classmethod
    def resharded(cls, rs, seconds: float, phases: dict) -> RestoreInfo:
        """The record of a reshard from `rs` (a universal.reshard.Resharding): the step of the old layout."""
        return cls(rs.step, MEMORY_RESHARDED, seconds, sum(rs.bytes_read.values()), None, dict(phases), rs.losses)


@dataclass
class Restored:
    """What an adapter's handle says it resumed from (`handle.restored`; None: a fresh start)."""

    step: int
    tier: str
    """The restore line's source: memory | peer_memory | peer_reconstruction | disk | memory_resharded."""
    seconds: float
    """The whole restore, the framework's load included."""
    phases: dict = field(default_factory=dict)
    """Seconds per phase: the adapter's setup, the restore's (RestoreInfo.phases), the framework's load."""
    extras: Any = None
    """DeepSpeed: what extra_state() returned when the snapshot was taken, on this rank (resharded: the old
    rank's that universal/reshard.py maps this one to)."""
    tag: str | None = None
    """DeepSpeed: the checkpoint tag the engine loaded."""
    resharded: dict | None = None
    """From another layout: {from, to, bytes_memory, bytes_parity, ...} (layouts as Topology.layout())."""

    @classmethod
    def in_place(cls, info: RestoreInfo, seconds: float, phases: dict, **adapter) -> Restored:
        return cls(info.step, Tier(info.source), seconds, phases, **adapter)

    @classmethod
    def from_reshard(cls, rs, seconds: float, phases: dict, **adapter) -> Restored:
        return cls(rs.step, Tier(MEMORY_RESHARDED), seconds, phases, resharded=rs.describe(), **adapter)

    def say(self, node, rank: int, logger: logging.Logger = log, level: int = logging.WARNING) -> None:
        """The restore event of this record (WARNING: the one line per rank that says where training resumed
        from, shown with no logging set up)."""
        layouts = (self.resharded["from"], self.resharded["to"]) if self.resharded else None
        wheres = {k[len("bytes_"):]: v for k, v in (self.resharded or {}).items() if k.startswith("bytes_")}
        say(node, rank, self.step, self.tier, self.seconds, phases=self.phases, layouts=layouts,
            bytes_by_where=wheres, logger=logger, level=level)


def say(node, rank: int, step: int, tier: str, seconds: float, *, nbytes: int | None = None,
        phases: dict | None = None, layouts: tuple[str, str] | None = None, bytes_by_where: dict | None = None,
        logger: logging.Logger = log, level: int = logging.WARNING) -> None:
    """The one restore event, and its line (see the module docstring)."""
    fields = {"step": step, "source": str(tier)}
    if layouts is not None:
        fields.update({"from": layouts[0], "to": layouts[1]})
    fields["seconds"] = seconds
    if nbytes is not None:
        fields["bytes"] = nbytes
    fields.update({f"{k}_s": v for k, v in (phases or {}).items()})
    fields.update({f"bytes_{k}": v for k, v in sorted((bytes_by_where or {}).items())})
    events.emit(events.Source("rank", node, rank), "restore", "restore", say=functools.partial(logger.log, level),
                **fields)


def say_fresh(rank: int, logger: logging.Logger = log) -> None:
    """Nothing to resume: the job starts from scratch."""
    logger.info("restore rank=%d step=none source=none: starting from scratch", rank)


def say_framework_disk(rank: int, step: int, what: str, logger: logging.Logger = log) -> None:
    """The framework loaded its own checkpoint (newer than any snapshot) instead."""
    logger.warning("restore rank=%d step=%d source=%s: %s", rank, step, DISK, what)


class ReshardSource:
    """The newest snapshots in memory are of another layout: what a resharding adapter reads them through.
    It owns what it opens of them (SMP connections, this node's slot mappings): opened once, by `open()`, and
    let go by `close()` (or the end of a `with` block), whether or not the adapter opened it."""

    def __init__(self, step: int, why: str, opened, open_collective: Callable | None):
        """open_collective: the Opener's together(), None where the restore was not asked to reshard (open()
        then refuses)."""
        self.step, self.why = step, why
        self.settled = opened is not None
        """The restore's agreement settled which step to read, and every rank opened it already (its open
        time is then part of the restore's agreement)."""
        self._rs, self._open = opened, open_collective
        self._closed = False

    def open(self):
        """Collective: the universal.reshard.Resharding every rank reads the same old step through."""
        if self._closed:
            raise ValueError("ReshardSource.open: closed")
        if self._open is None:
            self.refuse()
        if self._rs is None:
            self._rs = self._open()
        return self._rs

    def refuse(self):
        """The adapter does not reshard: let go, and raise the error that says what to do."""
        self.close()
        raise LayoutChanged(self.why, self.step)

    def close(self) -> None:
        self._closed = True
        if self._rs is not None:
            self._rs.close()
            self._rs = None

    def __enter__(self) -> ReshardSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Opener(Protocol):
    """How a restore that reshards opens another layout's snapshots (universal.reshard.FromMemory): capture
    sits below universal, which reads them."""

    def alone(self):
        """This rank's open of the newest of them, agreeing with no one: tried before the restore's agreement,
        which then also settles that every rank opened the same step."""

    def together(self):
        """Collective: the open every rank agrees on, where the restore's agreement did not settle it."""


@dataclass
class Resume:
    """What a restart gets: exactly one of `state` (restored in place, `info` says from where), `reshard` (the
    newest snapshots are of another layout), or neither (nothing to resume: start from scratch)."""

    state: Any = None
    info: RestoreInfo | None = None
    reshard: ReshardSource | None = None

    @property
    def nothing(self) -> bool:
        return self.state is None and self.reshard is None
