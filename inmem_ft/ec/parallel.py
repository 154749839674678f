"""A small thread pool that splits one erasure-coding call across cores.

One core encodes at 8-20 GB/s, about what it copies, while a server node's memory moves several times that;
a snapshot's parity must keep up with the copies of all the node's ranks. A ctypes call releases the GIL,
so the byte range of one call is cut into contiguous pieces that run side by side: the caller runs the
first piece itself, pool threads the rest.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from threading import Lock

from .. import pages

WORKERS = max(1, min(4, os.cpu_count() or 1))
MIN_PIECE = 1 << 20  # below this many bytes per piece, handing work to a thread costs more than it saves
_ALIGN = 64  # pieces start on a cache line, as ISA-L's SIMD loads like

_pool: ThreadPoolExecutor | None = None
_pool_lock = Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, WORKERS - 1), thread_name_prefix="inmem_ft-ec-encode")
        return _pool


def pieces(length: int, workers: int = WORKERS) -> list[tuple[int, int]]:
    """[start, end) ranges covering [0, length): at most `workers`, none shorter than MIN_PIECE but the
    last, all but the last a multiple of 64 bytes long."""
    count = max(1, min(workers, length // MIN_PIECE))
    step = -(-length // count // _ALIGN) * _ALIGN if count > 1 else length
    return [(a, min(length, a + step)) for a in range(0, length, step)] if length else [(0, 0)]


def run(fn, length: int, workers: int = WORKERS) -> None:
    """fn(start, end) over pieces of [0, length), side by side; returns when all are done, raising the first
    failure."""
    todo = pieces(length, workers)
    if len(todo) == 1:
        fn(*todo[0])
        return
    futures = [_executor().submit(fn, a, b) for a, b in todo[1:]]
    try:
        fn(*todo[0])
    finally:  # every piece ends first: a failure makes the caller drop the parity segment they write into
        pages.wait_all(futures)
