"""Restore: every rank agrees on the newest step all ranks hold intact, and reads it back fast.

A rank verifies every region's checksum of its own slot; data-parallel shares held by the same node's SMP
are read straight out of their slots (their owners verify them); only shares on other nodes travel. Every
rank then votes on whether its slot verified; a corrupt slot anywhere makes all ranks fall back to the next
older step they all hold.

By default the state handed back is private memory: a copy made while verifying (each piece hashed right
after it is copied, while it is in cache), so a framework that keeps restored tensors (torch optimizers do)
can never write into a snapshot. With `views`, the state views a copy-on-write mapping of the slot instead
and nothing is copied here: the framework's load copies into tensors it already owns (or finds them already
pointed at the views), which is the fastest restore there is (no page of fresh memory faults in), and
`capture.views.PrivateAfterLoad` gives whatever it kept pages of its own. With
`defer_checks` as well, only the small regions are verified before the hand-over; the large ones are checked
behind the framework's load and the first forward/backward, and the ranks vote on them at the next fence
(`capture.verdict`), before anything the restored state produces can last.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import device
from ..errors import InmemFTError, LayoutMismatch, SMPUnavailable, SnapshotCorrupt, SnapshotLost, UnknownFormat
from ..smp.client import SMPClient
from ..smp.segments import path_of
from ..snapshot import layout, segment as seg
from ..snapshot.topology import Topology, layout_key
from . import resume, sentinel, verdict
from .agreement import Agreement, all_gather_bytes

log = logging.getLogger("inmem_ft.capture")
NO_STEP = -1
SAID_MAX = 4096  # bytes of a rank's failure to list that its peers learn (the SMP's messages are one line)
# What an SMP's list is refused with, by name: a peer raises the failing rank's error as its own class.
_SAID = {cls.__name__: cls for cls in (SMPUnavailable, SnapshotLost, SnapshotCorrupt, UnknownFormat)}


class NoUsableSnapshot(InmemFTError):
    """Snapshots of a complete step exist in memory but not on every rank: starting over would lose them."""


class Row(NamedTuple):
    """What one rank tells the others before they choose the step (one round of the agreement)."""

    newest: int  # its two newest steps of this job's layout (NO_STEP: none)
    older: int
    other_step: int  # its newest step of another layout
    complete: int  # the newest step its SMP knows the job completed
    holds_any: int  # 1 if its SMP holds snapshots of any rank
    other_world: int  # the world size of that other layout's snapshot (0: none)
    opened: int  # the step this rank opened of another layout before the agreement (NO_STEP: none)
    said: int  # the length of its failure to list its snapshots (0: none)

    @property
    def steps(self) -> set[int]:
        return {s for s in (self.newest, self.older) if s != NO_STEP}


@dataclass(frozen=True)
class RestoreContext:
    """What a restore needs of its Snapshotter, which hands it over (Snapshotter.restore_context)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    node: int
    start_fresh: bool
    smp: SMPClient
    agree: Agreement
    dp_group: Any
    """The data-parallel group's gloo mirror (None where dp_size is 1)."""
    attach: Callable[[str], Any]
    """Segment name -> this process's mapping of it (capture.snapshotter._Attached)."""
    resumed: Callable[[resume.RestoreInfo], None]
    """The job resumes from that step (Snapshotter.resumed)."""
    fresh: Callable[[], None]
    """Nothing to resume: the job starts from scratch."""
    defer: Callable[[verdict.DeferredChecks], None]
    """Checks behind the framework's load: their verdict at the next fence; stopped by close()."""
    after_load: Callable[[Callable[[], None]], None]
    """Call it once the framework's load is done (Snapshotter.after_load)."""


@dataclass
class _Candidate:
    step: int
    attached: object
    manifest: dict
    source: str


class _Clock:
    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self.last, 4)
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.t0


class Restorer:
    """The restore protocol over a Snapshotter's SMP client, agreement group and slot mappings (its
    RestoreContext)."""

    def __init__(self, ctx: RestoreContext, layout: Topology | None = None, reshard: resume.Opener | None = None,
                 summary: bool = True):
        """layout: this job's parallel layout; slots taken on another are not restored as they are (default:
        only the world size is compared). reshard: how the caller opens another layout's snapshots to reshard
        them (None: it does not); this rank opens the newest of them before the ranks agree when its newest slot
        is of another layout, so that the one agreement also settles what the reshard reads
        (ReshardSource.settled).
        summary: this restore's line is the user's summary of it, logged at WARNING so that it shows with no
        logging configured (an adapter that logs its own after the framework's load passes False: INFO)."""
        self.ctx, self.layout, self._summary = ctx, layout, summary
        self._reshard = reshard
        self._foreign: _Candidate | None = None  # this rank's newest slot of another layout

    def restore(self, views: bool = False, defer_checks: bool = False, to_device: bool = False) -> resume.Resume:
        ctx, clock = self.ctx, _Clock()
        listing, failure = self._list()
        local = self._own_layout(self._candidates(listing["slots"]))
        clock.mark("list")
        opened = self._open_other(local)
        try:
            rows = self._gather_candidates(local, listing, failure, opened)
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        changed = self._changed(rows, opened)
        if changed is not None:
            return resume.Resume(reshard=changed)
        if opened is not None:
            opened.close()
        clock.mark("agree")
        # A rank that landed on another node than its snapshots (a re-queue, a replacement node) finds them on
        # the other SMPs, or in parity, and has its own SMP install them; then everyone looks again.
        # A rank lacks the step to resume when its newest slot (NO_STEP: none) is not that step, or when it
        # holds none while some SMP holds snapshots. Every rank reads every rank's from the rows, so the round
        # that says whether any rank pulled runs only when some rank lacks (not on a plain restart).
        want = max(max(row.newest, row.complete) for row in rows)
        holds_any = any(row.holds_any for row in rows)
        lacks = [(want != NO_STEP and row.newest != want) or (row.newest == NO_STEP and holds_any) for row in rows]
        if any(lacks) and -ctx.agree.min(-int(lacks[ctx.rank] and self._pull())):
            listing, failure = self._list()
            local = self._own_layout(self._candidates(listing["slots"]))
            rows = self._gather_candidates(local, listing, failure)
            changed = self._changed(rows, None)
            if changed is not None:
                return resume.Resume(reshard=changed)
            clock.mark("pull")
        steps = set.intersection(*(row.steps for row in rows))
        while steps:
            step = max(steps)
            state, candidate, nbytes, later = self._load(step, local, clock, views, defer_checks, to_device)
            if ctx.agree.min(int(state is not None)):
                return resume.Resume(state, self._finish(step, candidate, nbytes, clock, later))
            log.warning("restore rank=%d step=%d event=corrupt_elsewhere: a rank's copy of step %d failed its "
                        "checksums; falling back to the next older step", ctx.rank, step, step)
            steps.discard(step)
        self._nothing(rows)
        return resume.Resume()

    # ---- choosing the step ------------------------------------------------------------------------------
    def _list(self) -> tuple[dict, InmemFTError | None]:
        """This rank's SMP listing, or (an empty one, why there is none). A rank whose SMP refuses (its node's
        snapshots are lost beyond what parity rebuilds, the SMP is gone) still joins the agreement, which
        then fails the restore on every rank with the same error: one rank raising alone would leave its peers
        in the collective until its connection drops, each ending with gloo's traceback instead of the cause."""
        try:
            return self.ctx.smp.call("list", rank=self.ctx.rank), None
        except InmemFTError as e:
            return {"slots": []}, e

    def _candidates(self, entries: list[dict]) -> list[_Candidate]:
        """The rank's committed slots whose header and manifest check out (regions are checked on the copy)."""
        out = []
        for entry in entries:
            attached = self.ctx.attach(entry["segment"])
            try:
                _, manifest = seg.read_committed(attached.segment.buf, f"rank {self.ctx.rank} slot {entry['segment']}")
            except (SnapshotCorrupt, UnknownFormat) as e:
                log.warning("restore rank=%d step=%d event=%s: %s; falling back to an older snapshot",
                            self.ctx.rank, entry["step"],
                            "unknown_format" if isinstance(e, UnknownFormat) else "corrupt", e)
                continue
            out.append(_Candidate(entry["step"], attached, manifest, entry["source"]))
        return out

    def _pull(self) -> bool:
        ctx = self.ctx
        try:
            pulled = ctx.smp.pull(ctx.rank)
        except InmemFTError as e:  # no peers configured, or none reachable: the agreement below says what next
            log.warning("restore rank=%d event=pull_failed: %s", ctx.rank, e)
            return False
        for slot in pulled:
            log.info("restore rank=%d step=%d event=pulled from_node=%d source=%s", ctx.rank, slot["step"],
                     slot["from_node"], slot["source"])
        return bool(pulled)

    def _own_layout(self, candidates: list[_Candidate]) -> list[_Candidate]:
        """The candidates of this job's layout; remembers the newest of another."""
        own, self._foreign = [], None
        for c in candidates:
            same = c.manifest["world_size"] == self.ctx.world_size and (
                self.layout is None or layout_key(c.manifest.get("topology", {})) == self.layout.layout_key())
            if same:
                own.append(c)
            elif self._foreign is None or c.step > self._foreign.step:
                self._foreign = c
        return own

    def _open_other(self, local: list[_Candidate]):
        """This rank's open of the newest snapshots of another layout, when its newest slot is of another
        layout and the caller reshards; None if it fails (the collective open then says why, on every rank)."""
        if self._reshard is None or self._foreign is None or any(c.step >= self._foreign.step for c in local):
            return None
        try:
            return self._reshard.alone()
        except Exception as e:  # every rank must take part in the agreement that follows
            log.info("restore rank=%d event=other_layout_unopened: %s", self.ctx.rank, e)
            return None

    def _gather_candidates(self, local: list[_Candidate], listing: dict, failure: InmemFTError | None,
                           opened=None) -> list[Row]:
        """Every rank's Row. Raises the first failure on every rank when some rank had one (_failed)."""
        other = self._foreign
        steps = [c.step for c in local][:2]
        known = NO_STEP if listing.get("complete_step") is None else int(listing["complete_step"])
        said = _said(failure)
        mine = Row(*steps, *[NO_STEP] * (2 - len(steps)), other.step if other else NO_STEP, known,
                   int(listing.get("holds_any", False)), other.manifest["world_size"] if other else 0,
                   opened.step if opened is not None else NO_STEP, len(said))
        rows = [Row(*row) for row in self.ctx.agree.gather(list(mine))]
        if any(row.said for row in rows):
            raise self._failed(rows, said, failure)
        return rows

    def _changed(self, rows: list[Row], opened) -> resume.ReshardSource | None:
        """The newest snapshots of another layout, when they are what to resume (`opened`: what this rank
        opened of them, handed over when every rank opened the same step)."""
        foreign = max(row.other_step for row in rows)
        if foreign == NO_STEP:
            return None
        complete = set.intersection(*(row.steps for row in rows))
        # Older than what this layout completed (stale slots of an earlier layout): not what to resume.
        if foreign <= max(complete, default=NO_STEP) or foreign < max(row.complete for row in rows):
            return None
        settled = rows[0].opened != NO_STEP and all(row.opened == rows[0].opened for row in rows)
        if opened is not None and not settled:
            opened.close()
        return resume.ReshardSource(foreign, self._why_changed(rows, foreign), opened if settled else None,
                                    self._reshard.together if self._reshard is not None else None)

    def _failed(self, rows: list[Row], said: bytes, failure: InmemFTError | None) -> InmemFTError:
        """The error of the first rank that could not list its snapshots, for every rank to raise: each learns
        its text in one more round (only on this path), so every rank's log ends with the same line."""
        texts = self.ctx.agree.gather_bytes(said, max(row.said for row in rows))
        first = next(r for r, row in enumerate(rows) if row.said)
        name, _, message = texts[first].decode(errors="replace").partition(": ")
        if failure is not None and first != self.ctx.rank:  # this rank's own cause, unless it is the one raised
            log.warning("restore rank=%d event=list_failed: %s: %s", self.ctx.rank, type(failure).__name__,
                        failure)
        return _SAID.get(name, InmemFTError)(f"rank {first} cannot restore: {message}")

    def _why_changed(self, rows: list[Row], step: int) -> str:
        rank = next(r for r, row in enumerate(rows) if row.other_step == step)
        old = f"world size {rows[rank].other_world}"
        if self._foreign is not None and self._foreign.step == step and "topology" in self._foreign.manifest:
            old += f" ({Topology.from_json(self._foreign.manifest['topology']).layout()})"
        new = f"world size {self.ctx.world_size}" + (f" ({self.layout.layout()})" if self.layout else "")
        return (f"the newest snapshots in memory (step {step}, found by rank {rank}) were taken with {old}, this job "
                f"runs with {new}: restart with the original layout, or let inmem_ft reshard them (\"reshard\": "
                f"\"auto\" in the inmem_ft block: DeepSpeed's config, Megatron's --inmem-ft-config). Nothing was "
                f"discarded.")

    def _nothing(self, rows: list[Row]) -> None:
        """No step is usable on every rank. Starting over is right only if no step was ever complete."""
        ctx = self.ctx
        held = [[row.newest, row.older] for row in rows]
        completed = max(row.complete for row in rows)
        if completed != NO_STEP and not ctx.start_fresh:
            missing = [r for r, row in enumerate(rows) if row.newest == NO_STEP]
            raise NoUsableSnapshot(
                f"the SMPs hold snapshots (the job completed step {completed}), but no step is intact on every "
                f"rank (steps held per rank: {held}; ranks with none: {missing or 'none'}): a node was lost "
                f"without erasure coding, ranks landed on nodes whose SMPs do not hold their state, or "
                f"snapshots were corrupted. Nothing was discarded. Restore from the disk tier, bring the "
                f"missing node's SMP back, or set start_fresh (INMEM_FT_START_FRESH=1) to train from scratch.")
        if any(s != NO_STEP for row in held for s in row):
            log.warning("restore rank=%d event=none_complete steps_per_rank=%s: no step was ever complete on "
                        "every rank; starting from scratch", ctx.rank, held)
        ctx.fresh()

    # ---- reading it ------------------------------------------------------------------------------------
    def _load(self, step: int, local: list[_Candidate], clock: _Clock, views: bool, defer_checks: bool,
              to_device: bool):
        """(state or None if this rank's slot failed its checksums, candidate, bytes, the checks deferred to the
        next fence or None). Collective. With `to_device`, leaves saved from an accelerator are read into fresh
        tensors there by non-blocking copies out of the slot's registered mapping (the deferred checks, which
        read the slot, run meanwhile)."""
        ctx = self.ctx
        candidate = next(c for c in local if c.step == step)
        header = seg.Header.read(candidate.attached.segment.buf)
        span = slice(header.data_off, header.data_off + header.data_len)
        shm = candidate.attached.bytes[span]
        where = f"rank {ctx.rank} slot {candidate.attached.segment.name}"
        later = None
        try:
            # Views are handed out of a copy-on-write mapping of the slot: the framework may keep and write them
            # (its own tensors can even be pointed at them, so that its load copies nothing); the checksums
            # read the slot itself.
            if views and defer_checks:
                # The small regions now, the large ones behind the framework's load (capture/verdict.py).
                now, rest = verdict.split(seg.regions(candidate.manifest))
                later = verdict.DeferredChecks(ctx, shm, rest, where, step)
                seg.check_regions(shm, now, where, step)
                data = candidate.attached.private()[span]
            elif views:
                seg.verify_data(shm, candidate.manifest, where, step)
                data = candidate.attached.private()[span]
            else:
                data = seg.copy_verified(shm, candidate.manifest, where, step)
        except SnapshotCorrupt as e:
            log.warning("restore rank=%d step=%d event=corrupt: %s", ctx.rank, step, e)
            data = None
        clock.mark("verify" if views else "copy_verify")
        # Collective whatever happened above: the rank's data-parallel peers wait for it here, and a share that
        # cannot be read after the exchange is this rank's failure in the vote, not an exception that skips it.
        try:
            replicated = replicated_region(ctx, candidate.manifest, shm if data is None else data, step,
                                           header.data_off, views=views)
        except InmemFTError as e:
            log.warning("restore rank=%d step=%d event=share_unreadable: %s", ctx.rank, step, e)
            data = None
        clock.mark("replicated")
        if data is None:
            return None, candidate, header.data_len, None
        upload = None
        if to_device and any("dv" in e for e in candidate.manifest["leaves"]):
            candidate.attached.register()
            upload = device.Upload()
        state = layout.unpack(candidate.manifest, data, replicated, owned=True, upload=upload, upload_from=shm)
        if upload is not None:
            upload.wait()  # the copies read the slot, which the next-but-one snapshot may overwrite
        clock.mark("unpack")
        return state, candidate, header.data_len, later

    def _finish(self, step: int, candidate: _Candidate, nbytes: int, clock: _Clock, later) -> resume.RestoreInfo:
        ctx = self.ctx
        info = resume.RestoreInfo(step, candidate.source, clock.total, nbytes,
                                  path_of(candidate.attached.segment.name), dict(clock.phases), sentinel.recorded_in(candidate.manifest))
        ctx.resumed(info)
        if later is not None:
            later.info = info
            ctx.defer(later)
            later.arm()
            if verdict.spare_cores():
                later.start()
            else:
                ctx.after_load(later.start)
        resume.say(ctx.node, ctx.rank, step, candidate.source, info.seconds, nbytes=nbytes, phases=info.phases,
                   level=logging.WARNING if self._summary else logging.INFO)
        return info


def _said(failure: InmemFTError | None) -> bytes:
    """`failure` as its peers learn it: "Class: message", cut to SAID_MAX bytes; empty for none."""
    return b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[:SAID_MAX]


def replicated_region(ctx: RestoreContext, manifest: dict, data: torch.Tensor, step: int, data_off: int, *,
                      views: bool = False) -> layout.Pieces | None:
    """The whole replicated region of `step`, from this rank's share in `data` and its data-parallel peers'
    shares. Collective over the data-parallel group (a tiny exchange of where each share lives; `data_off`:
    where `data` starts in this rank's slot): shares held by this node's SMP are read straight out of their
    slots (viewed there with `views`, else copied), only shares on other nodes travel, read through the local
    SMP. SMPs not linked to their peers (no --peers) cannot read other nodes: the group then all-gathers."""
    rep = manifest.get("replicated")
    if not rep:
        return None
    if rep["dp_size"] != ctx.dp_size:
        raise LayoutMismatch(f"step {manifest['step']} split replicated state over {rep['dp_size']} "
                             f"data-parallel ranks, this job has {ctx.dp_size}; restart with the original "
                             f"layout (this release cannot reshard a snapshot)")
    mine = data[rep["o"]: rep["o"] + rep["hi"] - rep["lo"]]
    if ctx.dp_size == 1:
        return layout.Pieces([(0, mine)])
    peers = dist.get_process_group_ranks(ctx.dp_group)
    try:  # nothing before the exchange may fail on one rank only: the others would wait in it
        linked = ctx.smp.call("list", rank=ctx.rank).get("linked", False)
    except InmemFTError:
        linked = False
    where = torch.tensor([ctx.node, data_off + rep["o"], int(linked)], dtype=torch.int64)
    found = [torch.empty_like(where) for _ in peers]
    dist.all_gather(found, where, group=ctx.dp_group)
    found = [t.tolist() for t in found]
    if len({node for node, _, _ in found}) > 1 and not all(ok for _, _, ok in found):
        _, _, chunk = layout.share_bounds(rep["total"], ctx.dp_rank, ctx.dp_size)
        share = torch.zeros(chunk, dtype=torch.uint8)  # the last share's padding stays zero
        share[: rep["hi"] - rep["lo"]] = mine
        return layout.Pieces([(0, all_gather_bytes(share, ctx.dp_group)[: rep["total"]])])
    parts = []
    for dp_rank, (rank, (node, offset, _)) in enumerate(zip(peers, found)):
        lo, hi, _ = layout.share_bounds(rep["total"], dp_rank, ctx.dp_size)
        if rank == ctx.rank:
            parts.append((lo, mine))
            continue
        local = _local_share(ctx, rank, step) if node == ctx.node else None
        if local is None:  # its owner is on another node (its SMP verifies the share's checksum as it serves it)
            local = torch.empty(hi - lo, dtype=torch.uint8)
            ctx.smp.read(node, rank, step, offset, hi - lo, into=local.numpy())
        elif not views:
            local = local.clone()
        parts.append((lo, local))
    return layout.Pieces(parts)


def _local_share(ctx: RestoreContext, rank: int, step: int) -> torch.Tensor | None:
    """A view of `rank`'s replicated share of `step` in its slot if this node's SMP holds it, else None. Its
    owner verifies it where it lies; the vote after the restore covers it."""
    for entry in ctx.smp.call("list", rank=rank)["slots"]:
        if entry["step"] != step:
            continue
        attached = ctx.attach(entry["segment"])
        try:
            header, manifest = seg.read_committed(attached.segment.buf, entry["segment"])
        except (SnapshotCorrupt, UnknownFormat):
            return None
        rep = manifest["replicated"]
        start = header.data_off + rep["o"]
        return attached.bytes[start: start + rep["hi"] - rep["lo"]]
    return None
