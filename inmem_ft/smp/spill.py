"""The SMP's disk spill: what a stopped job (preempted, cancelled, re-queued) keeps when memory goes too.

On SIGTERM the SMP writes this node's slots of the newest step complete on every rank (and any newer
committed one) into its spill directory, and an SMP that starts with nothing of its own in shared memory
takes them back. No trainer is needed for either, so a preemption's grace time only has to cover one
sequential write per node.

The files are raw slot bytes (header, manifest, tensor bytes): self-describing and checksummed, so a
spilled slot is verified exactly like one found in /dev/shm before anyone can restore it, and nothing
is unpickled. Each file is published atomically; older spills are removed only once the new one is
complete, so a kill mid-spill leaves the previous one usable.
"""
from __future__ import annotations

import logging
import os
import re
import struct

from ..errors import SnapshotCorrupt
from ..persist.atomic import atomic_write, fsync_dir
from ..snapshot import segment as seg

log = logging.getLogger("inmem_ft.smp")
SOURCE = "disk spill"  # what `list` reports, so a restore says where its snapshot came from
SLOT_FILE = re.compile(r"^r(\d+)\.step(\d+)\.slot$")


def node_dir(base: str, job: str, node: int) -> str:
    return os.path.join(base, job, f"node{node}")


def steps_to_spill(smp) -> set[int]:
    """Every committed step not older than the job's complete step. The SMPs of a job learn of a complete
    step at slightly different times, so one node's newest complete step may be the next one on another:
    restore takes the newest step found on every rank, which needs both nodes' candidates on disk."""
    floor = smp.complete_step if smp.complete_step is not None else -1
    return {step for slots in smp.slots.values() for s in slots if s is not None
            for step in [s.committed_step()] if step is not None and step >= floor}


def spill(smp, directory: str) -> list[int]:
    """Write those steps' slots; return the steps written."""
    with smp.lock:  # no begin may reuse a slot while it is being written out
        steps = steps_to_spill(smp)
        if not steps:
            log.warning("smp node=%d event=spill steps=none reason=no committed step at or after the complete "
                        "step %s", smp.node, smp.complete_step)
            return []
        os.makedirs(directory, mode=0o700, exist_ok=True)
        written = set()
        for rank, slots in sorted(smp.slots.items()):
            for slot in slots:
                step = slot.committed_step() if slot is not None else None
                if step not in steps:
                    continue
                header = slot.header
                name = f"r{rank}.step{step}.slot"
                atomic_write(os.path.join(directory, name),
                             lambda f, n=header.data_off + header.data_len, b=slot.segment.buf: f.write(b[:n]))
                written.add(name)
        for old in os.listdir(directory):
            if SLOT_FILE.match(old) and old not in written:
                os.unlink(os.path.join(directory, old))
        fsync_dir(directory)
    log.info("smp node=%d event=spill steps=%s files=%d dir=%s", smp.node, ",".join(map(str, sorted(steps))),
             len(written), directory)
    return sorted(steps)


def adopt(smp, directory: str) -> None:
    """Load spilled slots into fresh segments, verified; only for an SMP that adopted nothing from memory
    (newer snapshots in /dev/shm always win over a spill)."""
    from .daemon import SLOTS_PER_RANK, RequestError  # here: the daemon imports this module

    if any(s is not None for slots in smp.slots.values() for s in slots) or not os.path.isdir(directory):
        return
    # Newest first, two per rank: a spill killed half-way leaves the previous one beside it, and restore
    # takes the newest step that every rank of the job holds.
    found = sorted((int(m[1]), -int(m[2]), name) for name in os.listdir(directory) if (m := SLOT_FILE.match(name)))
    for rank, _, name in found:
        path = os.path.join(directory, name)
        slots = smp.slots.setdefault(rank, [None] * SLOTS_PER_RANK)
        if None not in slots:
            continue
        index = slots.index(None)
        try:
            with open(path, "rb") as f:
                header = seg.Header.read(f.read(seg.HEADER_SIZE))
                if header is None:
                    raise SnapshotCorrupt(f"{path}: no valid slot header")
                slot = smp._allocate(rank, index, seg.slot_size(header.manifest_len, header.data_len))
                f.seek(0)
                f.readinto(slot.segment.buf[: header.data_off + header.data_len])
            seg.verify(slot.segment.buf, path)
        except (SnapshotCorrupt, RequestError, OSError, ValueError, struct.error) as e:
            # A bad file must not keep the SMP from starting: this node then falls to the next tier.
            log.warning("smp node=%d event=discard file=%s reason=%s", smp.node, path, e)
            if slots[index] is not None:
                slots[index].segment.close()
                slots[index].segment.unlink()
                slots[index] = None
            continue
        slot.source = SOURCE
        log.info("smp node=%d event=adopt rank=%d slot=%d step=%d from=disk file=%s", smp.node, rank, index,
                 header.step, path)
