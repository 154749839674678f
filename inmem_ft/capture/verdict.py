"""Checksums of a restored slot off the restore's critical path, and the job's verdict on them at the fence.

A restore that hands the framework views (`Snapshotter.restore(views=True, defer_checks=True)`) checks the
small regions at once (RNG states, the user's extras, scalars: they are used before any fence) and hands the
large ones to `DeferredChecks`, which hashes them in the background while the framework loads (where a core
is spare for it) and while the first forward/backward runs. Until the next fence nothing the restored state
produces can last: forward and backward write no state, and the adapters fence before every optimizer step
and every snapshot. Once a rank's checks end, a thread of its own casts the rank's vote (one small all-gather
over the agreement group, which nothing else uses until that fence); at the fence every rank waits for that
vote. A bad region on any rank stops every rank there with the same error, before the optimizer steps or a
snapshot copies that state; the rank that found it tells its SMP, which discards that slot so a restart
restores the next tier.

Why the verdict is taken at the fence and not while the framework loads: a rank that found a bad region
inside DeepSpeed's load would leave the others waiting in the load's collectives; every rank votes whatever
it found, in a collective of its own, and acts on the verdict only at the fence, which every rank reaches,
so the ranks never split. Why not re-restore in-process from the next tier: by the fence the training loop
has taken the restored step and extras (its data position) and run a forward/backward on them, whose
gradients the engine holds; DeepSpeed offers no clean reload of an engine in the middle of a step (install()
already refuses a ZeRO-3 engine that trained). A restart is the clean way back, and loses nothing.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from ..errors import InmemFTError, SnapshotCorrupt
from ..snapshot import segment as seg
from .armed import Armed

SMALL = 64 << 10  # regions below this are checked before the hand-over: microseconds, and used before a fence
log = logging.getLogger("inmem_ft.capture")


class RestoreCorrupt(SnapshotCorrupt):
    """The snapshot a restore handed over failed its checksums in the background, before any optimizer step
    or snapshot used it. Nothing was lost: a restart restores the next tier."""


def split(todo: list, small: int = SMALL) -> tuple[list, list]:
    """(regions to check now, regions to check in the background) of a regions() list, each in offset order."""
    return [r for r in todo if r[1] - r[0] < small], [r for r in todo if r[1] - r[0] >= small]


def spare_cores() -> bool:
    """Whether this rank has a core beside the ones its node's ranks compute on. Where it has none (every core
    runs a rank, as on a 2-core box with 2 ranks), checks beside the framework's load would only slow the load
    that training waits for; they then start after it, behind the first forward/backward."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return len(os.sched_getaffinity(0)) > local * torch.get_num_threads()


class DeferredChecks:
    """The background checks of one rank's restored slot and the ranks' vote on them, which a thread of its own
    casts as soon as this rank's checks end (not at the fence: the vote then waits for the last rank's checks,
    not for the last rank to reach the fence). Calling it at the fence is the verdict."""

    def __init__(self, ctx, data, todo: list, where: str, step: int):
        """ctx: the restore's RestoreContext (its agreement, SMP client and rank)."""
        self.ctx, self.data, self.todo, self.where, self.step = ctx, data, todo, where, step
        self.info = None  # the restore's RestoreInfo, whose phases these checks add theirs to
        self.nbytes = sum(end - start for start, end, _, _ in todo)
        seg.check_bounds(data, todo, where, step)  # a malformed manifest fails the restore itself, not later
        self._thread: Armed | None = None
        self._problem: BaseException | None = None  # this rank's: a bad region, or why it could not check
        self._bad: list[int] | None = None  # the ranks whose checks failed; None: the vote did not finish
        self._vote_error: BaseException | None = None
        self._seconds, self._vote_s = 0.0, 0.0
        self._failed: RestoreCorrupt | None = None
        self._stop, self._reading = threading.Event(), threading.Lock()  # see stop()

    def arm(self) -> None:
        """Start the thread that will check and vote, before the framework's load (capture/armed.py)."""
        if self._thread is None:
            self._thread = Armed("inmem_ft-verdict")

    def start(self) -> None:
        """Begin the checks (idempotent). The vote that follows them is a collective of the agreement group,
        which nothing else uses between a restore and its fence: every snapshot and commit fences first."""
        self.arm()
        self._thread.go(self._check_and_vote)

    def _check_and_vote(self) -> None:
        t0 = time.perf_counter()
        try:
            # One thread where the node has no core to spare: the rank's main thread, training behind these
            # checks, then shares its core with one thread of them, not with one per worker.
            with self._reading:
                seg.check_regions(self.data, self.todo, self.where, self.step,
                                  workers=seg.COPY_WORKERS if spare_cores() else 1, stop=self._stop)
        except Exception as e:  # whatever it is, this rank must still vote
            self._problem = e
        t1 = time.perf_counter()
        self._seconds = t1 - t0
        try:
            rows = self.ctx.agree.gather([int(self._problem is None)])
            self._bad = [rank for rank, (ok,) in enumerate(rows) if not ok]
        except BaseException as e:  # raised at the fence
            self._vote_error = e
        self._vote_s = time.perf_counter() - t1

    def stop(self) -> None:
        """End the checks early (they then fail) and wait until they no longer read the slot: its Snapshotter
        is closing (Snapshotter.reading). The vote that follows reads nothing of the slot."""
        self._stop.set()
        with self._reading:
            pass

    def __call__(self) -> None:
        """Wait for this rank's checks and the vote; raise RestoreCorrupt on every rank if any rank found a bad
        region. A second call (the caller went on after the error) raises the same error, alone."""
        if self._failed is not None:
            raise self._failed
        self.start()
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        if self._vote_error is not None:
            raise self._vote_error
        info = self.info
        if info is not None:
            info.phases.update(verify_background=round(self._seconds, 4), verify_vote=round(self._vote_s, 4),
                               verify_wait=round(waited, 4))
        problem, bad = self._problem, self._bad
        if not bad:
            log.info("restore rank=%d step=%d event=verified bytes=%d background_s=%.3f vote_s=%.3f waited_s=%.3f",
                     self.ctx.rank, self.step, self.nbytes, self._seconds, self._vote_s, waited)
            return
        if isinstance(problem, SnapshotCorrupt):
            log.warning("restore rank=%d step=%d event=corrupt: %s", self.ctx.rank, self.step, problem)
            try:  # so that a restart does not choose this copy again
                self.ctx.smp.call("corrupt", rank=self.ctx.rank, step=self.step)
            except InmemFTError as e:
                log.warning("restore rank=%d step=%d event=corrupt_unreported: the SMP did not take the report "
                            "(%s); a restart finds the bad region again and stops the same way", self.ctx.rank,
                            self.step, e)
            found = f"this rank's copy failed its checksums ({problem})"
        elif problem is not None:  # not a bad region: the slot is kept
            found = f"this rank could not check its copy ({type(problem).__name__}: {problem})"
        else:
            found = f"rank(s) {bad} found their copies corrupted or could not check them (see their logs)"
        self._failed = RestoreCorrupt(
            f"step {self.step}, restored from memory, failed its checksums in the background: {found}. Training "
            f"stopped here, at the first optimizer step or snapshot after the restore, before either used that "
            f"state. Nothing was lost: the SMP no longer offers the corrupted copy, and a restart of the job "
            f"restores the next tier (the newest step intact on every rank: an older one in memory, a copy its "
            f"peers hold, or the disk tier).")
        raise self._failed
