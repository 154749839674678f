"""What the SMP remembers about whether its snapshots can be trusted, beside the slots (survives its restarts).

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
        self.bad: dict[int, str] = {}  # step -> why
        self.pending: int | None = None  # the step of the last trip, until a sentinel passes

    def load(self) -> None:
        try:
            text = read_record(self.name)
            data = json.loads(text) if text is not None else {}
            self.bad = {int(s): str(why) for s, why in data.get("bad", [])}
            self.pending = None if data.get("pending") is None else int(data["pending"])
        except (ValueError, TypeError, KeyError) as e:
            # Nothing here can make a restore load garbage: a lost record only loses the bad steps.
            log.warning("smp node=%d event=refused record=%s reason=unreadable (%s): starting without it", self.node,
                        self.name, e)
            self.bad, self.pending = {}, None

    def _save(self) -> None:
        if not (self.bad or self.pending is not None):
            unlink(self.name)  # nothing to remember: no file beside the slots
            return
        write_record(self.name, json.dumps({
            "bad": sorted(self.bad.items())[-KEEP_BAD:], "pending": self.pending}))

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
        self.bad, self.pending = {}, None
        unlink(self.name)
