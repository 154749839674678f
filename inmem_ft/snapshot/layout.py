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
from .segment import FORMAT, align
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


def unpack(manifest: dict, data: torch.Tensor, replicated: torch.Tensor | None = None, *, owned: bool = False):
    """Rebuild the state from a slot's data bytes (uint8 tensor) and, if any, the gathered replicated region.

    Leaves of the replicated region become views of it: that buffer is the caller's own, handed over here.
    Leaves in `data` are copied out, so the result stays valid after the slot is reused, unless `owned`
    says `data` is a private copy too; then they are views of it.
    """
    values = []
    for entry in manifest["leaves"]:
        n = entry["n"]
        if "o" in entry:
            values.append(_tensor_from(data[entry["o"]: entry["o"] + n], entry, copy=not owned))
        else:
            values.append(_tensor_from(replicated[entry["ro"]: entry["ro"] + n], entry, copy=False))
    return unflatten(manifest["tree"], values)


def shard_specs(manifest: dict) -> dict[int, list[ShardSpec]]:
    """Leaf index -> the shard specs it carries, for leaves that carry any."""
    return {i: [ShardSpec.from_json(d) for d in e["shards"]] for i, e in enumerate(manifest["leaves"])
            if "shards" in e}
