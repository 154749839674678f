"""Restoring from views of shared memory without letting the framework keep them.

A restore that hands a framework views of the slots (`Snapshotter.restore(views=True)`) skips a copy of the
whole state into fresh memory, which on a CPU node costs more than everything else in a restore (every page
of fresh memory faults in on first touch). Most loaders copy what they read into tensors they already own
(module.load_state_dict, DeepSpeed's ZeRO-1/2 partitions), but torch's Optimizer.load_state_dict keeps the
tensors it is given, and the trainer rewrites its slots two snapshots later: a kept view would then change
under the optimizer, and the optimizer's in-place updates would write into a snapshot. `PrivateAfterLoad`
brackets the framework's load and copies every kept view out into memory the framework owns: into the state
tensors the optimizer held before the load where they match (already faulted in, so the copy runs at memcpy
speed), else into fresh memory.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch


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
        for opt, before in zip(self.optimizers, self._before):
            for p, state in opt.state.items():
                for key, value in state.items():
                    if _views(value, bases):
                        state[key] = self._private(value, before.get(id(p), {}).get(key))
        for module in self.modules:
            for t in [*module.parameters(), *module.buffers()]:
                if _views(t, bases):
                    t.data = self._private(t.data)
        for holder in self.holders:
            for name, value in vars(holder).items():
                if _views(value, bases):
                    setattr(holder, name, self._private(value))
                elif isinstance(value, list):
                    for i, item in enumerate(value):
                        if _views(item, bases):
                            value[i] = self._private(item)
        return False

    def _private(self, view: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
        self.copied += view.numel() * view.element_size()
        if (own is not None and own is not view and own.shape == view.shape and own.dtype == view.dtype
                and own.device == view.device and own.is_contiguous()):
            return own.copy_(view)
        return view.clone()


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
