"""The SMPs' disk tier (smp/disktier.py: `<persist_dir>/<job>/node<N>/r<rank>.step<step>.slot`, raw slot bytes,
each step's files named by its `step<S>.done` marker) offered as committed slots, the way an SMP offers its own:
`catalog()` lists one slot per file with its manifest, `read()` serves byte ranges of it. MemorySource reads
them as it reads the SMPs', so `inmem-ft export --from DIR` is the same code as an export from memory and needs
no SMP running.

Only files a marker names are read (a file no marker names is a torn flush). Every file is verified before it
is listed (header and manifest checksums, then every tensor region's), so a torn or corrupted file is an error
naming it, never garbage in an export. Files are memory-mapped, and the pages of each region verified or piece
read are let go at once: the process holds one region or piece.
"""
from __future__ import annotations

import mmap
import os
import re

import numpy as np

from ..errors import InmemFTError, SnapshotCorrupt
from ..smp.disktier import SOURCE, flushed_steps
from ..snapshot import segment as seg

_NODE = re.compile(r"^node(\d+)$")


def slot_files(directory: str) -> list[tuple[int, str]]:
    """(node, path) of every flushed slot file under `directory`: the disk tier's base, one job's folder, or
    one node's folder. The node is read off its `node<N>` folder (-1 when the file lies elsewhere)."""
    if not os.path.isdir(directory):
        raise InmemFTError(f"--from {directory}: no such directory")
    out = []
    for folder, _, _ in os.walk(directory):
        m = _NODE.match(os.path.basename(folder))
        # A named file that is gone is a missing slot, which MemorySource reports with the ranks it lacks
        named = sorted({n for files in flushed_steps(folder).values() for n in files
                        if os.path.exists(os.path.join(folder, n))})
        out += [(int(m[1]) if m else -1, os.path.join(folder, n)) for n in named]
    if not out:
        raise InmemFTError(f"--from {directory}: no flushed slots (r<rank>.step<step>.slot named by a step<S>.done "
                           f"marker) in it or below it; give the SMPs' disk tier directory (`persist_dir`, written "
                           f"every `persist_every_steps` steps and on SIGTERM) or one job's folder in it")
    return out


class DiskSlots:
    def __init__(self, directory: str):
        self.where = directory
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._entries: list[dict] = []
        try:
            for node, path in slot_files(directory):
                self._add(node, path)
        except BaseException:
            self.close()
            raise

    def _add(self, node: int, path: str) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < seg.HEADER_SIZE:
                raise SnapshotCorrupt(f"{path}: {size} bytes, shorter than a slot header: a torn file; "
                                      f"remove it (its node's snapshot is then missing) or export from the SMPs")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:  # as seg.verify, letting go of each region's pages once checked: they fault in again when read
            header, manifest = seg.read_committed(memoryview(buf), path)
            seg.verify_regions(memoryview(buf), header, manifest, path, lambda o, n: _drop(buf, o, n))
        except SnapshotCorrupt as e:  # the map is left to the collector: the traceback still holds views of it
            raise SnapshotCorrupt(f"{e}; the disk tier's file is torn or damaged: remove the file (its node's snapshot is "
                                  f"then missing) or export from the SMPs") from None
        _drop(buf, 0, size)
        rank, step = manifest["rank"], header.step
        if (rank, step) in self._maps:  # the same slot flushed by two nodes: identical, verified; keep one
            buf.close()
            return
        self._maps[(rank, step)] = buf
        self._entries.append({"node": node, "rank": rank, "step": step, "segment": None, "data_off": header.data_off,
                              "data_len": header.data_len, "manifest_len": header.manifest_len, "source": SOURCE,
                              "manifest": manifest})

    def catalog(self, step: int | None = None) -> dict:
        return {"entries": [e for e in self._entries if step is None or e["step"] == step], "unreachable": []}

    def read(self, node: int, rank: int, step: int, offset: int, length: int, into: np.ndarray | None = None):
        """Bytes [offset, offset+length) of `rank`'s slot of `step` (offsets from the slot's start, as the
        catalog's), as SMPClient.read returns them."""
        buf = self._maps[(rank, step)]
        data = np.frombuffer(buf, dtype=np.uint8, count=length, offset=offset)
        out = data.copy() if into is None else into
        if into is not None:
            into[:] = data
        del data
        _drop(buf, offset, length)
        return out, SOURCE

    def close(self) -> None:
        for buf in self._maps.values():
            buf.close()
        self._maps.clear()


def _drop(buf: mmap.mmap, offset: int, length: int) -> None:
    """Unmap the pages of [offset, offset+length) from this process (they stay in the page cache): what an
    export holds stays one piece, not every file it has read."""
    lo = offset - offset % mmap.PAGESIZE
    buf.madvise(mmap.MADV_DONTNEED, lo, min(len(buf), offset + length) - lo)
