"""Copy a state's bytes into a snapshot slot; device bytes leave behind forward and backward.

Host-resident leaves go straight into shared memory (snapshot/pack.py), the whole cost of a CPU snapshot.
Device leaves are copied by a side stream straight into the slot, in one hop: save() only records an event on
the training stream; the side stream waits on that event (the tensors as of save(), not whatever training
queues after it), gathers the small tensors of each dtype into one flat device buffer (kept while the layout
holds), queues non-blocking copies out and records its own event. The training stream waits on that event
only at fence(), which the caller places right before the state next changes (the optimizer step); the
commit thread waits on it on the host before the checksums. The slot's mapping is registered with the device
(device.register, by the commit thread) so that these copies are DMA that overlaps everything else; a slot not
yet registered takes the same copies through pageable memory.

With `defer` (overlap), the copies themselves are queued by the commit thread, which also learns from the SMP
which slot to write: nothing of a snapshot runs on the training thread but the event.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import device
from ..errors import BudgetExceeded
from ..snapshot import pack
from ..snapshot.layout import Batch, Copy, Plan


@dataclass
class Work:
    """A snapshot's copies: `ready` (device -> the training stream's event at save()) until they are queued,
    then `done` (device -> the side stream's event after them)."""

    values: list
    copies: list[Copy]
    batches: list[Batch]
    ready: dict = field(default_factory=dict)
    done: dict = field(default_factory=dict)

    @property
    def on_device(self) -> bool:
        return bool(self.ready or self.done)


class Copier:
    def __init__(self, staging_budget: int | None):
        self.staging_budget = staging_budget  # device bytes of one snapshot (pinned where they land) at most
        self._streams: dict[torch.device, torch.Stream] = {}
        self._flat: dict[tuple, torch.Tensor] = {}  # (batch dst, device) -> its gather buffer, for self._plan
        self._plan: Plan | None = None

    def copy(self, values: list, plan: Plan, data: torch.Tensor | None, defer: bool = False) -> Work:
        """Copy the leaves `values` as `plan` lays them out into `data` (the slot's data bytes), or with `defer`
        only note what to copy (`data` may then still be unknown: None; copy_out() copies, fence() orders the
        training stream after it): the caller must fence() before the state changes."""
        work = Work(values, plan.copies, plan.batches)
        devices = {values[c.leaf].device for c in plan.copies if device.accelerated(values[c.leaf])} | \
            {torch.device(b.device) for b in plan.batches if b.device != "cpu"}
        if devices:
            self._check_budget(values, plan)
        work.ready = {d: device.ready_event(d) for d in devices}
        if not defer:
            self.copy_out(work, data)
            self.fence(work)
        return work

    def copy_out(self, work: Work, data: torch.Tensor) -> None:
        """Queue the device copies on their side streams, then copy the host leaves (the commit thread runs this
        for an overlapped snapshot)."""
        on_device = [c for c in work.copies if device.accelerated(work.values[c.leaf])]
        host = [c for c in work.copies if not device.accelerated(work.values[c.leaf])]
        for d, ready in work.ready.items():
            work.done[d] = self._queue(d, ready, work, on_device, data)
        work.ready = {}
        pack.write(work.values, host, [b for b in work.batches if b.device == "cpu"], data)
        work.copies, work.batches = [], []

    def fence(self, work: Work) -> None:
        """The training stream waits for the device copies (no host wait: kernels queue behind them)."""
        for d, done in work.done.items():
            device.wait_on_current(done, d)

    def drain(self, work: Work | None) -> None:
        """Commit thread: wait until the device copies landed in the slot (before its checksums)."""
        if work is not None:
            for done in work.done.values():
                done.synchronize()

    def _queue(self, d: torch.device, ready: torch.Event, work: Work, copies: list[Copy], data) -> torch.Event:
        stream = self._streams.get(d)
        if stream is None:
            stream = self._streams[d] = device.side_stream(d)
        values = work.values
        with device.on_stream(stream):
            stream.wait_event(ready)
            for b in work.batches:
                if torch.device(b.device) == d:
                    for i in b.leaves:
                        device.keep_for(values[i], stream)
                    pack.gather_into(data, values, b, self._flat_buffer(b, d))
            for c in copies:
                value = values[c.leaf]
                if value.device == d:
                    device.keep_for(value, stream)
                    pack.copy_into(data[c.dst: c.dst + c.hi - c.lo], value, c)
            return device.done_event(stream)

    def _flat_buffer(self, b: Batch, d: torch.device) -> torch.Tensor:
        """The batch's gather buffer on the device, made once for as long as its plan is reused. Allocated on the
        side stream, which alone uses it (and waits for its previous copy before it gathers again)."""
        key = (b.dst, b.nbytes, b.dtype, d)
        flat = self._flat.get(key)
        if flat is None:
            flat = self._flat[key] = torch.empty(b.nbytes // b.dtype.itemsize, dtype=b.dtype, device=d)
        return flat

    def _check_budget(self, values: list, plan: Plan) -> None:
        if plan is not self._plan:  # a new layout: the old one's buffers would only hold device memory
            self._plan, self._flat = plan, {}
        if self.staging_budget is None:
            return
        pinned = sum(c.hi - c.lo for c in plan.copies if device.accelerated(values[c.leaf])) + \
            sum(b.nbytes for b in plan.batches if b.device != "cpu")
        if pinned > self.staging_budget:
            raise BudgetExceeded(
                f"this rank's GPU state needs {pinned / 2**20:.1f} MiB of pinned (registered) host memory but "
                f"staging_budget is {self.staging_budget / 2**20:.1f} MiB; raise staging_budget")
