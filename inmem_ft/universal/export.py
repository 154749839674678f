"""`inmem-ft export`: one complete step of a job, read from memory, written in a format stock tools load.

Formats: `deepspeed-universal` (ds_universal.py) and `torch-dcp` (dcp.py). Each reads one global tensor at a
time through the local SMP (other nodes' bytes, parity for a lost node) and writes it before the next.
"""
from __future__ import annotations

import os
import time

from tqdm import tqdm

from . import dcp, ds_universal
from .source import MemorySource

FORMATS = {"deepspeed-universal": ds_universal, "torch-dcp": dcp}


def export(socket_path: str, fmt: str, out: str, step: int | None = None, progress: bool = True) -> dict:
    """Returns {step, format, path, tensors, bytes, seconds}."""
    writer = FORMATS[fmt]
    t0 = time.monotonic()
    with MemorySource(socket_path, step) as src:
        os.makedirs(out, exist_ok=True)
        with tqdm(desc=f"export step {src.step} as {fmt}", unit="tensor", disable=not progress,
                  delay=0.5) as bar:
            path, tensors, nbytes = writer.write(src, out, bar)
        return {"step": src.step, "format": fmt, "path": path, "tensors": tensors, "bytes": nbytes,
                "seconds": round(time.monotonic() - t0, 3)}
