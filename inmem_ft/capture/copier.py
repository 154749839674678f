"""Copy a state's bytes into a snapshot slot, blocking the trainer only for the copy out of device memory.

Host-resident leaves go straight into shared memory: one memcpy each, the whole cost of a CPU snapshot.
CUDA leaves go from a side stream into a pinned staging buffer laid out like the slot; the trainer's
stream waits on that copy before it can touch the tensors again, and the commit thread later moves the
staged bytes into shared memory, off the training path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BudgetExceeded
from ..snapshot.layout import Copy
from ..snapshot.tree import Leaf


def _source_bytes(value, lo: int, hi: int, whole: bool):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8)[lo:hi])
    if whole:
        return value
    return value.contiguous().reshape(-1).view(torch.uint8)[lo:hi]


def _copy_into(dst: torch.Tensor, value, c: Copy, whole: bool) -> None:
    src = _source_bytes(value, c.lo, c.hi, whole)
    if whole and isinstance(value, torch.Tensor):
        dst.view(value.dtype).view(value.shape).copy_(src)
    else:
        dst.copy_(src)


@dataclass
class DeviceWork:
    """Staged CUDA copies still to be moved into shared memory by the commit thread."""

    event: "torch.cuda.Event"
    ranges: list[tuple[int, int]]


class Copier:
    def __init__(self, staging_budget: int | None):
        self.staging_budget = staging_budget
        self._staging: torch.Tensor | None = None
        self._stream = None

    def copy(self, leaves: list[Leaf], copies: list[Copy], data: torch.Tensor) -> DeviceWork | None:
        device_copies = []
        for c in copies:
            value = leaves[c.leaf].value
            whole = c.lo == 0 and c.hi == leaves[c.leaf].nbytes
            if isinstance(value, torch.Tensor) and value.is_cuda:
                device_copies.append((c, value, whole))
            else:
                _copy_into(data[c.dst: c.dst + c.hi - c.lo], value, c, whole)
        return self._stage(device_copies, data.numel()) if device_copies else None

    def _stage(self, device_copies, data_len: int) -> DeviceWork:
        staging = self._staging_buffer(data_len)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)  # copy the values as of this point in the training stream
        ranges = []
        with torch.cuda.stream(self._stream):
            for c, value, whole in device_copies:
                _copy_into(staging[c.dst: c.dst + c.hi - c.lo], value, c, whole)
                value.record_stream(self._stream)
                ranges.append((c.dst, c.dst + c.hi - c.lo))
            event = torch.cuda.Event()
            event.record(self._stream)
        main.wait_event(event)  # the optimizer step that follows cannot overwrite what is being copied
        return DeviceWork(event, ranges)

    def _staging_buffer(self, data_len: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < data_len:
            if self.staging_budget is not None and data_len > self.staging_budget:
                raise BudgetExceeded(
                    f"this rank's GPU state needs {data_len / 2**20:.1f} MiB of pinned staging memory but "
                    f"staging_budget is {self.staging_budget / 2**20:.1f} MiB; raise staging_budget")
            self._staging = torch.empty(data_len, dtype=torch.uint8, pin_memory=True)
        return self._staging

    def drain(self, work: DeviceWork | None, data: torch.Tensor) -> None:
        """Commit thread: move staged device bytes into the slot once the side-stream copy finished."""
        if work is None:
            return
        work.event.synchronize()
        for lo, hi in work.ranges:
            data[lo:hi].copy_(self._staging[lo:hi])
