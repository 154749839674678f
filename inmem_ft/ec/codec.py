"""Systematic Cauchy Reed-Solomon (k data + m parity blocks) on in-memory buffers, via ISA-L.

Blocks are numpy arrays, memoryviews or anything else exposing a contiguous buffer; ISA-L reads and
writes them in place through their addresses, so encode/decode copy nothing. Block indices 0..k-1 are
the data blocks (stored unchanged: the code is systematic), k..k+m-1 the parity blocks. Any k of the
k+m blocks rebuild the others, because every k x k submatrix of a Cauchy generator is invertible.
"""

import ctypes
import threading
from collections import OrderedDict

import numpy as np

from inmem_ft.ec import parallel
from inmem_ft.ec.isal import LIB

# ISA-L takes the block length as a C int; 1 GiB slices stay clear of its limit and are still long
# enough that per-call overhead is invisible.
_SLICE = 1 << 30
# Erasure patterns seen by one process are few (one per combination of lost nodes), but bound the
# cache anyway: a table is k * rows * 32 bytes.
_CACHE_ENTRIES = 256

_u8_p = ctypes.POINTER(ctypes.c_ubyte)
_u8_pp = ctypes.POINTER(_u8_p)


class NotEnoughBlocks(ValueError):
    """More blocks are lost than the code tolerates."""


def _gf_tables():
    # Log/exp tables built with ISA-L's own gf_mul, so products below are in exactly its field.
    exp = np.zeros(510, dtype=np.int64)
    exp[0] = 1
    for i in range(1, 255):
        exp[i] = LIB.gf_mul(int(exp[i - 1]), 2)
    exp[255:] = exp[:255]
    log = np.zeros(256, dtype=np.int64)
    log[exp[:255]] = np.arange(255)
    a = np.arange(256)[:, None]
    b = np.arange(256)[None, :]
    mul = exp[log[a] + log[b]].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    return mul


_GF_MUL = _gf_tables()


def _gf_matmul(a, b):
    """Matrix product over GF(2^8): addition is XOR."""
    return np.bitwise_xor.reduce(_GF_MUL[a[:, :, None], b[None, :, :]], axis=1)


def _ptr(arr):
    return ctypes.cast(arr.ctypes.data, _u8_p)


def as_u8(buf, name, writable=False):
    """A flat uint8 numpy view of `buf`'s memory (never a copy), or a clear error."""
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as exc:
            raise TypeError(
                f"{name}: needs a contiguous buffer (numpy array, memoryview, bytes, bytearray), "
                f"got {type(buf).__name__} ({exc})"
            ) from None
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} is not contiguous in memory; pass np.ascontiguousarray(...) of it")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only, but output blocks are written in place: pass a writable buffer")
    return arr.reshape(-1).view(np.uint8)


def _common_length(arrays, what):
    lengths = {a.nbytes for a in arrays}
    if len(lengths) != 1:
        raise ValueError(f"{what} must all have the same length, got lengths {sorted(lengths)}")
    return lengths.pop()


class RSCodec:
    """Systematic Cauchy Reed-Solomon code with k data and m parity blocks (k + m <= 255). One call runs on
    up to `workers` cores (ec/parallel.py)."""

    def __init__(self, k, m, workers=parallel.WORKERS):
        for name, value in (("k", k), ("m", m), ("workers", workers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RSCodec: {name} must be an integer >= 1, got {value!r}")
        if k + m > 255:
            raise ValueError(f"RSCodec: k + m must be <= 255 (GF(2^8) has 255 usable points), got k={k}, m={m}")
        self.k, self.m, self.n = k, m, k + m
        self.workers = workers
        self._matrix = np.empty((self.n, k), dtype=np.uint8)
        LIB.gf_gen_cauchy1_matrix(_ptr(self._matrix), self.n, k)
        self._tables = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self):
        return f"RSCodec(k={self.k}, m={self.m})"

    def encode(self, data, parity_out=None, parity_indices=None):
        """Computes parity of the k `data` blocks into `parity_out` (written in place) and returns it.

        `parity_indices` (default all of 0..m-1) selects which parity blocks to compute, so a node
        that holds one parity block of a stripe computes only that one. Without `parity_out`, new
        arrays are allocated.
        """
        if len(data) != self.k:
            raise ValueError(f"{self}: encode needs exactly k={self.k} data blocks, got {len(data)}")
        rows = list(range(self.m)) if parity_indices is None else list(parity_indices)
        bad = [p for p in rows if not 0 <= p < self.m]
        if bad or len(set(rows)) != len(rows) or not rows:
            raise ValueError(f"{self}: parity_indices must be distinct values in 0..{self.m - 1}, got {rows}")
        src = [as_u8(b, f"data[{i}]") for i, b in enumerate(data)]
        length = _common_length(src, "data blocks")
        dst = self._outputs(parity_out, len(rows), length, "parity_out")
        self._run(tuple(range(self.k)), tuple(self.k + p for p in rows), src, dst, length)
        return dst

    def decode(self, blocks, want, out=None):
        """Rebuilds the blocks numbered in `want` (data or parity) from surviving `blocks`.

        `blocks` maps block index -> buffer for at least k survivors; `out` optionally maps each
        wanted index to a writable buffer of the block length (else new arrays are allocated).
        Returns {index: rebuilt block}.
        """
        want = list(want)
        if not want:
            raise ValueError(f"{self}: decode needs at least one block index in `want`")
        for idx in list(blocks) + want:
            if not isinstance(idx, (int, np.integer)) or not 0 <= idx < self.n:
                raise ValueError(f"{self}: block index {idx!r} is outside 0..{self.n - 1}")
        if len(set(want)) != len(want):
            raise ValueError(f"{self}: `want` lists a block twice: {want}")
        both = sorted(set(want) & set(blocks))
        if both:
            raise ValueError(f"{self}: blocks {both} are both given and wanted; want only lost blocks")
        if len(blocks) < self.k:
            raise NotEnoughBlocks(
                f"{self}: need {self.k} surviving blocks to rebuild {sorted(want)}, got {len(blocks)} "
                f"({sorted(blocks)}): {self.n - len(blocks)} blocks are lost and the code tolerates {self.m}"
            )
        # Lowest indices first: when every data block survives, the decode matrix is the identity.
        sources = tuple(sorted(int(i) for i in blocks)[: self.k])
        src = [as_u8(blocks[i], f"blocks[{i}]") for i in sources]
        length = _common_length(src, "surviving blocks")
        if out is None:
            dst = self._outputs(None, len(want), length, "out")
        else:
            missing = [i for i in want if i not in out]
            if missing:
                raise ValueError(f"{self}: `out` has no buffer for wanted blocks {missing}")
            dst = self._outputs([out[i] for i in want], len(want), length, "out")
        self._run(sources, tuple(int(i) for i in want), src, dst, length)
        return dict(zip(want, dst))

    def _outputs(self, given, count, length, name):
        if given is None:
            return [np.empty(length, dtype=np.uint8) for _ in range(count)]
        if len(given) != count:
            raise ValueError(f"{self}: {name} needs {count} buffers, got {len(given)}")
        dst = [as_u8(b, f"{name}[{i}]", writable=True) for i, b in enumerate(given)]
        for i, d in enumerate(dst):
            if d.nbytes != length:
                raise ValueError(f"{self}: {name}[{i}] holds {d.nbytes} bytes, blocks are {length} bytes")
        return dst

    def _coefficients(self, sources, targets):
        """Init tables that map the `sources` blocks to the `targets` blocks, cached per pattern."""
        key = (sources, targets)
        with self._lock:
            tables = self._tables.get(key)
            if tables is not None:
                self._tables.move_to_end(key)
                return tables
        if sources == tuple(range(self.k)):
            inverse = np.eye(self.k, dtype=np.uint8)
        else:
            # gf_invert_matrix destroys its input: hand it a copy.
            sub = np.ascontiguousarray(self._matrix[list(sources)])
            inverse = np.empty((self.k, self.k), dtype=np.uint8)
            if LIB.gf_invert_matrix(_ptr(sub), _ptr(inverse), self.k) != 0:
                raise ArithmeticError(f"{self}: generator rows {sources} are singular (a bug: Cauchy's never are)")
        coeffs = np.ascontiguousarray(_gf_matmul(self._matrix[list(targets)], inverse))
        tables = np.empty(self.k * len(targets) * 32, dtype=np.uint8)
        LIB.ec_init_tables(self.k, len(targets), _ptr(coeffs), _ptr(tables))
        with self._lock:
            self._tables[key] = tables
            if len(self._tables) > _CACHE_ENTRIES:
                self._tables.popitem(last=False)
        return tables

    def _run(self, sources, targets, src, dst, length):
        tables = self._coefficients(sources, targets)
        src_addr = [a.ctypes.data for a in src]
        dst_addr = [a.ctypes.data for a in dst]

        def piece(start, end):
            for off in range(start, end, _SLICE):
                n = min(_SLICE, end - off)
                src_p = (ctypes.c_void_p * len(src))(*[a + off for a in src_addr])
                dst_p = (ctypes.c_void_p * len(dst))(*[a + off for a in dst_addr])
                LIB.ec_encode_data(
                    n, self.k, len(dst), _ptr(tables), ctypes.cast(src_p, _u8_pp), ctypes.cast(dst_p, _u8_pp)
                )

        # `src`, `dst` and `tables` are referenced until this returns, so the memory stays alive.
        parallel.run(piece, length, self.workers)
