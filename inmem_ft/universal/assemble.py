"""Global tensors, or any piece of one, from the `main` fragments the catalog lists, wherever their bytes live.

Reads go through a `read(node, rank, step, offset, length, into=None) -> uint8 array` callable (the local
SMP's `SMPClient.read`, which reaches other nodes and decodes a lost node's bytes from parity). A piece is a box of
the global tensor (optionally only a row-major range of it, as a ZeRO partition or a bucket slice is): only
the fragment bytes that overlap it are read, in windows of at most WINDOW bytes, so memory stays at the
piece being built plus one window.
"""
from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import torch

from ..errors import CatalogHole
from ..snapshot.catalog import byte_runs, coverage, element_runs
from ..snapshot.tree import dtype_from_name

WINDOW = 64 << 20


def keys(table: pa.Table) -> list[str]:
    return sorted(set(table.column("key").to_pylist()))


def read_global(table: pa.Table, key: str, read) -> torch.Tensor:
    """The global tensor `key`; raises CatalogHole if its main fragments do not cover it exactly."""
    import pyarrow.compute as pc  # here only: importing it costs a resharding load 0.2-0.6 s per rank

    rows = table.filter(pc.equal(table.column("key"), key))
    info = coverage(rows)
    if not info:
        raise CatalogHole(f"global tensor {key!r} is not in the catalog")
    if info[0]["hole"]:
        raise CatalogHole(f"global tensor {key!r}: {info[0]['hole']}")
    return Fragments(rows).tensor(key, read)


class Fragments:
    """The main fragments of a catalog table (catalog.check'ed: they cover each global tensor exactly once),
    indexed by key, and reads of any piece of a global tensor through them."""

    def __init__(self, table: pa.Table):
        self.cols = table.to_pydict()
        self.by_key: dict[str, list[int]] = {}
        for i, (key, main) in enumerate(zip(self.cols["key"], self.cols["main"])):
            if main:
                self.by_key.setdefault(key, []).append(i)
        self._runs: dict[int, tuple] = {}
        self.bytes_read: Counter = Counter()  # by where the bytes came from: memory | parity
        self.seconds_read: Counter = Counter()  # the same split of the reads' time: parity is the reconstruction

    def __contains__(self, key: str) -> bool:
        return key in self.by_key

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.cols["global_shape"][self._rows(key)[0]])

    def dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self.cols["dtype"][self._rows(key)[0]])

    def tensor(self, key: str, read) -> torch.Tensor:
        return self.piece(key, read).view(self.shape(key))

    def piece(self, key: str, read, offset=None, shape=None, flat=None, out: torch.Tensor | None = None):
        """Elements of `key` inside the box `offset` + `shape` (default: the whole tensor), only its row-major
        range `flat` = (lo, hi) if given, as a 1-D tensor (into `out` when given)."""
        gs = self.shape(key)
        shape = tuple(shape) if shape is not None else gs
        lo, hi = flat if flat is not None else (0, math.prod(shape))
        dtype = self.dtype(key)
        if out is None:
            out = torch.empty(hi - lo, dtype=dtype)
        if out.dtype != dtype or out.numel() != hi - lo:
            raise ValueError(f"{key}: `out` holds {out.numel()} {out.dtype}, the piece is {hi - lo} {dtype}")
        if hi > lo:
            # The slot's bytes land in host memory: a device target (a CUDA parameter) is filled through a host
            # piece and one copy to the device; numpy() of it would raise.
            host = out if out.device.type == "cpu" else torch.empty(hi - lo, dtype=dtype)
            self._fill(key, read, offset, shape, (lo, hi), host.view(-1).view(torch.uint8).numpy())
            if host is not out:
                out.view(-1).copy_(host)
        return out

    def raw(self, key: str, read) -> np.ndarray:
        """The bytes of the whole global tensor `key`, whatever its dtype (numpy leaves name numpy dtypes)."""
        rows = self._rows(key)
        out = np.empty(math.prod(self.shape(key)) * self.cols["itemsize"][rows[0]], dtype=np.uint8)
        if out.nbytes:
            self._fill(key, read, None, self.shape(key), (0, math.prod(self.shape(key))), out)
        return out

    def _fill(self, key: str, read, offset, shape, flat, dst: np.ndarray) -> None:
        rows = self._rows(key)
        cols = self.cols
        gs = self.shape(key)
        offset = tuple(offset) if offset is not None else (0,) * len(gs)
        lo, hi = flat
        itemsize = cols["itemsize"][rows[0]]
        starts, lens = element_runs(gs, offset, shape, lo, hi)
        t_lo, t_hi = starts * itemsize, (starts + lens) * itemsize
        t_pos = np.concatenate(([0], np.cumsum(t_hi - t_lo)[:-1]))
        filled = 0
        for i in rows:
            r_lo, r_hi = self.runs(i)
            if not len(r_lo):
                continue
            r_pos = np.concatenate(([0], np.cumsum(r_hi - r_lo)[:-1]))
            a, b, s, e = _overlaps(r_lo, r_hi, t_lo, t_hi)
            if not len(s):
                continue
            src, dst_pos, n = r_pos[a] + s - r_lo[a], t_pos[b] + s - t_lo[b], e - s
            filled += int(n.sum())
            self._copy(i, read, src, dst_pos, n, dst)
        if filled != dst.nbytes:
            raise CatalogHole(f"global tensor {key!r}: the main fragments hold {filled} of the {dst.nbytes} bytes of "
                              f"box {offset}+{tuple(shape)} range [{lo}, {hi}); a loader cannot assemble it from this "
                              f"step")

    def _rows(self, key: str) -> list[int]:
        rows = self.by_key.get(key)
        if not rows:
            raise CatalogHole(f"global tensor {key!r} is not in the catalog")
        return rows

    def runs(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """catalog.byte_runs of row i, computed once (the catalog's check and every read of the row use them)."""
        if i not in self._runs:
            self._runs[i] = byte_runs(self.cols, i)
        return self._runs[i]

    def _copy(self, i: int, read, src, dst_pos, n, dst: np.ndarray) -> None:
        """Bytes [src, src+n) of row i's slot bytes into dst[dst_pos:]: a lone piece straight into place, nearby
        small ones through one window of at most WINDOW bytes."""
        cols = self.cols
        where = (cols["node"][i], cols["rank"][i], cols["step"][i])
        base = cols["slot_offset"][i]
        order = np.argsort(src, kind="stable")
        src, dst_pos, n = src[order], dst_pos[order], n[order]
        end = src + n  # increasing too: the pieces are disjoint runs of the row's bytes
        j = 0
        while j < len(src):
            k = max(int(np.searchsorted(end, src[j] + WINDOW, side="right")), j + 1)
            if k == j + 1:
                at, size = int(dst_pos[j]), int(n[j])
                self._read(read, where, base + int(src[j]), size, dst[at: at + size])
            else:
                w_lo = int(src[j])
                data = self._read(read, where, base + w_lo, int(end[k - 1]) - w_lo, None)
                _scatter(dst, dst_pos[j:k], data, src[j:k] - w_lo, n[j:k])
            j = k

    def _read(self, read, where, offset: int, length: int, into):
        t0 = time.perf_counter()
        data = read(*where, offset, length, into=into)
        source = "memory"
        if isinstance(data, tuple):  # SMPClient.read also says where the bytes came from
            data, source = data
        self.bytes_read[source] += length
        self.seconds_read[source] += time.perf_counter() - t0
        if into is not None and data is not into:
            into[:] = data
        return data


def _scatter(dst: np.ndarray, dst_pos, data: np.ndarray, src, n) -> None:
    """dst[dst_pos[m]: +n[m]] = data[src[m]: +n[m]] for every m. The pieces between the first and the last are
    mostly the rows of a box (one size, evenly spaced on both sides; a flat range cuts the first and the last):
    those go in one strided copy, not a Python step each (a TP-split weight has thousands)."""
    rest = range(len(n))
    if len(n) > 3:
        size, d_step, s_step = n[1:-1], np.diff(dst_pos[1:-1]), np.diff(src[1:-1])
        if (size == size[0]).all() and (d_step == d_step[0]).all() and (s_step == s_step[0]).all() \
                and min(d_step[0], s_step[0]) >= size[0]:  # evenly spaced, and apart: no piece overlaps the next
            shape, strided = (len(n) - 2, int(size[0])), np.lib.stride_tricks.as_strided
            strided(dst[int(dst_pos[1]):], shape, (int(d_step[0]), 1))[:] = \
                strided(data[int(src[1]):], shape, (int(s_step[0]), 1))
            rest = (0, len(n) - 1)
    for m in rest:
        a, b, size = int(dst_pos[m]), int(src[m]), int(n[m])
        dst[a: a + size] = data[b: b + size]


def _overlaps(a_lo, a_hi, b_lo, b_hi):
    """(i, j, lo, hi) of every overlap [lo, hi) of interval a[i] with interval b[j]; each list sorted and
    disjoint (a fragment's byte runs, a piece's byte runs)."""
    first = np.searchsorted(b_hi, a_lo, side="right")
    last = np.searchsorted(b_lo, a_hi, side="left")
    count = np.maximum(last - first, 0)
    i = np.repeat(np.arange(len(a_lo)), count)
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    lo, hi = np.maximum(a_lo[i], b_lo[j]), np.minimum(a_hi[i], b_hi[j])
    keep = lo < hi
    return i[keep], j[keep], lo[keep], hi[keep]
