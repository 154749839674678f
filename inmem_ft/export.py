"""`inmem-ft export`: one complete step of a job, read from memory (or from the SMPs' disk tier), written in a
format stock tools load.

Formats: `deepspeed-universal` (integrations/deepspeed/universal_export.py), `megatron-dist` (integrations/megatron/dist_export.py) and `torch-dcp` (dcp/export.py).
Each reads one global tensor at a time, through the local SMP (other nodes' bytes, parity for a lost node) or
from the disk tier's files (diskslots.py, verified first), and writes it before the next.
"""
from __future__ import annotations

import importlib
import os
import time

from tqdm import tqdm

from .universal.source import MemorySource

# Each format lives with its adapter; imported when chosen, as each imports its framework.
FORMATS = {"deepspeed-universal": ".integrations.deepspeed.universal_export",
           "megatron-dist": ".integrations.megatron.dist_export", "torch-dcp": ".dcp.export"}


def export(slots, fmt: str, out: str, step: int | None = None, progress: bool = True) -> dict:
    """`slots`: the local SMP's socket path, or a diskslots.DiskSlots. Returns {step, format, path, tensors,
    bytes, seconds}."""
    writer = importlib.import_module(FORMATS[fmt], __package__)
    t0 = time.monotonic()
    with MemorySource(slots, step) as src:
        os.makedirs(out, exist_ok=True)
        with tqdm(desc=f"export step {src.step} as {fmt}", unit="tensor", disable=not progress,
                  delay=0.5) as bar:
            path, tensors, nbytes = writer.write(src, out, bar)
        return {"step": src.step, "format": fmt, "path": path, "tensors": tensors, "bytes": nbytes,
                "seconds": round(time.monotonic() - t0, 3)}
