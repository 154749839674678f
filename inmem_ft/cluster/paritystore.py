"""A node's parity chunks for one step, in owner-only shared memory that outlives the SMP process.

    [0, 4096)          u32 length, JSON record, u64 xxh3 of the record
    [4096 + i*cs, ...) parity chunk i (i in StripeLayout.parity_for_node order), each cs bytes

The record holds the step, the state (building -> built -> protected), what a rebuild needs to know
about the whole group (each member's node-data length, the padded size) and each chunk's xxh3, so a
restarted SMP re-adopts its parity like its slots, and a corrupted chunk is caught before it is used.
"""
from __future__ import annotations

import json
import re
import struct

import numpy as np

from ..errors import ForeignSegment, SnapshotCorrupt
from ..smp.segments import Segment, names_with_prefix, unlink
from ..snapshot.checksum import checksum, to_hex

RECORD = 4096
BUILDING, BUILT, PROTECTED = "building", "built", "protected"
_LEN = struct.Struct("<I")
_HASH = struct.Struct("<Q")
_NAME = re.compile(r"\.parity\.s(\d+)$")


def name_of(prefix: str, step: int) -> str:
    return f"{prefix}parity.s{step}"


class ParitySet:
    def __init__(self, segment: Segment, record: dict):
        self.segment, self.record = segment, record
        self._verified: set[int] = set()  # chunks checked once: sealed parity is never written again
        # The members that went before this node saw their parity built, where it kept the set built without them
        # (cluster/protection.py); not in the record: an SMP that adopts the set takes it as plainly built.
        self.built_without: list[int] = []

    @classmethod
    def create(cls, prefix: str, step: int, m: int, chunk_size: int, group: dict) -> "ParitySet":
        name = name_of(prefix, step)
        unlink(name)  # a half-built leftover of the same step
        record = {"step": step, "state": BUILDING, "chunk_size": chunk_size, "m": m, "hashes": [], **group}
        ps = cls(Segment(name, RECORD + m * chunk_size, create=True), record)
        ps.write_record()
        return ps

    @property
    def step(self) -> int:
        return self.record["step"]

    @property
    def state(self) -> str:
        return self.record["state"]

    def chunk(self, i: int) -> np.ndarray:
        cs = self.record["chunk_size"]
        return np.frombuffer(self.segment.buf, dtype=np.uint8, count=cs, offset=RECORD + i * cs)

    def seal(self, state: str) -> None:
        """Record the chunks' checksums (first time) and move to `state`."""
        if not self.record["hashes"]:
            self.record["hashes"] = [to_hex(checksum(self.chunk(i))) for i in range(self.record["m"])]
        self.record["state"] = state
        self.write_record()

    def verified_chunk(self, i: int, where: str) -> np.ndarray:
        data = self.chunk(i)
        if i in self._verified:
            return data
        if to_hex(checksum(data)) != self.record["hashes"][i]:
            raise SnapshotCorrupt(f"{where}: parity chunk {i} of step {self.step} fails its checksum: the parity "
                                  f"in memory was corrupted and cannot be used to rebuild")
        self._verified.add(i)
        return data

    def write_record(self) -> None:
        raw = json.dumps(self.record, separators=(",", ":")).encode()
        if _LEN.size + len(raw) + _HASH.size > RECORD:
            raise ValueError(f"parity record of {len(raw)} bytes does not fit {RECORD}")
        self.segment.buf[: _LEN.size + len(raw) + _HASH.size] = _LEN.pack(len(raw)) + raw + _HASH.pack(checksum(raw))

    def drop(self) -> None:
        self.segment.close()
        self.segment.unlink()


def adopt(prefix: str, keep_building: bool = False) -> tuple[list[ParitySet], list[str], list[str]]:
    """Parity sets found in shared memory that are at least built (or still building, with `keep_building`: a
    rebuild goes on with it); (sets, reasons for each one discarded, reasons for each one refused: not written
    by an SMP of this user, so neither used nor deleted)."""
    found, discarded, refused = [], [], []
    for name in names_with_prefix(prefix):
        if not _NAME.search(name):
            continue
        segment = None
        try:
            segment = Segment(name)
            (n,) = _LEN.unpack(segment.buf[: _LEN.size])
            raw = bytes(segment.buf[_LEN.size: _LEN.size + n])
            (stored,) = _HASH.unpack(segment.buf[_LEN.size + n: _LEN.size + n + _HASH.size])
            if n > RECORD or checksum(raw) != stored:
                raise SnapshotCorrupt("record fails its checksum")
            record = json.loads(raw)
            if record["state"] == BUILDING and not keep_building:
                raise SnapshotCorrupt("it was still being built")
            found.append(ParitySet(segment, record))
        except ForeignSegment as e:
            refused.append(f"{name}: {e}")
        except (SnapshotCorrupt, ValueError, KeyError, OSError, struct.error) as e:
            if segment is not None:
                segment.close()
            unlink(name)
            discarded.append(f"{name}: {e}")
    return found, discarded, refused
