"""DCP write items <-> what a rank's snapshot holds, and DCP's Metadata rebuilt from every rank's snapshot.

A rank's snapshot is `{"dcp": {"items": [...], "planner_data": {...}, "data": [...]}}`: per write item a
JSON-able description (FQN, chunk offsets, kind, global size, dtype, chunk sizes) and its bytes as a plain
tensor leaf (a byte item, DCP's own torch.save of a non-tensor value, as a uint8 tensor of those bytes, never
decoded here). The Metadata DCP's load planner needs is the union of those descriptions, so reading it needs
no disk and no pickle; a chunk that several ranks hold (replicated tensors) is read from the lowest rank.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..errors import UnknownFormat
from ..snapshot import catalog
from ..snapshot.tree import dtype_from_name

ROOT = "dcp"
BYTES, TENSOR = "b", "t"


def index_key(index: MetadataIndex) -> tuple:
    return index.fqn, tuple(index.offset) if index.offset is not None else None


def stored(pairs: list[tuple[WriteItem, object]], planner_data) -> dict:
    """A rank's snapshot state of its (write item, resolved data) pairs."""
    described, data = [], []
    for item, value in pairs:
        if item.type == WriteItemType.BYTE_IO:
            raw = value.getbuffer()
            described.append([item.index.fqn, None, BYTES])
            data.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw)
                        else torch.empty(0, dtype=torch.uint8))
            continue
        td = item.tensor_data
        described.append([item.index.fqn, list(td.chunk.offsets), TENSOR, list(td.size),
                          str(td.properties.dtype).removeprefix("torch."), list(td.chunk.sizes)])
        data.append(value)
    return {ROOT: {"items": described, "planner_data": dict(planner_data or {}), "data": data}}


class Where:
    """Where one stored item's bytes are: its catalog key, and for a tensor its chunk's shape and dtype."""

    __slots__ = ("key", "shape", "dtype")

    def __init__(self, key: str, shape: tuple | None, dtype: torch.dtype | None):
        self.key, self.shape, self.dtype = key, shape, dtype


def metadata(source) -> tuple[Metadata, dict[tuple, Where]]:
    """DCP's Metadata of the step `source` (a universal.source.MemorySource) opened, and where each chunk is."""
    state_md: dict = {}
    where: dict[tuple, Where] = {}
    planner_data: dict = {}
    for rank in sorted(source.manifests):
        manifest = source.manifests[rank]
        refs = _data_refs(manifest, source.step, rank)
        described = source.state(rank, ROOT, "items")
        for j, entry in enumerate(described):
            fqn, offset, kind = entry[0], entry[1], entry[2]
            key = catalog.leaf_key(manifest, refs[j])
            if kind == BYTES:
                state_md.setdefault(fqn, BytesStorageMetadata())
                where.setdefault((fqn, None), Where(key, None, None))
                continue
            size, dtype, sizes = entry[3], dtype_from_name(entry[4]), entry[5]
            md = state_md.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), []))
            if (fqn, tuple(offset)) not in where:
                md.chunks.append(ChunkStorageMetadata(torch.Size(offset), torch.Size(sizes)))
                where[(fqn, tuple(offset))] = Where(key, tuple(sizes), dtype)
        for fqn, path in source.state(rank, ROOT, "planner_data").items():
            planner_data.setdefault(fqn, path)
    return Metadata(state_dict_metadata=state_md, planner_data=planner_data), where


def is_dcp(manifest: dict) -> bool:
    """Whether this rank's snapshot was written by InmemStorageWriter."""
    tree = manifest["tree"]
    return isinstance(tree, dict) and isinstance(tree.get("d"), dict) and ROOT in tree["d"]


def _data_refs(manifest: dict, step: int, rank: int) -> list[int]:
    """The leaf index of each stored item's bytes, from the manifest's JSON tree."""
    node = manifest["tree"]
    for name in (ROOT, "data"):
        body = node.get("d") if isinstance(node, dict) else None
        if body is None or name not in body:
            raise UnknownFormat(f"rank {rank}'s snapshot of step {step} holds no DCP checkpoint (it was not written "
                                f"by inmem_ft.dcp.InmemStorageWriter); restore it with the API that wrote it")
        node = body[name]
    return [ref["T"] for ref in node]
