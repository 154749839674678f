"""`inmem-ft export`: one complete step of a job, read from memory (or from the SMPs' disk tier), written in a
format stock tools load.

Formats: `deepspeed-universal` (ds_universal.py), `megatron-dist` (megatron_dist.py) and `torch-dcp` (dcp.py).
Each reads one global tensor at a time, through the local SMP (other nodes' bytes, parity for a lost node) or
from the disk tier's files (diskslots.py, verified first), and writes it before the next.
"""
from __future__ import annotations

import os
import time

from tqdm import tqdm

from . import dcp, ds_universal, megatron_dist
from .source import MemorySource

FORMATS = {"deepspeed-universal": ds_universal, "megatron-dist": megatron_dist, "torch-dcp": dcp}


def export(slots, fmt: str, out: str, step: int | None = None, progress: bool = True) -> dict:
    """`slots`: the local SMP's socket path, or a diskslots.DiskSlots. Returns {step, format, path, tensors,
    bytes, seconds}."""
    writer = FORMATS[fmt]
    t0 = time.monotonic()
    with MemorySource(slots, step) as src:
        os.makedirs(out, exist_ok=True)
        with tqdm(desc=f"export step {src.step} as {fmt}", unit="tensor", disable=not progress,
                  delay=0.5) as bar:
            path, tensors, nbytes = writer.write(src, out, bar)
        return {"step": src.step, "format": fmt, "path": path, "tensors": tensors, "bytes": nbytes,
                "seconds": round(time.monotonic() - t0, 3)}
