"""A snapshot as a torch.distributed.checkpoint (DCP) checkpoint: `{key: global tensor}` for every named
global tensor of the catalog, plus `step` (int) and `topology` (the source layout, JSON text).

`torch.distributed.checkpoint.load` reads it in any process, with any layout of its own. The state dict
handed to `dcp.save` holds meta tensors only; the planner reads each global tensor from memory when the
writer asks for it and the writer writes it at once (FileSystemWriter with one thread resolves items one by
one), and with one file per tensor nothing keeps it, so one global tensor at a time is in memory.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from ..errors import InmemFTError
from ..snapshot.catalog import coverage
from ..snapshot.tree import dtype_from_name
from .source import MemorySource


class FromMemory(DefaultSavePlanner):
    """Resolves each meta tensor of the state dict by reading it from `src` only when the writer asks for it."""

    def __init__(self, src: MemorySource, bar):
        super().__init__()
        self.src, self.bar, self.nbytes = src, bar, 0

    def lookup_object(self, index):
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            obj = self.src.tensor(index.fqn)
            self.nbytes += obj.numel() * obj.element_size()
            self.bar.update(1)
        return obj


def write(src: MemorySource, out: str, bar) -> tuple[str, int, int]:
    """Writes the checkpoint into `out` (which must hold no other DCP checkpoint); returns (out, tensors, bytes)."""
    if os.path.exists(os.path.join(out, ".metadata")):
        raise InmemFTError(f"{out} already holds a DCP checkpoint; remove it or give another --out")
    names = set(src.keys())
    state: dict = {c["key"]: torch.empty(c["global_shape"], dtype=dtype_from_name(c["dtype"]), device="meta")
                   for c in coverage(src.table) if c["key"] in names}
    bar.reset(total=len(state))
    state["step"] = src.step
    state["topology"] = json.dumps(src.topology)
    planner = FromMemory(src, bar)
    # One file per tensor: torch 2.13's writer keeps a reference to every tensor of a file until the file is
    # done (for its safetensors format), so one file per rank would hold the whole state at once.
    writer = FileSystemWriter(out, single_file_per_rank=False, thread_count=1)
    dcp.save(state, storage_writer=writer, planner=planner)
    return out, len(state) - 2, planner.nbytes
