"""Restoring from views of shared memory without letting the framework keep them.

A restore that hands a framework views of the slots (`Snapshotter.restore(views=True)`) skips a copy of the
whole state into fresh memory, which on a CPU node costs more than everything else in a restore (every page
of fresh memory faults in on first touch). Most loaders copy what they read into tensors they already own
(module.load_state_dict, DeepSpeed's ZeRO-1/2 partitions), but torch's Optimizer.load_state_dict keeps the
tensors it is given, and the trainer rewrites its slots two snapshots later: a kept view would then change
under the optimizer, and the optimizer's in-place updates would write into a snapshot. `PrivateAfterLoad`
brackets the framework's load and copies every kept view out into memory the framework owns: into the state
tensors the optimizer held before the load where they match (already faulted in, so the copy runs at memcpy
speed), else into one fresh arena faulted in up front on huge pages (pages.fresh), several times cheaper than
faulting fresh tensors in one 4 KiB page at a time.

With `defer`, that copy runs in the background and the kept views are swapped for the copies at the
Snapshotter's next fence() (before the next optimizer step or snapshot, which the adapters already fence):
until then nothing writes the views (forward and backward do not touch optimizer state) and the slots they
view cannot be rewritten (the restored step's slots are kept until every rank, each after its own fence,
commits a newer step). A fresh process has no optimizer state to copy into, so the copy is mostly page
faults of fresh memory, whose cost swings from 0.1 to several seconds with the kernel's huge-page compaction
on a loaded node: behind the first forward/backward, the restore no longer waits for it.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Iterable

import numpy as np
import torch

from .. import pages
from ..snapshot import segment

PIECE = 1 << 21  # elements per copy task: enough tasks to keep every worker busy, few enough to be cheap
log = logging.getLogger("inmem_ft.capture")


class PrivateAfterLoad:
    """`with PrivateAfterLoad(snap, optimizers, modules, holders): framework_load()`; on exit (with `defer`: at
    `snap`'s next fence()) nothing reachable from the optimizers' state, the modules' parameters and buffers,
    or the tensor attributes of `holders` (framework wrappers such as a ZeRO optimizer) views one of `snap`'s
    slot mappings."""

    def __init__(self, snap, optimizers: Iterable[torch.optim.Optimizer] = (), modules: Iterable = (),
                 holders: Iterable = (), defer: bool = False):
        self.snap, self.optimizers, self.modules = snap, list(optimizers), list(modules)
        self.holders, self.defer = list(holders), defer
        self.copied = 0  # bytes copied out of shared memory (with `defer`: being copied, in the background)

    def __enter__(self):
        self._before = [{id(p): dict(s) for p, s in opt.state.items()} for opt in self.optimizers]
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
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
        copy = _CopyOut(kept, self.snap.rank)
        self.copied = copy.nbytes
        if self.defer and kept:
            self.snap.before_change(copy.finish)
            copy.start()
        else:
            copy.run()
            copy.finish()
        self.snap.loaded()
        return False


class _CopyOut:
    """Each kept view into the tensor the framework had (if it fits) or into one fresh arena, faulted in up
    front on huge pages; the copies run side by side (torch's copy releases the GIL). finish() hands the
    copies to the framework in place of the views."""

    def __init__(self, kept: list, rank: int):
        self.kept, self.rank, self.nbytes = kept, rank, sum(view.numel() * view.element_size() for _, view, _ in kept)
        self._thread, self._error, self._seconds = None, None, 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._background, name="inmem_ft-copy-out", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        try:
            self.run()
        except BaseException as e:  # raised on the training thread at finish()
            self._error = e

    def run(self) -> None:
        t0 = time.perf_counter()
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
        list(pages.pool().map(lambda pair: pair[0].copy_(pair[1]), pieces))
        self._owned, self._seconds = owned, time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for the copies (background ones), then put them where the framework keeps the views."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            waited = time.perf_counter() - t0
            if self._error is not None:
                raise self._error
            log.info("restore rank=%d event=copied_out bytes=%d background_s=%.3f waited_s=%.3f", self.rank,
                     self.nbytes, self._seconds, waited)
        for (put, _, _), own in zip(self.kept, self._owned):
            put(own)
        self.kept = self._owned = []


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
