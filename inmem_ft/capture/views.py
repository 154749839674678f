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
"""
from __future__ import annotations

import functools
from typing import Iterable

import numpy as np
import torch

from .. import pages
from ..snapshot import segment

PIECE = 1 << 21  # elements per copy task: enough tasks to keep every worker busy, few enough to be cheap


class PrivateAfterLoad:
    """`with PrivateAfterLoad(snap, optimizers, modules, holders): framework_load()`; on exit nothing reachable
    from the optimizers' state, the modules' parameters and buffers, or the tensor attributes of `holders`
    (framework wrappers such as a ZeRO optimizer) views one of `snap`'s slot mappings."""

    def __init__(self, snap, optimizers: Iterable[torch.optim.Optimizer] = (), modules: Iterable = (),
                 holders: Iterable = ()):
        self.snap, self.optimizers, self.modules = snap, list(optimizers), list(modules)
        self.holders = list(holders)
        self.copied = 0  # bytes copied out of shared memory on exit

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
        self._copy_out(kept)
        return False

    def _copy_out(self, kept: list) -> None:
        """Each kept view into the tensor the framework had (if it fits) or into one fresh arena, faulted in up
        front on huge pages; the copies run side by side (torch's copy releases the GIL)."""
        targets, sizes = [], []
        for put, view, own in kept:
            fits = (own is not None and own is not view and own.shape == view.shape and own.dtype == view.dtype
                    and own.device == view.device and own.is_contiguous())
            targets.append(own if fits else None)
            sizes.append(0 if fits else segment.align(view.numel() * view.element_size()))
        arena = pages.fresh(sum(sizes), threads=pages.WORKERS) if sum(sizes) else None
        pieces, offset = [], 0
        for (put, view, _), own, size in zip(kept, targets, sizes):
            if own is None:
                own = arena[offset: offset + view.numel() * view.element_size()].view(view.dtype).view(view.shape)
                offset += size
            flat_dst, flat_src = own.view(-1), view.reshape(-1)
            pieces += [(flat_dst[a: a + PIECE], flat_src[a: a + PIECE]) for a in range(0, flat_dst.numel(), PIECE)]
            put(own)
            self.copied += view.numel() * view.element_size()
        list(pages.pool().map(lambda pair: pair[0].copy_(pair[1]), pieces))


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
