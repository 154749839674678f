"""A state tree in a file, in the snapshot layout (header + JSON manifest + raw tensor bytes, checksummed):
loadable without pickle, with the same type allowlist as shared-memory snapshots."""
from __future__ import annotations


import torch

from ..snapshot import layout, pack, segment as seg
from ..snapshot.tree import flatten
from .atomic import atomic_write


def encode(state, step: int = 0) -> bytes:
    flat = flatten(state)
    plan = layout.plan(flat, step=step, rank=0, world_size=1)
    data = torch.zeros(plan.data_len, dtype=torch.uint8)
    pack.write(flat.values, plan.copies, plan.batches, data)
    raw_data = data.numpy().tobytes()
    seg.region_hashes(memoryview(raw_data), plan.manifest)
    raw = seg.encode_manifest(plan.manifest)
    off = seg.data_offset(len(raw))
    header = seg.Header(seg.COMMITTED, step, len(raw), off, plan.data_len)
    header.manifest_hash = seg.checksum(raw)
    out = bytearray(off + plan.data_len)
    out[: seg.HEADER_SIZE] = header.pack().ljust(seg.HEADER_SIZE, b"\0")
    out[seg.HEADER_SIZE: seg.HEADER_SIZE + len(raw)] = raw
    out[off:] = raw_data
    return bytes(out)


def write_state(path: str, state, step: int = 0) -> None:
    blob = encode(state, step)
    atomic_write(path, lambda f: f.write(blob))


def read_state(path: str):
    """The state written by write_state; SnapshotCorrupt if any checksum fails."""
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    header, manifest = seg.verify(memoryview(buf), path)
    data = torch.frombuffer(buf, dtype=torch.uint8)[header.data_off: header.data_off + header.data_len] \
        if header.data_len else torch.empty(0, dtype=torch.uint8)
    return layout.unpack(manifest, data)
