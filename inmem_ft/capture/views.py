"""Restoring from views of the slots without letting the framework keep the snapshot's memory.

A restore that hands a framework views of the slots (`Snapshotter.restore(views=True)`) skips a copy of the
whole state into fresh memory, which on a CPU node costs more than everything else in a restore (every page
of fresh memory faults in on first touch). The views are of a copy-on-write mapping of the slot
(`smp.segments.Segment.private`): the framework may write them without touching the snapshot, and an adapter
may point the framework's own tensors at them so that its load copies nothing (DeepSpeed's fp32 partitions:
integrations/deepspeed/handle.py). What stays shared is a page not yet written: it would change when the SMP
rewrites the slot, two snapshots later. `PrivateAfterLoad` brackets the framework's load and gives every kept
view of a copy-on-write mapping pages of its own (pages.privatize: the kernel copies each page, no Python
pass over the bytes); whatever the framework kept of the slots' shared mappings (a data-parallel peer's
share) is copied out: into the state tensors the optimizer held before the load where they match (already
faulted in, so the copy runs at memcpy speed), else into one fresh arena faulted in up front on huge pages.

With `defer`, that work runs in the background and finishes at the Snapshotter's next fence() (before the
next optimizer step or snapshot, which the adapters already fence): until then nothing writes the views
(forward and backward do not touch optimizer state) and the slots they view cannot be rewritten (the
restored step's slots are kept until every rank, each after its own fence, commits a newer step).
"""
from __future__ import annotations

import functools
import logging
import mmap
import time
from typing import Iterable

import numpy as np
import torch

from .. import pages
from ..snapshot import segment
from .armed import Armed

PIECE = 1 << 21  # elements per copy task: enough tasks to keep every worker busy, few enough to be cheap
log = logging.getLogger("inmem_ft.capture")


class PrivateAfterLoad:
    """`with PrivateAfterLoad(snap, optimizers, modules, holders): framework_load()`; on exit (with `defer`: at
    `snap`'s next fence()) nothing reachable from the optimizers' state, the modules' parameters and buffers,
    or the tensor attributes of `holders` (framework wrappers such as a ZeRO optimizer) views one of `snap`'s
    slot mappings."""

    def __init__(self, snap, optimizers: Iterable[torch.optim.Optimizer] = (), modules: Iterable = (),
                 holders: Iterable = (), defer: bool = False, release: list | None = None):
        """release: tensors the framework no longer holds (what an adapter displaced), dropped after the kept
        views have pages of their own: freeing hundreds of MiB is not for the restore to wait on."""
        self.snap, self.optimizers, self.modules = snap, list(optimizers), list(modules)
        self.holders, self.defer, self.release = list(holders), defer, release if release is not None else []
        self.copied = 0  # bytes copied out of shared memory (with `defer`: being copied, in the background)
        self.privatized = 0  # bytes of copy-on-write views kept, whose pages become this process's own

    def __enter__(self):
        self._before = [{id(p): dict(s) for p, s in opt.state.items()} for opt in self.optimizers]
        self._armed = Armed("inmem_ft-copy-out") if self.defer else None
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            if self._armed is not None:
                self._armed.go(None)
            return False
        bases = self.snap.mapped_storages()
        kept = []  # (put(tensor), view, own tensor to copy into or None)
        for opt, before in zip(self.optimizers, self._before):
            for p, state in opt.state.items():
                for key, value in state.items():
                    if _views(value, bases):
                        kept.append((functools.partial(state.__setitem__, key), value,
                                     before.get(id(p), {}).get(key)))
        for module in self.modules:
            for t in [*module.parameters(), *module.buffers()]:
                if _views(t, bases):
                    kept.append((functools.partial(setattr, t, "data"), t.data, None))
        for holder in self.holders:
            for name, value in vars(holder).items():
                if _views(value, bases):
                    kept.append((functools.partial(setattr, holder, name), value, None))
                elif isinstance(value, list):
                    kept += [(functools.partial(value.__setitem__, i), item, None)
                             for i, item in enumerate(value) if _views(item, bases)]
        # What views a copy-on-write mapping stays where it is; only its pages are made the process's own.
        cow = self.snap.private_mappings()
        moved, stays = [], []
        for k in kept:
            (stays if k[1].untyped_storage().data_ptr() in cow and k[1].is_contiguous() else moved).append(k)
        # a holder may keep one view under two names (ZeRO-3's module partitions and the buffer backing them)
        ranges = _runs({(view.data_ptr(), view.numel() * view.element_size()) for _, view, _ in stays})
        info = self.snap.last_restore
        copy = _CopyOut(moved, ranges, self.snap.rank, self.release, info.phases if info is not None else None)
        self.copied, self.privatized = copy.nbytes, copy.private_bytes
        if self.defer and kept:
            self.snap.before_change(copy.finish)
            self.snap.reading(copy)
            copy.start(self._armed)
        else:
            if self._armed is not None:
                self._armed.go(None)
            copy.run()
            copy.finish()
        self.snap.loaded()
        return False


class _CopyOut:
    """Each kept view into the tensor the framework had (if it fits) or into one fresh arena, faulted in up
    front on huge pages; the copies run side by side (torch's copy releases the GIL). The (address, length)
    ranges of `private` (kept views of copy-on-write mappings) get pages of their own instead, with no copy
    in Python. finish() hands the copies to the framework in place of the views."""

    def __init__(self, kept: list, private: list[tuple[int, int]], rank: int, release: list,
                 phases: dict | None = None):
        self.kept, self.private, self.rank, self.release, self.phases = kept, private, rank, release, phases
        self.nbytes = sum(view.numel() * view.element_size() for _, view, _ in kept)
        self.private_bytes = sum(n for _, n in private)
        self._thread, self._error, self._seconds = None, None, 0.0
        self._owned: list = []

    def start(self, thread: Armed) -> None:
        self._thread = thread
        thread.go(self._background)

    def _background(self) -> None:
        try:
            self.run()
        except BaseException as e:  # raised on the training thread at finish()
            self._error = e

    def run(self) -> None:
        t0 = time.perf_counter()
        for address, length in self.private:
            pages.privatize(address, length)
        targets, sizes = [], []
        for put, view, own in self.kept:
            fits = (own is not None and own is not view and own.shape == view.shape and own.dtype == view.dtype
                    and own.device == view.device and own.is_contiguous())
            targets.append(own if fits else None)
            sizes.append(0 if fits else segment.align(view.numel() * view.element_size()))
        arena = pages.fresh(sum(sizes), threads=pages.WORKERS) if sum(sizes) else None
        pieces, offset = [], 0
        owned = []
        for (put, view, _), own, size in zip(self.kept, targets, sizes):
            if own is None:
                own = arena[offset: offset + view.numel() * view.element_size()].view(view.dtype).view(view.shape)
                offset += size
            flat_dst, flat_src = own.view(-1), view.reshape(-1)
            pieces += [(flat_dst[a: a + PIECE], flat_src[a: a + PIECE]) for a in range(0, flat_dst.numel(), PIECE)]
            owned.append(own)
        # Host to host, and all end before a failure is raised.
        pages.run_all(lambda pair: pair[0].copy_(pair[1], non_blocking=False), pieces)
        self.release.clear()
        self._owned, self._seconds = owned, time.perf_counter() - t0

    def stop(self) -> None:
        """Wait for the background copies, which read the slots: their Snapshotter is closing."""
        if self._thread is not None:
            self._thread.join()

    def finish(self) -> None:
        """Wait for the copies (background ones), then put them where the framework keeps the views."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            waited = time.perf_counter() - t0
            if self._error is not None:
                raise self._error
            log.info("restore rank=%d event=copied_out bytes=%d privatized_bytes=%d background_s=%.3f waited_s=%.3f",
                     self.rank, self.nbytes, self.private_bytes, self._seconds, waited)
            if self.phases is not None:  # the restore's breakdown (RestoreInfo.phases) shows the work it deferred
                self.phases.update(copy_out_background=round(self._seconds, 4), copy_out_wait=round(waited, 4))
        for (put, _, _), own in zip(self.kept, self._owned):
            put(own)
        self.kept = self._owned = []


def _runs(ranges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, length) ranges merged where they overlap or lie less than a page apart: a slot lays its
    tensors out one after another, and privatizing a few long runs moves whole pages at once
    (pages.privatize) where one range per tensor would leave every tensor's edge pages to the kernel. Less
    than a page: a gap of a page or more may be a hole between two mappings, which no copy may read."""
    out: list[list[int]] = []
    for address, length in sorted(ranges):
        if out and address < out[-1][0] + out[-1][1] + mmap.PAGESIZE:
            out[-1][1] = max(out[-1][1], address + length - out[-1][0])
        else:
            out.append([address, length])
    return [(a, n) for a, n in out]


def _views(value, bases: set[int]) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and \
        value.untyped_storage().data_ptr() in bases


def private(obj, bases: set[int]):
    """`obj` with every tensor or array that views a slot mapping replaced by a copy (for small user state
    handed back from a restore, such as DeepSpeed extras)."""
    if _views(obj, bases):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return type(obj)((k, private(v, bases)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(private(v, bases) for v in obj)
    return obj
