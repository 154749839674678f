"""A node's data for one step, as erasure coding sees it: one byte string made of a small JSON index and
the used bytes of each local rank's committed slot.

    [0, 8)              u64 length of the index
    [8, 8 + len)        index JSON: {"step": s, "ranks": {rank: [offset, length]}}, offsets counted from `base`
    base = [8 + len] rounded up to 64, then each rank's slot bytes [0, data_off + data_len) (header,
                        manifest, tensors), each at a 64-aligned offset

The slot bytes are self-describing and carry their own checksums, so a rebuilt node is verified with the
same checks a restore runs. The string is never materialised: `pieces` serves any byte range straight
from the slots' shared memory (zeros past the end stand for the stripe padding).
"""
from __future__ import annotations

import json
import struct

import numpy as np

from ..snapshot.segment import align

_LEN = struct.Struct("<Q")
MAX_INDEX = 16 << 20  # bytes of index JSON: far above any node's, bounds what a garbage length could ask for


class NodeData:
    def __init__(self, step: int, slots: dict[int, memoryview]):
        """`slots`: rank -> the used bytes of its committed slot for `step`."""
        self.step = step
        ranks, off = {}, 0
        for rank in sorted(slots):
            ranks[str(rank)] = [off, len(slots[rank])]
            off = align(off + len(slots[rank]))
        index = json.dumps({"step": step, "ranks": ranks}, separators=(",", ":")).encode()
        head = _LEN.pack(len(index)) + index
        base = align(len(head))
        self.parts = [(0, memoryview(head))] + [(base + ranks[str(r)][0], slots[r]) for r in sorted(slots)]
        self.length = self.parts[-1][0] + len(self.parts[-1][1])

    def pieces(self, start: int, length: int) -> list:
        """Buffers that together are bytes [start, start+length) of the node data, zero-padded."""
        out, pos, end = [], start, start + length
        for off, view in self.parts:
            lo, hi = max(pos, off), min(end, off + len(view))
            if lo >= hi:
                continue
            if lo > pos:
                out.append(bytes(lo - pos))
            out.append(view[lo - off: hi - off])
            pos = hi
        if pos < end:
            out.append(bytes(end - pos))
        return out


def read_index(read) -> tuple[int, dict[int, tuple[int, int]]]:
    """(step, rank -> (offset, length) of its slot bytes in the node data) through `read(offset, n) -> bytes`,
    so a lost node's index can be decoded from parity piece by piece; ValueError if the index is garbage."""
    (n,) = _LEN.unpack(bytes(read(0, _LEN.size)))
    if n > MAX_INDEX:
        raise ValueError(f"node data index claims {n} bytes, more than the {MAX_INDEX}-byte limit")
    index = json.loads(bytes(read(_LEN.size, n)))
    base = align(_LEN.size + n)
    return int(index["step"]), {int(r): (base + o, ln) for r, (o, ln) in index["ranks"].items()}


def split(data: np.ndarray) -> tuple[int, dict[int, np.ndarray]]:
    """(step, rank -> slot bytes) from a node's (rebuilt) data; raises ValueError if the index is garbage."""
    def read(off, n):
        if off + n > len(data):
            raise ValueError(f"node data index points past the {len(data)} bytes rebuilt")
        return data[off: off + n]
    step, ranks = read_index(read)
    return step, {r: read(o, ln) for r, (o, ln) in ranks.items()}
