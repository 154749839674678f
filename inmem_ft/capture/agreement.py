"""The few collectives the snapshot protocol needs, on a gloo group of its own: they run from the commit
thread and must never interleave with the training loop's collectives on the default group."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Agreement:
    def __init__(self, timeout_s: float):
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.group, self.rank, self.world_size = None, 0, 1

    def min(self, value: int | list[int]) -> int | list[int]:
        """The smallest `value` of all ranks; of a list, the smallest of each element (one round for all)."""
        if not self.distributed:
            return value
        t = torch.tensor(value, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), indexed by rank."""
        if not self.distributed:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]


    def mirror(self, group) -> "object | None":
        """A gloo group with the same members as `group` (which may be NCCL), usable from the commit thread.

        new_group is collective over the whole world, so every rank learns every group's members first and
        all ranks create all the mirrors in the same order. A group of the whole world (data parallelism
        alone) gets this agreement's own group: the callers never use both at once (the restore's exchanges
        run on the main thread before any snapshot or background check), and a gloo group of the whole world
        is the costly one to build (a connection between every two ranks).
        """
        if group is None or not self.distributed:
            return None
        members = dist.get_process_group_ranks(group)
        if len(members) == self.world_size:
            return self.group
        rows = self.gather(sorted(members))
        mine = None
        for ranks in sorted({tuple(r) for r in rows}):
            g = dist.new_group(list(ranks), backend="gloo")
            if self.rank in ranks:
                mine = g
        return mine


def all_gather_bytes(share: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every group member's equal-length uint8 `share`, in group-rank order."""
    out = torch.empty(dist.get_world_size(group) * share.numel(), dtype=share.dtype)
    dist.all_gather(list(out.view(-1, share.numel())), share, group=group)  # straight into one buffer
    return out
