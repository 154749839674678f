"""Where each leaf's bytes go in a slot, and how a slot's bytes become a state again.

Replicated subtrees (identical across the data-parallel group) are laid end to end in one virtual region;
data-parallel rank i stores only bytes [i*chunk, (i+1)*chunk) of it, so replicas split the work and the
memory evenly whatever the tensor sizes are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .checksum import PLACEHOLDER
from .segment import ALIGN, FORMAT, align
from .shardspec import ShardSpec
from .topology import Topology
from .tree import FlatState, dtype_from_name, unflatten


@dataclass
class Copy:
    """Copy bytes [lo, hi) of leaf `leaf` to data offset `dst`."""

    leaf: int
    lo: int
    hi: int
    dst: int


@dataclass
class Plan:
    manifest: dict
    data_len: int
    copies: list[Copy]


def share_bounds(total: int, dp_rank: int, dp_size: int) -> tuple[int, int, int]:
    chunk = -(-total // dp_size) if total else 0
    lo = min(total, dp_rank * chunk)
    return lo, min(total, lo + chunk), chunk


def plan(flat: FlatState, *, step: int, rank: int, world_size: int, dp_rank: int = 0, dp_size: int = 1,
         topology: Topology | None = None, meta: dict | None = None) -> Plan:
    leaves, copies, off, roff = [], [], 0, 0
    for i, leaf in enumerate(flat.leaves):
        entry = {"k": "a" if leaf.is_array else "t", "dt": leaf.dtype_name, "sh": list(leaf.value.shape),
                 "n": leaf.nbytes}
        if leaf.shards:
            entry["shards"] = [spec.to_json() for spec in leaf.shards]
        if leaf.replicated:
            entry["ro"] = roff
            roff = align(roff + leaf.nbytes)
        else:
            entry["o"], entry["h"] = off, PLACEHOLDER
            copies.append(Copy(i, 0, leaf.nbytes, off))
            off = align(off + leaf.nbytes)
        leaves.append(entry)
    replicated = None
    if roff:
        lo, hi, _ = share_bounds(roff, dp_rank, dp_size)
        replicated = {"total": roff, "dp_rank": dp_rank, "dp_size": dp_size, "lo": lo, "hi": hi, "o": off,
                      "h": PLACEHOLDER}
        for i, entry in enumerate(leaves):
            if "ro" in entry:
                a, b = max(lo, entry["ro"]), min(hi, entry["ro"] + entry["n"])
                if a < b:
                    copies.append(Copy(i, a - entry["ro"], b - entry["ro"], off + a - lo))
        off = align(off + hi - lo)
    topology = topology or Topology(world_size=world_size, dp=dp_size, coords={"dp": dp_rank})
    manifest = {"format": FORMAT, "step": step, "rank": rank, "world_size": world_size,
                "topology": topology.to_json(), "tree": flat.tree, "leaves": leaves, "replicated": replicated,
                "meta": meta or {}}
    return Plan(manifest, off, copies)


def _tensor_from(src: torch.Tensor, entry: dict, copy: bool):
    raw = src.clone() if copy else src
    if entry["k"] == "a":
        return raw.numpy().view(np.dtype(entry["dt"])).reshape(entry["sh"])
    return raw.view(dtype_from_name(entry["dt"])).view(entry["sh"])


@dataclass
class Pieces:
    """The replicated region of a step as it was found: pieces (offset in the region, uint8 tensor) that cover
    it end to end. A piece is a view of a slot where the share lies on this node, or a private buffer."""

    parts: list[tuple[int, torch.Tensor]]

    def take(self, ro: int, n: int) -> torch.Tensor:
        """Bytes [ro, ro + n) of the region: a view of the piece holding them where that piece holds all of
        them at an address their dtype can view (ALIGN covers every dtype), else a private copy."""
        pieces = [(lo, t) for lo, t in self.parts if lo < ro + n and ro < lo + t.numel()] or self.parts[:1]
        lo, t = pieces[0]
        if len(pieces) == 1 and (t.storage_offset() + ro - lo) % ALIGN == 0:
            return t[ro - lo: ro - lo + n]
        return torch.cat([t[max(0, ro - lo): ro + n - lo] for lo, t in pieces])


def unpack(manifest: dict, data: torch.Tensor, replicated: Pieces | None = None, *, owned: bool = False):
    """Rebuild the state from a slot's data bytes (uint8 tensor) and, if any, the replicated region's pieces.

    Leaves of the replicated region are taken from its pieces as they are (views where they can be). Leaves
    in `data` are copied out, so the result stays valid after the slot is reused, unless `owned` says the
    caller takes care of that (a private copy, or a caller that copies out what it keeps); then they are views.
    """
    values = []
    for entry in manifest["leaves"]:
        n = entry["n"]
        if "o" in entry:
            values.append(_tensor_from(data[entry["o"]: entry["o"] + n], entry, copy=not owned))
        else:
            values.append(_tensor_from(replicated.take(entry["ro"], n), entry, copy=False))
    return unflatten(manifest["tree"], values)


def shard_specs(manifest: dict) -> dict[int, list[ShardSpec]]:
    """Leaf index -> the shard specs it carries, for leaves that carry any."""
    return {i: [ShardSpec.from_json(d) for d in e["shards"]] for i, e in enumerate(manifest["leaves"])
            if "shards" in e}
