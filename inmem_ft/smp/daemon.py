"""The snapshot management process (SMP): one per node, outside the trainers, owning their snapshot memory.

Each rank has two slots. The slot header in shared memory is the only record of a slot's state, so the
daemon can be killed and restarted and re-adopt what is there. Trainers write tensor bytes and the manifest
straight into a slot; the daemon hands out slots, seals commits, and never overwrites the newest step the
job has declared complete on every rank.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import socketserver
import struct
import threading
import time

from .. import events
from ..errors import ConfigError, ForeignSegment, InmemFTError, SnapshotCorrupt, SnapshotLost, UnknownFormat
from ..snapshot import segment as seg
from ..snapshot.checksum import checksum
from ..units import human
from . import fields, paths, protocol, segments
from .trust import TrustRecord
from .segments import (Segment, capacity, held_bytes, how_to_enlarge, names_with_prefix, path_of, read_record, unlink,
                       write_record)

log = logging.getLogger("inmem_ft.smp")
SLOTS_PER_RANK = 2
# How long a `list` on a replacement node waits for its rebuild (the trainer's own timeout is longer).
REBUILD_WAIT_S = 540.0
# The events SMP.counts counts: commits sealed, snapshots skipped (a begin found both slots pinned), slots found
# torn (a write that never committed) and corrupt (failing a checksum), each discarded; sentinel trips (a restored
# step found bad by the check after a restore, capture/sentinel.py); replica mismatches (a step whose data-parallel
# replicas disagreed, capture/fingerprint.py).
COUNTS = ("commits", "skipped", "torn", "corrupt", "sentinel_trips", "replica_mismatches")


# Error classes the client raises again from a reply's `code` (smp/client.py maps them back).
_CODES = {SnapshotCorrupt: "corrupt", SnapshotLost: "lost", UnknownFormat: "format"}


class _Server(socketserver.ThreadingUnixStreamServer):
    # socketserver's backlog of 5 refuses connections (EAGAIN, at once) when a node's ranks all connect while
    # the accept loop is busy: 8 ranks of a loaded node did.
    request_queue_size = 256


class RequestError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Slot:
    def __init__(self, segment: Segment, generation: int, source: str = "memory"):
        self.segment, self.generation = segment, generation
        self.source = source  # "memory", or "peer_reconstruction" for a slot rebuilt from the EC group
        # When its step was committed, for the age of the newest snapshot. A slot adopted at start takes its
        # segment file's mtime, which writes through the mapping need not move: the age is then an upper bound.
        self.committed_at = os.stat(path_of(segment.name)).st_mtime

    @property
    def header(self) -> seg.Header | None:
        return seg.Header.read(self.segment.buf)

    def committed_step(self) -> int | None:
        h = self.header
        return h.step if h is not None and h.state == seg.COMMITTED else None

    def blank(self) -> None:
        self.segment.buf[: seg.HEADER_SIZE] = bytes(seg.HEADER_SIZE)


class SMP:
    def __init__(self, job: str, node: int, socket_path: str, budget_bytes: int):
        self.job, self.node, self.socket_path, self.budget = paths.check_job(job), node, socket_path, budget_bytes
        self.prefix = paths.segment_prefix(job, node)
        self.slots: dict[int, list[Slot | None]] = {}
        self.writers: dict[int, tuple[int, int]] = {}  # rank -> (slot index, connection id)
        self.moved: dict[int, int] = {}  # rank -> the complete step it committed on another node
        self.complete_step: int | None = None
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.started = time.time()
        self.protector = None  # a cluster.protection.Protector when erasure coding is on
        self.peers = None  # cluster.peers.Peers: links to the other SMPs (local-only without --peers)
        self.reads = None  # cluster.slotreads.SlotReads: serves catalog/read/pull, which may wait on peers
        self.stopping = False
        self.local_ranks = 0  # trainers say how many ranks share this node; the budget error needs it
        self.disk = None  # disktier.DiskTier: periodic flush, SIGTERM flush, adoption at start
        self.flushes = None  # cluster.flushnow.FlushNow: serves `flush` (every node's disk tier, now) over the peers
        self.node_lock = None  # nodelock.NodeLock: held while this SMP serves the node
        self.metrics = None  # metrics.Exporter: the Prometheus endpoint and/or textfile, when asked for
        # What happened since this SMP started, each also a log line: `smp status` and the metrics show them.
        self.counts = dict.fromkeys(COUNTS, 0)
        self.trust = TrustRecord(job, node)  # bad steps (smp/trust.py)

    # ---- memory ---------------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        parity = self.protector.parity_bytes() if self.protector is not None else 0
        return parity + sum(s.segment.size for slots in self.slots.values() for s in slots if s is not None)

    def _allocate(self, rank: int, index: int, size: int) -> Slot:
        old = self.slots[rank][index]
        in_use = self.used_bytes() - (old.segment.size if old else 0)
        if in_use + size > self.budget:
            ranks = max(self.local_ranks, len(self.slots))
            raise RequestError("budget", (
                f"node {self.node} memory budget too small: rank {rank} needs {SLOTS_PER_RANK} slots of "
                f"{human(size)} but {human(in_use)} of the {human(self.budget)} budget are in use; start the SMP "
                f"with --memory-budget of at least {human(SLOTS_PER_RANK * size * ranks)} "
                f"({SLOTS_PER_RANK} slots x {ranks} local rank(s), plus parity when erasure coding)"))
        generation = old.generation + 1 if old else 0
        if old is not None:
            old.segment.close()
            old.segment.unlink()
            self.slots[rank][index] = None  # gone: a new segment that cannot be created leaves the slot empty
        name = paths.segment_name(self.job, self.node, rank, index, generation)
        while os.path.exists(path_of(name)):  # a kept segment of another release holds this name
            generation += 1
            name = paths.segment_name(self.job, self.node, rank, index, generation)
        try:
            slot = Slot(Segment(name, size, create=True), generation)
        except MemoryError as e:
            # Not "budget" (BudgetExceeded, which ends a trainer at its first snapshot): a tmpfs that something
            # else filled may have room again for the next snapshot, so the trainer skips this one and goes on.
            raise RequestError("space", str(e)) from None
        self.slots[rank][index] = slot
        log.info("smp node=%d event=allocate rank=%d slot=%d bytes=%d", self.node, rank, index, size)
        return slot

    # ---- re-adoption ----------------------------------------------------------------------------------
    # ---- the job's newest complete step, kept beside the slots so a restarted SMP still knows it --------
    def _record_complete(self, step: int | None) -> None:
        """A restore that finds this step missing somewhere must fail rather than start the job over; an SMP
        restart must not make it forget (a crash during the very first snapshot, which never completed, is
        the case where starting over is right)."""
        self.complete_step = step
        if step is None:
            unlink(paths.complete_record_name(self.job, self.node))
        else:
            write_record(paths.complete_record_name(self.job, self.node), str(step))

    def _read_complete(self) -> None:
        try:
            self.complete_step = read_complete(self.job, self.node)
        except ForeignSegment as e:
            self.complete_step = None
            log.warning("smp node=%d event=refused segment=%s reason=%s", self.node,
                        paths.complete_record_name(self.job, self.node), e)

    def adopt_existing(self) -> None:
        self._read_complete()
        self.trust.load()
        try:
            rebuilding = read_record(paths.rebuild_record_name(self.job, self.node)) is not None
        except ForeignSegment:
            rebuilding = False
        for name in names_with_prefix(self.prefix):
            parsed = paths.parse_segment_name(name)
            if parsed is None:
                continue
            rank, index, generation = parsed
            slots = self.slots.setdefault(rank, [None] * SLOTS_PER_RANK)
            segment = None
            try:
                if index >= SLOTS_PER_RANK or slots[index] is not None:
                    raise SnapshotCorrupt(f"{name}: unexpected slot (a leftover of an older generation)")
                segment = Segment(name)
                if seg.is_blank(segment.buf) and rebuilding:
                    # A rebuild writes each slot's header last: it goes on with these (cluster/rebuild.py).
                    slots[index] = Slot(segment, generation, "peer_reconstruction")
                    log.info("smp node=%d event=keep segment=%s reason=blank, a rebuild under way fills it",
                             self.node, name)
                    continue
                if seg.is_blank(segment.buf):
                    log.info("smp node=%d event=empty segment=%s reason=slot reserved or discarded, holds "
                             "nothing", self.node, name)
                    segment.close()
                    unlink(name)
                    continue
                header, _ = seg.verify(segment.buf, name)
            except ForeignSegment as e:
                # Not written by an SMP of this user: never adopted, and not ours to delete either.
                log.warning("smp node=%d event=refused segment=%s reason=%s", self.node, name, e)
                continue
            except UnknownFormat as e:
                # Another release's snapshot: never ours to load, and never ours to delete.
                log.warning("smp node=%d event=unknown_format segment=%s kept=yes reason=%s", self.node, name, e)
                segment.close()
                continue
            except (SnapshotCorrupt, ValueError, OSError) as e:
                defect = self._defect(segment)
                if defect in self.counts:
                    self.counts[defect] += 1
                log.warning("smp node=%d event=%s segment=%s reason=%s: slot discarded", self.node, defect, name, e)
                if segment is not None:
                    segment.close()
                unlink(name)
                continue
            slots[index] = Slot(segment, generation)
            log.info("smp node=%d event=adopt rank=%d slot=%d step=%d", self.node, rank, index, header.step)

    @staticmethod
    def _defect(segment: Segment | None) -> str:
        """What an unusable segment is, for its log line: torn (a write that never committed), corrupt
        (anything else that fails a check), discard (a leftover that was never opened)."""
        if segment is None:
            return "discard"
        header = seg.Header.read(segment.buf)
        return "torn" if header is not None and header.state == seg.WRITING else "corrupt"

    def _discard_corrupt(self, rank: int) -> None:
        """Say and discard every slot of `rank` whose header fails its checksum (flipped bits in memory): it
        must not just vanish from `list`."""
        for i, slot in enumerate(self.slots.get(rank, [])):
            if slot is not None and slot.header is None and not seg.is_blank(slot.segment.buf):
                log.warning("smp node=%d event=corrupt rank=%d slot=%d segment=%s reason=slot header fails its "
                            "checksum: slot discarded", self.node, rank, i, slot.segment.name)
                self.counts["corrupt"] += 1
                slot.blank()

    # ---- requests ---------------------------------------------------------------------------------------
    def handle(self, msg: dict, conn_id: int) -> tuple[dict, list]:
        """(reply, raw pieces sent after it). Cross-node operations run outside the lock: they wait on peers."""
        op = msg.get("op")
        if not isinstance(op, str):
            raise RequestError("bad_request", f"field 'op' must be a string, got {type(op).__name__}")
        for outside in (self.reads, self.flushes):
            if outside is not None and op in outside.OPS:
                return outside.handle(op, msg)
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise RequestError("bad_request", f"unknown operation {op!r}")
        with self.lock:
            return fn(msg, conn_id), []

    def answer(self, msg: dict, conn_id: int) -> tuple[dict, list]:
        """handle(), with every failure turned into an error reply: no request takes the daemon down or leaves
        a traceback in its log."""
        try:
            reply, pieces = self.handle(msg, conn_id)
            return {"ok": True, **reply}, pieces
        except RequestError as e:
            return {"ok": False, "code": e.code, "error": str(e)}, []
        except InmemFTError as e:
            return {"ok": False, "code": _CODES.get(type(e), "error"), "error": str(e)}, []
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            return {"ok": False, "code": "bad_request", "error": f"malformed request: {type(e).__name__}: {e}"}, []
        except Exception as e:  # a bug: say it in one line, keep serving the other trainers
            log.error("smp node=%d event=request_failed op=%.40r reason=%s: %s", self.node, msg.get("op"),
                      type(e).__name__, e)
            return {"ok": False, "code": "error", "error": f"the SMP failed on this request: {type(e).__name__}: "
                                                          f"{e}; see its log"}, []

    def op_ping(self, msg, conn_id):
        return {"job": self.job, "node": self.node, "pid": os.getpid()}

    def op_begin(self, msg, conn_id):
        rank, step, keep = fields.rank(msg), fields.step(msg), fields.step(msg, "keep_step", optional=True)
        man_len, data_len = fields.size(msg, "manifest_len"), fields.size(msg, "data_len")
        size = seg.slot_size(man_len, data_len)
        local_ranks = fields.integer(msg, "local_ranks", fields.MAX_RANK, optional=True)
        self.local_ranks = max(self.local_ranks, local_ranks or 0)
        slots = self.slots.setdefault(rank, [None] * SLOTS_PER_RANK)
        self.moved.pop(rank, None)  # it runs here (again)
        pins = self._pins(rank, step, slots, keep)
        if pins is None:
            self.counts["skipped"] += 1
            return {"skipped": (f"erasure_coding_lag: both slots of rank {rank} hold steps that must survive (step "
                                f"{keep}, complete, is not protected yet; step {self.protector.protected} is): "
                                f"step {step} is not snapshotted")}
        flushing = self.disk.pinned if self.disk is not None else frozenset()
        if flushing:
            # The writer thread reads a step being flushed straight from its slots: never overwritten meanwhile.
            pins = pins | flushing
            if all(s is not None and s.committed_step() in pins for s in slots):
                log.warning("smp node=%d event=skipped rank=%d step=%d reason=disk_flush_lag: step %s is still being "
                            "flushed, step %s is complete; both slots are pinned", self.node, rank, step,
                            ",".join(map(str, sorted(flushing))), keep)
                self.counts["skipped"] += 1
                return {"skipped": (f"disk_flush_lag: both slots of rank {rank} hold steps that must survive (steps "
                                    f"{sorted(flushing)} are being flushed to disk, step {keep} is complete): step "
                                    f"{step} is not snapshotted")}
        if msg.get("reserve"):
            for i in range(SLOTS_PER_RANK):
                if slots[i] is None or slots[i].segment.size < size:
                    if slots[i] is None or slots[i].committed_step() not in pins:
                        self._allocate(rank, i, size)
        index = self._choose(slots, pins)
        slot = slots[index]
        if slot is None or slot.segment.size < size:
            slot = self._allocate(rank, index, size)
        seg.Header(seg.WRITING, step, man_len, seg.data_offset(man_len), data_len).write(slot.segment.buf)
        self.writers[rank] = (index, conn_id)
        return {"segment": slot.segment.name, "inode": slot.segment.inode, "data_off": seg.data_offset(man_len),
                "slot": index}

    def _pins(self, rank: int, step: int, slots: list[Slot | None], keep: int | None) -> set | None:
        """Steps a begin must not overwrite: the job's complete step and, with EC, the newest protected one
        (survivors rebuild a lost node from it). None: both fill every slot while the group is still
        protecting the complete step; the begin then skips this snapshot rather than make the training
        thread wait for erasure coding. Once protecting the complete step failed (also while a retry of it
        waits), the older protected step is given up (keeping the complete step safe locally matters more
        than surviving a node loss)."""
        if self.protector is None or self.protector.groups is None:  # no group (too few nodes left): no parity
            return {keep}
        protected = self.protector.protected
        held = {s.committed_step() for s in slots if s is not None}
        if None in held or len(held) < SLOTS_PER_RANK or not held <= {keep, protected}:
            return {keep, protected}
        if self.protector.failed != keep:
            log.warning("smp node=%d event=skipped rank=%d step=%d reason=erasure_coding_lag: step %s is complete "
                        "but not yet protected, step %s is protected; both slots are pinned", self.node, rank, step,
                        keep, protected)
            return None
        log.warning("smp node=%d event=unprotect rank=%d step=%s reason=protecting complete step %s failed (see "
                    "event=protect_retry, event=protect_failed): overwriting the older protected step; a node loss "
                    "now falls to the next tier", self.node, rank, protected, keep)
        return {keep}

    @staticmethod
    def _choose(slots: list[Slot | None], pins: set) -> int:
        """A slot to write: never one holding a pinned step; else an empty one; else the older step."""
        def rank_of(i):
            step = slots[i].committed_step() if slots[i] is not None else None
            return (step is not None and step in pins, -1 if step is None else step)
        return min(range(SLOTS_PER_RANK), key=rank_of)

    def op_commit(self, msg, conn_id):
        rank, step = fields.rank(msg), fields.step(msg)
        index, _ = self.writers.get(rank, (None, None))
        if index is None:
            raise RequestError("bad_request", f"rank {rank} commits step {step} without a begin")
        slot = self.slots[rank][index]
        header = slot.header
        if header is None or header.state != seg.WRITING or header.step != step:
            raise RequestError("bad_request", f"rank {rank} step {step}: slot is not being written")
        raw = seg.manifest_view(slot.segment.buf, header)
        try:
            manifest = json.loads(bytes(raw))
        except ValueError:
            raise RequestError("corrupt", f"rank {rank} step {step}: manifest is not valid JSON") from None
        if manifest.get("rank") != rank or manifest.get("step") != step:
            raise RequestError("corrupt", f"rank {rank} step {step}: manifest names another rank/step")
        header.state, header.manifest_hash = seg.COMMITTED, checksum(raw)
        header.write(slot.segment.buf)
        slot.committed_at = time.time()
        self.counts["commits"] += 1
        del self.writers[rank]
        log.info("smp node=%d event=commit rank=%d step=%d bytes=%d", self.node, rank, step, header.data_len)
        return {}

    def op_abort(self, msg, conn_id):
        self._drop_writer(fields.rank(msg), "aborted by trainer")
        return {}

    def _drop_writer(self, rank: int, why: str) -> None:
        index, _ = self.writers.pop(rank, (None, None))
        if index is not None:
            slot = self.slots[rank][index]
            header = slot.header
            slot.blank()
            self.counts["torn"] += 1
            log.warning("smp node=%d event=torn rank=%d step=%s reason=%s: slot discarded", self.node, rank,
                        header.step if header else "?", why)

    def op_list(self, msg, conn_id):
        rank = fields.rank(msg)
        if self.protector is not None:
            # A replacement node answers once it has rebuilt its ranks' slots from the group.
            if not self.cond.wait_for(self.protector.rebuild_done.is_set, REBUILD_WAIT_S):
                raise RequestError("busy", f"node {self.node} is still rebuilding its snapshots from its EC group "
                                           f"after {REBUILD_WAIT_S:.0f} s; see its log, then restart the job")
            if self.protector.rebuild_error:
                raise RequestError("lost", self.protector.rebuild_error)
        self._discard_corrupt(rank)
        out = []
        for slot in self.slots.get(rank, []):
            step = slot.committed_step() if slot is not None else None
            if step is not None and step not in self.trust.bad:  # a step found bad is never restored again
                out.append({"segment": slot.segment.name, "step": step, "source": slot.source})
        complete = self.complete_step
        if complete in self.trust.bad:  # the job's restore must not insist on the step it may never use
            complete = max((s["step"] for s in out if s["step"] < complete), default=None)
        return {"slots": sorted(out, key=lambda s: -s["step"]), "complete_step": complete,
                "holds_any": bool(self.committed()),
                "linked": self.peers is not None and len(self.peers.addresses) > 1}

    def op_complete(self, msg, conn_id):
        self._record_complete(fields.step(msg))
        self._mark_moved(self.complete_step)
        if self.disk is not None:
            self.disk.complete(self.complete_step)
        if self.protector is None:
            self.release_moved(self.complete_step)
        else:
            self.protector.notify_complete(self.complete_step)
        return {}

    def _mark_moved(self, step: int) -> None:
        """Every rank committed `step`: a rank with slots here but no committed `step` here now runs on another
        node. It leaves this node's data from `step` on (protection encodes the ranks that run here)."""
        for rank, slots in self.slots.items():
            if rank not in self.writers and rank not in self.moved and \
                    step not in {s.committed_step() for s in slots if s is not None}:
                self.moved[rank] = step

    def release_moved(self, step: int) -> None:
        """Free the slots of ranks that moved away by `step`: once `step` is complete (with erasure coding,
        protected), their older steps here are no longer what a restore or a rebuild uses."""
        with self.lock:
            for rank in [r for r, since in self.moved.items() if since <= step]:
                del self.moved[rank]
                held = sorted({s.committed_step() for s in self.slots.get(rank, []) if s is not None} - {None})
                self.drop_slots(rank)
                log.info("smp node=%d event=released rank=%d steps=%s reason=rank committed step %d on another "
                         "node", self.node, rank, held, step)

    # ---- the slot store: what protection and cross-node reads use ------------------------------------------
    def committed_views(self, step: int, ranks=None) -> dict[int, memoryview]:
        """rank -> the used bytes of its committed slot of `step`, for every rank that runs here (or those of
        `ranks`); raises if one lacks it."""
        with self.lock:
            out = {}
            for rank, slots in self.slots.items():
                if (ranks is not None and rank not in ranks) or (ranks is None and rank in self.moved):
                    continue
                for slot in slots:
                    h = slot.header if slot is not None else None
                    if h is not None and h.state == seg.COMMITTED and h.step == step:
                        out[rank] = slot.segment.buf[: h.data_off + h.data_len]
                if rank not in out:
                    raise SnapshotCorrupt(f"node {self.node} holds no committed slot of step {step} for rank {rank}")
            return out

    def complete_steps_held(self) -> list[int]:
        """Steps every rank that runs here holds committed."""
        with self.lock:
            per_rank = [{s.committed_step() for s in slots if s is not None} - {None}
                        for rank, slots in self.slots.items() if rank not in self.moved]
        return sorted(set.intersection(*per_rank)) if per_rank else []

    def committed(self, rank: int | None = None, step: int | None = None) -> list[tuple[int, Slot]]:
        """(rank, slot) of the committed slots, optionally of one rank and/or step."""
        with self.lock:
            return [(r, slot) for r, slots in sorted(self.slots.items()) if rank is None or r == rank
                    for slot in slots if slot is not None and slot.committed_step() is not None
                    and (step is None or slot.committed_step() == step)]

    def install(self, rank: int, size: int, fill, source: str, index: int | None = None) -> Slot:
        """A fresh slot of `rank` holding a copy of a committed slot from elsewhere: `fill(buf)` writes its bytes
        (outside the lock: it may wait on peers), then it is verified like a restore would. `index`: which slot,
        default one holding no step this rank keeps (its newest)."""
        slot = self.reserve_copy(rank, size, source, index)
        try:
            fill(slot.segment.buf)
        except BaseException:
            slot.blank()
            raise
        self.finish_copy(slot, None, f"node {self.node} rank {rank} slot {slot.segment.name} ({source})")
        return slot

    def reserve_copy(self, rank: int, size: int, source: str, index: int | None = None) -> Slot:
        """A blank slot of `rank`, `size` bytes, for a copy that finish_copy seals (see install)."""
        with self.lock:
            slots = self.slots.setdefault(rank, [None] * SLOTS_PER_RANK)
            self.moved.pop(rank, None)  # it runs here (again)
            if index is None:
                held = [s.committed_step() for s in slots if s is not None and s.committed_step() is not None]
                index = self._choose(slots, {max(held)} if held else set())
            try:
                slot = self._allocate(rank, index, size)
            except RequestError as e:
                raise SnapshotCorrupt(f"node {self.node} cannot hold a copy of rank {rank}'s slot: {e}") from None
        slot.source = source
        return slot

    def finish_copy(self, slot: Slot, header: bytes | None, where: str) -> None:
        """Write the copy's `header` bytes last (None: they are in place) and verify the slot like a restore
        would; a slot that fails is blanked, never served."""
        try:
            if header is not None:
                slot.segment.buf[: len(header)] = header
            seg.verify(slot.segment.buf, where)
        except BaseException:
            slot.blank()
            raise

    def drop_slots(self, rank: int) -> None:
        """Free every slot of `rank` here."""
        with self.lock:
            for slot in self.slots.pop(rank, []):
                if slot is not None:
                    slot.segment.close()
                    slot.segment.unlink()

    def op_corrupt(self, msg, conn_id):
        """A trainer found a region of its restored slot of `step` corrupted after the restore handed it over
        (capture/verdict.py): discard that slot, so that the next restore falls to another tier."""
        rank, step = fields.rank(msg), fields.step(msg)
        for i, slot in enumerate(self.slots.get(rank, [])):
            if slot is not None and slot.committed_step() == step:
                log.warning("smp node=%d event=corrupt rank=%d step=%d slot=%d segment=%s reason=a region failed its "
                            "checksum in the trainer's restore: slot discarded", self.node, rank, step, i,
                            slot.segment.name)
                self.counts["corrupt"] += 1
                slot.blank()
        return {}

    def op_bad(self, msg, conn_id):
        """A sentinel tripped after the job restored `step` (capture/sentinel.py), or with `replicas` the step's
        data-parallel replicas disagreed (capture/fingerprint.py): the step is never listed again. {"before": of a
        trip, the step of the previous one if no sentinel passed since, else None}."""
        step, why, replicas = fields.step(msg), fields.text(msg, "why"), msg.get("replicas") is True
        with self.lock:
            new = step not in self.trust.bad
            before = self.trust.mark_bad(step, why, trip=not replicas)
            if new:
                self.counts["replica_mismatches" if replicas else "sentinel_trips"] += 1
                log.warning("smp node=%d event=bad_step step=%d reason=%s: never restored again", self.node, step,
                            why)
        return {"before": before}

    def op_sentinel_passed(self, msg, conn_id):
        """The steps after a restore passed the sentinel: a later trip is the first in a row again."""
        with self.lock:
            self.trust.passed()
        return {}

    def op_restored(self, msg, conn_id):
        """The job resumed from `step` (or from scratch): newer slots belong to an abandoned timeline."""
        rank, step = fields.rank(msg), fields.step(msg, optional=True)
        for slot in self.slots.get(rank, []):
            committed = slot.committed_step() if slot is not None else None
            if committed is not None and (step is None or committed > step):
                slot.blank()
                log.info("smp node=%d event=discard rank=%d step=%d reason=job resumed from %s", self.node,
                         rank, committed, "scratch" if step is None else f"step {step}")
        self._record_complete(step)
        if self.protector is not None:
            self.protector.restored(step)
        return {}

    def op_members(self, msg, conn_id):
        """The job runs on the SMPs of `nodes` now (the agent, at each rendezvous of a job with a node range):
        erasure coding forms its groups over them (cluster/protection.py, Protector.regroup)."""
        nodes = msg.get("nodes")
        if not isinstance(nodes, list) or not nodes or not all(type(n) is int and 0 <= n <= fields.MAX_NODE
                                                                for n in nodes) or self.node not in nodes:
            raise RequestError("bad_request", f"'nodes' must list the job's node ids, this node ({self.node}) "
                                              f"among them, got {nodes!r:.200}")
        if self.protector is None:
            return {"group": None, "changed": False, "text": ""}
        try:
            return self.protector.regroup(nodes)
        except ValueError as e:  # a member without an address in --peers
            raise RequestError("bad_request", str(e)) from None

    def op_status(self, msg, conn_id):
        return self.status()

    def status(self) -> dict:
        """What `smp status`, inmem_ft.status() and the metrics show (inmem_ft/smp/control.py documents the
        fields): read from the live slots at each call, so the three always agree."""
        with self.lock:
            return self._status()

    def _status(self) -> dict:
        now = time.time()
        ranks = []
        for rank in sorted(self.slots):
            slots = []
            for i, slot in enumerate(self.slots[rank]):
                if slot is None:
                    continue
                h = slot.header
                state = {seg.COMMITTED: "committed", seg.WRITING: "writing"}.get(h.state if h else 0, "empty")
                slots.append({"slot": i, "state": state, "step": h.step if h and h.state else None,
                              "bytes": h.data_len if h and h.state else 0, "capacity": slot.segment.size})
            ranks.append({"rank": rank, "slots": slots})
        held = self.complete_steps_held()
        held_step = held[-1] if held else None
        return {"job": self.job, "node": self.node, "pid": os.getpid(), "budget": self.budget,
                "used": self.used_bytes(), "complete_step": self.complete_step, "ranks": ranks,
                "uptime_s": round(now - self.started, 1), "held_step": held_step,
                "held_age_s": None if held_step is None else round(now - self._committed_at(held_step), 1),
                "counters": dict(self.counts), "bad_steps": sorted(self.trust.bad),
                "ec": self.protector.status() if self.protector is not None else None,
                "disk": self.disk.status() if self.disk is not None else None,
                "peers": self.peers.links() if self.peers is not None else []}

    def _committed_at(self, step: int) -> float:
        """When the last rank running here committed `step`: from then on every rank held it."""
        return max(slot.committed_at for rank, slot in self.committed(step=step) if rank not in self.moved)

    def op_shutdown(self, msg, conn_id):
        self._stop_protecting()  # before a wipe: a protection begun after it would make parity nobody frees
        if self.disk is not None:
            self.disk.drain()  # the writer thread reads slots that a wipe unmaps; never under it
        if msg.get("wipe"):
            self.wipe()
        self.stopping = True  # the handler stops the server once this reply is out
        return {}

    def wipe(self) -> None:
        for rank in list(self.slots):
            self.drop_slots(rank)
        self._record_complete(None)
        self.trust.wipe()
        if self.protector is not None:
            self.protector.wipe()
        log.info("smp node=%d event=wipe", self.node)

    def disconnected(self, conn_id: int) -> None:
        with self.lock:
            for rank, (_, owner) in list(self.writers.items()):
                if owner == conn_id:
                    self._drop_writer(rank, "trainer disconnected mid-write")

    def terminate(self) -> None:
        """SIGTERM: a preempted, cancelled or re-queued job. Flush first: memory may not outlive the job."""
        self._stop_protecting()
        if self.disk is not None and not self.stopping:
            self.stopping = True
            try:
                self.disk.spill()
            except Exception as e:  # whatever went wrong, the SMP still stops
                log.error("smp node=%d event=spill_failed dir=%s reason=%s: %s", self.node, self.disk.dir,
                          type(e).__name__, e)
        self.server.shutdown()

    def _stop_protecting(self) -> None:
        """No protection (or retry of one) begins once the SMP is stopping: none may outlive it."""
        if self.protector is not None:
            self.protector.stop()

    # ---- serving ----------------------------------------------------------------------------------------
    def serve(self) -> None:
        paths.make_private_dir(os.path.dirname(self.socket_path))
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # stale socket of a dead SMP; a live one was ruled out by the caller
        smp = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                uid = struct.unpack("3i", self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                if uid != os.getuid():
                    log.warning("smp node=%d event=refused peer_uid=%d", smp.node, uid)
                    return
                conn_id = id(self)
                try:
                    while True:
                        try:
                            msg = protocol.recv(self.request)
                        except protocol.BadMessage as e:
                            protocol.send(self.request, {"ok": False, "code": "bad_request", "error": str(e)})
                            if e.framed:
                                continue
                            return  # the rest of the stream cannot be framed
                        reply, pieces = smp.answer(msg, conn_id)
                        protocol.send(self.request, reply, pieces)
                        if smp.stopping:
                            threading.Thread(target=smp.server.shutdown, daemon=True).start()
                            return
                except (protocol.ProtocolError, OSError):
                    pass
                finally:
                    smp.disconnected(conn_id)

        old_umask = os.umask(0o177)  # the socket file is created owner-only
        try:
            self.server = _Server(self.socket_path, Handler)
        finally:
            os.umask(old_umask)
        self.server.daemon_threads = True
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=self.terminate).start())
        if self.peers is not None:
            self.peers.start()
        if self.protector is not None:
            self.protector.start()
        events.emit(events.Source("smp", self.node), "smp", "ready", say=log.info, job=self.job,
                    socket=self.socket_path, budget=self.budget, pid=os.getpid())
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self._stop_protecting()
            self.server.server_close()
            if self.peers is not None:
                self.peers.close()
            if self.disk is not None:
                self.disk.close()
            if self.metrics is not None:
                self.metrics.close()
            if self.node_lock is not None:
                self.node_lock.release()  # before the socket goes: `smp stop` returns once it is gone
            if os.path.exists(self.socket_path):
                os.unlink(self.socket_path)
            events.emit(events.Source("smp", self.node), "smp", "stopped", say=log.info)


def read_complete(job: str, node: int) -> int | None:
    """The newest step the job completed, as the node's SMP recorded it beside the slots (None: none, or
    unreadable)."""
    text = read_record(paths.complete_record_name(job, node))
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def check_budget_fits(budget_bytes: int, job: str, node: int) -> None:
    """Refuse a budget the segments' file system cannot hold, before the daemon starts: a tmpfs that fills up
    would otherwise refuse a snapshot only once the trainers are running. What this node's kept snapshots hold
    counts as room: its SMP adopts or reuses them."""
    free, total = capacity()
    if budget_bytes > total:
        raise ConfigError(
            f"memory budget {human(budget_bytes)} exceeds the {human(total)} {segments.SHM_DIR} can hold at all; "
            f"lower --memory-budget or {how_to_enlarge(budget_bytes)}")
    room = free + held_bytes(paths.segment_prefix(job, node))
    if budget_bytes > room:
        raise ConfigError(
            f"memory budget {human(budget_bytes)} exceeds the {human(room)} free in {segments.SHM_DIR} (of "
            f"{human(total)}); free it (`inmem-ft smp status` lists snapshots no SMP serves, `inmem-ft smp clean` "
            f"removes them), lower --memory-budget, or {how_to_enlarge(total - room + budget_bytes)}")
