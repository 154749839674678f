"""What the SMP remembers about whether its snapshots can be trusted, beside the slots (survives its restarts).

- the recent losses each rank's snapshot recorded (sent with its commit): what the sentinel after a restore
  learns its bound from (capture/sentinel.py);
- the steps a sentinel found bad after a restore, or whose replicas disagreed: never listed, so never restored
  again, from any tier;
- the trip that is not yet cleared: a second trip before the sentinel passes once means the older step is bad
  as well, and the job stops instead of walking back step by step (`op_bad` answers with it).

One JSON record per node (written with segments.write_record, so a reader sees the old text or the new).
"""
from __future__ import annotations

import json
import logging

from . import paths
from .segments import read_record, unlink, write_record

log = logging.getLogger("inmem_ft.smp")
KEEP_BAD = 64  # bad steps remembered: far more than a job walks back


class TrustRecord:
    def __init__(self, job: str, node: int):
        self.name = paths.trust_record_name(job, node)
        self.node = node
        self.losses: dict[tuple[int, int], list[float]] = {}  # (rank, step) -> its snapshot's recorded losses
        self.bad: dict[int, str] = {}  # step -> why
        self.pending: int | None = None  # the step of the last trip, until a sentinel passes

    def load(self) -> None:
        try:
            text = read_record(self.name)
            data = json.loads(text) if text is not None else {}
            self.losses = {(int(r), int(s)): [float(x) for x in v] for r, s, v in data.get("losses", [])}
            self.bad = {int(s): str(why) for s, why in data.get("bad", [])}
            self.pending = None if data.get("pending") is None else int(data["pending"])
        except (ValueError, TypeError, KeyError) as e:
            # Nothing here can make a restore load garbage: a lost record only loses bound and bad steps.
            log.warning("smp node=%d event=refused record=%s reason=unreadable (%s): starting without it", self.node,
                        self.name, e)
            self.losses, self.bad, self.pending = {}, {}, None

    def _save(self) -> None:
        if not (self.losses or self.bad or self.pending is not None):
            unlink(self.name)  # nothing to remember: no file beside the slots
            return
        write_record(self.name, json.dumps({
            "losses": [[r, s, v] for (r, s), v in sorted(self.losses.items())],
            "bad": sorted(self.bad.items())[-KEEP_BAD:], "pending": self.pending}))

    def committed(self, rank: int, step: int, losses, held) -> None:
        """Rank `rank` committed `step` with `losses` (or None); `held`: the steps its slots still hold."""
        before = dict(self.losses)
        if losses:
            self.losses[(rank, step)] = [float(x) for x in losses]
        for key in [k for k in self.losses if k[0] == rank and k[1] not in held]:
            del self.losses[key]
        if self.losses != before:
            self._save()

    def mark_bad(self, step: int, why: str, trip: bool = True) -> int | None:
        """`step` is bad: with `trip`, a sentinel tripped on a restore from it, and this returns the step of the
        trip before it if none passed since (else the step was found bad before any restore: no trip)."""
        before = self.pending if trip and self.pending != step else None
        self.bad[step] = why
        if trip:
            self.pending = step
        self._save()
        return before

    def passed(self) -> None:
        if self.pending is not None:
            self.pending = None
            self._save()

    def wipe(self) -> None:
        self.losses, self.bad, self.pending = {}, {}, None
        unlink(self.name)
