"""A trainer's reads of its own node's committed slots straight from shared memory: one copy, no socket.

Each region's checksum is verified once, on first touch (SlotView, as the SMP verifies what it serves), and
the slot header is checked again after every copy, so a slot reused meanwhile fails instead of handing back
mixed bytes. Other nodes' slots, and a lost node's through parity, are read through the SMP (`fallback`).
"""
from __future__ import annotations

import numpy as np

from ..errors import InmemFTError
from ..smp.protocol import READ_MAX
from ..smp.segments import Segment
from ..snapshot import segment as seg
from .slotreads import SlotView


class LocalReads:
    def __init__(self, node: int, entries: list[dict], fallback):
        """entries: catalog listings (SMPClient.catalog); fallback: SMPClient.read, for every other slot."""
        self.node, self.fallback = node, fallback
        self._names = {(e["rank"], e["step"]): e["segment"] for e in entries
                       if e["node"] == node and e["source"] == "memory" and e.get("segment")}
        self._open: dict[str, tuple[Segment, SlotView]] = {}

    def read(self, node: int, rank: int, step: int, offset: int, length: int, into: np.ndarray | None = None):
        """As SMPClient.read: (bytes [offset, offset+length) of the slot, where they came from)."""
        name = self._names.get((rank, step)) if node == self.node else None
        if name is None:
            return self.fallback(node, rank, step, offset, length, into=into)
        segment, view = self._view(name)
        out = np.empty(length, dtype=np.uint8) if into is None else into
        for a in range(0, length, READ_MAX):
            n = min(READ_MAX, length - a)
            out[a: a + n] = view.read(offset + a, n)
            if seg.Header.read(segment.buf) != view.header:
                raise InmemFTError(f"{view.where}: the slot was reused by a newer snapshot during the read; restart "
                                   f"the job to restore again")
        return out, "memory"

    def _view(self, name: str) -> tuple[Segment, SlotView]:
        if name not in self._open:
            segment = Segment(name)
            where = f"node {self.node} slot {name}"
            header, manifest = seg.read_committed(segment.buf, where)
            buf = segment.buf  # zero-copy views: SlotView hashes them, read() copies them out

            def view(off, n):
                return np.frombuffer(buf, dtype=np.uint8, count=n, offset=off)
            self._open[name] = (segment, SlotView(where, header, manifest, view))
        return self._open[name]

    def close(self) -> None:
        for segment, _ in self._open.values():
            segment.close()
        self._open.clear()
