"""One global tensor from the `main` fragments the catalog lists, wherever their bytes live.

Reads go through a `read(node, rank, step, offset, length) -> uint8 array` callable (the local SMP's
`SMPClient.read`, which reaches other nodes and decodes a lost node's bytes from parity), one fragment piece
at a time, so memory stays at the tensor being built plus one piece.
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..errors import CatalogHole
from ..snapshot.catalog import byte_runs, coverage
from ..snapshot.tree import dtype_from_name


def keys(table: pa.Table) -> list[str]:
    return sorted(set(table.column("key").to_pylist()))


def read_global(table: pa.Table, key: str, read) -> torch.Tensor:
    """The global tensor `key`; raises CatalogHole if its main fragments do not cover it exactly."""
    rows = table.filter(pc.equal(table.column("key"), key))
    info = coverage(rows)
    if not info:
        raise CatalogHole(f"global tensor {key!r} is not in the catalog")
    if info[0]["hole"]:
        raise CatalogHole(f"global tensor {key!r}: {info[0]['hole']}")
    cols = rows.to_pydict()
    shape, dtype = tuple(info[0]["global_shape"]), dtype_from_name(info[0]["dtype"])
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1).view(torch.uint8).numpy() if math.prod(shape) else np.zeros(0, np.uint8)
    for i, main in enumerate(cols["main"]):
        if not main:
            continue
        data = read(cols["node"][i], cols["rank"][i], cols["step"][i], cols["slot_offset"][i], cols["nbytes"][i])
        if isinstance(data, tuple):
            data = data[0]  # SMPClient.read also says where the bytes came from
        starts, ends = byte_runs(cols, i)
        pos = 0
        for a, b in zip(starts.tolist(), ends.tolist()):
            flat[a:b] = data[pos: pos + b - a]
            pos += b - a
    return out
