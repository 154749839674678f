"""The trainer-side API: save a rank's state into its node's SMP every N steps, restore it after a crash.

save() returns once the bytes are out of device memory; checksums, the commit to the SMP and the
job-wide agreement that a step is complete run in a background thread. A step counts only when every
rank committed it, and the SMP never overwrites the newest such step, so some complete step always
survives a crash at any instant.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import SnapshotConfig
from ..errors import BudgetExceeded, InmemFTError, LayoutMismatch, SnapshotCorrupt
from ..smp.client import SMPClient
from ..smp.segments import Segment, path_of
from ..snapshot import layout, segment as seg
from ..snapshot.tree import flatten
from ..telemetry import Heartbeat
from .agreement import Agreement, all_gather_bytes
from .copier import Copier

log = logging.getLogger("inmem_ft.capture")
NO_STEP = -1


@dataclass
class Metrics:
    snapshots: int = 0
    failures: int = 0
    last_stall_s: float = 0.0
    total_stall_s: float = 0.0
    last_commit_s: float = 0.0
    last_bytes: int = 0
    stalls_s: list[float] = field(default_factory=list)
    flushes: int = 0
    last_flush_s: float = 0.0


@dataclass
class RestoreInfo:
    step: int
    source: str
    seconds: float
    bytes: int
    path: str | None = None
    """A file that holds the restored snapshot (its shared-memory slot), for loaders that want a path."""


class _Attached:
    """A slot mapped into this process, with a uint8 tensor over it for torch copies."""

    def __init__(self, name: str):
        self.segment = Segment(name)
        self.bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.populated = False

    def for_writing(self) -> "_Attached":
        # Prefault once, so snapshot copies run at memcpy speed; a restore only reads and need not pay it.
        if not self.populated:
            self.segment.populate()
            self.populated = True
        return self

    def close(self) -> None:
        del self.bytes
        self.segment.close()


class Snapshotter:
    """Per-rank handle on the node's SMP. Create it on every rank after init_process_group."""

    def __init__(self, config: SnapshotConfig | None = None, *, dp_group=None, disk=None):
        """disk: optional persistent tier (inmem_ft.persist.DiskTier or alike: due(step), write(step,
        state), publish(step)); complete snapshots it marks due are flushed from the commit thread."""
        self.disk = disk
        self.config = config or SnapshotConfig.from_env()
        self._agree = Agreement(self.config.timeout_s)
        self.rank, self.world_size = self._agree.rank, self._agree.world_size
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._dp_gloo = self._agree.mirror(dp_group) if self.dp_size > 1 else None
        self._smp = SMPClient(self.config.socket_path, timeout_s=self.config.timeout_s)
        self._smp.call("ping")  # no SMP: fail now, with the command that starts one
        self._copier = Copier(self.config.staging_budget)
        self._attached: dict[str, _Attached] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inmem_ft-commit")
        self._pending: Future | None = None
        self._fence_work = None
        self._copied = threading.Event()
        self._complete: int | None = None
        self._reserved = False
        self.metrics = Metrics()
        self.last_restore: RestoreInfo | None = None
        self._heartbeat = Heartbeat.from_env(self.rank)

    # ---- saving -----------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.config.interval == 0

    def maybe_save(self, step: int, state_fn, *, overlap: bool = False) -> bool:
        """Save `state_fn()` if `step` is a snapshot step; the state is only built when needed.

        Call it every step: it is also the rank's heartbeat for supervisors that watch for hangs.
        """
        self.heartbeat(step=step)
        if not self.due(step):
            return False
        self.save(step, state_fn(), overlap=overlap)
        return True

    def heartbeat(self, **fields) -> None:
        """Tell a supervisor watching for hangs that this rank is alive (no-op without one)."""
        if self._heartbeat:
            self._heartbeat.beat(**fields)

    def save(self, step: int, state, *, overlap: bool = False) -> None:
        """Snapshot `state` as of now. Returns once its bytes are out of device memory, or with `overlap`
        at once: the copy then runs behind training and fence() must be called before the state changes
        (see fence_optimizer)."""
        t0 = time.perf_counter()
        self.wait()
        flat = flatten(state)
        plan = layout.plan(flat, step=step, rank=self.rank, world_size=self.world_size, dp_rank=self.dp_rank,
                           dp_size=self.dp_size)
        manifest_len = len(seg.encode_manifest(plan.manifest))
        target, work, error = None, None, None
        try:
            reply = self._smp.call("begin", rank=self.rank, step=step, manifest_len=manifest_len,
                                   data_len=plan.data_len, keep_step=self._complete, reserve=not self._reserved,
                                   local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
            target = self._attach(reply["segment"])
            if not overlap:
                target.for_writing()  # else the commit thread prefaults, off the training path
            data = target.bytes[reply["data_off"]: reply["data_off"] + plan.data_len]
            work = self._copier.copy(flat.leaves, plan.copies, data, defer=overlap)
            self._reserved = True
        except BudgetExceeded:
            if not self._reserved:
                raise  # the first snapshot reserves the slots: a budget that cannot fit is a setup error
            error = sys.exc_info()[1]
        except InmemFTError as e:
            error = e
        stall = time.perf_counter() - t0
        m = self.metrics
        m.last_stall_s, m.last_bytes = stall, plan.data_len
        m.total_stall_s += stall
        m.stalls_s.append(stall)
        if self._heartbeat:
            self._heartbeat.beat(step=step, snapshot_step=step, stall_s=stall, bytes=plan.data_len)
        self._copied = threading.Event()
        self._fence_work = work if overlap and error is None else None
        if self._fence_work is None:
            self._copied.set()
        # Submitted even after an error: every rank must take part in the step's agreement.
        self._pending = self._pool.submit(self._finish, step, plan, target, reply if target else None, work,
                                          error)

    def fence(self) -> None:
        """Before the snapshotted state changes: wait for an overlapped snapshot's copy. Cheap otherwise."""
        work, self._fence_work = self._fence_work, None
        if work is None:
            return
        t0 = time.perf_counter()
        self._copier.fence(work)
        self._copied.wait()
        waited = time.perf_counter() - t0
        self.metrics.last_stall_s += waited
        self.metrics.total_stall_s += waited
        self.metrics.stalls_s[-1] += waited

    def fence_optimizer(self, optimizer) -> None:
        """Fence automatically before every `optimizer.step()` (a torch.optim step pre-hook)."""
        optimizer.register_step_pre_hook(lambda *_: self.fence())

    def _finish(self, step, plan, target, reply, work, error) -> None:
        t0 = time.perf_counter()
        if error is None:
            try:
                data = target.bytes[reply["data_off"]: reply["data_off"] + plan.data_len]
                try:
                    target.for_writing()
                    self._copier.copy_host(work, data)
                finally:
                    self._copied.set()
                self._copier.drain(work, data)
                seg.region_hashes(target.segment.buf[reply["data_off"]:], plan.manifest)
                raw = seg.encode_manifest(plan.manifest)
                target.segment.buf[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
                self._smp.call("commit", rank=self.rank, step=step)
            except InmemFTError as e:
                error = e
        agreed = self._agree.min(NO_STEP if error else step)
        if agreed == step:
            self._complete = step
            try:
                self._smp.call("complete", step=step)
            except InmemFTError as e:
                error = e
        self.metrics.last_commit_s = time.perf_counter() - t0
        if error is None and agreed == step and self.disk is not None and self.disk.due(step):
            self._flush(step, target, reply["data_off"], plan)
        if error is not None:
            self.metrics.failures += 1
            log.error("snapshot rank=%d step=%d event=failed: %s", self.rank, step, error)
            raise error
        self.metrics.snapshots += 1
        log.info("snapshot rank=%d step=%d event=committed complete=%s stall_s=%.4f commit_s=%.4f bytes=%d",
                 self.rank, step, agreed == step, self.metrics.last_stall_s, self.metrics.last_commit_s,
                 plan.data_len)

    def _flush(self, step: int, target: "_Attached", data_off: int, plan) -> None:
        """Write a complete step to the disk tier: read this rank's committed slot back (the live tensors have
        moved on), gather the replicated region, let the tier write; once every rank wrote, rank 0 publishes."""
        t0 = time.perf_counter()
        manifest = plan.manifest
        data = target.bytes[data_off: data_off + plan.data_len]
        replicated = self._gather_replicated(manifest, data)  # collective: outside the try, all ranks join
        ok = True
        try:
            self.disk.write(step, layout.unpack(manifest, data, replicated))
        except Exception as e:  # a full disk or a bad path must not take training down
            ok = False
            log.error("persist rank=%d step=%d event=failed: %s: %s", self.rank, step, type(e).__name__, e)
        everyone = self._agree.min(step if ok else NO_STEP)
        if everyone == step and self.rank == 0:
            try:
                self.disk.publish(step)
            except OSError as e:
                everyone = NO_STEP
                log.error("persist rank=%d step=%d event=failed: latest not written: %s", self.rank, step, e)
        self.metrics.last_flush_s = time.perf_counter() - t0
        if everyone == step:
            self.metrics.flushes += 1
            log.info("persist rank=%d step=%d event=flushed seconds=%.3f", self.rank, step,
                     self.metrics.last_flush_s)
        elif self.config.on_error == "raise":
            raise InmemFTError(f"step {step} could not be flushed to the disk tier (see the persist errors)")

    def agree_min(self, value: int) -> int:
        """Collective over the whole job: the smallest `value` of all ranks (for restart decisions)."""
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

    def _attach(self, name: str) -> _Attached:
        if name not in self._attached:
            # A resized slot gets a new name; the old mapping is dead weight.
            for old in [n for n in self._attached if n.rsplit(".g", 1)[0] == name.rsplit(".g", 1)[0]]:
                self._attached.pop(old).close()
            self._attached[name] = _Attached(name)
        return self._attached[name]

    # ---- restoring --------------------------------------------------------------------------------------
    def restore(self):
        """Collective: the state of the newest step every rank holds intact, or None to start fresh."""
        self.wait()
        t0 = time.perf_counter()
        entries = self._smp.call("list", rank=self.rank)["slots"]  # newest first
        # Usually every rank's newest slot is intact and of the same step: verify only that one, and read
        # (checksum) the older one only when the ranks disagree.
        local = self._verified(entries[:1])
        rows = self._gather_candidates(local)
        if len({row[0] for row in rows}) != 1 or rows[0][0] == NO_STEP:
            local = self._verified(entries)
            rows = self._gather_candidates(local)
        common = set.intersection(*({s for s in row[:2] if s != NO_STEP} for row in rows))
        if not common:
            if any(s != NO_STEP for row in rows for s in row[:2]):
                log.warning("restore rank=%d event=none_complete steps_per_rank=%s: no step is intact on every "
                            "rank; starting from scratch", self.rank, [row[:2] for row in rows])
            self._smp.call("restored", rank=self.rank, step=None)
            self._complete = None
            if self._heartbeat:
                self._heartbeat.beat(step=0, restored=None)
            return None
        step = max(common)
        attached, manifest, source = next((a, m, src) for s, a, m, src in local if s == step)
        header = seg.Header.read(attached.segment.buf)
        data = attached.bytes[header.data_off: header.data_off + header.data_len]
        replicated = self._gather_replicated(manifest, data)
        state = layout.unpack(manifest, data, replicated)
        self._smp.call("restored", rank=self.rank, step=step)
        self._complete = step
        self.last_restore = RestoreInfo(step, source, time.perf_counter() - t0, header.data_len,
                                        path_of(attached.segment.name))
        log.info("restore rank=%d step=%d source=%s seconds=%.3f bytes=%d", self.rank, step,
                 source.replace(" ", "_"), self.last_restore.seconds, header.data_len)
        if self._heartbeat:
            self._heartbeat.beat(step=step, restored=vars(self.last_restore))
        return state

    def _gather_candidates(self, local) -> list[list[int]]:
        """Every rank's verified steps (two, padded) and the world size of a foreign-layout snapshot, if any."""
        mismatch = next((m["world_size"] for _, _, m, _ in local if m["world_size"] != self.world_size), 0)
        steps = [s for s, _, _, _ in local][:2]
        rows = self._agree.gather(steps + [NO_STEP] * (2 - len(steps)) + [mismatch])
        for rank, row in enumerate(rows):
            if row[2]:
                raise LayoutMismatch(
                    f"the snapshots in memory were taken with world size {row[2]} (rank {rank}), this job has "
                    f"{self.world_size}; restart with the original layout (this release cannot reshard a snapshot "
                    f"to another layout). Nothing was discarded.")
        return rows

    def _verified(self, entries: list[dict]):
        out = []
        for entry in entries:
            attached = self._attach(entry["segment"])
            try:
                _, manifest = seg.verify(attached.segment.buf, f"rank {self.rank} slot {entry['segment']}")
            except SnapshotCorrupt as e:
                log.warning("restore rank=%d step=%d event=corrupt: %s; falling back to an older snapshot",
                            self.rank, entry["step"], e)
                continue
            out.append((entry["step"], attached, manifest, entry["source"]))
        return out

    def _gather_replicated(self, manifest: dict, data: torch.Tensor) -> torch.Tensor | None:
        rep = manifest.get("replicated")
        if not rep:
            return None
        if rep["dp_size"] != self.dp_size:
            raise LayoutMismatch(f"step {manifest['step']} split replicated state over {rep['dp_size']} "
                                 f"data-parallel ranks, this job has {self.dp_size}; restart with the original "
                                 f"layout (this release cannot reshard a snapshot)")
        _, _, chunk = layout.share_bounds(rep["total"], self.dp_rank, self.dp_size)
        mine = rep["hi"] - rep["lo"]
        share = torch.empty(chunk, dtype=torch.uint8)
        share[:mine] = data[rep["o"]: rep["o"] + mine]
        share[mine:] = 0  # the last share's padding
        if self.dp_size == 1:
            return share
        return all_gather_bytes(share, self._dp_gloo)[: rep["total"]]

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._heartbeat:
            self._heartbeat.beat(done=True)  # what follows (last commit, teardown) is no hang
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            for attached in self._attached.values():
                attached.close()
            self._attached.clear()
            self._smp.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

