"""Page-level advice for memory this package copies into: prefaulting and huge pages.

A copy into memory no one has touched yet pays a page fault (and the zeroing of a page) for every 4 KiB;
on a CPU node that costs more than the copy itself. Asking the kernel up front, for the whole range and from
several threads, is several times cheaper. madvise goes through ctypes because mmap.madvise holds the GIL
and knows neither advice on Python 3.11.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import numpy as np

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; an older kernel refuses it and pages fault in on first touch
HUGE = 2 << 20
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MAP_FAILED = ctypes.c_void_p(-1).value
WORKERS = 4  # copies, checksums and prefaults release the GIL; page faults scale with threads
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = _libc.mremap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The process's worker threads for bulk memory work, all started at once on first use: a thread started
    while another prefaults waits for the address-space lock the prefault holds (its stack is an mmap), which
    serialises what was meant to run side by side."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="inmem_ft-memory")
            started = threading.Barrier(WORKERS)
            for future in [_pool.submit(started.wait) for _ in range(WORKERS)]:
                future.result()
        return _pool


def run_all(fn, items, stop: threading.Event | None = None) -> None:
    """fn(item) for every item on the pool, side by side; returns once every call ended (wait_all)."""
    futures = []
    try:
        for item in items:
            futures.append(pool().submit(fn, item))
    finally:  # a submit refused at interpreter exit: the calls already submitted still end first
        wait_all(futures, stop)


def wait_all(futures: list[Future], stop: threading.Event | None = None) -> None:
    """Wait until every one of `futures` has ended, then raise the first failure. Not at the first failure:
    each reads memory its caller may unmap or reuse once this returns (a restore that falls back lets go of
    the slot it checked), and a copy still running there is a SIGSEGV. At a failure or an interruption the
    queued ones are cancelled and `stop` is set, which the running ones check between pieces to end early."""
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        if stop is not None and not all(f.done() for f in futures):
            stop.set()
        for future in futures:
            future.cancel()
        wait(futures)
    for future in futures:
        if not future.cancelled():  # cancelled: queued behind the failure
            future.result()


def advise(address: int, length: int, advice: int) -> bool:
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def populate(address: int, length: int, threads: int = 1) -> None:
    """Prefault [address, address + length) for writing, split over `threads` (madvise releases the GIL)."""
    if threads <= 1 or length < 2 * HUGE:
        advise(address, length, MADV_POPULATE_WRITE)
        return
    step = -(-length // threads // HUGE) * HUGE
    list(pool().map(lambda a: advise(address + a, min(step, length - a), MADV_POPULATE_WRITE),
                    range(0, length, step)))


def privatize(address: int, length: int, chunk: int = HUGE) -> None:
    """Give this process its own copy of every page of [address, address + length) in a copy-on-write mapping
    (segments.Segment.private), so the memory no longer changes when the segment behind it is rewritten. The
    whole pages inside the range are copied into fresh memory on huge pages, which is then moved over them
    (_move_in_copy); what is left, and everything where that fails, the kernel copies a page at a time
    (_copy_on_write). No one else may write the range meanwhile (the callers run it before their fence)."""
    page = mmap.PAGESIZE
    inner_lo, inner_hi = -(-address // page) * page, (address + length) // page * page
    if inner_hi - inner_lo >= 2 * HUGE and _move_in_copy(inner_lo, inner_hi - inner_lo):
        rest = [(address, inner_lo - address), (inner_hi, address + length - inner_hi)]
    else:
        rest = [(address, length)]
    for a, n in rest:
        if n > 0:
            _copy_on_write(a, n, chunk)


def _move_in_copy(address: int, length: int) -> bool:
    """Copy the whole pages [address, address + length) into a fresh anonymous mapping and move that mapping
    over them (mremap), so that the tensors there keep their addresses and the process owns the pages. Copying
    a page on write costs a fault per 4 KiB (and each fault takes the address-space lock a training thread's
    own faults and frees wait on): 600 MiB was 155k faults, 0.3-1.1 s, and beside a training step on the same
    cores several times that; into huge pages it is a few hundred faults and a memcpy. The source is placed at
    the same offset within 2 MiB as the destination, so that its huge pages stay whole where they land.
    False (nothing changed) where the kernel refuses a step."""
    import torch  # here: the SMP uses this module and never imports torch

    # Not fresh(): a Python mmap unmaps its own range when it goes, which after the move is someone else's.
    span = length + HUGE
    base = _libc.mmap(None, ctypes.c_size_t(span), mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, MAP_FAILED):
        return False
    src = base + (address - base) % HUGE
    head, tail = src - base, base + span - (src + length)
    try:
        advise(src, length, MADV_HUGEPAGE)
        populate(src, length, threads=WORKERS)
        dst_t = torch.frombuffer((ctypes.c_uint8 * length).from_address(src), dtype=torch.uint8)
        src_t = torch.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8)
        run_all(lambda a: dst_t[a: a + HUGE * 8].copy_(src_t[a: a + HUGE * 8]), range(0, length, HUGE * 8))
        moved = _libc.mremap(ctypes.c_void_p(src), ctypes.c_size_t(length), ctypes.c_size_t(length),
                             MREMAP_MAYMOVE | MREMAP_FIXED, ctypes.c_void_p(address))
    except BaseException:
        _libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(span))
        raise
    if moved != address:
        _libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(span))
        return False
    # What is left of the source mapping around the moved range.
    for a, n in ((base, head), (src + length, tail)):
        if n:
            _libc.munmap(ctypes.c_void_p(a), ctypes.c_size_t(n))
    return True


def _copy_on_write(address: int, length: int, chunk: int) -> None:
    """The kernel's copy of each page of [address, address + length), in chunks: each madvise holds the
    address-space lock, which a thread start or a large allocation elsewhere in the process waits for. Where
    the kernel refuses MADV_POPULATE_WRITE (before 5.14), one byte of every page is written with its own value
    instead."""
    import torch

    page = mmap.PAGESIZE
    lo, hi = address - address % page, address + length
    _drop_unwritten(lo, hi)
    for a in range(lo, hi, chunk):
        n = min(chunk, hi - a)
        if not advise(a, n, MADV_POPULATE_WRITE):
            first = (ctypes.c_uint8 * n).from_address(a)
            touched = torch.frombuffer(first, dtype=torch.uint8)[::page]
            touched.copy_(touched.clone())


def _drop_unwritten(lo: int, hi: int) -> None:
    """Unmap the pages of [lo, hi) (lo page-aligned) that still map the file behind a private mapping: read,
    never written, they show the file's own bytes, so nothing is lost. Making such a page private replaces a
    mapped page, which interrupts every core the process runs on to flush its TLB entry, one page at a time:
    400 MiB took 2.1 s that way beside a busy training thread, 0.32 s once unmapped (the kernel then gives
    each page its copy as it maps it, and unmapping flushes in batches). The page flags come from
    /proc/self/pagemap (bit 63: present, bit 61: a file page); without it nothing is dropped."""
    page = mmap.PAGESIZE
    first, count = lo // page, -(-(hi - lo) // page)
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            flags = np.frombuffer(f.read(count * 8), dtype=np.uint64)
    except OSError:
        return
    mapped = ((flags >> np.uint64(63)) & (flags >> np.uint64(61)) & np.uint64(1)).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mapped, [0]))))
    for start, stop in zip(edges[::2], edges[1::2]):
        advise(lo + int(start) * page, int(stop - start) * page, MADV_DONTNEED)


def fresh(nbytes: int, threads: int = 1):
    """`nbytes` of private memory (uint8 tensor, which keeps the mapping alive), already faulted in, on huge
    pages where the kernel has them (transparent huge pages in `madvise` mode, the common default)."""
    import torch  # here: the SMP uses this module and never imports torch

    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = torch.frombuffer(m, dtype=torch.uint8)[:nbytes]
    advise(out.data_ptr(), len(m), MADV_HUGEPAGE)
    populate(out.data_ptr(), len(m), threads)
    return out
