"""Copy a state's bytes into a snapshot slot, blocking the trainer only for the copy out of device memory.

Host-resident leaves go straight into shared memory (snapshot/pack.py), the whole cost of a CPU snapshot.
CUDA leaves go from a side stream into a pinned staging buffer laid out like the slot; the trainer's
stream waits on that copy before it can touch the tensors again, and the commit thread later moves the
staged bytes into shared memory, off the training path.

With `defer` (overlap), nothing waits at save time: host copies run in the commit thread and the training
stream waits on the device copies only at fence(), which the caller places right before the state next
changes (the optimizer step), so forward and backward overlap the copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import BudgetExceeded
from ..snapshot import pack
from ..snapshot.layout import Batch, Copy, Plan


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


@dataclass
class Work:
    """Copies still to finish after copy() returned: host copies deferred to the commit thread (overlap),
    and staged CUDA copies to move into shared memory once the side-stream event has fired."""

    values: list = field(default_factory=list)
    host: list[Copy] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    event: "torch.cuda.Event | None" = None
    ranges: list[tuple[int, int]] = field(default_factory=list)


class Copier:
    def __init__(self, staging_budget: int | None):
        self.staging_budget = staging_budget
        self._staging: torch.Tensor | None = None
        self._stream = None

    def copy(self, values: list, plan: Plan, data: torch.Tensor | None, defer: bool = False) -> Work:
        """Copy the leaves `values` as `plan` lays them out into `data` (the slot's data bytes), or with `defer`
        only start copying (`data` may then still be unknown: None): the caller must fence() before the state
        changes."""
        work = Work(values, batches=plan.batches)
        device_copies = []
        for c in plan.copies:
            (device_copies if _on_device(values[c.leaf]) else work.host).append(c)
        if device_copies:
            self._stage(device_copies, values, plan.data_len, work)
        if not defer:
            self.copy_host(work, data)
            self.fence(work)
        return work

    def copy_host(self, work: Work, data: torch.Tensor) -> None:
        """The host copies (the commit thread runs them for an overlapped snapshot)."""
        pack.write(work.values, work.host, work.batches, data)
        work.host, work.batches = [], []

    def fence(self, work: Work) -> None:
        """The training stream waits for the device copies (no host wait: kernels queue behind them)."""
        if work.event is not None:
            torch.cuda.current_stream().wait_event(work.event)

    def _stage(self, device_copies: list[Copy], values: list, data_len: int, work: Work) -> None:
        staging = self._staging_buffer(data_len)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # copy the values as of this point
        with torch.cuda.stream(self._stream):
            for c in device_copies:
                value = values[c.leaf]
                pack.copy_into(staging[c.dst: c.dst + c.hi - c.lo], value, c)
                value.record_stream(self._stream)
                work.ranges.append((c.dst, c.dst + c.hi - c.lo))
            work.event = torch.cuda.Event()
            work.event.record(self._stream)

    def _staging_buffer(self, data_len: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < data_len:
            if self.staging_budget is not None and data_len > self.staging_budget:
                raise BudgetExceeded(
                    f"this rank's GPU state needs {data_len / 2**20:.1f} MiB of pinned staging memory but "
                    f"staging_budget is {self.staging_budget / 2**20:.1f} MiB; raise staging_budget")
            self._staging = torch.empty(data_len, dtype=torch.uint8, pin_memory=True)
        return self._staging

    def drain(self, work: Work | None, data: torch.Tensor) -> None:
        """Commit thread: move staged device bytes into the slot once the side-stream copy finished."""
        if work is None or work.event is None:
            return
        work.event.synchronize()
        for lo, hi in work.ranges:
            data[lo:hi].copy_(self._staging[lo:hi])
