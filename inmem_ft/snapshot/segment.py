"""The byte layout of one snapshot slot in shared memory, and its integrity checks.

    [0, 4 KiB)                 header: magic, state, step, offsets, manifest checksum, header checksum
    [4 KiB, data_off)          manifest (JSON, written by the trainer at commit)
    [data_off, data_off+len)   tensor bytes, each region 64-byte aligned

A slot is self-describing so a restarted SMP can re-adopt it from /dev/shm alone. The chain header ->
manifest -> region checksums means a torn or corrupted slot is always detected before it is loaded.
"""
from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass

from .. import pages
from ..errors import InmemFTError, SnapshotCorrupt, UnknownFormat
from .checksum import checksum, to_hex

MAGIC = b"INMEMFT1"
VERSION = 1
FORMAT = "inmem_ft/2"  # the manifest's schema (docs/FORMAT.md); VERSION is the binary header's
HEADER_SIZE = 4096
ALIGN = 64
PAGE = 4096

BLANK, WRITING, COMMITTED = 0, 1, 2
_FIELDS = struct.Struct("<8sIIqQQQQQ")  # magic version state step man_off man_len data_off data_len man_hash
_HASH = struct.Struct("<Q")


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def data_offset(manifest_len: int) -> int:
    return HEADER_SIZE + align(manifest_len, PAGE)


def slot_size(manifest_len: int, data_len: int) -> int:
    return data_offset(manifest_len) + align(data_len, PAGE)


@dataclass
class Header:
    state: int
    step: int
    manifest_len: int
    data_off: int
    data_len: int
    manifest_hash: int = 0

    def pack(self) -> bytes:
        body = _FIELDS.pack(MAGIC, VERSION, self.state, self.step, HEADER_SIZE, self.manifest_len,
                            self.data_off, self.data_len, self.manifest_hash)
        return body + _HASH.pack(checksum(body))

    def write(self, buf) -> None:
        raw = self.pack()
        buf[: len(raw)] = raw

    @classmethod
    def read(cls, buf) -> "Header | None":
        """The header, or None if the slot holds no valid header (blank, torn or foreign)."""
        raw = bytes(buf[: _FIELDS.size + _HASH.size])
        body, (stored,) = raw[: _FIELDS.size], _HASH.unpack(raw[_FIELDS.size:])
        magic, version, state, step, _, man_len, data_off, data_len, man_hash = _FIELDS.unpack(body)
        if magic != MAGIC or checksum(body) != stored:
            return None
        if version != VERSION:
            raise UnknownFormat(f"slot header version {version}, this inmem_ft reads version {VERSION}: the "
                                f"snapshot was written by another inmem_ft release; restore it with that "
                                f"release or from the disk tier (the snapshot is kept)")
        return cls(state, step, man_len, data_off, data_len, man_hash)


def is_blank(buf) -> bool:
    """A header of zeros: a slot reserved and never written, or one the SMP discarded. Not a corruption."""
    return not any(bytes(buf[: _FIELDS.size + _HASH.size]))


def manifest_view(buf, header: Header):
    return buf[HEADER_SIZE: HEADER_SIZE + header.manifest_len]


def data_view(buf, header: Header):
    return buf[header.data_off: header.data_off + header.data_len]


def encode_manifest(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()


def read_committed(buf, where: str, size: int | None = None) -> tuple[Header, dict]:
    """Header and manifest of a committed slot, after checking header and manifest checksums. `buf` may hold
    only the slot's first bytes (header and manifest, as a remote reader fetches them); `size`: the slot's."""
    header = Header.read(buf)
    if header is None:
        raise SnapshotCorrupt(f"{where}: header missing or failing its checksum (a blank, overwritten or corrupted "
                              f"slot)")
    if header.state != COMMITTED:
        raise SnapshotCorrupt(f"{where}: slot for step {header.step} was never committed (torn write)")
    if header.data_off + header.data_len > (len(buf) if size is None else size):
        raise SnapshotCorrupt(f"{where}: header points past the end of the segment")
    raw = manifest_view(buf, header)
    if len(raw) != header.manifest_len:
        raise SnapshotCorrupt(f"{where}: the manifest of step {header.step} is cut short")
    if checksum(raw) != header.manifest_hash:
        raise SnapshotCorrupt(f"{where}: manifest of step {header.step} fails its checksum")
    manifest = json.loads(bytes(raw))
    check_format(manifest, where)
    return header, manifest


def check_format(manifest: dict, where: str) -> None:
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        raise UnknownFormat(f"{where}: manifest format {found!r}, this inmem_ft reads {FORMAT!r} (docs/FORMAT.md): "
                            f"the snapshot was written by another inmem_ft release; restore it with that release "
                            f"or from the disk tier (the snapshot is kept)")


def verify_regions(buf, header: Header, manifest: dict, where: str, checked=None) -> None:
    """Check every tensor region's checksum; raise SnapshotCorrupt naming the first bad one. `checked(offset,
    length)` hears of each region (offsets from the slot's start) once it passed: a reader of a mapped file
    lets go of its pages there."""
    data = data_view(buf, header)
    for i, leaf in enumerate(manifest["leaves"]):
        if "o" in leaf and checksum(data[leaf["o"]: leaf["o"] + leaf["n"]]) != int(leaf["h"], 16):
            raise SnapshotCorrupt(f"{where}: step {header.step} tensor #{i} ({leaf['dt']}{leaf['sh']}) "
                                  f"fails its checksum: the bytes in memory were corrupted")
        if "o" in leaf and checked is not None:
            checked(header.data_off + leaf["o"], leaf["n"])
    rep = manifest.get("replicated")
    if rep and checksum(data[rep["o"]: rep["o"] + rep["hi"] - rep["lo"]]) != int(rep["h"], 16):
        raise SnapshotCorrupt(f"{where}: step {header.step} replicated share fails its checksum")


def regions(manifest: dict, base: int = 0) -> list[tuple[int, int, int, str]]:
    """(start, end, checksum, label) of every checksummed region, offsets from `base` (the data offset for
    slot offsets, 0 for data offsets), in offset order."""
    out = [(base + leaf["o"], base + leaf["o"] + leaf["n"], int(leaf["h"], 16),
            f"tensor #{i} ({leaf['dt']}{leaf['sh']})") for i, leaf in enumerate(manifest["leaves"]) if "o" in leaf]
    rep = manifest.get("replicated")
    if rep:
        out.append((base + rep["o"], base + rep["o"] + rep["hi"] - rep["lo"], int(rep["h"], 16), "replicated share"))
    return sorted(out)


COPY_PIECE = 8 << 20  # small enough to stay in cache between the copy and its checksum
COPY_WORKERS = pages.WORKERS


def copy_verified(data, manifest: dict, where: str, step: int, workers: int = COPY_WORKERS):
    """A private copy of a slot's data bytes (uint8 tensor), every region's checksum verified on the copy.

    One pass over shared memory: each piece is hashed right after it is copied, while it is still in cache,
    instead of a checksum pass over shared memory followed by a copy pass."""
    import torch

    out = torch.empty(data.numel(), dtype=torch.uint8)
    _run(data, out, regions(manifest), where, step, workers)
    return out


def verify_data(data, manifest: dict, where: str, step: int, workers: int = COPY_WORKERS) -> None:
    """Check every region's checksum of a slot's data bytes (uint8 tensor) where they lie, with no copy: for
    callers that read the slot in place and copy only what they keep."""
    check_regions(data, regions(manifest), where, step, workers)


def check_regions(data, todo: list, where: str, step: int, workers: int = COPY_WORKERS,
                  stop: threading.Event | None = None) -> None:
    """Check the regions `todo` (as regions() lists them) of a slot's data bytes where they lie, on the memory
    pool's threads; raises SnapshotCorrupt naming a bad region, or one past the data. `stop`, once set, ends
    the checks early (InmemFTError): the slot's owner is letting go of it."""
    _run(data, None, todo, where, step, workers, stop)


def check_bounds(data, todo: list, where: str, step: int) -> None:
    if todo and todo[-1][1] > data.numel():
        raise SnapshotCorrupt(f"{where}: step {step} {todo[-1][3]} lies past the slot's data")


def _run(data, out, todo: list, where: str, step: int, workers: int, stop: threading.Event | None = None) -> None:
    """Split the regions into `workers` runs of about equal bytes, checked (and copied into `out`, if given)
    side by side: hashing and copying release the GIL, and fresh memory's page faults scale with threads.
    Returns only once every run has ended (pages.wait_all): the caller may unmap `data` right after."""
    import os

    check_bounds(data, todo, where, step)
    if not todo:
        return
    runs, total, acc = [[]], sum(end - start for start, end, _, _ in todo), 0
    share = total / max(1, min(workers, os.cpu_count() or 1))
    for region in todo:
        if runs[-1] and acc >= share * len(runs):
            runs.append([])
        runs[-1].append(region)
        acc += region[1] - region[0]
    stopped = threading.Event() if stop is None else stop
    pages.run_all(lambda run: _check_run(data, out, run, where, step, stopped), runs, stopped)
    if stopped.is_set():  # no run failed (that would have been raised), so `stop` was set by the caller's owner
        raise InmemFTError(f"{where}: the checks of step {step} were stopped before they ended")


def _check_run(data, out, run: list, where: str, step: int, stop: threading.Event) -> None:
    """Hash bytes [first region's start, last region's end) piece by piece; with `out`, copy each piece there
    first and hash the copy while it is in cache. Ends early, quietly, once `stop` is set (another run failed,
    or the slot's owner is closing it)."""
    import xxhash

    view = (data if out is None else out).numpy()
    i, partial = 0, None
    lo, hi = run[0][0], run[-1][1]
    for a in range(lo, hi, COPY_PIECE):
        if stop.is_set():
            return
        b = min(hi, a + COPY_PIECE)
        if out is not None:
            out[a:b].copy_(data[a:b], non_blocking=False)  # host to host: done before it is hashed
        while i < len(run) and run[i][0] < b:
            start, end, expected, label = run[i]
            piece = view[max(start, a): min(end, b)]
            if partial is None and end <= b:
                got = xxhash.xxh3_64_intdigest(piece)
            else:
                partial = partial or xxhash.xxh3_64()
                partial.update(piece)
                if end > b:
                    break
                got, partial = partial.intdigest(), None
            if got != expected:
                raise SnapshotCorrupt(f"{where}: step {step} {label} fails its checksum: the bytes in memory "
                                      f"were corrupted")
            i += 1
    for start, end, expected, label in run[i:]:  # empty regions at the very end
        if checksum(b"") != expected:
            raise SnapshotCorrupt(f"{where}: step {step} {label} fails its checksum")


def verify(buf, where: str) -> tuple[Header, dict]:
    header, manifest = read_committed(buf, where)
    verify_regions(buf, header, manifest, where)
    return header, manifest


def region_hashes(data, manifest: dict) -> None:
    """Fill in the checksum of every region of `data` (the slot's data view) into the manifest."""
    for leaf in manifest["leaves"]:
        if "o" in leaf:
            leaf["h"] = to_hex(checksum(data[leaf["o"]: leaf["o"] + leaf["n"]]))
    rep = manifest.get("replicated")
    if rep:
        rep["h"] = to_hex(checksum(data[rep["o"]: rep["o"] + rep["hi"] - rep["lo"]]))
