"""Where each leaf's bytes go in a slot, and how a slot's bytes become a state again.

Replicated subtrees (identical across the data-parallel group) are laid end to end in one virtual region;
data-parallel rank i stores only bytes [i*chunk, (i+1)*chunk) of it, so replicas split the work and the
memory evenly whatever the tensor sizes are.

Host tensors of one dtype and trailing shape sit next to each other (each such group 64-byte aligned), so
that one torch.cat copies a whole group: a state of 10^5 small tensors then costs a few calls, not 10^5.
Small device tensors of one dtype sit next to each other whatever their shapes: they are gathered into one
flat buffer on the device and leave it in one copy (capture/copier.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import device
from ..errors import UnsafeType
from .checksum import PLACEHOLDER
from .segment import ALIGN, FORMAT, align
from .shardspec import ShardSpec
from .topology import Topology
from .tree import FlatState, Leaf, dtype_from_name, unflatten


@dataclass
class Copy:
    """Copy bytes [lo, hi) of leaf `leaf` to data offset `dst`."""

    leaf: int
    lo: int
    hi: int
    dst: int


# Device tensors up to this size are gathered on the device before they leave it; a larger one is a copy of
# its own (one copy of a large tensor already runs at the link's speed, and gathering it would cost its size
# again in device memory).
GATHER_MAX = 1 << 20


@dataclass(frozen=True)
class Batch:
    """Whole tensors of one dtype laid end to end from data offset `dst`. Host tensors all have the same
    `trailing` shape after their first dimension (None: all 0-d): one torch.cat (stack) copies them all, at a
    fraction of the per-tensor cost of one copy each (10^5-tensor states). Small tensors on `device` (not
    "cpu") may have any shapes: they are gathered flat on the device and copied out at once."""

    leaves: tuple[int, ...]
    dst: int
    nbytes: int
    dtype: torch.dtype
    trailing: tuple[int, ...] | None
    device: str = "cpu"


@dataclass
class Plan:
    manifest: dict
    data_len: int
    copies: list[Copy]
    batches: list[Batch] = field(default_factory=list)


def share_bounds(total: int, dp_rank: int, dp_size: int) -> tuple[int, int, int]:
    chunk = -(-total // dp_size) if total else 0
    lo = min(total, dp_rank * chunk)
    return lo, min(total, lo + chunk), chunk


def _batch_key(leaf: Leaf):
    v = leaf.value
    if leaf.is_array or not v.numel():
        return None
    if device.accelerated(v):
        return (v.dtype, (), str(v.device)) if leaf.nbytes <= GATHER_MAX else None
    if v.device.type != "cpu":
        return None
    return v.dtype, tuple(v.shape[1:]) if v.dim() else None


def _pack(leaves: list[Leaf], indices: list[int], entries: list[dict], where: str) -> tuple[list[list[int]], int]:
    """Lay the leaves `indices` end to end, those that can share a Batch next to each other, each group 64-byte
    aligned; offsets go into entries[i][where]. Returns the groups and the aligned end."""
    groups: dict = {}
    for i in indices:
        groups.setdefault(_batch_key(leaves[i]) or i, []).append(i)
    off = 0
    for members in groups.values():
        off = align(off)
        for i in members:
            entries[i][where] = off
            off += leaves[i].nbytes
    return list(groups.values()), align(off)


def _schedule(leaves, groups, entries, where, lo, hi, base, copies, batches) -> None:
    """The copies that put bytes [lo, hi) of a packed region at data offset `base`: a Batch for every run of
    two or more whole leaves of a group, a Copy for any other leaf or part of one."""
    for members in groups:
        whole = []
        for i in members:
            a, n = entries[i][where], leaves[i].nbytes
            if lo <= a and a + n <= hi:
                whole.append(i)
            elif max(lo, a) < min(hi, a + n):
                copies.append(Copy(i, max(lo, a) - a, min(hi, a + n) - a, base + max(lo, a) - lo))
        key = _batch_key(leaves[whole[0]]) if whole else None
        dst = base + entries[whole[0]][where] - lo if whole else 0
        # A data-parallel share may start anywhere in the replicated region: its tensors can then only be
        # copied as bytes (pack.copy_into), not viewed as their dtype.
        if len(whole) > 1 and key is not None and dst % key[0].itemsize == 0:
            end = entries[whole[-1]][where] + leaves[whole[-1]].nbytes
            batches.append(Batch(tuple(whole), dst, end - entries[whole[0]][where], *key))
        else:
            copies.extend(Copy(i, 0, leaves[i].nbytes, base + entries[i][where] - lo) for i in whole)


def _entry(flat: FlatState, i: int, leaf: Leaf) -> dict:
    v = leaf.value
    if not leaf.is_array and (v.layout != torch.strided or v.is_quantized):
        kind = "quantized" if v.is_quantized else str(v.layout)
        raise UnsafeType(f"{flat.path_of(i)}: {kind} tensors are not supported; convert to a dense tensor first")
    entry = {"k": "a" if leaf.is_array else "t", "dt": leaf.dtype_name, "sh": list(v.shape), "n": leaf.nbytes}
    if not leaf.is_array and device.accelerated(v):
        entry["dv"] = device.kind(v)  # where it lived: a restore to the device puts it back there
    if leaf.shards:
        entry["shards"] = [spec.to_json() for spec in leaf.shards]
    return entry


def plan(flat: FlatState, *, step: int, rank: int, world_size: int, dp_rank: int = 0, dp_size: int = 1,
         topology: Topology | None = None, meta: dict | None = None) -> Plan:
    leaves = flat.leaves
    entries = [_entry(flat, i, leaf) for i, leaf in enumerate(leaves)]
    copies, batches = [], []
    own_groups, off = _pack(leaves, [i for i, leaf in enumerate(leaves) if not leaf.replicated], entries, "o")
    for group in own_groups:
        for i in group:
            entries[i]["h"] = PLACEHOLDER
    _schedule(leaves, own_groups, entries, "o", 0, off, 0, copies, batches)
    replicated = None
    rep_groups, roff = _pack(leaves, [i for i, leaf in enumerate(leaves) if leaf.replicated], entries, "ro")
    if roff:
        lo, hi, _ = share_bounds(roff, dp_rank, dp_size)
        replicated = {"total": roff, "dp_rank": dp_rank, "dp_size": dp_size, "lo": lo, "hi": hi, "o": off,
                      "h": PLACEHOLDER}
        _schedule(leaves, rep_groups, entries, "ro", lo, hi, off, copies, batches)
        off = align(off + hi - lo)
    topology = topology or Topology.plain(world_size, dp_size, dp_rank)
    manifest = {"format": FORMAT, "step": step, "rank": rank, "world_size": world_size,
                "topology": topology.to_json(), "tree": flat.tree, "leaves": entries, "replicated": replicated,
                "meta": meta or {}}
    return Plan(manifest, off, copies, batches)


def _tensor_from(src: torch.Tensor, entry: dict, copy: bool):
    raw = src.clone() if copy else src
    if entry["k"] == "a":
        return raw.numpy().view(np.dtype(entry["dt"])).reshape(entry["sh"])
    return raw.view(dtype_from_name(entry["dt"])).view(entry["sh"])


def _itemsize(entry: dict) -> int:
    # Packed leaves (see _pack) sit at multiples of their element size, not always of ALIGN.
    return np.dtype(entry["dt"]).itemsize if entry["k"] == "a" else dtype_from_name(entry["dt"]).itemsize


@dataclass
class Pieces:
    """The replicated region of a step as it was found: pieces (offset in the region, uint8 tensor) that cover
    it end to end. A piece is a view of a slot where the share lies on this node, or a private buffer."""

    parts: list[tuple[int, torch.Tensor]]

    def take(self, ro: int, n: int, itemsize: int = ALIGN) -> torch.Tensor:
        """Bytes [ro, ro + n) of the region: a view of the piece holding them where that piece holds all of
        them at an address their dtype (of `itemsize` bytes) can view, else a private copy."""
        pieces = [(lo, t) for lo, t in self.parts if lo < ro + n and ro < lo + t.numel()] or self.parts[:1]
        lo, t = pieces[0]
        if len(pieces) == 1 and (t.storage_offset() + ro - lo) % itemsize == 0:
            return t[ro - lo: ro - lo + n]
        return torch.cat([t[max(0, ro - lo): ro + n - lo] for lo, t in pieces])


def unpack(manifest: dict, data: torch.Tensor, replicated: Pieces | None = None, *, owned: bool = False,
           upload=None, upload_from: torch.Tensor | None = None):
    """Rebuild the state from a slot's data bytes (uint8 tensor) and, if any, the replicated region's pieces.

    Leaves of the replicated region are taken from its pieces as they are (views where they can be). Leaves
    in `data` are copied out, so the result stays valid after the slot is reused, unless `owned` says the
    caller takes care of that (a private copy, or a caller that copies out what it keeps); then they are views.
    `upload` (a device.Upload): leaves that lived on an accelerator when saved go back there through it, read
    from `upload_from` (the slot's shared, registered mapping of `data`) where given.
    """
    values = []
    for entry in manifest["leaves"]:
        n = entry["n"]
        if upload is not None and "dv" in entry:
            own = data if upload_from is None else upload_from
            src = own[entry["o"]: entry["o"] + n] if "o" in entry else replicated.take(entry["ro"], n, _itemsize(entry))
            values.append(upload(_tensor_from(src, entry, copy=False), entry["dv"]))
        elif "o" in entry:
            values.append(_tensor_from(data[entry["o"]: entry["o"] + n], entry, copy=not owned))
        else:
            values.append(_tensor_from(replicated.take(entry["ro"], n, _itemsize(entry)), entry, copy=False))
    return unflatten(manifest["tree"], values)


def shard_specs(manifest: dict) -> dict[int, list[ShardSpec]]:
    """Leaf index -> the shard specs it carries, for leaves that carry any."""
    return {i: [ShardSpec.from_json(d) for d in e["shards"]] for i, e in enumerate(manifest["leaves"])
            if "shards" in e}
