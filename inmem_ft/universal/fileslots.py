"""State trees held in this process (a disk checkpoint's files, memory-mapped) offered as committed slots, the
way an SMP offers its own: `catalog()` lists one slot per rank with its manifest, `read()` serves byte
ranges of it. MemorySource reads them as it reads the SMPs', so resharding from the disk tier is the same
code as from memory, and only the pages of the pieces a rank reads are touched.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from ..errors import InmemFTError
from ..snapshot import layout
from ..snapshot.topology import Topology
from ..snapshot.tree import flatten

SOURCE = "disk"


class FileSlots:
    def __init__(self, trees: dict[int, object], step: int, topologies: dict[int, Topology], where: str):
        """trees: rank -> its state (tensors may carry shard specs); `where` names the files for errors."""
        self.where, self._slots, self._entries = where, {}, []
        world = len(trees)
        for rank in sorted(trees):
            flat = flatten(trees[rank])
            plan = layout.plan(flat, step=step, rank=rank, world_size=world, topology=topologies[rank])
            # Where each leaf's bytes sit in the slot: the manifest says it (`o`), whatever copies plan() chose.
            placed = sorted((entry["o"], entry["n"], flat.leaves[i].value)
                            for i, entry in enumerate(plan.manifest["leaves"]) if "o" in entry and entry["n"])
            self._slots[rank] = ([p[0] for p in placed], placed)
            self._entries.append({"node": -1, "rank": rank, "step": step, "segment": None, "data_off": 0,
                                  "data_len": plan.data_len, "manifest_len": 0, "source": SOURCE,
                                  "manifest": plan.manifest})

    def catalog(self, step: int | None = None) -> dict:
        return {"entries": [e for e in self._entries if step is None or e["step"] == step], "unreachable": []}

    def read(self, node: int, rank: int, step: int, offset: int, length: int, into: np.ndarray | None = None):
        """Bytes [offset, offset+length) of `rank`'s slot data, as SMPClient.read returns them."""
        out = np.empty(length, dtype=np.uint8) if into is None else into
        (starts, placed), end = self._slots[rank], offset + length
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        filled = 0
        for dst, n, value in placed[i:]:
            if dst >= end:
                break
            a, b = max(dst, offset), min(dst + n, end)
            if a < b:
                out[a - offset: b - offset] = _bytes(value)[a - dst: b - dst]
                filled += b - a
        if filled != length:
            raise InmemFTError(f"{self.where}: rank {rank}'s bytes [{offset}, {end}) are not all in its files")
        return out, SOURCE

    def close(self) -> None:
        self._slots.clear()


def _bytes(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value.reshape(-1).view(np.uint8)
    return value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
