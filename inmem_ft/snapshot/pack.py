"""Leaves -> a slot's data bytes, as a layout.Plan places them (the inverse of layout.unpack).

A Batch (whole host tensors of one dtype and trailing shape, laid end to end) is one torch.cat into a view
of the slot; any other leaf, or part of one, is one copy. Copies run under no_grad: leaves are the caller's own
tensors, parameters included, and nothing here is part of training's graph.
"""
from __future__ import annotations

import math
from operator import itemgetter

import numpy as np
import torch

from .layout import Batch, Copy
from .tree import nbytes


def source_bytes(value, lo: int, hi: int, whole: bool = False):
    """Bytes [lo, hi) of a leaf as a uint8 tensor where it lives (`whole`: the tensor itself, as its dtype)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8)[lo:hi])
    if whole:
        return value
    return value.contiguous().reshape(-1).view(torch.uint8)[lo:hi]


def copy_into(dst: torch.Tensor, value, c: Copy) -> None:
    """Bytes [c.lo, c.hi) of leaf `value` into `dst` (a uint8 tensor of that many bytes, any device). From a
    device, the copy is only queued on the current stream (the caller's event says when it is done)."""
    # Whole tensors are copied as themselves (any strides), unless `dst` cannot be viewed as their dtype.
    whole = c.lo == 0 and c.hi == nbytes(value) and isinstance(value, torch.Tensor) \
        and dst.storage_offset() % value.element_size() == 0
    src = source_bytes(value, c.lo, c.hi, whole)
    with torch.no_grad():
        if whole:
            dst.view(value.dtype).view(value.shape).copy_(src, non_blocking=True)
        else:
            dst.copy_(src, non_blocking=True)


def cat_into(data: torch.Tensor, values: list, b: Batch) -> None:
    """One torch.cat of a batch's tensors into its bytes of `data` (stack for 0-d tensors)."""
    out = data[b.dst: b.dst + b.nbytes].view(b.dtype)
    group = itemgetter(*b.leaves)(values)
    with torch.no_grad():
        if b.trailing is None:
            torch.stack(group, out=out)
            return
        rows = out.numel() // max(1, math.prod(b.trailing))
        # Empty, so that cat sizes it: under a reused plan whose tensors changed size, the rows it writes are
        # checked below (they never pass the end of the slot, which cannot grow).
        out = out[:0].view(0, *b.trailing)
        torch.cat(group, out=out)
        if out.shape[0] != rows:
            raise ValueError(f"a batch of {len(group)} tensors no longer fills its {b.nbytes} bytes")


def gather_into(data: torch.Tensor, values: list, b: Batch, flat: torch.Tensor) -> None:
    """A device batch: its tensors gathered into `flat` (b.nbytes on the device, of b.dtype) by one kernel,
    then one copy out into its bytes of `data`, queued on the current stream."""
    group = [values[i].reshape(-1) for i in b.leaves]
    if sum(t.numel() for t in group) != flat.numel():
        raise ValueError(f"a batch of {len(group)} device tensors no longer fills its {b.nbytes} bytes")
    with torch.no_grad():
        torch.cat(group, out=flat)
        data[b.dst: b.dst + b.nbytes].view(b.dtype).copy_(flat, non_blocking=True)


def write(values: list, copies: list[Copy], batches: list[Batch], data: torch.Tensor) -> None:
    """Every batch and copy into `data`, the slot's data bytes (a host uint8 tensor)."""
    for b in batches:
        cat_into(data, values, b)
    for c in copies:
        copy_into(data[c.dst: c.dst + c.hi - c.lo], values[c.leaf], c)
