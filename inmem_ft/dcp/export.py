"""A snapshot as a torch.distributed.checkpoint (DCP) checkpoint: `{key: global tensor}` for every named
global tensor of the catalog, plus `step` (int) and `topology` (the source layout, JSON text). A snapshot
that inmem_ft.dcp wrote is exported as the checkpoint its DCP save described: the same FQNs, each tensor
assembled from its chunks, and its byte items as the very bytes DCP wrote (never decoded here), so stock
`dcp.load` reads it as it would have read a FileSystemWriter's.

`torch.distributed.checkpoint.load` reads it in any process, with any layout of its own. The state dict
handed to `dcp.save` holds meta tensors only; the planner reads each global tensor from memory when the
writer asks for it and the writer writes it at once (FileSystemWriter with one thread resolves items one by
one), and with one file per tensor nothing keeps it, so one global tensor at a time is in memory.
"""
from __future__ import annotations

import io
import json
import math
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from . import items
from ..errors import InmemFTError
from ..snapshot.catalog import coverage
from ..snapshot.tree import dtype_from_name
from ..universal.source import MemorySource


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


class FromDCPSnapshot(DefaultSavePlanner):
    """Resolves each item of a DCP snapshot's state (meta tensors, byte placeholders) from `src` on demand."""

    def __init__(self, src: MemorySource, where: dict, bar):
        super().__init__()
        self.src, self.where, self.bar, self.nbytes = src, where, bar, 0

    def lookup_object(self, index):
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            full = torch.empty(obj.shape, dtype=obj.dtype)
            for (fqn, offset), w in self.where.items():
                if fqn == index.fqn and offset is not None and math.prod(w.shape):
                    box = tuple(slice(o, o + n) for o, n in zip(offset, w.shape))
                    full[box] = self.src.piece(w.key).view(w.shape)
            self.nbytes += full.numel() * full.element_size()
            self.bar.update(1)
            return full
        return obj

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:  # the bytes DCP's own save produced, as they were
            w = self.where[(write_item.index.fqn, None)]
            raw = self.src.fragments.raw(w.key, self.src.read).tobytes() if w.key in self.src.fragments else b""
            return io.BytesIO(raw)
        return super().resolve_data(write_item)


def write(src: MemorySource, out: str, bar) -> tuple[str, int, int]:
    """Writes the checkpoint into `out` (which must hold no other DCP checkpoint); returns (out, tensors, bytes)."""
    if os.path.exists(os.path.join(out, ".metadata")):
        raise InmemFTError(f"{out} already holds a DCP checkpoint; remove it or give another --out")
    if all(items.is_dcp(manifest) for manifest in src.manifests.values()):
        return _write_dcp(src, out, bar)
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


def _write_dcp(src: MemorySource, out: str, bar) -> tuple[str, int, int]:
    metadata, where = items.metadata(src)
    state: dict = {}
    for fqn, md in metadata.state_dict_metadata.items():
        state[fqn] = torch.empty(md.size, dtype=md.properties.dtype, device="meta") \
            if isinstance(md, TensorStorageMetadata) else b""  # a byte item: resolve_data gives its bytes
    bar.reset(total=sum(isinstance(v, torch.Tensor) for v in state.values()))
    planner = FromDCPSnapshot(src, where, bar)
    dcp.save(state, storage_writer=FileSystemWriter(out, single_file_per_rank=False, thread_count=1),
             planner=planner, no_dist=True)
    return out, bar.total, planner.nbytes
