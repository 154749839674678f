"""The disk tier, written by the SMP from shared memory: trainers pay nothing for it and a trainer crash cannot
tear it.

Two writers, one format. Periodically, once every rank of the job committed a step that is due (`every`
training steps), the SMP's writer thread copies its node's slots of that step to disk while the slots stay
pinned (a begin that finds both of a rank's slots pinned skips its snapshot, as for erasure-coding lag, rather
than wait); the control socket and protection go on meanwhile. On SIGTERM (preemption, end of allocation) the
SMP writes the newest complete step (and any newer committed one) before it exits. An SMP that starts with
nothing of its own in shared memory adopts the newest flushed steps, verified.

Layout under DIR/<job>/: `node<N>/r<rank>.step<S>.slot` (raw slot bytes: header, manifest, tensor bytes,
self-checksummed, verified on adoption exactly like a slot found in /dev/shm), `node<N>/step<S>.done` (JSON:
the files of step S this node wrote; published last, so a step without it is a torn flush and is never read),
and `latest` (JSON: the newest step every node flushed). Each file is published atomically; each node keeps
its `keep` newest steps, and the job's `latest` step as well.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import SnapshotCorrupt
from ..persist.atomic import TMP_SUFFIX, atomic_write, atomic_write_text, fsync_dir
from ..snapshot import segment as seg

log = logging.getLogger("inmem_ft.smp")
SOURCE = "disk"  # what `list` reports, so a restore says where its snapshot came from
LATEST = "latest"
SLOT_FILE = re.compile(r"^r(\d+)\.step(\d+)\.slot$")
_DONE = re.compile(r"^step(\d+)\.done$")


def node_dir(base: str, job: str, node: int) -> str:
    return os.path.join(base, job, f"node{node}")


def flushed_steps(directory: str) -> dict[int, list[str]]:
    """step -> the slot files of it a node published (its `.done` marker), for every complete flush there."""
    out = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if m := _DONE.match(name):
            try:
                with open(os.path.join(directory, name)) as f:
                    files = json.load(f)["files"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("event=discard file=%s reason=unreadable flush marker: %s", name, e)
                continue
            if isinstance(files, list) and all(isinstance(n, str) and SLOT_FILE.match(n) for n in files):
                out[int(m[1])] = files
    return out


def read_latest(job_dir: str) -> int | None:
    """The newest step every node of the job flushed, as published in DIR/<job>/latest (None: none yet)."""
    try:
        with open(os.path.join(job_dir, LATEST)) as f:
            step = json.load(f)["step"]
        return step if isinstance(step, int) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


class DiskTier:
    def __init__(self, smp, base: str, every: int = 0, keep: int = 2):
        """every: flush each complete step that is a multiple of it (0: only on SIGTERM); keep: steps kept."""
        if every < 0:
            raise ValueError(f"--persist-every-steps {every}: must be >= 0 (steps between flushes; 0: only on SIGTERM)")
        if keep < 1:
            raise ValueError(f"--persist-keep {keep}: must be >= 1 (flushed steps each node keeps)")
        self.smp, self.every, self.keep = smp, every, keep
        self.job_dir = os.path.join(base, smp.job)
        self.dir = node_dir(base, smp.job, smp.node)
        self.pinned: frozenset[int] = frozenset()  # steps being written; replaced whole, read without a lock
        self._queued = -1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inmem_ft-flush")
        self._last: Future | None = None
        # For `smp status` and the metrics: the newest step this node has on disk, how long after the job
        # completed it the last flush finished, and how many flushes failed since this SMP started.
        flushed = flushed_steps(self.dir)
        self.flushed_step: int | None = max(flushed) if flushed else None
        self.flush_lag_s: float | None = None
        self.flush_failures = 0
        self._failed: dict[int, str] = {}  # step -> why its flush failed, until a `flush` request hears it


    # ---- periodic flush -----------------------------------------------------------------------------------
    def complete(self, step: int) -> None:
        """Every rank of the job committed `step` (called under the SMP's lock, once per local rank)."""
        if not self.every or step % self.every or step <= self._queued:
            return
        self._queue(step)

    def _queue(self, step: int) -> None:
        self._queued = max(self._queued, step)
        try:
            views = self.smp.committed_views(step)
        except SnapshotCorrupt as e:
            log.error("smp node=%d event=flush_failed step=%d reason=%s", self.smp.node, step, e)
            self._fail(step, str(e))
            return
        self.pinned = self.pinned | {step}
        self._last = self._pool.submit(self._flush, step, views, time.time())

    def _fail(self, step: int, why: str) -> None:
        # Only the newest failures matter to a request (it asks for the newest complete step): a disk that
        # stays full for weeks must not grow this without bound.
        self._failed = {s: w for s, w in self._failed.items() if s > step} | {step: why}

    def request(self, step: int) -> dict:
        """Flush `step` now unless it (or a newer step) is on disk or being written: an operator's `smp flush`,
        asked of every node. Returns {flushed_step, pending, error}: error says why its flush failed (said
        once: asking again tries again)."""
        with self.smp.lock:
            error = self._failed.pop(step, None)
            done = self.flushed_step is not None and self.flushed_step >= step
            if not done and error is None and step not in self.pinned:
                log.info("smp node=%d event=flush_requested step=%d", self.smp.node, step)
                self._queue(step)
                error = self._failed.pop(step, None)
            return {"flushed_step": self.flushed_step, "pending": step in self.pinned, "error": error}

    def _flush(self, step: int, views: dict, completed_at: float) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._write(step, views)
            self._retain()
            self._flushed(step, completed_at)
        except Exception as e:  # a full or missing disk must not take the SMP (and the memory tier) down
            self.flush_failures += 1
            self._fail(step, f"{type(e).__name__}: {e}")
            log.error("smp node=%d event=flush_failed step=%d dir=%s reason=%s: %s", self.smp.node, step, self.dir,
                      type(e).__name__, e)
            return
        finally:
            for view in views.values():
                view.release()
            self.pinned = self.pinned - {step}
        log.info("smp node=%d event=flushed step=%d ranks=%s bytes=%d seconds=%.3f dir=%s", self.smp.node, step,
                 ",".join(map(str, sorted(views))), nbytes, time.perf_counter() - t0, self.dir)

    def _flushed(self, step: int, completed_at: float) -> None:
        self.flushed_step = max(step, self.flushed_step if self.flushed_step is not None else step)
        self.flush_lag_s = round(time.time() - completed_at, 3)

    def status(self) -> dict:
        return {"dir": self.dir, "every": self.every, "flushed_step": self.flushed_step,
                "flush_lag_s": self.flush_lag_s, "flush_failures": self.flush_failures}

    def drain(self) -> None:
        """Until the flush in progress (if any) is on disk."""
        if self._last is not None:
            futures.wait([self._last])  # a failed flush said so in its own log line

    # ---- SIGTERM ------------------------------------------------------------------------------------------
    def spill(self) -> list[int]:
        """Write every committed step not older than the job's complete step; return the steps written. The SMPs
        of a job learn of a complete step at slightly different times, so one node's newest complete step may be
        the next one on another: restore takes the newest step found on every rank, which needs both nodes'
        candidates on disk. Holds the SMP's lock: no begin may reuse a slot meanwhile."""
        self.drain()
        smp = self.smp
        with smp.lock:
            floor = smp.complete_step if smp.complete_step is not None else -1
            by_step: dict[int, dict] = {}
            for rank, slot in smp.committed():
                step = slot.committed_step()
                if step >= floor:
                    h = slot.header
                    by_step.setdefault(step, {})[rank] = slot.segment.buf[: h.data_off + h.data_len]
            if not by_step:
                log.warning("smp node=%d event=spill steps=none reason=no committed step at or after the complete "
                            "step %s", smp.node, smp.complete_step)
                return []
            files = 0
            for step, views in sorted(by_step.items()):
                self._write(step, views)
                files += len(views)
                for view in views.values():
                    view.release()
            self._retain(protect=set(by_step))
            self._flushed(max(by_step), time.time())
        log.info("smp node=%d event=spill steps=%s files=%d dir=%s", smp.node, ",".join(map(str, sorted(by_step))),
                 files, self.dir)
        return sorted(by_step)

    # ---- the files ----------------------------------------------------------------------------------------
    def _write(self, step: int, views: dict) -> int:
        """rank -> used bytes of its slot of `step`: the slot files, then the step's marker. Returns bytes."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        names = []
        for rank, view in sorted(views.items()):
            name = f"r{rank}.step{step}.slot"
            atomic_write(os.path.join(self.dir, name), lambda f, v=view: f.write(v))
            names.append(name)
        atomic_write_text(os.path.join(self.dir, f"step{step}.done"), json.dumps({"step": step, "files": names}))
        self._publish_latest()
        return sum(len(v) for v in views.values())

    def _nodes(self) -> list[int]:
        return self.smp.peers.nodes if self.smp.peers is not None else [self.smp.node]

    def _publish_latest(self) -> None:
        """DIR/<job>/latest: the newest step every node of the job flushed, never lowered. It reads the other
        nodes' markers, so it is written where DIR is shared; with node-local disks each node's markers alone
        decide what it adopts, and restore agrees on the newest step every rank holds."""
        done = [set(flushed_steps(node_dir(os.path.dirname(self.job_dir), self.smp.job, n))) for n in self._nodes()]
        common = set.intersection(*done) if done else set()
        if common and max(common) > (read_latest(self.job_dir) or -1):
            atomic_write_text(os.path.join(self.job_dir, LATEST), json.dumps({"step": max(common)}))

    def _retain(self, protect: set[int] = frozenset()) -> None:
        """Keep the `keep` newest flushed steps, the job's `latest` and `protect`; the marker goes first, so a
        crash half-way leaves files no marker names (cleaned at the next start), never a marker without files."""
        flushed = flushed_steps(self.dir)
        keep = set(sorted(flushed)[-self.keep:]) | set(protect) | {read_latest(self.job_dir)}
        named = {name for step in keep if step in flushed for name in flushed[step]}
        for step in set(flushed) - keep:
            os.unlink(os.path.join(self.dir, f"step{step}.done"))
        for name in os.listdir(self.dir):
            if SLOT_FILE.match(name) and name not in named:
                os.unlink(os.path.join(self.dir, name))
        fsync_dir(self.dir)

    # ---- start ------------------------------------------------------------------------------------------
    def clean(self) -> None:
        """At start: temporary files of a flush that was killed, and slot files no marker names (a step whose
        flush never finished), are removed; nothing reads them."""
        if not os.path.isdir(self.dir):
            return
        named = {name for files in flushed_steps(self.dir).values() for name in files}
        for name in os.listdir(self.dir):
            if name.endswith(TMP_SUFFIX) or (SLOT_FILE.match(name) and name not in named):
                log.info("smp node=%d event=clean file=%s reason=%s", self.smp.node, name,
                         "temporary file" if name.endswith(TMP_SUFFIX) else "no flush marker names it (torn flush)")
                os.unlink(os.path.join(self.dir, name))

    def adopt(self) -> None:
        """Load flushed slots into fresh segments, verified; only for an SMP that adopted nothing from memory
        (newer snapshots in /dev/shm always win over disk)."""
        from .daemon import SLOTS_PER_RANK, RequestError  # here: the daemon imports this module

        smp = self.smp
        self.clean()
        if any(s is not None for slots in smp.slots.values() for s in slots):
            return
        # Newest first, two per rank: restore takes the newest step that every rank of the job holds.
        found = sorted((int(SLOT_FILE.match(name)[1]), -step, name)
                       for step, names in flushed_steps(self.dir).items() for name in names)
        for rank, _, name in found:
            path = os.path.join(self.dir, name)
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
                # A bad file must not keep the SMP from starting: this rank then falls to an older step.
                log.warning("smp node=%d event=discard file=%s reason=%s", smp.node, path, e)
                if slots[index] is not None:
                    slots[index].segment.close()
                    slots[index].segment.unlink()
                    slots[index] = None
                continue
            slot.source = SOURCE
            log.info("smp node=%d event=adopt rank=%d slot=%d step=%d from=disk file=%s", smp.node, rank, index,
                     header.step, path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
