"""The trainer-side API: save a rank's state into its node's SMP every N steps, restore it after a crash.

save() returns once the copies out of device memory are queued (capture/copier.py); checksums, the commit to the SMP and the
job-wide agreement that a step is complete run in a background thread. A step counts only when every
rank committed it, and the SMP never overwrites the newest such step, so some complete step always
survives a crash at any instant.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from .. import device, events
from ..config import SnapshotConfig
from ..errors import BudgetExceeded, InmemFTError, ReplicasDisagree, RestoredStateBad
from ..smp.client import SMPClient
from ..smp.segments import Segment, path_of
from ..snapshot import layout, segment as seg
from ..snapshot.topology import Topology
from ..snapshot.tree import FlatState, flatten
from ..telemetry import Heartbeat
from . import fingerprint
from .agreement import Agreement
from .copier import Copier
from .plans import PlanCache, StalePlan
from .restore import NO_STEP, RestoreContext, Restorer
from .resume import Opener, RestoreInfo, Resume
from .sentinel import Sentinel

log = logging.getLogger("inmem_ft.capture")


# Stalls kept for percentiles: a job snapshotting every step for weeks must not grow a list without bound; the
# count, total and maximum cover the whole run.
STALL_WINDOW = 1024


@dataclass
class Metrics:
    snapshots: int = 0
    failures: int = 0
    last_stall_s: float = 0.0
    total_stall_s: float = 0.0
    max_stall_s: float = 0.0
    stall_count: int = 0
    last_commit_s: float = 0.0
    last_bytes: int = 0
    stalls_s: deque[float] = field(default_factory=lambda: deque(maxlen=STALL_WINDOW))  # the newest stalls
    skipped: int = 0  # snapshots the SMP declined (erasure coding still protecting the previous one)
    planned: int = 0  # snapshots laid out afresh (the first, and any after the state's structure changed)
    stale: int = 0  # snapshots not committed: a tensor changed dtype or shape under the reused layout
    last_committed: dict | None = None  # {step, stall_s, commit_s, bytes} of the newest committed snapshot
    sentinel_trips: int = 0  # restored steps the check after a restore found bad (capture/sentinel.py)
    fingerprints: int = 0  # snapshots whose data-parallel replicas were compared (capture/fingerprint.py)
    replica_mismatches: int = 0  # of those, the ones whose replicas disagreed
    last_fingerprint_s: float = 0.0  # the newest comparison's digests (both parts) and its collectives

    def add_stall(self, seconds: float) -> None:
        self.last_stall_s = seconds
        self.total_stall_s += seconds
        self.max_stall_s = max(self.max_stall_s, seconds)
        self.stall_count += 1
        self.stalls_s.append(seconds)

    def extend_stall(self, seconds: float) -> None:
        """The last stall went on by `seconds` (a fence waited for its copy)."""
        self.last_stall_s += seconds
        self.total_stall_s += seconds
        self.stalls_s[-1] += seconds
        self.max_stall_s = max(self.max_stall_s, self.last_stall_s)


@dataclass
class _Written:
    """What the commit thread needs of a snapshot save() began."""

    flat: FlatState
    plan: layout.Plan
    reused: bool  # the plan was made for an earlier snapshot: confirm it before committing
    topology: Topology | None
    manifest_len: int  # room reserved for the manifest
    target: _Attached | None  # None: the commit thread asks the SMP for the slot (an overlapped snapshot)
    reply: dict | None
    work: object
    compare: bool = False  # the replicas compare fingerprints of this snapshot (capture/fingerprint.py)
    held: dict | None = None  # share -> its digests as the state held it at the snapshot, the other ranks' shares
    digest_s: float = 0.0  # what computing `held` took

    @property
    def data_off(self) -> int:
        return self.reply["data_off"]


class _Skipped(InmemFTError):
    """The SMP declined this snapshot (reason in the message): no slot was free; not a failure."""


class _Attached:
    """A slot mapped into this process, with a uint8 tensor over it for torch copies."""

    def __init__(self, name: str):
        self.segment = Segment(name)
        self.bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.populated = False
        self.registration: device.Registration | None = None
        self._private: list[tuple[weakref.ref, int]] = []  # (its mmap, its base address) per private()

    def private(self) -> torch.Tensor:
        """The slot's bytes in a fresh copy-on-write mapping of it (Segment.private): what a restore with views
        hands the framework, which may then keep and write them without touching the snapshot. Fresh for every
        restore: the framework may have written into an earlier one since."""
        mapping = self.segment.private()
        out = torch.frombuffer(mapping, dtype=torch.uint8)
        self._private.append((weakref.ref(mapping), out.data_ptr()))
        return out

    def twin(self, view: torch.Tensor) -> torch.Tensor | None:
        """What `view` shows of one of this slot's copy-on-write mappings, in a fresh one: the same bytes for a
        second tensor that changes apart from the first, without a copy. None if `view` is not in one."""
        address, length = view.data_ptr(), view.numel() * view.element_size()
        for base in self.private_bases():
            if base <= address and address + length <= base + self.segment.size:
                start = address - base
                return self.private()[start: start + length].view(view.dtype).view(view.shape)
        return None

    def private_bases(self) -> set[int]:
        """Base addresses of this slot's copy-on-write mappings still alive (a tensor views each)."""
        self._private = [(ref, base) for ref, base in self._private if ref() is not None]
        return {base for _, base in self._private}

    def for_writing(self) -> "_Attached":
        # Prefault once, so snapshot copies run at memcpy speed; a restore only reads and need not pay it.
        if not self.populated:
            self.segment.populate()
            self.populated = True
        return self

    def register(self) -> None:
        """Register the mapping with the device once (commit thread: it takes about 0.1 s per GB), so that
        device copies into and out of it are DMA; where that fails they go through pageable memory."""
        if self.registration is None:
            self.registration = device.register(self.bytes.data_ptr(), self.segment.size) or \
                device.Registration(0, 0)

    def close(self) -> None:
        # No copy is in flight here (the commit thread drained them): unregistered before the mapping may go.
        if self.registration is not None:
            self.registration.release()
        # Not Segment.close(): torch.frombuffer holds no buffer export, so that munmap would go through under
        # a tensor still viewing the slot (work not yet ended, a view the caller kept), whose next read is a
        # SIGSEGV. Each tensor holds the memoryview, which holds the mmap: the mapping goes with the last one.
        del self.bytes
        self._private = []  # each mapping goes with the last tensor that views it


class Snapshotter:
    """Per-rank handle on the node's SMP. Create it on every rank after init_process_group."""

    def __init__(self, config: SnapshotConfig | None = None, *, dp_group=None):
        self.config = config or SnapshotConfig.from_env()
        self._agree = Agreement(self.config.timeout_s)
        self.rank, self.world_size = self._agree.rank, self._agree.world_size
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        if self.dp_size > 1:
            self._agree.mirror(dp_group)  # kept there (_dp_gloo), so that closing the agreement lets it go
        self._smp = SMPClient(self.config.socket_path, timeout_s=self.config.timeout_s)
        self._smp.call("ping")  # no SMP: fail now, with the command that starts one
        self._copier = Copier(self.config.staging_budget)
        self._plans = PlanCache(rank=self.rank, world_size=self.world_size, dp_rank=self.dp_rank,
                                dp_size=self.dp_size)
        self._attached: dict[str, _Attached] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inmem_ft-commit")
        self._pending: Future | None = None
        self._fence_work = None
        self._before_change = []  # run at the next fence (a restore's copy-out and checks behind forward/backward)
        self._after_load = []  # started once the framework's load from a restore's views is done
        self._readers = weakref.WeakSet()  # background work reading the slot mappings (see reading())
        self._failed: BaseException | None = None  # what a fence found: the state must not change any more
        self._copied = threading.Event()
        self._complete: int | None = None
        self._reserved = False
        self.metrics = Metrics()
        self.last_restore: RestoreInfo | None = None
        self._heartbeat = Heartbeat.from_env(self.rank)
        self._sentinel = Sentinel(self.config.sentinel_steps)
        self._shares: tuple = (None, [])  # (a plan, the pieces of each DP rank's share of its replicated region)

    # ---- saving -----------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.config.interval == 0

    def maybe_save(self, step: int, state_fn, *, overlap: bool = False, topology: Topology | None = None) -> bool:
        """Save `state_fn()` if `step` is a snapshot step; the state is only built when needed.

        Call it every step: it is also the rank's heartbeat for supervisors that watch for hangs.
        """
        self.heartbeat(step=step)
        if not self.due(step):
            return False
        self.save(step, state_fn(), overlap=overlap, topology=topology)
        return True

    def heartbeat(self, **fields) -> None:
        """Tell a supervisor watching for hangs that this rank is alive (no-op without one)."""
        if self._heartbeat:
            self._heartbeat.beat(**fields)

    def save(self, step: int, state, *, overlap: bool = False, topology: Topology | None = None) -> Future:
        """Snapshot `state` as of now. Returns once its host bytes are copied and its device bytes' copies are
        queued behind an event of the training stream (which waits on them before its next kernels), or with
        `overlap` at once: the copy then runs behind training and fence() must be called before the state changes
        (see fence_optimizer). `topology`: the layout record stored with it (default: this job's world and
        data-parallel sizes, framework 'pytorch'). Returns its commit: done once the step's vote is in (see
        wait_for)."""
        t0 = time.perf_counter()
        self.wait()
        plan, reused, flat, target, reply, work, error, fatal = None, False, None, None, None, None, None, False
        compare, held = False, None
        try:
            flat = flatten(state)
            plan, reused = self._plans.plan(flat, step, topology)
            self.metrics.planned += not reused
            try:
                reply, target, work = self._begin_and_copy(step, flat, plan, overlap)
            except (RuntimeError, ValueError) as e:
                if not reused or isinstance(e, InmemFTError):
                    raise
                # A tensor changed shape or device under the reused layout; the state itself has not changed
                # yet, so lay it out afresh and copy again.
                log.info("snapshot rank=%d step=%d event=replan reason=%s", self.rank, step, str(e).splitlines()[0])
                plan, reused = self._plans.fresh(flat, step, topology), False
                self.metrics.planned += 1
                reply, target, work = self._begin_and_copy(step, flat, plan, overlap)
            self._reserved = True
            compare = self.dp_size > 1 and plan.manifest["replicated"] is not None and \
                fingerprint.due(step, self.config.interval, self.config.fingerprint_every)
            # Without overlap the state may change once this returns: the other shares are digested now.
            held = self._digest_held(flat.values, plan) if compare and not overlap else None
        except Exception as e:  # any failure, ours or not: the step's vote in _finish tells every rank
            error, target = e, None
            # The first snapshot reserves the slots: a budget that cannot fit is a setup error.
            fatal = isinstance(e, BudgetExceeded) and not self._reserved
        stall = time.perf_counter() - t0
        m = self.metrics
        m.last_bytes = plan.data_len if plan else 0
        m.add_stall(stall)
        if self._heartbeat:
            self._heartbeat.beat(step=step, snapshot_step=step, stall_s=stall, bytes=m.last_bytes)
        self._copied = threading.Event()
        self._fence_work = work if overlap and error is None else None
        if self._fence_work is None:
            self._copied.set()
        written = _Written(flat, plan, reused, topology, self._plans.manifest_len, target, reply, work, compare,
                           *(held or (None, 0.0))) if error is None else None
        # Submitted even after an error: every rank must take part in the step's agreement.
        self._pending = commit = self._pool.submit(self._finish, step, written, error, self._sentinel.recorded())
        if fatal:
            with contextlib.suppress(Exception):
                self.wait()  # the vote first, so no other rank waits for this one
            raise error
        return commit

    def _begin_and_copy(self, step: int, flat, plan, overlap: bool):
        if overlap and self._reserved:
            # The host copy runs on the commit thread, and the device copy stages outside the slot: the SMP's
            # answer to which slot (a round trip to a process that competes for the same cores) is the commit
            # thread's to wait for. The first snapshot still asks here, so that a budget that cannot fit fails
            # the save() call.
            return None, None, self._copier.copy(flat.values, plan, None, defer=True)
        reply, target = self._begin(step, plan, self._plans.manifest_len)
        if not overlap:
            target.for_writing()  # else the commit thread prefaults, off the training path
        data = target.bytes[reply["data_off"]: reply["data_off"] + plan.data_len]
        return reply, target, self._copier.copy(flat.values, plan, data, defer=overlap)

    def _begin(self, step: int, plan, manifest_len: int) -> tuple[dict, "_Attached"]:
        """The SMP's slot for this snapshot, mapped; _Skipped if it declines."""
        reply = self._smp.call("begin", rank=self.rank, step=step, manifest_len=manifest_len,
                               data_len=plan.data_len, keep_step=self._complete, reserve=not self._reserved,
                               local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
        if "skipped" in reply:
            raise _Skipped(reply["skipped"])
        return reply, self._attach(reply["segment"], reply["inode"])

    def fence(self) -> None:
        """Before the snapshotted state changes: wait for an overlapped snapshot's copy, or for a restore's
        copy-out (capture.views) and checks (capture.verdict; collective then). Cheap otherwise. If one of
        those failed, this and every later fence raises: the state must not be stepped or snapshotted."""
        if self._failed is not None:
            raise self._failed
        pending, self._before_change = self._before_change, []
        for finish in pending:  # every one, even after a failure: the checks' verdict is collective
            try:
                finish()
            except BaseException as e:
                self._failed = self._failed or e
        if self._failed is not None:
            raise self._failed
        work, self._fence_work = self._fence_work, None
        if work is None:
            return
        t0 = time.perf_counter()
        self._copied.wait()  # the commit thread queued the device copies: the training stream waits on them
        self._copier.fence(work)
        waited = time.perf_counter() - t0
        self.metrics.extend_stall(waited)

    def before_change(self, finish) -> None:
        """Call `finish()` at the next fence(), before the state next changes or is snapshotted."""
        self._before_change.append(finish)

    def reading(self, work) -> None:
        """`work` reads this process's slot mappings in the background until its `stop()` returns (which ends
        it early or waits for it). close() calls that, even where the fence that normally waits for the work
        was skipped or interrupted: once close() returns, nothing of this Snapshotter reads a slot any more."""
        self._readers.add(work)

    def after_load(self, start) -> None:
        """Call `start()` at loaded(): background work that would only slow the framework's load."""
        self._after_load.append(start)

    def loaded(self) -> None:
        """The framework's load from a restore's views is done (capture.views.PrivateAfterLoad says so)."""
        pending, self._after_load = self._after_load, []
        for start in pending:
            start()

    def fence_optimizer(self, optimizer) -> None:
        """Fence automatically before every `optimizer.step()` (a torch.optim step pre-hook)."""
        optimizer.register_step_pre_hook(lambda *_: self.fence())

    def _finish(self, step: int, w: "_Written | None", error, losses: list) -> None:
        t0 = time.perf_counter()
        if error is None:
            try:
                try:
                    if w.target is None:
                        w.reply, w.target = self._begin(step, w.plan, w.manifest_len)
                    data = w.target.bytes[w.data_off: w.data_off + w.plan.data_len]
                    w.target.for_writing()
                    if w.work.on_device:
                        w.target.register()
                    self._copier.copy_out(w.work, data)
                    if w.compare and w.held is None:  # the state changes after the fence, which waits for this
                        w.held, w.digest_s = self._digest_held(w.flat.values, w.plan)
                except (RuntimeError, ValueError) as e:
                    if not w.reused or isinstance(e, InmemFTError):
                        raise
                    self._plans.drop()
                    raise StalePlan(f"step {step}: a tensor changed shape or device under an unchanged structure "
                                    f"({str(e).splitlines()[0]}); the next snapshot is laid out afresh") from None
                finally:
                    self._copied.set()
                self._copier.drain(w.work)
                if w.work.on_device:  # a slot written before it was registered (save() without overlap)
                    w.target.register()
                raw = self._plans.manifest(w.flat, step, w.topology, w.target.segment.buf[w.data_off:],
                                           confirm=w.reused, losses=losses)
                if len(raw) > w.manifest_len:
                    self._plans.drop()
                    raise StalePlan(f"step {step}: its manifest ({len(raw)} bytes) outgrew the room reserved for it "
                                    f"({w.manifest_len} bytes); the next snapshot is laid out afresh")
                w.target.segment.buf[seg.HEADER_SIZE: seg.HEADER_SIZE + w.manifest_len] = raw.ljust(w.manifest_len)
                self._smp.call("commit", rank=self.rank, step=step)
            except Exception as e:  # whatever it is, the vote below must run on every rank
                error = e
        if isinstance(error, StalePlan):
            try:
                self._smp.call("abort", rank=self.rank)
            except InmemFTError:
                pass  # the next begin takes the slot over anyway
        disagree = None
        if self.dp_size > 1 and fingerprint.due(step, self.config.interval, self.config.fingerprint_every):
            disagree = self._compare_replicas(step, w if error is None else None)  # every DP peer takes part
        # One round for both: a step whose replicas disagree in any DP group is complete nowhere and bad everywhere.
        agreed, replicas_agree = self._agree.min([NO_STEP if error or disagree else step, int(disagree is None)])
        if not replicas_agree:
            self._replicas_disagree(step, disagree)
            return
        if agreed == step:
            self._complete = step
            try:
                self._smp.call("complete", step=step)
            except InmemFTError as e:
                error = e
        self.metrics.last_commit_s = time.perf_counter() - t0
        if isinstance(error, _Skipped):  # the agreement above kept the step from counting as complete anywhere
            self.metrics.skipped += 1
            log.warning("snapshot rank=%d step=%d event=skipped reason=%s", self.rank, step, error)
            return
        if isinstance(error, StalePlan):
            self.metrics.stale += 1
            log.warning("snapshot rank=%d step=%d event=stale reason=%s", self.rank, step, error)
            return
        if error is not None:
            self.metrics.failures += 1
            log.error("snapshot rank=%d step=%d event=failed: %s: %s", self.rank, step, type(error).__name__,
                      error)
            if not isinstance(error, InmemFTError):  # so that on_error decides, as for our own errors
                raise InmemFTError(f"snapshot of step {step} failed: {type(error).__name__}: {error}") from error
            raise error
        self.metrics.last_committed = {"step": step, "stall_s": self.metrics.last_stall_s,
                                       "commit_s": self.metrics.last_commit_s, "bytes": w.plan.data_len}
        self.metrics.snapshots += 1  # after last_committed: capture.monitor_metrics reads both from the training thread
        log.info("snapshot rank=%d step=%d event=committed complete=%s stall_s=%.4f commit_s=%.4f bytes=%d",
                 self.rank, step, agreed == step, self.metrics.last_stall_s, self.metrics.last_commit_s,
                 w.plan.data_len)

    def _pieces(self, plan) -> list:
        if self._shares[0] is not plan:
            self._shares = (plan, fingerprint.shares(plan.manifest["leaves"], plan.manifest["replicated"]))
        return self._shares[1]

    def _digest_held(self, values: list, plan) -> tuple[dict, float]:
        """The digests of the other DP ranks' shares as this rank's state holds them now (of its own share, the
        pieces in accelerator memory: capture/fingerprint.py), and the seconds it took."""
        t0 = time.perf_counter()
        held = {j: fingerprint.of_state(values, pieces, device_only=j == self.dp_rank)
                for j, pieces in enumerate(self._pieces(plan))}
        return held, time.perf_counter() - t0

    def _compare_replicas(self, step: int, w: "_Written | None") -> str | None:
        """Commit thread, collective over the DP group: every replica's fingerprint of every share of the
        replicated region (its own share's from the slot); what disagrees, in words, or None. A rank that could
        not take part (its snapshot failed, no replicated region) sends no fingerprints: then none are compared."""
        t0 = time.perf_counter()
        digests, row = {}, [0, self.rank, self.config.node] + [0] * self.dp_size
        if w is not None and w.compare and w.held is not None:
            try:
                share = w.target.segment.buf[w.data_off + w.plan.manifest["replicated"]["o"]:]
                digests = {**w.held, self.dp_rank: fingerprint.of_slot(share, self._pieces(w.plan)[self.dp_rank],
                                                                       w.flat.values, w.held[self.dp_rank])}
                row = [1, self.rank, self.config.node] + [fingerprint.fingerprint(digests[j])
                                                          for j in range(self.dp_size)]
            except Exception as e:  # the collective below must run on every peer: this rank only abstains
                log.warning("snapshot rank=%d step=%d event=fingerprint_failed: %s: %s", self.rank, step,
                            type(e).__name__, e)
        rows = self._agree.gather_replicas(row)
        if not all(r[0] for r in rows):
            return None
        disagreements = fingerprint.compare([r[3:] for r in rows])
        parts = []
        for d in disagreements:  # every peer found the same ones: the second rounds pair up
            pieces = self._pieces(w.plan)[d.share]
            theirs = self._agree.gather_replicas(digests[d.share].view(np.int64))
            names = ", ".join(w.flat.path_of(leaf) for leaf in fingerprint.differing(pieces, theirs))
            parts.append(_disagreement(d, rows, names))
        self.metrics.fingerprints += 1
        self.metrics.last_fingerprint_s = w.digest_s + time.perf_counter() - t0
        if parts:
            return f"step {step}: the data-parallel replicas disagree: {'; '.join(parts)}"
        log.info("snapshot rank=%d step=%d event=replicas_agree digest_s=%.4f", self.rank, step,
                 self.metrics.last_fingerprint_s)
        return None

    def _replicas_disagree(self, step: int, why: str | None) -> None:
        """Some DP group's replicas disagree on `step` (`why`, where it is this rank's): the step is marked bad on
        this rank's SMP (every node hears it from its own ranks), and the next fence stops the rank."""
        self.metrics.replica_mismatches += 1
        why = why or f"step {step}: the data-parallel replicas of another group disagree"
        try:
            self._smp.call("bad", step=step, why=why[:1024], replicas=True)
        except InmemFTError as e:  # the other ranks' SMPs still hear it; this rank stops either way
            log.error("snapshot rank=%d step=%d event=failed: could not mark the step bad: %s", self.rank, step, e)
        if self.dp_rank == 0:
            log.error("snapshot rank=%d step=%d event=replica_mismatch reason=%s", self.rank, step, why)
        self._failed = ReplicasDisagree(
            f"inmem_ft: {why}: step {step} is marked bad on every SMP and is never restored; look for a bad GPU or "
            f"host there, then restart the job: it resumes from the newest older good step", step)

    def flush(self, timeout_s: float = 600.0) -> dict:
        """Put the job's newest complete step on disk on every node now (planned maintenance): waits for this
        rank's last snapshot to commit, then has the SMPs write it and returns once it is on every node's disk:
        {step, nodes: {node: step on its disk}}. Raises InmemFTError saying why not (no disk tier, a node that
        cannot write or be reached, `timeout_s`). Not collective: one rank may call it, or all (each waits)."""
        self.wait()
        from ..smp import control

        return control.flush(self.config.job, self.config.node, self.config.socket_path, timeout_s)

    @property
    def complete(self) -> int | None:
        """The newest step this Snapshotter knows every rank committed (saved or resumed from), if any."""
        return self._complete

    def agree_min(self, value: int | list[int]) -> int | list[int]:
        """Collective over the whole job: the smallest `value` of all ranks (for restart decisions); of a list,
        the smallest of each element, in one round."""
        return self._agree.min(value)

    def wait(self) -> None:
        """Block until the last snapshot is committed (or failed)."""
        self.fence()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except InmemFTError:
            if self.config.on_error == "raise":
                raise
        if self._failed is not None:  # that commit found the state bad (replicas that disagree): no step on it
            raise self._failed

    def wait_for(self, commit: Future) -> None:
        """wait() for the snapshot whose commit save() returned, if it is still the last one; an older one
        was waited for (and its error raised or logged) by the save() after it."""
        if commit is self._pending:
            self.wait()

    def _attach(self, name: str, inode: int | None = None) -> _Attached:
        """The mapping of segment `name` whose inode is `inode` (default: the one now under that name). A
        restarted SMP may have replaced the segment under the same name: a stale mapping is dropped."""
        if inode is None:
            inode = os.stat(path_of(name)).st_ino
        cached = self._attached.get(name)
        if cached is None or cached.segment.inode != inode:
            # A resized or replaced slot: the old mapping is dead weight (or, written, a lost snapshot).
            for old in [n for n in self._attached if n.rsplit(".g", 1)[0] == name.rsplit(".g", 1)[0]]:
                self._attached.pop(old).close()
            self._attached[name] = _Attached(name)
        return self._attached[name]

    # ---- restoring --------------------------------------------------------------------------------------
    def resume(self, layout: Topology | None = None, *, views: bool = False, defer_checks: bool = False,
               reshard: Opener | None = None, summary: bool = True, to_device: bool = False) -> Resume:
        """Collective: what this restart gets (capture/resume.py): the state of the newest step every rank holds
        intact (Resume.state, Resume.info), the newest snapshots of another layout than `layout` (default:
        another world size) when those are newer (Resume.reshard, which the caller closes; with `reshard`, how
        to open them, e.g. universal.reshard.FromMemory, the restore's agreement also settles which step a
        reshard reads), or nothing when no step was ever complete.
        Raises NoUsableSnapshot when the job completed a step that is not intact on every rank (unless
        config.start_fresh).

        The state's tensors are private copies; with `views`, most of them view a copy-on-write mapping of the
        slots instead (no copy; a data-parallel peer's share views its slot's shared mapping, read-only for the
        caller): the caller may write the former, and must give what it keeps pages of its own (or copy it out)
        before the next-but-one snapshot, e.g. by loading inside `capture.views.PrivateAfterLoad`. With
        `defer_checks` too, the checksums of the large regions run in the background (capture.verdict) and the
        ranks take their verdict at the next fence(), which every rank must then reach before the state changes
        or is snapshotted; it raises RestoreCorrupt on every rank if a region failed. `summary`: see Restorer.
        `to_device`: the tensors saved from an accelerator come back on the current device of that accelerator
        (copied by DMA out of the slot), the others in host memory; without it, all come back in host memory."""
        self.wait()
        return Restorer(self._restore_context(), layout, reshard, summary).restore(views, defer_checks, to_device)

    def restore(self, layout: Topology | None = None, views: bool = False, defer_checks: bool = False,
                summary: bool = True, to_device: bool = False):
        """Collective: resume()'s state, or None when no step was ever complete. Raises LayoutChanged (a
        LayoutMismatch) when the newest snapshots were taken on another layout than `layout` (default: another
        world size): this API does not reshard."""
        got = self.resume(layout, views=views, defer_checks=defer_checks, summary=summary, to_device=to_device)
        if got.reshard is not None:
            got.reshard.refuse()
        return got.state

    def _restore_context(self) -> RestoreContext:
        def defer(checks) -> None:
            self.before_change(checks)
            self.reading(checks)

        return RestoreContext(self.rank, self.world_size, self.dp_rank, self.dp_size, self.config.node,
                              self.config.start_fresh, self._smp, self._agree,
                              self._dp_gloo, self._attach, self.resumed, self._start_fresh, defer, self.after_load)

    def _start_fresh(self) -> None:
        """Nothing to resume: the SMP keeps nothing for this rank's sake, and a supervisor hears step 0."""
        self._smp.call("restored", rank=self.rank, step=None)
        self._complete = None
        if self._heartbeat:
            self._heartbeat.beat(step=0, restored=None)

    def mapped_storages(self) -> set[int]:
        """Base addresses of the slot mappings of this process (what a restore with views hands out)."""
        return {attached.bytes.untyped_storage().data_ptr() for attached in self._attached.values()} | \
            self.private_mappings()

    def private_twin(self, view: torch.Tensor) -> torch.Tensor:
        """A contiguous `view` of a copy-on-write slot mapping (a restore with views), as a view of a fresh
        copy-on-write mapping of the same slot: two framework tensors that start equal and change apart (an
        adapter let them share one view so that the framework's copy of one into the other was skipped) each
        get pages of their own from the snapshot, not from each other."""
        if view.is_contiguous():
            for attached in self._attached.values():
                twin = attached.twin(view)
                if twin is not None:
                    return twin
        raise ValueError("private_twin: the tensor is not a contiguous view of a copy-on-write slot mapping")

    def private_mappings(self) -> set[int]:
        """Base addresses of the copy-on-write slot mappings (_Attached.private) of this process."""
        return set().union(*(a.private_bases() for a in self._attached.values()))

    def resumed(self, info: RestoreInfo) -> None:
        """The job resumes from `info.step` (restored here, or rebuilt from another layout's snapshots by an
        adapter): the SMP drops this rank's newer slots and keeps that step until a newer one is complete. The
        next `config.sentinel_steps` steps are screened (see observe)."""
        self._smp.call("restored", rank=self.rank, step=info.step)
        self._sentinel.arm(info.step, info.losses)
        self._complete = info.step
        self.last_restore = info
        if self._heartbeat:
            self._heartbeat.beat(step=info.step, restored=vars(info))

    @property
    def screening(self) -> bool:
        """Whether the next observed steps are screened (the steps after a restore, capture/sentinel.py)."""
        return self._sentinel.armed

    def observe(self, step: int, loss, grad_norm=None) -> None:
        """Hand each trained step's loss (a float or 0-d tensor) and, where the framework computes it, the
        gradient norm to the check after a restore (capture/sentinel.py); the adapters call it, a plain loop
        calls it after each optimizer step. The snapshot keeps the last losses, to learn the bound from.

        Within `config.sentinel_steps` steps of a restore, a NaN/Inf or a loss above that bound marks the
        restored step bad on this rank's SMP (every node's SMP hears it from its own ranks), so that no tier
        restores it again, and raises RestoredStateBad: the job restarts (its supervisor restarts it) from the
        newest older good step. A trip again before a restore passed the check stops the job, naming both."""
        was_armed = self._sentinel.armed
        trip = self._sentinel.observe(step, loss, grad_norm)
        if not was_armed:
            return
        # Every rank decides together (a spike may show on some ranks only): one that raised alone would leave
        # the others in the next collective. The commit thread votes on the same group: its vote goes first, or
        # two threads' collectives could pair up differently on different ranks.
        self.wait()
        if self._agree.min(int(trip is None)):
            if not self._sentinel.armed:
                self._smp.call("sentinel_passed")
            return
        if trip is None:
            self._sentinel.disarm()
            restored = self.last_restore.step if self.last_restore else NO_STEP
            why = f"step {step} after the restore from step {restored}: another rank's check tripped"
        else:
            restored = trip.restored
            why = f"step {trip.step} after the restore from step {restored}: {trip.why}"
        self.metrics.sentinel_trips += 1
        before = self._smp.call("bad", step=restored, why=why[:1024])["before"]
        if before is not None:
            raise RestoredStateBad(
                f"inmem_ft: the state restored from step {before} and then the one from step {restored} both went "
                f"bad ({why}): the job stops instead of walking back further; look for bad data or a bad host, then "
                f"restart it (both steps stay marked bad: `inmem-ft smp status`)", restored, fatal=True)
        events.emit(events.Source("rank", self.config.node, self.rank), "restore", "sentinel_trip", say=log.error,
                    step=restored, reason=why, text=f"step {restored} is marked bad and never restored again; restart "
                                                    f"the job to resume from an older step")
        raise RestoredStateBad(f"inmem_ft: {why}: step {restored} is marked bad on every SMP and will not be "
                               f"restored again; restart the job and it resumes from the newest older good step",
                               restored)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._heartbeat:
            self._heartbeat.beat(done=True)  # what follows (last commit, teardown) is no hang
        try:
            if self._failed is None:  # else it was raised at the fence that found it, and nothing is pending
                self.wait()
        finally:
            self._pool.shutdown(wait=True)  # no collective of ours is in flight past this
            try:
                for work in list(self._readers):
                    work.stop()
                for attached in self._attached.values():
                    attached.close()
                self._attached.clear()
                self._smp.close()
            finally:
                self._agree.close()  # it holds our references to our groups: destroyed here

    @property
    def _dp_gloo(self):
        """The gloo mirror of the data-parallel group (None where dp_size is 1), held by the agreement."""
        return self._agree.dp_mirror

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _disagreement(d: "fingerprint.Disagreement", rows: list[list[int]], names: str) -> str:
    """One share's disagreement in words; `rows[dp_rank]`: [_, rank, node, ...] of each replica."""
    def who(dp_ranks) -> str:
        return ", ".join(f"rank {rows[r][1]} (node {rows[r][2]})" for r in dp_ranks)

    if d.suspects:
        verdict = f"{who(d.suspects)} {'differs' if len(d.suspects) == 1 else 'differ'} from the other " \
                  f"{len(rows) - len(d.suspects)} replicas (the suspect)"
    else:
        verdict = " against ".join(f"[{who(g)}]" for g in d.groups) + " (no majority: which is wrong cannot be told)"
    return f"the share stored by {who([d.share])}: {verdict}, in {names}"

